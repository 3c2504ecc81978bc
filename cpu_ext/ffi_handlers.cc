// XLA FFI handler: y[..., rows] = x[..., cols] · Wᵀ for a GGUF weight W [rows, cols] (see qmatmul.h).
//
// Work is split over XLA's own intra-op thread pool (Ctx<ThreadPool>): OpenMP threads would compete with XLA's
// threads and were measured 2-3x slower on per-layer-sized calls (shared/notes/jax-feasibility.md §3.4).
#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "qmatmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxinfer_cpu {
namespace {

// gguf.GGMLQuantizationType values of the supported weight types.
enum GgmlType : int64_t { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14 };

struct TypeInfo {
  int block_size, type_size;     // values and bytes per block (1 and 2 or 4 for float types)
  ffi::DataType storage;         // element type of the weight buffer
  QuantDot Kernels::*quant_dot;  // exactly one of these two is set
  FloatDot Kernels::*float_dot;
};

bool type_info(int64_t qtype, TypeInfo* info) {
  switch (qtype) {
    case kF32: *info = {1, 4, ffi::DataType::F32, nullptr, &Kernels::f32}; return true;
    case kF16: *info = {1, 2, ffi::DataType::F16, nullptr, &Kernels::f16}; return true;
    case kQ4_0: *info = {32, 18, ffi::DataType::U8, &Kernels::q4_0, nullptr}; return true;
    case kQ4_1: *info = {32, 20, ffi::DataType::U8, &Kernels::q4_1, nullptr}; return true;
    case kQ8_0: *info = {32, 34, ffi::DataType::U8, &Kernels::q8_0, nullptr}; return true;
    case kQ4_K: *info = {256, 144, ffi::DataType::U8, &Kernels::q4_k, nullptr}; return true;
    case kQ6_K: *info = {256, 210, ffi::DataType::U8, &Kernels::q6_k, nullptr}; return true;
    default: return false;
  }
}

// Runs fn(0) .. fn(n_tasks - 1) on the calling thread and up to pool.num_threads() - 1 pool threads. Tasks are
// claimed from a shared counter, so the caller never waits for a pool thread that has not started: a helper that
// starts after all tasks are claimed exits without touching `fn` (the shared state outlives this call).
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n_tasks, const F& fn) {
  const int64_t n_helpers = std::min<int64_t>(pool.num_threads(), n_tasks) - 1;
  if (n_helpers <= 0) {
    for (int64_t i = 0; i < n_tasks; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n_tasks, &fn] {
    for (int64_t i; (i = state->next.fetch_add(1)) < n_tasks;) {
      fn(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < n_helpers; ++t) pool.Schedule(decltype(work)(work));  // Schedule takes ownership
  work();
  while (state->done.load(std::memory_order_acquire) < n_tasks) std::this_thread::yield();
}

constexpr int64_t kRowsPerTask = 16;   // small enough to balance two threads, large enough that W rows stay in L1
constexpr int64_t kActRowsPerTask = 8;  // activation rows quantized per task

ffi::Error QuantizedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                               ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t rows, int64_t cols) {
  TypeInfo info;
  if (!type_info(qtype, &info)) {
    return ffi::Error::InvalidArgument("quantized_matmul: unsupported GGML type " + std::to_string(qtype));
  }
  if (rows <= 0 || cols <= 0 || cols % info.block_size != 0 || cols > (int64_t{1} << 30)) {
    return ffi::Error::InvalidArgument("quantized_matmul: cols=" + std::to_string(cols) + " must be a positive " +
                                       "multiple of the block size " + std::to_string(info.block_size));
  }
  const int64_t row_bytes = cols / info.block_size * info.type_size;
  const auto w_dims = w.dimensions();
  const int64_t w_last = info.storage == ffi::DataType::U8 ? row_bytes : cols;
  if (w.element_type() != info.storage || w_dims.size() != 2 || w_dims[0] != rows || w_dims[1] != w_last) {
    return ffi::Error::InvalidArgument("quantized_matmul: weight must be [" + std::to_string(rows) + ", " +
                                       std::to_string(w_last) + "] of the type's storage dtype for GGML type " +
                                       std::to_string(qtype));
  }
  const auto x_dims = x.dimensions();
  if (x_dims.size() < 1 || x_dims[x_dims.size() - 1] != cols) {
    return ffi::Error::InvalidArgument("quantized_matmul: x must be [..., " + std::to_string(cols) + "]");
  }
  const int64_t m = x.element_count() / cols;
  if (y->element_count() != static_cast<size_t>(m * rows)) {
    return ffi::Error::InvalidArgument("quantized_matmul: output must be [..., " + std::to_string(rows) + "]");
  }

  const Kernels& k = best_kernels();
  const float* xs = x.typed_data();
  const auto* ws = static_cast<const uint8_t*>(w.untyped_data());
  float* ys = y->typed_data();
  const int n = static_cast<int>(cols);
  const int64_t row_tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;

  // Each task is a band of output rows for all m tokens: the band's weights are read from memory once.
  auto run_rows = [&](auto dot_row, const auto* x_rows, int64_t x_stride) {
    parallel_for(pool, row_tasks, [&](int64_t task) {
      const int64_t r0 = task * kRowsPerTask, r1 = std::min(rows, r0 + kRowsPerTask);
      for (int64_t t = 0; t < m; ++t) {
        for (int64_t r = r0; r < r1; ++r) ys[t * rows + r] = dot_row(ws + r * row_bytes, x_rows + t * x_stride, n);
      }
    });
  };

  if (info.float_dot != nullptr) {
    run_rows(k.*info.float_dot, xs, cols);
    return ffi::Error::Success();
  }
  const int64_t x_blocks = cols / kQK;
  std::vector<BlockQ8> xq(static_cast<size_t>(m * x_blocks));
  parallel_for(pool, (m + kActRowsPerTask - 1) / kActRowsPerTask, [&](int64_t task) {
    for (int64_t t = task * kActRowsPerTask; t < std::min(m, (task + 1) * kActRowsPerTask); ++t) {
      k.quantize_row(xs + t * cols, xq.data() + t * x_blocks, n);
    }
  });
  run_rows(k.*info.quant_dot, xq.data(), x_blocks);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxinfer_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizedMatmul, jaxinfer_cpu::QuantizedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., cols]
                                  .Arg<ffi::AnyBuffer>()         // W: uint8 blocks [rows, bytes], or f16/f32 [rows, cols]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., rows]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols"));

// What the FFI handlers (ffi_handlers.cc: dense, sparse_handlers.cc: row-sparse) share: the GGML type table, the
// weight checks, XLA's thread pool as a parallel for, per-thread scratch buffers and the activation side of the row
// dot products.
//
// Work is split over XLA's own intra-op thread pool (Ctx<ThreadPool>): OpenMP threads would compete with XLA's
// threads and were measured 2-3x slower on per-layer-sized calls (shared/notes/jax-feasibility.md §3.4).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "qmatmul.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxinfer_cpu {

// gguf.GGMLQuantizationType values of the supported weight types.
enum GgmlType : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ2_K = 10, kQ3_K = 11,
  kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23,
  kTQ1_0 = 34, kTQ2_0 = 35, kI2_S = 36  // I2_S: Microsoft BitNet's id, not gguf's (jaxinfer.ternary)
};

struct TypeInfo {
  int block_size, type_size;     // values and bytes per block (1 and 2 or 4 for float types)
  ffi::DataType storage;         // element type of the weight buffer
  QuantDot Kernels::*quant_dot;  // exactly one of these two is set
  FloatDot Kernels::*float_dot;
  Axpy Kernels::*axpy;
  QuantDot4 Kernels::*quant_dot4;  // null where no four-token dot exists
  QuantDotK Kernels::*quant_dot_k;  // K-quants: these two instead of quant_dot and quant_dot4
  QuantDotK4 Kernels::*quant_dot4_k;
  QuantDot2x4 Kernels::*quant_dot_2x4;  // null where no two-row four-token dot exists
  // K-quant-style dots whose activations are not quantize_row_k's (I2_S: one scale per row); null: quantize_row_k.
  void (*Kernels::*quantize_k)(const float* x, BlockQ8K* out, int n);
  QuantDotK2x4 Kernels::*quant_dot_2x4_k;  // null where no two-row four-token K-quant-style dot exists
  QuantDotAhead Kernels::*quant_dot_ahead;  // null where quant_dot has no variant asking for the next row
  QuantDotGather4 Kernels::*quant_dot_g4;  // null where no dot of one row and any four tokens exists
  QuantDotPair Kernels::*quant_dot_pair;  // null where no dot of two rows and one token exists
};

inline bool type_info(int64_t qtype, TypeInfo* info) {
  switch (qtype) {
    case kF32: *info = {1, 4, ffi::DataType::F32, nullptr, &Kernels::f32, &Kernels::axpy_f32, nullptr}; return true;
    case kF16: *info = {1, 2, ffi::DataType::F16, nullptr, &Kernels::f16, &Kernels::axpy_f16, nullptr}; return true;
    case kQ4_0:
      *info = {32, 18, ffi::DataType::U8, &Kernels::q4_0, nullptr, &Kernels::axpy_q4_0, &Kernels::q4_0_x4,
               nullptr, nullptr, &Kernels::q4_0_2x4, nullptr, nullptr,
               &Kernels::q4_0_ahead, &Kernels::q4_0_g4, &Kernels::q4_0_pair};
      return true;
    case kQ4_1:
      *info = {32, 20, ffi::DataType::U8, &Kernels::q4_1, nullptr, &Kernels::axpy_q4_1, &Kernels::q4_1_x4,
               nullptr, nullptr, &Kernels::q4_1_2x4, nullptr, nullptr,
               &Kernels::q4_1_ahead, &Kernels::q4_1_g4, &Kernels::q4_1_pair};
      return true;
    case kQ5_0:
      *info = {32, 22, ffi::DataType::U8, &Kernels::q5_0, nullptr, &Kernels::axpy_q5_0, &Kernels::q5_0_x4,
               nullptr, nullptr, &Kernels::q5_0_2x4, nullptr, nullptr,
               &Kernels::q5_0_ahead, nullptr, &Kernels::q5_0_pair};
      return true;
    case kQ5_1:
      *info = {32, 24, ffi::DataType::U8, &Kernels::q5_1, nullptr, &Kernels::axpy_q5_1, &Kernels::q5_1_x4,
               nullptr, nullptr, &Kernels::q5_1_2x4, nullptr, nullptr,
               &Kernels::q5_1_ahead, nullptr, &Kernels::q5_1_pair};
      return true;
    case kQ8_0:
      *info = {32, 34, ffi::DataType::U8, &Kernels::q8_0, nullptr, &Kernels::axpy_q8_0, &Kernels::q8_0_x4,
               nullptr, nullptr, &Kernels::q8_0_2x4, nullptr, nullptr,
               &Kernels::q8_0_ahead, &Kernels::q8_0_g4, &Kernels::q8_0_pair};
      return true;
    case kQ2_K:
      *info = {256, 84, ffi::DataType::U8, nullptr, nullptr, &Kernels::axpy_q2_k, nullptr, &Kernels::q2_k,
               &Kernels::q2_k_x4};
      return true;
    case kQ3_K:
      *info = {256, 110, ffi::DataType::U8, nullptr, nullptr, &Kernels::axpy_q3_k, nullptr, &Kernels::q3_k,
               &Kernels::q3_k_x4};
      return true;
    case kQ4_K:
      *info = {256, 144, ffi::DataType::U8, nullptr, nullptr, &Kernels::axpy_q4_k, nullptr, &Kernels::q4_k,
               &Kernels::q4_k_x4};
      return true;
    case kQ5_K:
      *info = {256, 176, ffi::DataType::U8, nullptr, nullptr, &Kernels::axpy_q5_k, nullptr, &Kernels::q5_k,
               &Kernels::q5_k_x4};
      return true;
    case kQ6_K:
      *info = {256, 210, ffi::DataType::U8, nullptr, nullptr, &Kernels::axpy_q6_k, nullptr, &Kernels::q6_k,
               &Kernels::q6_k_x4};
      return true;
    case kIQ4_NL:
      *info = {32, 18, ffi::DataType::U8, &Kernels::iq4_nl, nullptr, &Kernels::axpy_iq4_nl, &Kernels::iq4_nl_x4,
               nullptr, nullptr, &Kernels::iq4_nl_2x4, nullptr, nullptr,
               &Kernels::iq4_nl_ahead, &Kernels::iq4_nl_g4, &Kernels::iq4_nl_pair};
      return true;
    case kIQ4_XS:
      *info = {256, 136, ffi::DataType::U8, nullptr, nullptr, &Kernels::axpy_iq4_xs, nullptr, &Kernels::iq4_xs,
               &Kernels::iq4_xs_x4};
      return true;
    // Ternary: 256-value blocks (an I2_S block is two of its 128-value groups, so rows are a multiple of 256).
    case kTQ1_0:
      *info = {256, 54, ffi::DataType::U8, nullptr, nullptr, &Kernels::axpy_tq1_0, nullptr, &Kernels::tq1_0,
               &Kernels::tq1_0_x4, nullptr, nullptr, &Kernels::tq1_0_2x4};
      return true;
    case kTQ2_0:
      *info = {256, 66, ffi::DataType::U8, nullptr, nullptr, &Kernels::axpy_tq2_0, nullptr, &Kernels::tq2_0,
               &Kernels::tq2_0_x4, nullptr, nullptr, &Kernels::tq2_0_2x4};
      return true;
    case kI2_S:
      *info = {256, 64, ffi::DataType::U8, nullptr, nullptr, &Kernels::axpy_i2_s, nullptr, &Kernels::i2_s,
               &Kernels::i2_s_x4, nullptr, &Kernels::quantize_row_absmax, &Kernels::i2_s_2x4};
      return true;
    default: return false;
  }
}

// True if dims is [..., last]; *m is then the product of the leading dims (the tokens).
inline bool tokens_of(ffi::Span<const int64_t> dims, int64_t last, int64_t* m) {
  if (dims.size() < 1 || dims[dims.size() - 1] != last) return false;
  *m = 1;
  for (size_t i = 0; i + 1 < dims.size(); ++i) *m *= dims[i];
  return true;
}

// Whether a buffer of `count` elements holds exactly a * b. XLA takes no shape whose dims' product overflows, but a
// product of dims of two buffers can: an empty h [2^60 + 1, 0] has 2^60 + 1 tokens, and times 16 columns that is 16
// modulo 2^64, which a [1, 16] output matched. An overflowing product matches no buffer.
inline bool holds(size_t count, int64_t a, int64_t b) {
  int64_t product;
  return !__builtin_mul_overflow(a, b, &product) && product >= 0 && count == static_cast<size_t>(product);
}

// Checks the type attributes and a weight W [rows, cols] of GGML type `qtype` as stored (uint8 blocks [rows,
// row_bytes], or f16/f32 [rows, cols]); on success fills `info` and `row_bytes`. `op` prefixes the messages.
inline ffi::Error check_weight(const std::string& op, const ffi::AnyBuffer& w, int64_t qtype, int64_t rows,
                               int64_t cols, TypeInfo* info, int64_t* row_bytes) {
  if (!type_info(qtype, info)) {
    return ffi::Error::InvalidArgument(op + ": unsupported GGML type " + std::to_string(qtype));
  }
  if (rows <= 0 || rows > (int64_t{1} << 30) || cols <= 0 || cols % info->block_size != 0 ||
      cols > (int64_t{1} << 30)) {
    return ffi::Error::InvalidArgument(op + ": rows=" + std::to_string(rows) + " must be positive and cols=" +
                                       std::to_string(cols) + " must be a positive multiple of the block size " +
                                       std::to_string(info->block_size));
  }
  *row_bytes = cols / info->block_size * info->type_size;
  const auto dims = w.dimensions();
  const int64_t last = info->storage == ffi::DataType::U8 ? *row_bytes : cols;
  if (w.element_type() != info->storage || dims.size() != 2 || dims[0] != rows || dims[1] != last) {
    return ffi::Error::InvalidArgument(op + ": weight must be [" + std::to_string(rows) + ", " +
                                       std::to_string(last) + "] of the type's storage dtype for GGML type " +
                                       std::to_string(qtype));
  }
  return ffi::Error::Success();
}

// Runs fn(0) .. fn(n_tasks - 1) on the calling thread and up to pool.num_threads() - 1 pool threads. Tasks are
// claimed from a shared counter, so the caller never waits for a pool thread that has not started: a helper that
// starts after all tasks are claimed exits without touching what fn points to (the shared state outlives this call).
//
// A cache line that one thread writes while the other reads it in every task makes the threads wait on each other:
// measured 1.5x slower dense matmuls at SmolLM2 sizes on two threads (42 vs 28 µs). Hence the shared counters get a
// line of their own, each pool thread runs its own copy of fn on its own stack (the closure Schedule allocates may
// share a line with other heap data), and task lambdas capture by value what their loops read: a helper reading the
// caller's stack frame shares lines with the return addresses the caller pushes on every kernel call.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n_tasks, const F& fn) {
  const int64_t n_helpers = std::min(pool.num_threads(), n_tasks) - 1;
  if (n_helpers <= 0) {
    for (int64_t i = 0; i < n_tasks; ++i) fn(i);
    return;
  }
  struct alignas(64) State {  // a cache line of its own: every task writes it
    std::atomic<int64_t> next{0}, done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n_tasks](const F& f) {
    for (int64_t i; (i = state->next.fetch_add(1)) < n_tasks;) {
      f(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 0; t < n_helpers; ++t) {
    pool.Schedule([work, fn] {  // Schedule takes ownership of this closure, on the heap next to who knows what
      const F own = fn;
      work(own);
    });
  }
  work(fn);
  while (state->done.load(std::memory_order_acquire) < n_tasks) std::this_thread::yield();
}

constexpr int64_t kRowsPerTask = 16;    // small enough to balance two threads, large enough that W rows stay in L1
constexpr int64_t kTasksPerThread = 4;

// Rows per task of a row-parallel matmul: at least kRowsPerTask, and few enough tasks (kTasksPerThread per thread)
// that claiming them stays cheap: each claim moves the shared counter's cache line between cores, and 16-row tasks
// made the default model's decode 1.5x slower than this (9.8-11.4 vs 6.2-6.7 ms/token, 30 layers x 7 calls).
inline int64_t rows_per_task(ffi::ThreadPool& pool, int64_t rows) {
  const int64_t tasks = kTasksPerThread * std::max<int64_t>(1, pool.num_threads());
  return std::max(kRowsPerTask, (rows + tasks - 1) / tasks);
}
constexpr int64_t kActRowsPerTask = 8;  // activation rows quantized per task

// Buffers reused by every call on a thread, so calls in steady state do not allocate: a handler runs on one thread at
// a time, and the pool helpers of its parallel_for only write into the buffers of the thread that called them. They
// keep the size of the largest call seen (activations, an index list over the rows, the axpy accumulators).
struct Scratch {
  std::vector<BlockQ8> xq;
  std::vector<BlockQ8K> xk;
  std::vector<uint8_t> active;
  std::vector<int32_t> rows;
  std::vector<int32_t> index;  // a gather's wider index, narrowed (sparse_handlers.cc)
  std::vector<float> acc;
  std::vector<float> masked;  // a token's masked h (neuron_major_axpy), the listed neurons' h (down_rows.cc)
  // A union's rows by how many tokens take them, which rows of each group of them each token takes, the tokens in
  // the order their tiles are dotted, and the takes in that order (union_rows.cc).
  std::vector<int32_t> takers, ordered, tokens, hot, cold, cold_index;
  std::vector<uint8_t> taken, taken_ordered, cold_bits;
};

inline Scratch& thread_scratch() {
  thread_local Scratch scratch;
  return scratch;
}

// Quantizes the m rows of x [m, cols] with quantize(row, out, cols), kActRowsPerTask rows per task, into `out`
// (blocks_per_row blocks a row), resized to fit; with `order`, out's row t is x's row order[t].
template <typename Block, typename Quantize>
Block* quantize_rows(ffi::ThreadPool& pool, Quantize quantize, const float* x, int64_t m, int64_t cols,
                     int64_t blocks_per_row, std::vector<Block>& out, const int32_t* order = nullptr) {
  out.resize(static_cast<size_t>(m * blocks_per_row));
  Block* data = out.data();
  parallel_for(pool, (m + kActRowsPerTask - 1) / kActRowsPerTask, [=](int64_t task) {
    for (int64_t t = task * kActRowsPerTask; t < std::min(m, (task + 1) * kActRowsPerTask); ++t) {
      quantize(x + (order == nullptr ? t : order[t]) * cols, data + t * blocks_per_row, static_cast<int>(cols));
    }
  });
  return data;
}

// How a row-sparse product asks for the next active row it reads (read once: an active or gathered row). Which way
// serves best depends on the cache design, so it is the vendor's, each measured on a decode step of the 8-layer
// 7B-shaped PowerInfer file at sparsity 0.8 (predictor mode) or on its gate alone. AMD (Zen 4): every line of the row
// at once, two rows ahead, with the non-temporal hint (20% of a 4096 x 11008 Q4_0 weight's rows in 0.165 ms against
// 0.205 with the L2 hint). Intel (Emerald Rapids): the non-temporal hint fills the L1 only and leaves the L2's
// streamer untrained (16.4-17.3 tokens/s against 20.5-23.5 with the L1 hint), and a whole row asked for at once
// stalls on the L1's few outstanding misses, so the row dot itself asks for the row two ahead a line a block as it
// goes (RowDot::ahead, the dot's bits unchanged: 1.06-1.08x the tokens/s of the whole row at once, in one process
// alternating 8 times).
inline bool whole_rows_non_temporal() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

inline void prefetch_row_once(const uint8_t* row, int64_t row_bytes) {
  if (whole_rows_non_temporal()) {
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 0);
  } else {
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
  }
}

// The activations x [m, cols] as the row dot kernels take them: as given for float weights, else quantized to 8 bits
// (in parallel): per 32 values (into s.xq), or for K-quant weights per 256 (into s.xk). dot(w_row, t) is W row · x[t].
class RowDot {
 public:
  RowDot(ffi::ThreadPool& pool, const Kernels& k, const TypeInfo& info, const float* x, int64_t m, int64_t cols,
         Scratch& s)
      : x_(x), cols_(cols), n_(static_cast<int>(cols)) {
    if (info.float_dot != nullptr) {
      float_dot_ = k.*info.float_dot;
    } else if (info.quant_dot_k != nullptr) {
      quant_dot_k_ = k.*info.quant_dot_k;
      quant_dot4_k_ = k.*info.quant_dot4_k;
      if (info.quant_dot_2x4_k != nullptr) quant_dot_2x4_k_ = k.*info.quant_dot_2x4_k;
      blocks_ = cols / kQK_K;
      xk_ = quantize_rows(pool, info.quantize_k != nullptr ? k.*info.quantize_k : k.quantize_row_k, x, m, cols,
                          blocks_, s.xk);
    } else {
      quant_dot_ = k.*info.quant_dot;
      if (info.quant_dot_ahead != nullptr && !whole_rows_non_temporal()) quant_dot_ahead_ = k.*info.quant_dot_ahead;
      if (info.quant_dot_pair != nullptr) quant_dot_pair_ = k.*info.quant_dot_pair;
      if (info.quant_dot4 != nullptr) quant_dot4_ = k.*info.quant_dot4;
      if (info.quant_dot_2x4 != nullptr) quant_dot_2x4_ = k.*info.quant_dot_2x4;
      blocks_ = cols / kQK;
      xq_ = quantize_rows(pool, k.quantize_row, x, m, cols, blocks_, s.xq);
    }
  }

  float operator()(const uint8_t* w_row, int64_t t) const {
    if (float_dot_ != nullptr) return float_dot_(w_row, x_ + t * cols_, n_);
    if (quant_dot_k_ != nullptr) return quant_dot_k_(w_row, xk_ + t * blocks_, n_);
    return quant_dot_(w_row, xq_ + t * blocks_, n_);
  }

  // (*this)(w_row, t), asking meanwhile for the row of row_bytes at `next`, which the caller reads soon after.
  float ahead(const uint8_t* w_row, int64_t t, const uint8_t* next, int64_t row_bytes) const {
    if (quant_dot_ahead_ != nullptr) return quant_dot_ahead_(w_row, xq_ + t * blocks_, n_, next);
    prefetch_row_once(next, row_bytes);
    return (*this)(w_row, t);
  }

  // Whether the kernels dot two rows of this type at once for one token (pair()).
  bool pairs() const { return quant_dot_pair_ != nullptr; }

  // out[r] = W row r · x[t] for the rows w0 and w1, each with (*this)'s bits, asking meanwhile for the rows at next0
  // and next1 (null: none) as ahead() does, or, where the CPU's rows are asked for whole, all their lines now.
  // Only where pairs().
  void pair(const uint8_t* w0, const uint8_t* w1, int64_t t, const uint8_t* next0, const uint8_t* next1,
            int64_t row_bytes, float* out) const {
    if (quant_dot_ahead_ == nullptr) {
      for (const uint8_t* next : {next0, next1}) {
        if (next != nullptr) prefetch_row_once(next, row_bytes);
      }
      next0 = next1 = nullptr;
    } else if (next0 == nullptr) {
      std::swap(next0, next1);
    }
    quant_dot_pair_(w0, w1, xq_ + t * blocks_, n_, next0, next1, out);
  }

  // out[i] = W row · x[t + i] for i < 4.
  void four(const uint8_t* w_row, int64_t t, float* out) const {
    if (quant_dot4_ != nullptr) return quant_dot4_(w_row, xq_ + t * blocks_, blocks_, n_, out);
    if (quant_dot4_k_ != nullptr) return quant_dot4_k_(w_row, xk_ + t * blocks_, blocks_, n_, out);
    for (int i = 0; i < 4; ++i) out[i] = (*this)(w_row, t + i);
  }

  // out[4 r + i] = W row r · x[t + i] for r < 2, i < 4; rows w_row and w_row + w_stride.
  void two_by_four(const uint8_t* w_row, int64_t w_stride, int64_t t, float* out) const {
    if (quant_dot_2x4_ != nullptr) return quant_dot_2x4_(w_row, w_stride, xq_ + t * blocks_, blocks_, n_, out);
    if (quant_dot_2x4_k_ != nullptr) return quant_dot_2x4_k_(w_row, w_stride, xk_ + t * blocks_, blocks_, n_, out);
    four(w_row, t, out);
    four(w_row + w_stride, t, out + 4);
  }

 private:
  const float* x_;
  const BlockQ8* xq_ = nullptr;
  const BlockQ8K* xk_ = nullptr;
  int64_t cols_, blocks_ = 0;
  int n_;
  FloatDot float_dot_ = nullptr;
  QuantDot quant_dot_ = nullptr;
  QuantDotAhead quant_dot_ahead_ = nullptr;
  QuantDotPair quant_dot_pair_ = nullptr;
  QuantDot4 quant_dot4_ = nullptr;
  QuantDotK quant_dot_k_ = nullptr;
  QuantDotK4 quant_dot4_k_ = nullptr;
  QuantDot2x4 quant_dot_2x4_ = nullptr;
  QuantDotK2x4 quant_dot_2x4_k_ = nullptr;
};

}  // namespace jaxinfer_cpu

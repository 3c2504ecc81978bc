// The down_rows_axpy and down_rows_gather_axpy handlers (down_rows.h): the sparse down projection of a Q4_0/Q8_0
// weight laid out as down rows, over a token's active neurons (a mask over all of them, or the rows an index names),
// the coefficients of each group of them rounded to 8 bits and dotted in integers; the portable kernel that defines
// its bits; and the choice of kernel.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "down_rows.h"
#include "sparse_common.h"

namespace jaxinfer_cpu {

template <DownType T>
void down_group_portable(const DownGroup& g, int cols, DownCoefficients& c, float* y) {
  const int nb = cols / kQK;
  constexpr int kQsBytes = down_qs_bytes(T);
  auto coefficient = [&](int i, int b) {
    uint16_t bits;
    std::memcpy(&bits, g.rows[i] + 2 * b, 2);
    return g.h[i] * fp16_to_f32(bits);
  };
  for (int b = 0; b < nb; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < g.n; ++i) amax = std::fmax(amax, std::fabs(coefficient(i, b)));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    c.scale[b] = amax / 127.0f;
    int32_t sum = 0;
    for (int k = 0; k < g.n / 4; ++k) {
      uint32_t word = 0;
      for (int r = 0; r < 4; ++r) {
        const auto rounded = static_cast<int32_t>(std::nearbyint(coefficient(4 * k + r, b) * inv));
        sum += rounded;
        word |= static_cast<uint32_t>(static_cast<uint8_t>(static_cast<int8_t>(rounded))) << (8 * r);
      }
      c.word[static_cast<size_t>(k) * nb + b] = static_cast<int32_t>(word);
    }
    c.sum[b] = sum;
  }
  for (int b = 0; b < nb; ++b) {
    int32_t isum[kQK] = {};
    for (int i = 0; i < g.n; ++i) {
      const int32_t coef = static_cast<int8_t>(static_cast<uint32_t>(c.word[static_cast<size_t>(i / 4) * nb + b]) >>
                                               (8 * (i % 4)));
      const uint8_t* q = g.rows[i] + 2 * nb + kQsBytes * b;
      for (int j = 0; j < kQK; ++j) {
        const int value = T == DownType::kQ4_0 ? (j < 16 ? q[j] & 0x0F : q[j - 16] >> 4) : q[j];
        isum[j] += coef * value;
      }
    }
    for (int j = 0; j < kQK; ++j) {
      y[kQK * b + j] += c.scale[b] * static_cast<float>(isum[j] - down_offset(T) * c.sum[b]);
    }
  }
}

template void down_group_portable<DownType::kQ4_0>(const DownGroup&, int, DownCoefficients&, float*);
template void down_group_portable<DownType::kQ8_0>(const DownGroup&, int, DownCoefficients&, float*);

#if !JAXINFER_CPU_X86  // down_rows_avx512.cc is only built for x86-64
template <DownType T>
void down_group_avx512(const DownGroup& g, int cols, DownCoefficients& c, float* y) {
  down_group_portable<T>(g, cols, c, y);
}
#endif

namespace {

// The group kernel of the kernel set in use (Kernels::isa, so that tests forcing a set get its kernel): AVX-512 where
// the set is AVX-512 and the CPU has VBMI, else the portable one.
DownGroupKernel group_kernel(DownType t) {
  bool simd = std::strcmp(best_kernels().isa, "avx512") == 0;
#if JAXINFER_CPU_X86
  simd = simd && __builtin_cpu_supports("avx512vbmi");
#endif
  if (t == DownType::kQ4_0) return simd ? down_group_avx512<DownType::kQ4_0> : down_group_portable<DownType::kQ4_0>;
  return simd ? down_group_avx512<DownType::kQ8_0> : down_group_portable<DownType::kQ8_0>;
}

// One item of the work: a group of token t's nonzero neurons, entries [begin, end) of the neuron list.
struct GroupItem {
  int64_t t, begin, end;
};

// Tokens a prompt's tile of the down projection takes together (sum_down_rows): their accumulators, 16 KB a token
// at 4096 outputs, and the rows of the groups in flight stay in a core's L2.
constexpr int64_t kDownTokenTile = 16;

// The type of a down_rows call (Q4_0 or Q8_0) and its rows' bytes, its shape checked against the weight's.
ffi::Error down_rows_weight(const std::string& op, const ffi::Buffer<ffi::U8>& w, int64_t qtype, int64_t rows,
                            int64_t cols, DownType* type, int64_t* row_bytes) {
  int block_bytes;
  if (qtype == kQ4_0) {
    *type = DownType::kQ4_0, block_bytes = 18;
  } else if (qtype == kQ8_0) {
    *type = DownType::kQ8_0, block_bytes = 34;
  } else {
    return ffi::Error::InvalidArgument(op + ": unsupported GGML type " + std::to_string(qtype) + " (Q4_0 or Q8_0)");
  }
  if (rows <= 0 || rows > (int64_t{1} << 30) || cols <= 0 || cols % kQK != 0 || cols > (int64_t{1} << 30)) {
    return ffi::Error::InvalidArgument(op + ": rows=" + std::to_string(rows) + " must be positive and cols=" +
                                       std::to_string(cols) + " a positive multiple of 32");
  }
  *row_bytes = cols / kQK * block_bytes;
  const auto w_dims = w.dimensions();
  if (w_dims.size() != 2 || w_dims[0] != rows || w_dims[1] != *row_bytes) {
    return ffi::Error::InvalidArgument(op + ": weight must be uint8 [" + std::to_string(rows) + ", " +
                                       std::to_string(*row_bytes) + "], got " + dims_string(w_dims));
  }
  return ffi::Error::Success();
}

// y[t] = sum over token t's entries e < k with row_of(e) in [0, rows) and h[t, e] != 0 of h[t, e] W_t[row_of(e)]
// (row_of(e) < 0 where a mask leaves entry e out), in the entries' order: the neurons listed branch-free (as
// active_rows), cut into groups of kDownGroup per token and per segment of `segment` entries (a group never spans
// two), the groups summed over the threads.
template <typename RowOf>
void sum_down_rows(ffi::ThreadPool& pool, DownType type, const uint8_t* ws, int64_t row_bytes, int64_t rows,
                   int64_t cols, const float* hs, int64_t m, int64_t k, int64_t segment, RowOf row_of, float* y) {
  Scratch& s = thread_scratch();
  s.rows.resize(static_cast<size_t>(m * k));
  s.masked.resize(static_cast<size_t>(m * k));
  // Token t's neurons go to entries [t k, t k + its count): the tokens are listed in parallel, a few to a task (a
  // prompt's 512 tokens over 11008 neurons each took one thread 2-3% of the prompt's time while the others waited),
  // and their groups joined in token order.
  constexpr int64_t kTokensPerTask = 8;
  const int64_t n_tasks = (m + kTokensPerTask - 1) / kTokensPerTask;
  std::vector<std::vector<GroupItem>> task_items(static_cast<size_t>(n_tasks));
  std::vector<GroupItem>* task_items_data = task_items.data();
  int32_t* listed = s.rows.data();
  float* listed_h = s.masked.data();
  parallel_for(pool, n_tasks, [=](int64_t task) {
    std::vector<GroupItem>& out = task_items_data[task];
    for (int64_t t = task * kTokensPerTask; t < std::min(m, (task + 1) * kTokensPerTask); ++t) {
      int64_t n = t * k;
      for (int64_t start = 0; start < k; start += segment) {
        const int64_t first = n;
        for (int64_t e = start; e < std::min(k, start + segment); ++e) {
          const int64_t row = row_of(t, e);
          listed[n] = static_cast<int32_t>(row);
          listed_h[n] = hs[t * k + e];
          n += row >= 0 && row < rows && hs[t * k + e] != 0.0f;
        }
        for (int64_t begin = first; begin < n; begin += kDownGroup) {
          out.push_back({t, begin, std::min(n, begin + kDownGroup)});
        }
      }
    }
  });
  std::vector<GroupItem> items;
  for (const std::vector<GroupItem>& part : task_items) items.insert(items.end(), part.begin(), part.end());
  const DownGroupKernel kernel = group_kernel(type);
  const int32_t* neurons = s.rows.data();
  const float* values = s.masked.data();
  auto add = [=](const GroupItem* items_begin, const GroupItem* items_end, float* ys) {
    thread_local DownCoefficients coefficients;
    coefficients.resize(static_cast<int>(cols / kQK));
    DownGroup group;
    for (const GroupItem* item = items_begin; item != items_end; ++item) {
      group.n = static_cast<int>(item->end - item->begin);
      for (int e = 0; e < group.n; ++e) {
        group.rows[e] = ws + neurons[item->begin + e] * row_bytes;
        group.h[e] = values[item->begin + e];
      }
      for (; group.n % 4; ++group.n) {
        group.rows[group.n] = group.rows[0];
        group.h[group.n] = 0.0f;
      }
      kernel(group, static_cast<int>(cols), coefficients, ys + item->t * cols);
    }
  };
  GroupItem* groups = items.data();
  if (m < 2 * kDownTokenTile) {  // a decode step: its groups split over the threads, their sums added
    sum_over_groups(pool, static_cast<int64_t>(items.size()), m * cols, y, s,
                    [=](int64_t i0, int64_t i1, float* ys) { add(groups + i0, groups + i1, ys); });
    return;
  }
  // A prompt: tiles of kDownTokenTile tokens, each thread whole tiles. Token by token, each token's rows (a third of
  // a 7B-shaped layer's at 30% active: 7.6 MB) were read from memory again; within a tile the groups are taken in
  // the order of their first neuron, so that the tokens' groups over nearby neurons follow each other and a row is
  // read from memory about once a tile (the down projection of a 7B-shaped Q4_0 prompt: 23% -> 19% of its time).
  // A token's groups keep their order and one thread adds them all: its sum does not depend on the tiling.
  zero_floats(pool, y, m * cols);
  std::vector<int64_t> tile_start(1, 0);
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
    if (items[i].t / kDownTokenTile != items[tile_start.back()].t / kDownTokenTile) tile_start.push_back(i);
  }
  tile_start.push_back(static_cast<int64_t>(items.size()));
  const int64_t* starts = tile_start.data();
  parallel_for(pool, static_cast<int64_t>(tile_start.size()) - 1, [=](int64_t tile) {
    GroupItem* first = groups + starts[tile];
    GroupItem* last = groups + starts[tile + 1];
    std::stable_sort(first, last, [=](const GroupItem& a, const GroupItem& b) {
      return neurons[a.begin] < neurons[b.begin];
    });
    add(first, last, y);
  });
}

ffi::Error DownRowsAxpyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::U8> w,
                            ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t rows,
                            int64_t cols) {
  const std::string op = "down_rows_axpy";
  DownType type;
  int64_t row_bytes, m;
  if (ffi::Error error = down_rows_weight(op, w, qtype, rows, cols, &type, &row_bytes); error.failure()) return error;
  if (ffi::Error error = check_masked_axpy(op, h, mask, *y, rows, cols, &m); error.failure()) return error;
  const uint8_t* ms = mask_bytes(mask);
  sum_down_rows(pool, type, w.typed_data(), row_bytes, rows, cols, h.typed_data(), m, rows, rows,
                [=](int64_t t, int64_t j) { return ms[t * rows + j] != 0 ? j : int64_t{-1}; }, y->typed_data());
  return ffi::Error::Success();
}

ffi::Error DownRowsGatherAxpyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::U8> w,
                                  ffi::AnyBuffer index, ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t rows,
                                  int64_t cols, int64_t segment) {
  const std::string op = "down_rows_gather_axpy";
  DownType type;
  int64_t row_bytes, m, k;
  const int32_t* idx;
  if (ffi::Error error = down_rows_weight(op, w, qtype, rows, cols, &type, &row_bytes); error.failure()) return error;
  if (ffi::Error error = check_gather_axpy(op, h, index, *y, cols, thread_scratch(), &idx, &k, &m);
      error.failure()) {
    return error;
  }
  if (segment < 0) {
    return ffi::Error::InvalidArgument(op + ": segment must be 0 (the whole index) or positive, got " +
                                       std::to_string(segment));
  }
  sum_down_rows(pool, type, w.typed_data(), row_bytes, rows, cols, h.typed_data(), m, k, segment ? segment : k,
                [=](int64_t, int64_t e) { return int64_t{idx[e]}; }, y->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxinfer_cpu

// The weight: uint8 [rows, cols / 32 * type_size] laid out as down rows (jaxinfer.quant.pack_down_rows).
XLA_FFI_DEFINE_HANDLER_SYMBOL(DownRowsAxpy, jaxinfer_cpu::DownRowsAxpyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // h [..., rows]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // W_t as down rows
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [..., rows]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [..., cols]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(DownRowsGatherAxpy, jaxinfer_cpu::DownRowsGatherAxpyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h [..., k]
                                  .Arg<ffi::Buffer<ffi::U8>>()   // W_t as down rows
                                  .Arg<ffi::AnyBuffer>()         // index [k], as GatherAxpy's
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., cols]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols")
                                  .Attr<int64_t>("segment"));  // entries a group may span; 0: all

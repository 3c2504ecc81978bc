// XLA FFI handlers for a row-sparse FFN (PowerInfer-style): only the weight rows of active neurons are read.
//
//   masked_matmul  y[t, r] = x[t] · W[r] where mask[t, r], else 0            up/gate: W [n_ff, d]
//   masked_matmul_group  the same for several W of one shape and one mask (gate and up in one call)
//   gather_matmul  y[t, i] = x[t] · W[index[i]], 0 where index[i] is out of range (segmented: only i of token t's
//                  segment, 0 elsewhere); W in GGUF's rows, or repacked with the index in whole groups
//                  (gathered_groups.cc)
//   masked_axpy    y[t]    = sum over j with mask[t, j] of h[t, j] W_t[j]    down: W_t [n_ff, d], one row per neuron
//   gather_axpy    y[t]    = sum over i with index[i] in range of h[t, i] W_t[index[i]]
//   neuron_major_axpy  as masked_axpy, from a Q4_0/Q4_1/Q8_0 W [d, n_ff] packed neuron-major (NeuronBlockAxpy in
//                      qmatmul.h): h quantized to 8 bits, dotted in integers, no second rounding of W
//
// The matmuls reuse the dense kernel's row dots (8-bit activations). The axpys keep h in f32 and dequantize each
// active row into an f32 accumulator (Kernels::axpy_*): h is what the sparse FFN saves work on, and quantizing it
// would add the 8-bit rounding a second time for no saving in bytes read.
#include <cstring>

#include "gathered_groups.h"
#include "repacked_products.h"
#include "sparse_common.h"
#include "union_rows.h"

namespace jaxinfer_cpu {
namespace {

// Positions i < k whose index[i] is in [0, rows), in order, into s.rows; returns how many.
int64_t valid_positions(const int32_t* index, int64_t k, int64_t rows, Scratch& s) {
  s.rows.resize(k);
  int64_t count = 0;
  for (int64_t i = 0; i < k; ++i) {
    s.rows[count] = static_cast<int32_t>(i);
    count += index[i] >= 0 && index[i] < rows;
  }
  return count;
}

// ---- masked_matmul, gather_matmul

struct RowAndColumn {
  int64_t row, column;  // weight row, output column
};


// outs[i][t, column(e)] = W_i[row(e)] · x[t] for each weight i and the entries e < n_entries that token t takes, in
// tasks of rows_per_task (weight, entry) pairs, weight after weight. Other outputs are left as they are.
//
// The dot kernels read one row at a time, and the hardware prefetchers, trained on a sequential stream, fetch into
// rows a sparse set skips and not the next row it reads: at d = 4096 (Q8_0, one thread) half the rows, at random,
// took 1.35x as long as all of them. So the first token's pass prefetches the whole row two entries ahead, unless it
// continues a run of three consecutive rows, which the hardware streams well and where the extra requests cost time
// (1.5x with all rows). Measured on that case: 1.78 -> 1.09 ns per weight block of the whole matrix, and 1.31 with
// all rows, as before; prefetching one row ahead, or only its first lines, did worse. How the row is asked for is
// the CPU vendor's (prefetch_row_once, RowDot::ahead: a row dotted for the first token asks for it as it goes).
//
// One token (a decode step) dots its rows two at a time where the kernels have it (RowDot::pair, the same bits): two
// rows' reads and sums in flight. On the 7B-shaped files at 0.8 and 0.9, predictor mode, 1.02-1.04x the tokens/s of
// one row at a time (medians of 16 paired runs in one process, the variant switched between runs).
template <typename Entry, typename Take>
void row_dots(ffi::ThreadPool& pool, const RowDot& dot, const WeightsAndOutputs& wo, int64_t row_bytes, int64_t m,
              int64_t n_entries, const Entry& entry, const Take& take, int64_t out_stride) {
  const int64_t total = wo.n * n_entries;
  const int64_t band = rows_per_task(pool, total);
  if (m == 1 && dot.pairs()) {
    parallel_for(pool, (total + band - 1) / band, [=](int64_t task) {
      const int64_t p0 = task * band, p1 = std::min(total, p0 + band);
      // The row of entry p to ask for ahead: none past the task's end or in a run of three consecutive rows.
      auto ask = [&](int64_t p) -> const uint8_t* {
        if (p >= p1) return nullptr;
        const int64_t i = p / n_entries, e = p - i * n_entries;
        const int64_t r = entry(e).row;
        if (e >= 2 && p - 2 >= p0 && entry(e - 1).row == r - 1 && entry(e - 2).row == r - 2) return nullptr;
        return wo.ws[i] + r * row_bytes;
      };
      for (int64_t p = p0; p < p1;) {
        const int64_t i = p / n_entries, e = p - i * n_entries;
        if (p + 1 < p1 && e + 1 < n_entries && take(0, e) && take(0, e + 1)) {
          float out[2];
          const bool same_weight = (p + 2) / n_entries == (p + 3) / n_entries;  // the pair kernel's aheads: one buffer
          dot.pair(wo.ws[i] + entry(e).row * row_bytes, wo.ws[i] + entry(e + 1).row * row_bytes, 0, ask(p + 2),
                   same_weight ? ask(p + 3) : nullptr, row_bytes, out);
          wo.outs[i][entry(e).column] = out[0], wo.outs[i][entry(e + 1).column] = out[1];
          p += 2;
          continue;
        }
        if (take(0, e)) wo.outs[i][entry(e).column] = dot(wo.ws[i] + entry(e).row * row_bytes, 0);
        p += 1;
      }
    });
    return;
  }
  parallel_for(pool, (total + band - 1) / band, [=](int64_t task) {
    const int64_t p0 = task * band, p1 = std::min(total, p0 + band);
    for (int64_t t = 0; t < m; ++t) {  // the task's rows stay in L1 over the tokens
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t i = p / n_entries, e = p - i * n_entries;
        const uint8_t* next = nullptr;
        if (t == 0 && p + 2 < p1 && e + 2 < n_entries) {
          const int64_t r0 = entry(e).row, r1 = entry(e + 1).row, r2 = entry(e + 2).row;
          if (r2 != r1 + 1 || r1 != r0 + 1) next = wo.ws[i] + r2 * row_bytes;
        }
        if (!take(t, e)) {
          if (next != nullptr) prefetch_row_once(next, row_bytes);
          continue;
        }
        const RowAndColumn rc = entry(e);
        const uint8_t* row = wo.ws[i] + rc.row * row_bytes;
        wo.outs[i][t * out_stride + rc.column] = next != nullptr ? dot.ahead(row, t, next, row_bytes) : dot(row, t);
      }
    }
  });
}

ffi::Error MaskedMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                            ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t rows,
                            int64_t cols) {
  TypeInfo info;
  int64_t row_bytes, m;
  if (ffi::Error error = check_weight("masked_matmul", w, qtype, rows, cols, &info, &row_bytes); error.failure()) {
    return error;
  }
  if (!tokens_of(x.dimensions(), cols, &m)) {
    return ffi::Error::InvalidArgument("masked_matmul: x must be [..., " + std::to_string(cols) + "], got " +
                                       dims_string(x.dimensions()));
  }
  int64_t mask_m;
  if (!tokens_of(mask.dimensions(), rows, &mask_m) || !same_leading_dims(mask.dimensions(), x.dimensions())) {
    return ffi::Error::InvalidArgument("masked_matmul: mask must be [..., " + std::to_string(rows) +
                                       "] with the leading dims of x " + dims_string(x.dimensions()) + ", got " +
                                       dims_string(mask.dimensions()));
  }
  if (!holds(y->element_count(), m, rows)) {
    return ffi::Error::InvalidArgument("masked_matmul: output must be [..., " + std::to_string(rows) + "]");
  }

  Scratch& s = thread_scratch();
  const uint8_t* ms = mask_bytes(mask);
  float* ys = y->typed_data();
  zero_floats(pool, ys, m * rows);
  const int64_t n_active = active_rows(ms, m, rows, s);
  if (n_active == 0) return ffi::Error::Success();  // nothing to read, not even x
  const int32_t* active = s.rows.data();
  const WeightsAndOutputs wo{{static_cast<const uint8_t*>(w.untyped_data())}, {ys}, 1};
  if (packs_union(qtype, m)) {
    union_row_products(pool, qtype, x.typed_data(), m, cols, wo, row_bytes, active, n_active, ms, rows, s);
    return ffi::Error::Success();
  }
  const RowDot dot(pool, best_kernels(), info, x.typed_data(), m, cols, s);
  row_dots(
      pool, dot, wo, row_bytes, m, n_active,
      [=](int64_t e) { return RowAndColumn{active[e], active[e]}; },
      [=](int64_t t, int64_t e) { return ms[t * rows + active[e]] != 0; }, rows);
  return ffi::Error::Success();
}

// masked_matmul of one x and mask with several weights of one type and shape (a part's gate and up): x is
// quantized once, the active rows found once, and all the weights' rows split over the threads together.
ffi::Error MaskedMatmulGroupImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::PRED> mask,
                                 ffi::RemainingArgs ws, ffi::RemainingRets ys, int64_t qtype, int64_t rows,
                                 int64_t cols) {
  const std::string op = "masked_matmul_group";
  const int64_t n = static_cast<int64_t>(ws.size());
  if (n == 0 || n > kMaxWeights || static_cast<int64_t>(ys.size()) != n) {
    return ffi::Error::InvalidArgument(op + ": 1 to " + std::to_string(kMaxWeights) + " weights and one output each; "
                                       "got " + std::to_string(n) + " weights, " + std::to_string(ys.size()) +
                                       " outputs");
  }
  int64_t m;
  if (!tokens_of(x.dimensions(), cols, &m)) {
    return ffi::Error::InvalidArgument(op + ": x must be [..., " + std::to_string(cols) + "], got " +
                                       dims_string(x.dimensions()));
  }
  int64_t mask_m;
  if (!tokens_of(mask.dimensions(), rows, &mask_m) || !same_leading_dims(mask.dimensions(), x.dimensions())) {
    return ffi::Error::InvalidArgument(op + ": mask must be [..., " + std::to_string(rows) + "] with the leading "
                                       "dims of x " + dims_string(x.dimensions()) + ", got " +
                                       dims_string(mask.dimensions()));
  }
  TypeInfo info;
  int64_t row_bytes = 0;
  WeightsAndOutputs wo{{}, {}, n};
  for (int64_t i = 0; i < n; ++i) {
    const auto w = ws.get<ffi::AnyBuffer>(i);
    auto y = ys.get<ffi::AnyBuffer>(i);
    if (!w.has_value() || !y.has_value()) return ffi::Error::InvalidArgument(op + ": weights and outputs are buffers");
    if (ffi::Error error = check_weight(op, *w, qtype, rows, cols, &info, &row_bytes); error.failure()) return error;
    if ((*y)->element_type() != ffi::DataType::F32 || !holds((*y)->element_count(), m, rows)) {
      return ffi::Error::InvalidArgument(op + ": outputs must be f32 [..., " + std::to_string(rows) + "]");
    }
    wo.ws[i] = static_cast<const uint8_t*>(w->untyped_data());
    wo.outs[i] = static_cast<float*>((*y)->untyped_data());
    zero_floats(pool, wo.outs[i], m * rows);
  }
  Scratch& s = thread_scratch();
  const uint8_t* ms = mask_bytes(mask);
  const int64_t n_active = active_rows(ms, m, rows, s);
  if (n_active == 0) return ffi::Error::Success();
  const int32_t* active = s.rows.data();
  if (packs_union(qtype, m)) {
    union_row_products(pool, qtype, x.typed_data(), m, cols, wo, row_bytes, active, n_active, ms, rows, s);
    return ffi::Error::Success();
  }
  const RowDot dot(pool, best_kernels(), info, x.typed_data(), m, cols, s);
  row_dots(
      pool, dot, wo, row_bytes, m, n_active, [=](int64_t e) { return RowAndColumn{active[e], active[e]}; },
      [=](int64_t t, int64_t e) { return ms[t * rows + active[e]] != 0; }, rows);
  return ffi::Error::Success();
}

// With `segment` s > 0, token t (of m) takes only the entries t s .. (t + 1) s - 1 (k = m s): a mixture's down
// projections, each routed expert's rows with its own hidden values, in one call (moe.py). Entries are read once,
// in order, each dotted with its own token; the others' outputs stay 0.
void segmented_row_dots(ffi::ThreadPool& pool, const RowDot& dot, const uint8_t* w, int64_t row_bytes,
                        const int32_t* idx, const int32_t* pos, int64_t n_valid, int64_t segment, int64_t k,
                        float* ys) {
  const int64_t band = rows_per_task(pool, n_valid);
  parallel_for(pool, (n_valid + band - 1) / band, [=](int64_t task) {
    const int64_t e0 = task * band, e1 = std::min(n_valid, e0 + band);
    for (int64_t e = e0; e < e1; ++e) {
      const int64_t t = pos[e] / segment;
      const uint8_t* row = w + idx[pos[e]] * row_bytes;
      if (e + 2 < e1 && idx[pos[e + 2]] != idx[pos[e + 1]] + 1) {
        ys[t * k + pos[e]] = dot.ahead(row, t, w + idx[pos[e + 2]] * row_bytes, row_bytes);
      } else {
        ys[t * k + pos[e]] = dot(row, t);
      }
    }
  });
}

// gather_matmul of four tokens or more: each task's entries in tiles of kGatherTile, each tile dotted with the tokens
// four at a time (two consecutive rows at once where the index runs on), as the dense row product does: the same
// bits as one token at a time (every (row, token) sum runs the same operations), each row read once a tile instead
// of once a token. A mixture's experts run their tokens' tiles so (moe.py).
constexpr int64_t kGatherTile = 32;

void gathered_row_dots(ffi::ThreadPool& pool, const RowDot& dot, const uint8_t* w, int64_t row_bytes,
                       const int32_t* idx, const int32_t* pos, int64_t n_valid, int64_t m, int64_t k, float* ys) {
  const int64_t band = rows_per_task(pool, n_valid);
  parallel_for(pool, (n_valid + band - 1) / band, [=](int64_t task) {
    const int64_t e0 = task * band, e1 = std::min(n_valid, e0 + band);
    for (int64_t tile = e0; tile < e1; tile += kGatherTile) {
      const int64_t tile_end = std::min(tile + kGatherTile, e1);
      int64_t t = 0;
      for (; t + 4 <= m; t += 4) {
        for (int64_t e = tile; e < tile_end;) {
          const uint8_t* row = w + idx[pos[e]] * row_bytes;
          float out[8];
          if (e + 1 < tile_end && idx[pos[e + 1]] == idx[pos[e]] + 1) {
            dot.two_by_four(row, row_bytes, t, out);
            for (int i = 0; i < 4; ++i) ys[(t + i) * k + pos[e]] = out[i], ys[(t + i) * k + pos[e + 1]] = out[4 + i];
            e += 2;
          } else {
            dot.four(row, t, out);
            for (int i = 0; i < 4; ++i) ys[(t + i) * k + pos[e]] = out[i];
            e += 1;
          }
        }
      }
      for (; t < m; ++t) {
        for (int64_t e = tile; e < tile_end; ++e) ys[t * k + pos[e]] = dot(w + idx[pos[e]] * row_bytes, t);
      }
    }
  });
}

ffi::Error GatherMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w, ffi::AnyBuffer index,
                            ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t rows, int64_t cols, int64_t segment,
                            int64_t interleave) {
  TypeInfo info;
  int64_t row_bytes, m;
  if (ffi::Error error = check_any_weight("gather_matmul", w, qtype, rows, cols, interleave, &info, &row_bytes);
      error.failure()) {
    return error;
  }
  if (!tokens_of(x.dimensions(), cols, &m)) {
    return ffi::Error::InvalidArgument("gather_matmul: x must be [..., " + std::to_string(cols) + "], got " +
                                       dims_string(x.dimensions()));
  }
  Scratch& s = thread_scratch();
  const int32_t* idx;
  int64_t k;
  if (ffi::Error error = index_entries("gather_matmul", index, s, &idx, &k); error.failure()) return error;
  if (!holds(y->element_count(), m, k)) {
    return ffi::Error::InvalidArgument("gather_matmul: output must be [..., " + std::to_string(k) + "]");
  }

  if (segment < 0 || (segment > 0 && k != m * segment)) {
    return ffi::Error::InvalidArgument("gather_matmul: segment must be 0, or the index's entries per token (" +
                                       std::to_string(k) + " entries for " + std::to_string(m) + " tokens), got " +
                                       std::to_string(segment));
  }
  float* ys = y->typed_data();
  zero_floats(pool, ys, m * k);
  if (interleave == kInterleave) {
    return gathered_group_products(pool, info, qtype, static_cast<const uint8_t*>(w.untyped_data()), rows, cols,
                                   x.typed_data(), m, idx, k, segment, ys, s);
  }
  const int64_t n_valid = valid_positions(idx, k, rows, s);
  if (n_valid == 0) return ffi::Error::Success();
  const RowDot dot(pool, best_kernels(), info, x.typed_data(), m, cols, s);
  const int32_t* pos = s.rows.data();
  if (segment > 0) {
    segmented_row_dots(pool, dot, static_cast<const uint8_t*>(w.untyped_data()), row_bytes, idx, pos, n_valid,
                       segment, k, ys);
    return ffi::Error::Success();
  }
  if (m >= 4) {
    gathered_row_dots(pool, dot, static_cast<const uint8_t*>(w.untyped_data()), row_bytes, idx, pos, n_valid, m, k,
                      ys);
    return ffi::Error::Success();
  }
  row_dots(
      pool, dot, WeightsAndOutputs{{static_cast<const uint8_t*>(w.untyped_data())}, {ys}, 1}, row_bytes, m, n_valid,
      [=](int64_t e) { return RowAndColumn{idx[pos[e]], pos[e]}; }, [](int64_t, int64_t) { return true; }, k);
  return ffi::Error::Success();
}

// ---- masked_axpy, gather_axpy

// Adds the sum over the entries e in [e0, e1) that token t takes of h W_t[row(e)] to y [cols] (one panel for the axpy
// kernel; take(t, e, &h) says whether t takes e and with which coefficient h).
template <typename Row, typename Take>
void add_panel(Axpy axpy, const uint8_t* ws, int64_t row_bytes, int64_t e0, int64_t e1, int64_t t, const Row& row,
               const Take& take, float* y, int64_t cols) {
  const uint8_t* w_rows[kRowsPerTask];
  float h[kRowsPerTask];
  int n = 0;
  for (int64_t e = e0; e < e1; ++e) {  // branch-free, as in active_rows
    w_rows[n] = ws + row(e) * row_bytes;
    n += take(t, e, &h[n]);
  }
  if (n > 0) axpy(w_rows, h, n, y, static_cast<int>(cols));
}

// y [m, cols] = the axpys of the entries e < n_entries (see add_panel), overwriting y, in panels of kRowsPerTask
// entries summed over groups of panels (sum_over_groups).
//
// Splitting the rows this way was measured (with one accumulator per thread, before the groups made the sums
// reproducible) against splitting y into block-aligned column bands, a task adding every panel's part of its band
// with nothing to sum at the end: as fast at d = 576 with 1 token and 90% sparsity, 10-40% faster in every other
// case (d = 576 and 4096, 1 and 8 tokens, 50% and 90% sparsity), as whole rows are read in order.
template <typename Row, typename Take>
void axpy_entries(ffi::ThreadPool& pool, const TypeInfo& info, const uint8_t* ws, int64_t row_bytes, int64_t m,
                  int64_t cols, int64_t n_entries, const Row& row, const Take& take, float* ys, Scratch& s) {
  const Axpy axpy = best_kernels().*info.axpy;
  const int64_t n_panels = (n_entries + kRowsPerTask - 1) / kRowsPerTask;
  sum_over_groups(pool, n_panels, m * cols, ys, s, [=](int64_t p0, int64_t p1, float* y) {
    for (int64_t panel = p0; panel < p1; ++panel) {
      const int64_t e0 = panel * kRowsPerTask, e1 = std::min(n_entries, e0 + kRowsPerTask);
      for (int64_t t = 0; t < m; ++t) add_panel(axpy, ws, row_bytes, e0, e1, t, row, take, y + t * cols, cols);
    }
  });
}

ffi::Error MaskedAxpyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::AnyBuffer w,
                          ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t rows,
                          int64_t cols) {
  TypeInfo info;
  int64_t row_bytes, m;
  if (ffi::Error error = check_weight("masked_axpy", w, qtype, rows, cols, &info, &row_bytes); error.failure()) {
    return error;
  }
  if (ffi::Error error = check_masked_axpy("masked_axpy", h, mask, *y, rows, cols, &m); error.failure()) return error;

  Scratch& s = thread_scratch();
  const uint8_t* ms = mask_bytes(mask);
  const float* hs = h.typed_data();
  const int64_t n_active = active_rows(ms, m, rows, s);
  const int32_t* active = s.rows.data();
  axpy_entries(
      pool, info, static_cast<const uint8_t*>(w.untyped_data()), row_bytes, m, cols, n_active,
      [=](int64_t e) { return int64_t{active[e]}; },
      [=](int64_t t, int64_t e, float* coef) {
        *coef = hs[t * rows + active[e]];
        return ms[t * rows + active[e]] != 0;
      },
      y->typed_data(), s);
  return ffi::Error::Success();
}

ffi::Error GatherAxpyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::AnyBuffer w, ffi::AnyBuffer index,
                          ffi::ResultBuffer<ffi::F32> y, int64_t qtype, int64_t rows, int64_t cols) {
  TypeInfo info;
  int64_t row_bytes, m;
  if (ffi::Error error = check_weight("gather_axpy", w, qtype, rows, cols, &info, &row_bytes); error.failure()) {
    return error;
  }
  Scratch& s = thread_scratch();
  const int32_t* idx;
  int64_t k;
  if (ffi::Error error = check_gather_axpy("gather_axpy", h, index, *y, cols, s, &idx, &k, &m); error.failure()) {
    return error;
  }

  const float* hs = h.typed_data();
  const int64_t n_valid = valid_positions(idx, k, rows, s);
  const int32_t* pos = s.rows.data();
  axpy_entries(
      pool, info, static_cast<const uint8_t*>(w.untyped_data()), row_bytes, m, cols, n_valid,
      [=](int64_t e) { return int64_t{idx[pos[e]]}; },
      [=](int64_t t, int64_t e, float* coef) {
        *coef = hs[t * k + pos[e]];
        return true;
      },
      y->typed_data(), s);
  return ffi::Error::Success();
}

// ---- neuron_major_axpy

// While one 32-neuron block is added, the next one's first two tiles (scales and the active neurons' q) are asked
// for; the kernel asks for each tile's two tiles ahead as it goes.
void prefetch_block(const uint8_t* block, const NeuronLayout& layout, int n_tiles, const BlockQ8& x) {
  const uint8_t* rows[kQK];
  int8_t coef[kQK];
  const int n = nonzero_neurons(x, block, layout, 1, rows, coef);
  for (int t = 0; n > 0 && t < std::min(2, n_tiles); ++t) layout.prefetch_tile(block, t, rows, n);
}

ffi::Error NeuronMajorAxpyImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::U8> w,
                               ffi::Buffer<ffi::PRED> mask, ffi::ResultBuffer<ffi::F32> y, int64_t qtype,
                               int64_t rows, int64_t cols, int64_t span) {
  const Kernels& k = best_kernels();
  NeuronBlockAxpy add_block;
  NeuronLayout layout;
  switch (qtype) {
    case kQ4_0: add_block = k.neuron_block_q4_0, layout = kQ4_0Layout; break;
    case kQ4_1: add_block = k.neuron_block_q4_1, layout = kQ4_1Layout; break;
    case kQ8_0: add_block = k.neuron_block_q8_0, layout = kQ8_0Layout; break;
    default:
      return ffi::Error::InvalidArgument("neuron_major_axpy: unsupported GGML type " + std::to_string(qtype) +
                                         " (Q4_0, Q4_1 or Q8_0)");
  }
  if (rows <= 0 || rows % kQK != 0 || rows > (int64_t{1} << 30) || cols <= 0 || cols % 64 != 0 ||
      cols > (int64_t{1} << 30)) {
    return ffi::Error::InvalidArgument("neuron_major_axpy: rows=" + std::to_string(rows) +
                                       " must be a positive multiple of 32 and cols=" + std::to_string(cols) +
                                       " a positive multiple of 64");
  }
  if (span <= 0 || span % 64 != 0 || cols % span != 0) {
    return ffi::Error::InvalidArgument("neuron_major_axpy: span=" + std::to_string(span) +
                                       " must be a positive multiple of 64 dividing cols=" + std::to_string(cols));
  }
  layout.span_tiles = static_cast<int>(span / 64);
  const int64_t n_blocks = rows / kQK, block_bytes = cols / span * layout.span_bytes();
  const int n_tiles = static_cast<int>(cols / 64);
  const auto w_dims = w.dimensions();
  if (w_dims.size() != 2 || w_dims[0] != n_blocks || w_dims[1] != block_bytes) {
    return ffi::Error::InvalidArgument("neuron_major_axpy: packed weight must be uint8 [" + std::to_string(n_blocks) +
                                       ", " + std::to_string(block_bytes) + "], got " + dims_string(w_dims));
  }
  int64_t m;
  if (ffi::Error error = check_masked_axpy("neuron_major_axpy", h, mask, *y, rows, cols, &m); error.failure()) {
    return error;
  }

  // Each token's h, masked, in 8-bit blocks as the dense kernels quantize it: an inactive neuron is a 0. A block of
  // 32 inactive neurons is only marked (scale 0, skipped below) without being quantized: a mixture's routed experts
  // are a few of its [n_expert * f] neurons (moe.py), and quantizing all of them took 64 us of a call that reads none
  // (98,304 neurons, d = 2048).
  Scratch& s = thread_scratch();
  s.xq.resize(static_cast<size_t>(m * n_blocks));
  s.masked.resize(kQK);
  const float* hs = h.typed_data();
  const uint8_t* ms = mask_bytes(mask);
  for (int64_t t = 0; t < m; ++t) {
    for (int64_t b = 0; b < n_blocks; ++b) {
      const uint8_t* block_mask = ms + t * rows + b * kQK;
      const float* block_h = hs + t * rows + b * kQK;
      uint8_t any = 0;
      for (int j = 0; j < kQK; ++j) any |= block_mask[j];
      BlockQ8& out = s.xq[t * n_blocks + b];
      if (any == 0) {
        out = BlockQ8{};
        continue;
      }
      for (int j = 0; j < kQK; ++j) s.masked[j] = block_mask[j] != 0 ? block_h[j] : 0.0f;
      k.quantize_row(s.masked.data(), &out, kQK);
    }
  }
  const BlockQ8* xq = s.xq.data();
  const auto* ws = w.typed_data();
  sum_over_groups(pool, n_blocks, m * cols, y->typed_data(), s, [=](int64_t b0, int64_t b1, float* ys) {
    for (int64_t t = 0; t < m; ++t) {
      for (int64_t b = b0; b < b1; ++b) {
        if (xq[t * n_blocks + b].d == 0.0f) continue;  // no neuron of the block is active
        if (b + 1 < b1) prefetch_block(ws + (b + 1) * block_bytes, layout, n_tiles, xq[t * n_blocks + b + 1]);
        add_block(ws + b * block_bytes, static_cast<int>(cols), layout, xq[t * n_blocks + b], ys + t * cols);
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxinfer_cpu

// Weights are bound as in QuantizedMatmul (ffi_handlers.cc): uint8 blocks [rows, bytes], or f16/f32 [rows, cols].
XLA_FFI_DEFINE_HANDLER_SYMBOL(MaskedMatmul, jaxinfer_cpu::MaskedMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., cols]
                                  .Arg<ffi::AnyBuffer>()          // W [rows, ...]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [..., rows]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [..., rows]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaskedMatmulGroup, jaxinfer_cpu::MaskedMatmulGroupImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x [..., cols]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [..., rows]
                                  .RemainingArgs()                // W_1 .. W_n [rows, ...], one type
                                  .RemainingRets()                // y_1 .. y_n [..., rows], f32
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherMatmul, jaxinfer_cpu::GatherMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [..., cols]
                                  .Arg<ffi::AnyBuffer>()         // W [rows, ...], or repacked [ceil(rows / 8), ...]
                                  .Arg<ffi::AnyBuffer>()         // index [k], int32 (or a wider int, see index_entries)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., k]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols")
                                  .Attr<int64_t>("segment")     // 0, or entries per token (segmented_row_dots)
                                  .Attr<int64_t>("interleave"));  // 1: GGUF rows; 8: repacked (gathered_groups.h)

XLA_FFI_DEFINE_HANDLER_SYMBOL(MaskedAxpy, jaxinfer_cpu::MaskedAxpyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // h [..., rows]
                                  .Arg<ffi::AnyBuffer>()          // W_t [rows, ...]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [..., rows]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [..., cols]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherAxpy, jaxinfer_cpu::GatherAxpyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // h [..., k]
                                  .Arg<ffi::AnyBuffer>()         // W_t [rows, ...]
                                  .Arg<ffi::AnyBuffer>()         // index [k], as GatherMatmul's
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [..., cols]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols"));

// The packed weight: uint8 [rows / 32, cols * type_size] (quant.pack_neuron_major), one run of bytes per 32 neurons.
XLA_FFI_DEFINE_HANDLER_SYMBOL(NeuronMajorAxpy, jaxinfer_cpu::NeuronMajorAxpyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // h [..., rows]
                                  .Arg<ffi::Buffer<ffi::U8>>()    // W packed neuron-major
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // mask [..., rows]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y [..., cols]
                                  .Attr<int64_t>("qtype")
                                  .Attr<int64_t>("rows")
                                  .Attr<int64_t>("cols")
                                  .Attr<int64_t>("span"));

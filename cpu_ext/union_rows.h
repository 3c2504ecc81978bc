// Row-sparse products of many tokens through the repacked kernels (union_rows.cc): the rows any token needs, packed
// eight to a group for the call.
#pragma once

#include <cstdint>

#include "sparse_common.h"

namespace jaxinfer_cpu {

// From this many tokens a call packs its rows (measured crossover: below it, packing costs more than the row
// kernels lose; see union_rows.cc).
constexpr int64_t kUnionPackMinTokens = 16;

// Whether masked products of GGML type `qtype` over m tokens take union_row_products (32-value repacked types).
bool packs_union(int64_t qtype, int64_t m);

// outs[i][t, row] = W_i[row] · x[t] (x quantized to 8 bits per 32 values) for the rows active[0, n_active) and the
// tokens t whose mask[t, row] is set; the others are 0: they are written 0 or left as they are, so the caller zeroes
// the outputs first.
void union_row_products(ffi::ThreadPool& pool, int64_t qtype, const float* x, int64_t m, int64_t cols,
                        const WeightsAndOutputs& wo, int64_t row_bytes, const int32_t* active, int64_t n_active,
                        const uint8_t* mask, int64_t rows, Scratch& s);

}  // namespace jaxinfer_cpu

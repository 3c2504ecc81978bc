// Products with weights repacked eight rows to a group (qmatmul.h, jaxinfer.quant.pack_rows_x8), as the dense
// products (ffi_handlers.cc) and a gather of whole groups (a mixture's experts held repacked, gathered_groups.cc) run
// them: tiled over groups x tokens, any number of tokens.
#pragma once

#include <algorithm>
#include <string>

#include "repacked_kernels.h"

namespace jaxinfer_cpu {

// Some consecutive groups of a repacked weight and the tokens they are dotted with: token t's output of the
// product's row r (r < rows) goes to y[t * y_stride + r].
struct X8Product {
  const uint8_t* w;  // the first group
  int64_t rows;      // rows in its ceil(rows / 8) groups that are written (the last group's padding is not)
  float* y;
  int64_t y_stride;
  int64_t t0, t1;  // the tokens [t0, t1)
};

// Checks W for its interleave: GGUF rows (1, check_weight), or groups of eight rows (8) of a type with repacked
// kernels: u8 [ceil(rows / 8), 8 row_bytes]. Fills `info` and the bytes of one row as GGUF stores it
// (ffi_handlers.cc).
ffi::Error check_any_weight(const std::string& op, const ffi::AnyBuffer& w, int64_t qtype, int64_t rows,
                            int64_t cols, int64_t interleave, TypeInfo* info, int64_t* row_bytes);

// Every product's outputs = its groups · its tokens' x. Each task is a band of groups, counted across the products in
// order, for the product's tokens kTokenChunkBytes of activations at a time, eight or four tokens per kernel call
// (two groups at once where the kernel set has it), then one. xq: the tokens' `blocks` activation blocks each; a
// group is `group_bytes`. `products` stays readable until the call returns.
template <typename XBlock>
void multiply_x8(ffi::ThreadPool& pool, const X8Kernels<XBlock>& kernels, const XBlock* xq, int64_t blocks,
                 int64_t cols, int64_t group_bytes, const X8Product* products, size_t n_products) {
  int64_t total = 0;  // groups
  for (size_t i = 0; i < n_products; ++i) total += (products[i].rows + kInterleave - 1) / kInterleave;
  int64_t band = (rows_per_task(pool, total * kInterleave) + kInterleave - 1) / kInterleave;
  band += kernels.two_groups != nullptr && band % 2;  // an even band: no group left to the one-group kernel
  const int64_t chunk = std::max<int64_t>(8, kTokenChunkBytes / (blocks * int64_t{sizeof(XBlock)}) / 8 * 8);
  const int n = static_cast<int>(cols);
  parallel_for(pool, (total + band - 1) / band, [=](int64_t task) {
    int64_t start = 0;  // first group of product i in the count across products
    for (size_t i = 0; i < n_products; ++i) {
      const X8Product p = products[i];
      const int64_t groups = (p.rows + kInterleave - 1) / kInterleave;
      const int64_t g0 = std::max(task * band - start, int64_t{0}), g1 = std::min((task + 1) * band - start, groups);
      start += groups;
      for (int64_t t0 = p.t0; t0 < p.t1 && g0 < g1; t0 += chunk) {
        const int64_t t1 = std::min(p.t1, t0 + chunk);
        for (int64_t g = g0; g < g1;) {
          const uint8_t* group = p.w + g * group_bytes;
          const int64_t r0 = g * kInterleave;
          // Two groups at a time where the kernel set has the kernel, for four tokens at a time.
          const int64_t n_groups = kernels.two_groups != nullptr && g + 2 <= g1 && t1 - t0 >= 4 ? 2 : 1;
          const int64_t width = n_groups * kInterleave, valid = std::min(width, p.rows - r0);
          float out[8 * 2 * kInterleave];
          auto store = [&](int64_t t, int count) {
            for (int j = 0; j < count; ++j) std::copy(out + width * j, out + width * j + valid,
                                                      p.y + (t + j) * p.y_stride + r0);
          };
          int64_t t = t0;
          if (n_groups == 2 && kernels.two_groups_eight != nullptr) {
            for (; t + 8 <= t1; t += 8) {
              kernels.two_groups_eight(group, group_bytes, xq + t * blocks, blocks, n, out);
              store(t, 8);
            }
          }
          for (; t + 4 <= t1; t += 4) {
            if (n_groups == 2) {
              kernels.two_groups(group, group_bytes, xq + t * blocks, blocks, n, out);
            } else {
              kernels.four(group, xq + t * blocks, blocks, n, out);
            }
            store(t, 4);
          }
          for (; t < t1; ++t) {
            for (int64_t h = 0; h < n_groups; ++h) {
              kernels.one(group + h * group_bytes, xq + t * blocks, blocks, n, out + h * kInterleave);
            }
            store(t, 1);
          }
          g += n_groups;
        }
      }
    }
  });
}

// Quantizes the m tokens of x [m, cols] (8 bits per 32 values, or per 256 for the K-quants and IQ4_XS) and runs
// multiply_x8 with the type's kernels.
inline void run_x8_products(ffi::ThreadPool& pool, const TypeInfo& info, int64_t qtype, const float* x, int64_t m,
                            int64_t cols, const X8Product* products, size_t n, Scratch& scratch) {
  const Kernels& k = best_kernels();
  const int64_t blocks = cols / info.block_size, group_bytes = blocks * x8_block_bytes(qtype);
  if (info.block_size == kQK_K) {
    const BlockQ8K* xq = quantize_rows(pool, k.quantize_row_k, x, m, cols, blocks, scratch.xk);
    return multiply_x8(pool, x8k_kernels(k, qtype), xq, blocks, cols, group_bytes, products, n);
  }
  const BlockQ8* xq = quantize_rows(pool, k.quantize_row, x, m, cols, blocks, scratch.xq);
  multiply_x8(pool, x8_kernels(k, qtype), xq, blocks, cols, group_bytes, products, n);
}

}  // namespace jaxinfer_cpu

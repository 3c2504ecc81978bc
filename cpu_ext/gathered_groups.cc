// gather_matmul of a weight repacked eight rows to a group: a mixture's stacked experts held repacked (jaxinfer/moe.py)
// have each expert's rows in whole groups, so its rows of a projection are consecutive groups, and the routed and
// grouped products read them through the dense products' repacked kernels (repacked_products.h) instead of a row at
// a time (one expert of Qwen3-30B-A3B's width, Q4_0 768 x 2048: 16 tokens 53 against 222 us, one token 14 against
// 31 us, from cache). The index still names rows, as for GGUF's rows: the caller builds it the same way for both.
#include "gathered_groups.h"

#include <vector>

#include "repacked_products.h"

namespace jaxinfer_cpu {

ffi::Error gathered_group_products(ffi::ThreadPool& pool, const TypeInfo& info, int64_t qtype, const uint8_t* w,
                                   int64_t rows, int64_t cols, const float* x, int64_t m, const int32_t* index,
                                   int64_t k, int64_t segment, float* ys, Scratch& scratch) {
  const std::string op = "gather_matmul";
  if (k % kInterleave != 0 || segment % kInterleave != 0) {
    return ffi::Error::InvalidArgument(op + ": the index of a weight repacked eight rows to a group lists whole "
                                       "groups: its length (" + std::to_string(k) + ") and segment (" +
                                       std::to_string(segment) + ") must be multiples of 8");
  }
  const int64_t group_bytes = cols / info.block_size * x8_block_bytes(qtype);
  // Runs of consecutive groups with consecutive outputs and the same tokens: one product each.
  thread_local std::vector<X8Product> runs;
  runs.clear();
  for (int64_t j = 0; j < k; j += kInterleave) {
    const int64_t r = index[j];
    const bool inside = r >= 0 && r < rows;
    bool whole = !inside || r % kInterleave == 0;
    for (int64_t i = 1; i < kInterleave; ++i) {
      whole &= inside ? index[j + i] == r + i : index[j + i] < 0 || index[j + i] >= rows;
    }
    if (!whole) {
      return ffi::Error::InvalidArgument(op + ": entries " + std::to_string(j) + ".." + std::to_string(j + 7) +
                                         " of the index are not one group of eight rows of the repacked weight (rows "
                                         "8g .. 8g + 7, or all outside [0, " + std::to_string(rows) + "))");
    }
    if (!inside) continue;
    const int64_t t0 = segment > 0 ? j / segment : 0, t1 = segment > 0 ? t0 + 1 : m;
    const uint8_t* group = w + r / kInterleave * group_bytes;
    const int64_t valid = std::min<int64_t>(kInterleave, rows - r);
    if (!runs.empty()) {
      X8Product& last = runs.back();
      if (last.t0 == t0 && last.rows % kInterleave == 0 && last.y + last.rows == ys + j &&
          last.w + last.rows / kInterleave * group_bytes == group) {
        last.rows += valid;
        continue;
      }
    }
    runs.push_back({group, valid, ys + j, k, t0, t1});
  }
  if (!runs.empty()) run_x8_products(pool, info, qtype, x, m, cols, runs.data(), runs.size(), scratch);
  return ffi::Error::Success();
}

}  // namespace jaxinfer_cpu

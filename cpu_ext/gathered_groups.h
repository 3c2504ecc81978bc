// gather_matmul of a weight repacked eight rows to a group (gathered_groups.cc).
#pragma once

#include <cstdint>

#include "ffi_common.h"

namespace jaxinfer_cpu {

// ys[t, i] = x[t] · W[index[i]] for a W of `rows` rows repacked eight to a group, as gather_matmul with GGUF rows:
// index [k] lists whole groups (entries 8j .. 8j + 7 are rows r .. r + 7 of one group, r a multiple of 8 inside W,
// or all outside [0, rows): padding, left 0); with `segment` (a multiple of 8) token t takes only the entries
// t segment .. (t + 1) segment - 1. ys [m, k] is zeroed by the caller. An index that breaks a group is an error.
ffi::Error gathered_group_products(ffi::ThreadPool& pool, const TypeInfo& info, int64_t qtype, const uint8_t* w,
                                   int64_t rows, int64_t cols, const float* x, int64_t m, const int32_t* index,
                                   int64_t k, int64_t segment, float* ys, Scratch& scratch);

}  // namespace jaxinfer_cpu

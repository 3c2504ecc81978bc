// The tiled attention of many queries (attention_prefill.cc), called by cached_attention (attention.cc).
#pragma once

#include <algorithm>
#include <cstdint>

#include "ffi_common.h"

namespace jaxinfer_cpu {

// The first position a query at `position` sees: 0, or with a sliding window (> 0) the window's first.
inline int64_t first_seen(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, position - window + 1) : 0;
}

// One cached_attention call's operands, checked by its handler: q [B, T, H, hd] f32, the k and v bytes of the layer
// read ([R, S, H_kv, hd] from that layer's first row, f32 or f16), start [B], the sliding window (0: none), the
// scores' soft-cap (0: none), out [B, T, H, hd].
struct PrefillCall {
  const float* q;
  const char* k;
  const char* v;
  bool f16;
  int64_t batch, n_query, n_head, n_head_kv, head_dim, max_len;
  const int32_t* starts;
  int64_t window;
  float softcap;
  float* out;
};

void attend_prefill(ffi::ThreadPool& pool, const PrefillCall& call);

}  // namespace jaxinfer_cpu

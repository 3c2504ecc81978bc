// The tiled attention of many queries (attention_prefill.cc), called by cached_attention (attention.cc).
#pragma once

#include <cstdint>

#include "ffi_common.h"

namespace jaxinfer_cpu {

// One cached_attention call's operands, checked by its handler: q [B, T, H, hd] f32, the k and v bytes of the layer
// read ([R, S, H_kv, hd] from that layer's first row, f32 or f16), start [B], out [B, T, H, hd].
struct PrefillCall {
  const float* q;
  const char* k;
  const char* v;
  bool f16;
  int64_t batch, n_query, n_head, n_head_kv, head_dim, max_len;
  const int32_t* starts;
  float* out;
};

void attend_prefill(ffi::ThreadPool& pool, const PrefillCall& call);

}  // namespace jaxinfer_cpu

// XLA FFI handler: causal GQA attention of a few new queries against one layer of the whole KV cache.
//
// XLA:CPU runs a decode step's attention as a loop of a dozen small thunks per layer (slices of the cache, two
// einsums, the softmax pieces), about 120 µs a layer for 9 heads; here it is one call that reads exactly the filled
// keys of one layer, in place in the cache buffer (no slice is copied), about 10 µs at a short context.
//
//   q       f32 [B, T, H, hd]                queries at positions start .. start + T - 1
//   k, v    f32 [n_layer, B, S, H_kv, hd]    the caches, filled up to start + T - 1 (this step's K/V included)
//   layer   s32 []                           which layer of the caches
//   start   s32 []                           position of the first query
//   out     f32 [B, T, H, hd]                query head h uses KV head h / (H / H_kv)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "ffi_common.h"

namespace jaxinfer_cpu {
namespace {

// The two inner loops, compiled for AVX-512, AVX2 and plain x86-64; the loader picks one per CPU (GCC ifunc).
#if JAXINFER_CPU_X86
#define JAXINFER_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2,fma", "default")))
#else
#define JAXINFER_VECTOR_CLONES
#endif

// Sixteen running sums: one sum would be a chain of dependent adds that the compiler may not reorder (no
// -ffast-math), so it could not vectorize; sixteen independent ones become one or two vector registers.
JAXINFER_VECTOR_CLONES float dot(const float* a, const float* b, int n) {
  float sums[16] = {};
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) sums[j] += a[i + j] * b[i + j];
  }
  for (; i < n; ++i) sums[0] += a[i] * b[i];
  float total = 0.0f;
  for (float s : sums) total += s;
  return total;
}

JAXINFER_VECTOR_CLONES void axpy(float alpha, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

ffi::Error CachedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> layer_buf,
                               ffi::Buffer<ffi::S32> start_buf, ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end())) {
    return ffi::Error::InvalidArgument("cached_attention: q must be [B, T, H, hd], k and v [L, B, S, H_kv, hd]");
  }
  const int64_t batch = qd[0], n_query = qd[1], n_head = qd[2], head_dim = qd[3];
  const int64_t n_layer = kd[0], max_len = kd[2], n_head_kv = kd[3];
  if (kd[1] != batch || kd[4] != head_dim || n_head_kv <= 0 || n_head % n_head_kv != 0) {
    return ffi::Error::InvalidArgument("cached_attention: q [B, T, H, hd] and caches [L, B, S, H_kv, hd] disagree "
                                       "on B or hd, or H is not a multiple of H_kv");
  }
  const int64_t layer = *layer_buf.typed_data(), start = *start_buf.typed_data();
  if (layer < 0 || layer >= n_layer || start < 0 || start + n_query > max_len) {
    return ffi::Error::InvalidArgument("cached_attention: layer " + std::to_string(layer) + " or positions " +
                                       std::to_string(start) + ".." + std::to_string(start + n_query - 1) +
                                       " outside the cache [" + std::to_string(n_layer) + " layers, " +
                                       std::to_string(max_len) + " positions]");
  }
  const int64_t group = n_head / n_head_kv, row = n_head_kv * head_dim;  // row: one position of one layer's cache
  const float* ks = k.typed_data() + layer * batch * max_len * row;
  const float* vs = v.typed_data() + layer * batch * max_len * row;
  const float* qs = q.typed_data();
  float* os = out->typed_data();
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  const int n = static_cast<int>(head_dim);

  // One task per (batch, head): its queries share the keys, which stay in cache across them.
  parallel_for(pool, batch * n_head, [&](int64_t task) {
    const int64_t b = task / n_head, h = task % n_head, kv_head = h / group;
    const float* k_head = ks + b * max_len * row + kv_head * head_dim;
    const float* v_head = vs + b * max_len * row + kv_head * head_dim;
    std::vector<float> scores(static_cast<size_t>(start + n_query));
    for (int64_t t = 0; t < n_query; ++t) {
      const float* query = qs + ((b * n_query + t) * n_head + h) * head_dim;
      float* o = os + ((b * n_query + t) * n_head + h) * head_dim;
      const int64_t n_keys = start + t + 1;  // causal: positions 0 .. start + t
      float max_score = -INFINITY;
      for (int64_t j = 0; j < n_keys; ++j) {
        scores[j] = scale * dot(query, k_head + j * row, n);
        max_score = std::fmax(max_score, scores[j]);
      }
      float total = 0.0f;
      for (int64_t j = 0; j < n_keys; ++j) total += (scores[j] = std::exp(scores[j] - max_score));
      std::fill(o, o + head_dim, 0.0f);
      for (int64_t j = 0; j < n_keys; ++j) axpy(scores[j] / total, v_head + j * row, o, n);
    }
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxinfer_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(CachedAttention, jaxinfer_cpu::CachedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, T, H, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k cache [L, B, S, H_kv, hd]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // start []
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [B, T, H, hd]

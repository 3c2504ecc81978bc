// XLA FFI handler: causal GQA attention of new queries against one layer of the whole KV cache. A few queries (a
// decode step) are done here; more (a prompt, a perplexity window) by the tiled kernel of attention_prefill.cc.
//
// XLA:CPU runs a decode step's attention as a loop of a dozen small thunks per layer (slices of the cache, two
// einsums, the softmax pieces), about 120 µs a layer for 9 heads; here it is one call that reads exactly the filled
// keys of one layer, in place in the cache buffer (no slice is copied).
//
// A task is one batch row over a chunk of kChunkKeys positions, all heads: the query heads of a GQA group are done
// together, so each key and value row is read once for all of them, and a task reads one contiguous piece of each
// cache. Chunks spread long contexts over the
// threads (flash-decoding); each leaves its softmax partials (running max, sum, weighted values) and the calling
// thread merges them. Vectors are GCC vector extensions: one source, compiled for AVX-512, AVX2 and baseline x86-64
// (target_clones picks one per CPU at load time).
//
//   q       f32 [B, T, H, hd]                row b's queries at positions start[b] .. start[b] + T - 1
//   k, v    f32 or f16 [n_layer, B, S, H_kv, hd]   the caches, row b filled up to start[b] + T - 1 (this step's
//                                                  K/V included); an f16 cache's chunk is widened to f32 once per task
//   layer   s32 []                           which layer of the caches
//   start   s32 [B]                          position of each row's first query (rows at different depths)
//   row     s32 []                           the cache row of query row 0 (query row b reads cache row row + b: a
//                                            server's slot prefills alone)
//   window  attribute, int64                 > 0: a query at position p sees positions p - window + 1 .. p only (a
//                                            sliding-window layer); 0: every position up to p
//   softcap attribute, f32                   > 0: scores become softcap * tanh(score / softcap) before the softmax
//                                            (Gemma 2); 0: none
//   out     f32 [B, T, H, hd]                query head h uses KV head h / (H / H_kv)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if JAXINFER_CPU_X86
#include <immintrin.h>
#endif

#include "attention_prefill.h"
#include "attention_vectors.h"
#include "ffi_common.h"

namespace jaxinfer_cpu {

// n f16 values -> f32: with F16C 8 values per instruction (GCC 12 converts _Float16 through a libgcc call per value
// even where F16C is enabled: 0.39x llama.cpp's decode at 3072 tokens of context), else the portable conversion.
#if JAXINFER_CPU_X86
static __attribute__((target("avx2,f16c"))) void widen_f16_f16c(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
  for (; i < n; ++i) dst[i] = fp16_to_f32(src[i]);
}
#endif

void widen_f16(const uint16_t* src, int64_t n, float* dst) {
#if JAXINFER_CPU_X86
  static const bool f16c = __builtin_cpu_supports("f16c") && __builtin_cpu_supports("avx2");
  if (f16c) return widen_f16_f16c(src, n, dst);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = fp16_to_f32(src[i]);
}

namespace {

using namespace attention_vectors;

constexpr int64_t kChunkKeys = 64;  // positions per task: enough work to hide the task claim, few enough to balance
// Above this many queries a call, the tiled kernel of attention_prefill.cc takes them: its tasks are blocks of
// queries, too few to spread a decode step's long context over the threads.
constexpr int64_t kDecodeQueries = 8;

// Sixteen vectors -> one: lane i = sum of the lanes of v[i]. Four levels, each adding two shuffles of a pair so that
// every output keeps half as many lanes per vector, twice as many vectors per output: ~3 operations per vector
// against ~10 for a horizontal sum each.
__attribute__((always_inline)) inline F32x16 sum_lanes_16(const F32x16 v[16]) {
  F32x16 a[8], b[4], c[2];
  // a[i] lanes 0..7: halves of v[2i] added; lanes 8..15: of v[2i + 1]
  for (int i = 0; i < 8; ++i) {
    a[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  }
  // b[i]: four lanes per vector, in the order v[4i], v[4i + 2], v[4i + 1], v[4i + 3]
  for (int i = 0; i < 4; ++i) {
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30,
                                   31);
  }
  // c[i]: two lanes per vector
  for (int i = 0; i < 2; ++i) {
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30,
                                   31);
  }
  const F32x16 d = __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                   __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  // d holds v[i]'s sum at lane bit_reverse(i) (each level interleaves); bit reversal undoes itself
  return __builtin_shufflevector(d, d, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// The query heads of one KV head (`group` queries of `head_dim`, scaled by 1/sqrt(hd)) against keys [0, n_keys) of
// that head (rows `row` floats apart): per query head g, m[g] = max score, l[g] = sum of exp(score - m[g]) and
// o[g] = sum of exp(score - m[g]) * value, the scores soft-capped where softcap > 0. `scores` holds group * n_keys
// floats. HeadDim is the head size when it is known at compile time (the common 64, 128 and 256: loops unroll and
// accumulators stay in registers), else 0.
template <int HeadDim>
__attribute__((always_inline)) inline void attend_chunk(const float* queries, int group, int runtime_head_dim,
                                                        const float* keys, const float* values, int64_t row,
                                                        int64_t n_keys, float softcap, float* scores, float* m,
                                                        float* l, float* o) {
  const int head_dim = HeadDim > 0 ? HeadDim : runtime_head_dim;
  const int full = head_dim / kLanes * kLanes;
  for (int g = 0; g < group; ++g) {
    const float* query = queries + g * head_dim;
    int64_t j = 0;
    for (; j + kLanes <= n_keys; j += kLanes) {  // 16 keys' lane partials, summed together
      F32x16 partial[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        const float* key = keys + (j + i) * row;
        F32x16 acc{};
        for (int d = 0; d < full; d += kLanes) acc += load(query + d) * load(key + d);
        partial[i] = acc;
      }
      F32x16 score = sum_lanes_16(partial);
      for (int d = full; d < head_dim; ++d) {
        for (int i = 0; i < kLanes; ++i) score[i] += query[d] * keys[(j + i) * row + d];
      }
      store(scores + g * n_keys + j, softcap > 0 ? soft_cap(score, softcap) : score);
    }
    for (; j < n_keys; ++j) {
      const float* key = keys + j * row;
      F32x16 acc{};
      for (int d = 0; d < full; d += kLanes) acc += load(query + d) * load(key + d);
      float score = sum_lanes(acc);
      for (int d = full; d < head_dim; ++d) score += query[d] * key[d];
      scores[g * n_keys + j] = softcap > 0 ? soft_cap(splat(score), softcap)[0] : score;
    }
  }
  for (int g = 0; g < group; ++g) {
    float* s = scores + g * n_keys;
    int64_t j = 0;
    F32x16 max_lanes = splat(-INFINITY);
    for (; j + kLanes <= n_keys; j += kLanes) {
      const F32x16 x = load(s + j);
      max_lanes = x > max_lanes ? x : max_lanes;
    }
    float max_score = -INFINITY;
    for (int i = 0; i < kLanes; ++i) max_score = max_lanes[i] > max_score ? max_lanes[i] : max_score;
    for (; j < n_keys; ++j) max_score = s[j] > max_score ? s[j] : max_score;
    F32x16 total{};
    for (j = 0; j + kLanes <= n_keys; j += kLanes) {
      const F32x16 e = exp_nonpositive(load(s + j) - max_score);
      store(s + j, e);
      total += e;
    }
    float sum = sum_lanes(total);
    for (; j < n_keys; ++j) sum += (s[j] = std::exp(s[j] - max_score));
    m[g] = max_score;
    l[g] = sum;
  }
  // Per query head, the weighted values in registers where the head size is known (HeadDim / 16 vectors); the
  // chunk's values stay in L1 for the group's heads.
  constexpr int kVectors = HeadDim > 0 ? HeadDim / kLanes : 1;
  for (int g = 0; g < group; ++g) {
    float* out = o + g * head_dim;
    const float* p = scores + g * n_keys;
    if constexpr (HeadDim > 0 && HeadDim % kLanes == 0) {
      F32x16 acc[kVectors] = {};
      for (int64_t j = 0; j < n_keys; ++j) {
        const float* value = values + j * row;
        for (int i = 0; i < kVectors; ++i) acc[i] += p[j] * load(value + kLanes * i);
      }
      for (int i = 0; i < kVectors; ++i) store(out + kLanes * i, acc[i]);
    } else {
      std::fill(out, out + head_dim, 0.0f);
      for (int64_t j = 0; j < n_keys; ++j) {
        const float* value = values + j * row;
        for (int d = 0; d < full; d += kLanes) store(out + d, load(out + d) + p[j] * load(value + d));
        for (int d = full; d < head_dim; ++d) out[d] += p[j] * value[d];
      }
    }
  }
}

JAXINFER_VECTOR_CLONES void attend_chunk_any(const float* queries, int group, int head_dim, const float* keys,
                                             const float* values, int64_t row, int64_t n_keys, float softcap,
                                             float* scores, float* m, float* l, float* o) {
  switch (head_dim) {
    case 64: return attend_chunk<64>(queries, group, head_dim, keys, values, row, n_keys, softcap, scores, m, l, o);
    case 128:
      return attend_chunk<128>(queries, group, head_dim, keys, values, row, n_keys, softcap, scores, m, l, o);
    case 256:
      return attend_chunk<256>(queries, group, head_dim, keys, values, row, n_keys, softcap, scores, m, l, o);
    default: return attend_chunk<0>(queries, group, head_dim, keys, values, row, n_keys, softcap, scores, m, l, o);
  }
}

ffi::Error CachedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::Buffer<ffi::S32> layer_buf, ffi::Buffer<ffi::S32> start_buf,
                               ffi::Buffer<ffi::S32> row_buf, int64_t window, float softcap,
                               ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 5 || !std::equal(kd.begin(), kd.end(), vd.begin(), vd.end())) {
    return ffi::Error::InvalidArgument("cached_attention: q must be [B, T, H, hd], k and v [L, R, S, H_kv, hd]");
  }
  const ffi::DataType cache_type = k.element_type();
  if ((cache_type != ffi::DataType::F32 && cache_type != ffi::DataType::F16) || v.element_type() != cache_type) {
    return ffi::Error::InvalidArgument("cached_attention: the k and v caches must both be f32 or both f16");
  }
  const bool f16 = cache_type == ffi::DataType::F16;
  const int64_t batch = qd[0], n_query = qd[1], n_head = qd[2], head_dim = qd[3];
  // The queries' rows are B of the cache's R from `row` on (a server's decode step over its first busy slots, the
  // prefill of one slot).
  const int64_t n_layer = kd[0], cache_rows = kd[1], max_len = kd[2], n_head_kv = kd[3];
  if (cache_rows < batch || kd[4] != head_dim || n_head_kv <= 0 || n_head % n_head_kv != 0) {
    return ffi::Error::InvalidArgument("cached_attention: q [B, T, H, hd] and caches [L, R, S, H_kv, hd] disagree "
                                       "(R < B, or on hd), or H is not a multiple of H_kv");
  }
  if (!std::equal(qd.begin(), qd.end(), out->dimensions().begin(), out->dimensions().end())) {
    return ffi::Error::InvalidArgument("cached_attention: the output must have q's shape [B, T, H, hd]");
  }
  // Counts checked before any element is read: an empty one has no element 0.
  if (layer_buf.element_count() != 1 || row_buf.element_count() != 1 ||
      static_cast<int64_t>(start_buf.element_count()) != batch) {
    return ffi::Error::InvalidArgument("cached_attention: layer and row must be single int32 values and start one "
                                       "int32 per batch row (" + std::to_string(batch) + "), got " +
                                       std::to_string(layer_buf.element_count()) + ", " +
                                       std::to_string(row_buf.element_count()) + " and " +
                                       std::to_string(start_buf.element_count()));
  }
  const int64_t first_row = *row_buf.typed_data();
  if (first_row < 0 || first_row + batch > cache_rows) {
    return ffi::Error::InvalidArgument("cached_attention: rows " + std::to_string(first_row) + ".." +
                                       std::to_string(first_row + batch - 1) + " outside the cache's " +
                                       std::to_string(cache_rows));
  }
  if (window < 0) {
    return ffi::Error::InvalidArgument("cached_attention: window must be >= 0 (0: none), got " +
                                       std::to_string(window));
  }
  if (!(softcap >= 0) || std::isinf(softcap)) {
    return ffi::Error::InvalidArgument("cached_attention: softcap must be a finite number >= 0 (0: none), got " +
                                       std::to_string(softcap));
  }
  const int64_t layer = *layer_buf.typed_data();
  const int32_t* starts = start_buf.typed_data();
  int64_t deepest = 0;  // the most positions any row reads
  int64_t earliest = max_len;  // the first position any row's queries see
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = starts[b];
    if (layer < 0 || layer >= n_layer || start < 0 || start + n_query > max_len) {
      return ffi::Error::InvalidArgument("cached_attention: layer " + std::to_string(layer) + " or row " +
                                         std::to_string(b) + "'s positions " + std::to_string(start) + ".." +
                                         std::to_string(start + n_query - 1) + " outside the cache [" +
                                         std::to_string(n_layer) + " layers, " + std::to_string(max_len) +
                                         " positions]");
    }
    deepest = std::max(deepest, start + n_query);
    earliest = std::min(earliest, first_seen(start, window));
  }
  const int64_t group = n_head / n_head_kv, row = n_head_kv * head_dim;  // row: one position of one layer's cache
  // From here on, batch row b is cache row first_row + b of the layer.
  const int64_t elem = f16 ? 2 : 4, offset = (layer * cache_rows + first_row) * max_len * row * elem;
  const char* ks = static_cast<const char*>(k.untyped_data()) + offset;
  const char* vs = static_cast<const char*>(v.untyped_data()) + offset;
  const float* qs = q.typed_data();
  if (n_query > kDecodeQueries) {
    attend_prefill(pool, {qs, ks, vs, f16, batch, n_query, n_head, n_head_kv, head_dim, max_len, starts, window,
                          softcap, out->typed_data()});
    return ffi::Error::Success();
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  // Chunks from the one holding the first position any query sees: a sliding window's step reads the window,
  // not the context.
  const int64_t first_chunk = earliest / kChunkKeys;
  const int64_t n_chunks = (deepest + kChunkKeys - 1) / kChunkKeys - first_chunk;

  // Partials of (batch row, query, head, chunk): head_dim weighted values, then the max and the sum.
  const int64_t stride = head_dim + 2;
  thread_local std::vector<float> partials;
  partials.resize(static_cast<size_t>(batch * n_query * n_head * n_chunks * stride));
  float* parts = partials.data();
  auto part = [=](int64_t b, int64_t t, int64_t h, int64_t c) {
    return parts + (((b * n_query + t) * n_head + h) * n_chunks + c) * stride;
  };

  parallel_for(pool, batch * n_chunks, [=](int64_t task) {
    const int64_t b = task / n_chunks, c = task % n_chunks, first = (first_chunk + c) * kChunkKeys,
                  start = starts[b];
    // A chunk past this row's depth, or before what its first query sees: nothing for any of its queries.
    if (first >= start + n_query || first + kChunkKeys <= first_seen(start, window)) {
      for (int64_t t = 0; t < n_query; ++t) {
        for (int64_t h = 0; h < n_head; ++h) part(b, t, h, c)[head_dim] = -INFINITY;
      }
      return;
    }
    thread_local std::vector<float> scaled, scores, out, m, l, keys, values;
    scaled.resize(group * head_dim);
    scores.resize(group * kChunkKeys);
    out.resize(group * head_dim);
    m.resize(group);
    l.resize(group);
    // The chunk's rows, all KV heads, are contiguous in each cache. Ask for all of them at once: read head by head,
    // a row's lines come at a stride. An f16 chunk is widened once, for every query and head of the task.
    const int64_t n_rows = std::min(kChunkKeys, start + n_query - first), chunk_bytes = n_rows * row * elem;
    const char* k_bytes = ks + (b * max_len + first) * row * elem;
    const char* v_bytes = vs + (b * max_len + first) * row * elem;
    for (int64_t at = 0; at < chunk_bytes; at += 64) {
      __builtin_prefetch(k_bytes + at);
      __builtin_prefetch(v_bytes + at);
    }
    const float* k_chunk = reinterpret_cast<const float*>(k_bytes);
    const float* v_chunk = reinterpret_cast<const float*>(v_bytes);
    if (f16) {
      keys.resize(n_rows * row);
      values.resize(n_rows * row);
      widen_f16(reinterpret_cast<const uint16_t*>(k_bytes), n_rows * row, keys.data());
      widen_f16(reinterpret_cast<const uint16_t*>(v_bytes), n_rows * row, values.data());
      k_chunk = keys.data();
      v_chunk = values.data();
    }
    for (int64_t t = 0; t < n_query; ++t) {
      // Query t sees positions lo .. start + t: causal, and from the window's first on.
      const int64_t lo = std::max(first, first_seen(start + t, window));
      const int64_t n_keys = std::min(first + kChunkKeys, start + t + 1) - lo;
      for (int64_t kv_head = 0; kv_head < n_head_kv; ++kv_head) {
        const int64_t h0 = kv_head * group;
        if (n_keys <= 0) {
          for (int64_t g = 0; g < group; ++g) part(b, t, h0 + g, c)[head_dim] = -INFINITY;
          continue;
        }
        const float* query = qs + ((b * n_query + t) * n_head + h0) * head_dim;  // the group's heads are adjacent
        for (int64_t i = 0; i < group * head_dim; ++i) scaled[i] = query[i] * scale;
        const int64_t skip = (lo - first) * row + kv_head * head_dim;
        attend_chunk_any(scaled.data(), static_cast<int>(group), static_cast<int>(head_dim), k_chunk + skip,
                         v_chunk + skip, row, n_keys, softcap, scores.data(), m.data(), l.data(), out.data());
        for (int64_t g = 0; g < group; ++g) {
          float* p = part(b, t, h0 + g, c);
          std::copy(out.data() + g * head_dim, out.data() + (g + 1) * head_dim, p);
          p[head_dim] = m[g];
          p[head_dim + 1] = l[g];
        }
      }
    }
  });

  // Merge the chunks: rescale each by exp(its max - the overall max).
  float* os = out->typed_data();
  for (int64_t i = 0; i < batch * n_query * n_head; ++i) {
    const float* first = parts + i * n_chunks * stride;
    float max_all = -INFINITY;
    for (int64_t c = 0; c < n_chunks; ++c) max_all = std::fmax(max_all, first[c * stride + head_dim]);
    float* o = os + i * head_dim;
    std::fill(o, o + head_dim, 0.0f);
    float total = 0.0f;
    for (int64_t c = 0; c < n_chunks; ++c) {
      const float* p = first + c * stride;
      if (p[head_dim] == -INFINITY) continue;  // a chunk wholly after this query, or before its window
      const float w = std::exp(p[head_dim] - max_all);
      total += w * p[head_dim + 1];
      for (int64_t d = 0; d < head_dim; ++d) o[d] += w * p[d];
    }
    for (int64_t d = 0; d < head_dim; ++d) o[d] /= total;
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxinfer_cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(CachedAttention, jaxinfer_cpu::CachedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q [B, T, H, hd]
                                  .Arg<ffi::AnyBuffer>()         // k cache [L, B, S, H_kv, hd], f32 or f16
                                  .Arg<ffi::AnyBuffer>()         // v cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer []
                                  .Arg<ffi::Buffer<ffi::S32>>()  // start [B]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // row []
                                  .Attr<int64_t>("window")       // > 0: a sliding window of that many positions
                                  .Attr<float>("softcap")        // > 0: scores soft-capped (Gemma 2)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [B, T, H, hd]

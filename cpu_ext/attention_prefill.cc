// Causal GQA attention of many queries (a prompt, a perplexity window) against one layer of the KV cache, tiled:
// what cached_attention (attention.cc) runs above kDecodeQueries queries a call.
//
// attention.cc dots one query with one key at a time and sums lanes, right for a decode step. With hundreds of
// queries per KV head the work is two small matrix products per block of keys, so here a task is one batch row, one
// KV head and a block of queries, and walks the keys in blocks of kKeys with an online softmax (flash attention).
// The task's rows are its queries times the query heads of the group (row r: query r / group, head r % group),
// about kRows of them, padded to a multiple of kRowTile with zero queries whose results are dropped:
//
//   S = Q K^T          [rows, kKeys]  Q scaled by 1/sqrt(hd) once per task; the key block transposed once per block
//                                     (Kt [hd, kKeys]: a vector holds 16 keys of one dimension), so a tile of
//                                     kRowTile rows x 4 vectors of S stays in registers over the hd dimensions
//   (S = softcap * tanh(S / softcap) where the model soft-caps its scores: Gemma 2)
//   m' = max(m, max_j S)   P = exp(S - m')   l = l e^(m - m') + sum_j P   O = O e^(m - m') + P V
//
// and out = O / l at the end. Blocks after a row's position are never visited (causal: about half the products of
// the whole square), nor, in a sliding-window layer, blocks before the window of the task's first query; in the
// blocks that cross them the keys a row does not see weigh 0. An f16 cache's block is widened to f32 once per block
// and task.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "attention_prefill.h"
#include "attention_vectors.h"

namespace jaxinfer_cpu {
namespace {

using namespace attention_vectors;

constexpr int kKeys = 64;     // keys per block: 4 vectors of a row of S
constexpr int kKeyVectors = kKeys / kLanes;
constexpr int kDims = 64;     // dimensions of O per register tile
constexpr int kDimVectors = kDims / kLanes;
constexpr int kRowTile = 4;   // rows of S and of O per register tile: 4 x 4 accumulators
constexpr int64_t kRows = 64;  // rows per task, about: enough to pay for the key block's transposition

struct TaskBuffers {
  std::vector<float> q, kt, s, o, m, l, keys, values;
  std::vector<int64_t> first, last;  // per row, the first and the last position it sees
};

// One task: rows [n_rows] (padded to a multiple of kRowTile) of queries `q` scaled, each seeing keys first[r] ..
// last[r], against the keys and values of one KV head (f32 rows `stride` floats apart, positions from 0), read from
// the block holding position `begin` (the least first[r]) to position n_keys - 1. Leaves O and l in o, l.
template <int HeadDim>
__attribute__((always_inline)) inline void attend_rows(TaskBuffers& t, int runtime_head_dim, int64_t n_rows,
                                                       const float* keys, const float* values, int64_t stride,
                                                       int64_t begin, int64_t n_keys, const char* k_raw,
                                                       const char* v_raw, bool f16, float softcap) {
  const int head_dim = HeadDim > 0 ? HeadDim : runtime_head_dim;
  float* kt = t.kt.data();
  float* s = t.s.data();
  float* o = t.o.data();
  const float* q = t.q.data();
  I32x16 lane;
  for (int i = 0; i < kLanes; ++i) lane[i] = i;
  for (int64_t first = begin / kKeys * kKeys; first < n_keys; first += kKeys) {
    const int64_t nk = std::min<int64_t>(kKeys, n_keys - first);
    const int64_t skip = std::max<int64_t>(0, begin - first);  // keys before any row's window: never read
    const float* k_block = keys + first * stride;
    const float* v_block = values + first * stride;
    int64_t v_stride = stride;
    if (f16) {  // this head's rows of the block, widened side by side
      for (int64_t j = skip; j < nk; ++j) {
        widen_f16(reinterpret_cast<const uint16_t*>(k_raw) + (first + j) * stride, head_dim,
                  t.keys.data() + j * head_dim);
        widen_f16(reinterpret_cast<const uint16_t*>(v_raw) + (first + j) * stride, head_dim,
                  t.values.data() + j * head_dim);
      }
      k_block = t.keys.data();
      v_block = t.values.data();
      v_stride = head_dim;
    }
    const int64_t k_stride = f16 ? head_dim : stride;
    for (int64_t j = 0; j < kKeys; ++j) {
      for (int d = 0; d < head_dim; ++d) kt[d * kKeys + j] = j >= skip && j < nk ? k_block[j * k_stride + d] : 0.0f;
    }
    for (int64_t r0 = 0; r0 < n_rows; r0 += kRowTile) {
      F32x16 acc[kRowTile][kKeyVectors] = {};
      for (int d = 0; d < head_dim; ++d) {
        F32x16 k_d[kKeyVectors];
        for (int c = 0; c < kKeyVectors; ++c) k_d[c] = load(kt + d * kKeys + c * kLanes);
        for (int i = 0; i < kRowTile; ++i) {
          const F32x16 q_d = splat(q[(r0 + i) * head_dim + d]);
          for (int c = 0; c < kKeyVectors; ++c) acc[i][c] += q_d * k_d[c];
        }
      }
      for (int i = 0; i < kRowTile; ++i) {
        for (int c = 0; c < kKeyVectors; ++c) store(s + (r0 + i) * kKeys + c * kLanes, acc[i][c]);
      }
    }
    // The softmax step per row; P overwrites S, 0 for the keys a row does not see.
    for (int64_t r = 0; r < n_rows; ++r) {
      float* row = s + r * kKeys;
      const int64_t from = std::max<int64_t>(0, t.first[r] - first);
      const int64_t seen = std::min<int64_t>(nk, t.last[r] - first + 1);
      if (seen <= from) {
        std::fill(row, row + kKeys, 0.0f);
        continue;
      }
      F32x16 scores[kKeyVectors], max_lanes = splat(-INFINITY);
      I32x16 visible[kKeyVectors];
      for (int c = 0; c < kKeyVectors; ++c) {
        const F32x16 x = softcap > 0 ? soft_cap(load(row + c * kLanes), softcap) : load(row + c * kLanes);
        visible[c] = lane + c * kLanes < static_cast<int32_t>(seen) && lane + c * kLanes >= static_cast<int32_t>(from);
        scores[c] = visible[c] ? x : splat(-INFINITY);
        max_lanes = scores[c] > max_lanes ? scores[c] : max_lanes;
      }
      float block_max = max_lanes[0];
      for (int i = 1; i < kLanes; ++i) block_max = std::max(block_max, max_lanes[i]);
      const float new_max = std::max(t.m[r], block_max);
      F32x16 total{};
      for (int c = 0; c < kKeyVectors; ++c) {
        const F32x16 e = exp_nonpositive(scores[c] - new_max);
        const F32x16 p = visible[c] ? e : splat(0.0f);
        store(row + c * kLanes, p);
        total += p;
      }
      const float correction = std::exp(t.m[r] - new_max);  // 0 on the first block a row sees (m = -inf)
      t.l[r] = t.l[r] * correction + sum_lanes(total);
      t.m[r] = new_max;
      if (correction != 1.0f) {
        float* out = o + r * head_dim;
        if constexpr (HeadDim > 0 && HeadDim % kLanes == 0) {
          for (int d = 0; d < HeadDim; d += kLanes) store(out + d, load(out + d) * correction);
        } else {
          for (int d = 0; d < head_dim; ++d) out[d] *= correction;
        }
      }
    }
    // O += P V, kRowTile rows x 64 dimensions at a time where the head size is a multiple of 64 known at compile
    // time (64, 128, 256); else row by row, as the compiler vectorizes it.
    if constexpr (HeadDim > 0 && HeadDim % kDims == 0) {
      for (int64_t r0 = 0; r0 < n_rows; r0 += kRowTile) {
        for (int d0 = 0; d0 < head_dim; d0 += kDims) {
          F32x16 acc[kRowTile][kDimVectors];
          for (int i = 0; i < kRowTile; ++i) {
            for (int c = 0; c < kDimVectors; ++c) acc[i][c] = load(o + (r0 + i) * head_dim + d0 + c * kLanes);
          }
          for (int64_t j = skip; j < nk; ++j) {
            F32x16 v_j[kDimVectors];
            for (int c = 0; c < kDimVectors; ++c) v_j[c] = load(v_block + j * v_stride + d0 + c * kLanes);
            for (int i = 0; i < kRowTile; ++i) {
              const F32x16 p = splat(s[(r0 + i) * kKeys + j]);
              for (int c = 0; c < kDimVectors; ++c) acc[i][c] += p * v_j[c];
            }
          }
          for (int i = 0; i < kRowTile; ++i) {
            for (int c = 0; c < kDimVectors; ++c) store(o + (r0 + i) * head_dim + d0 + c * kLanes, acc[i][c]);
          }
        }
      }
    } else {
      for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t j = skip; j < nk; ++j) {
          const float p = s[r * kKeys + j];
          for (int d = 0; d < head_dim; ++d) o[r * head_dim + d] += p * v_block[j * v_stride + d];
        }
      }
    }
  }
}

JAXINFER_VECTOR_CLONES void attend_rows_any(TaskBuffers& t, int head_dim, int64_t n_rows, const float* keys,
                                            const float* values, int64_t stride, int64_t begin, int64_t n_keys,
                                            const char* k_raw, const char* v_raw, bool f16, float softcap) {
  switch (head_dim) {
    case 64:
      return attend_rows<64>(t, head_dim, n_rows, keys, values, stride, begin, n_keys, k_raw, v_raw, f16,
                              softcap);
    case 128:
      return attend_rows<128>(t, head_dim, n_rows, keys, values, stride, begin, n_keys, k_raw, v_raw, f16,
                              softcap);
    case 256:
      return attend_rows<256>(t, head_dim, n_rows, keys, values, stride, begin, n_keys, k_raw, v_raw, f16,
                              softcap);
    default:
      return attend_rows<0>(t, head_dim, n_rows, keys, values, stride, begin, n_keys, k_raw, v_raw, f16,
                              softcap);
  }
}

}  // namespace

void attend_prefill(ffi::ThreadPool& pool, const PrefillCall& c) {
  const int64_t group = c.n_head / c.n_head_kv, row = c.n_head_kv * c.head_dim, elem = c.f16 ? 2 : 4;
  const int64_t queries_per_task = std::max<int64_t>(1, kRows / group);
  const int64_t n_blocks = (c.n_query + queries_per_task - 1) / queries_per_task;
  const int64_t per_block = c.batch * c.n_head_kv;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  // The latest query blocks, with the most keys to read, are claimed first.
  parallel_for(pool, n_blocks * per_block, [&](int64_t task) {
    const int64_t block = n_blocks - 1 - task / per_block, b = task % per_block / c.n_head_kv,
                  kv_head = task % c.n_head_kv;
    const int64_t t0 = block * queries_per_task, n_q = std::min(queries_per_task, c.n_query - t0);
    const int64_t n_rows = (n_q * group + kRowTile - 1) / kRowTile * kRowTile;
    thread_local TaskBuffers t;
    t.q.assign(n_rows * c.head_dim, 0.0f);
    t.o.assign(n_rows * c.head_dim, 0.0f);
    t.m.assign(n_rows, -INFINITY);
    t.l.assign(n_rows, 0.0f);
    t.first.assign(n_rows, 0);
    t.last.assign(n_rows, -1);
    t.kt.resize(c.head_dim * kKeys);
    t.s.resize(n_rows * kKeys);
    t.keys.resize(kKeys * c.head_dim);
    t.values.resize(kKeys * c.head_dim);
    const int64_t start = c.starts[b];
    for (int64_t r = 0; r < n_q * group; ++r) {
      const int64_t query = t0 + r / group, head = kv_head * group + r % group;
      const float* src = c.q + ((b * c.n_query + query) * c.n_head + head) * c.head_dim;
      for (int64_t d = 0; d < c.head_dim; ++d) t.q[r * c.head_dim + d] = src[d] * scale;
      t.first[r] = first_seen(start + query, c.window);
      t.last[r] = start + query;
    }
    const int64_t offset = ((b * c.max_len) * row + kv_head * c.head_dim) * elem;
    const char* k_raw = c.k + offset;
    const char* v_raw = c.v + offset;
    attend_rows_any(t, static_cast<int>(c.head_dim), n_rows, reinterpret_cast<const float*>(k_raw),
                    reinterpret_cast<const float*>(v_raw), row, first_seen(start + t0, c.window), start + t0 + n_q,
                    k_raw, v_raw, c.f16, c.softcap);
    for (int64_t r = 0; r < n_q * group; ++r) {
      const int64_t query = t0 + r / group, head = kv_head * group + r % group;
      float* dst = c.out + ((b * c.n_query + query) * c.n_head + head) * c.head_dim;
      const float inverse = 1.0f / t.l[r];
      for (int64_t d = 0; d < c.head_dim; ++d) dst[d] = t.o[r * c.head_dim + d] * inverse;
    }
  });
}

}  // namespace jaxinfer_cpu

// Row-sparse products of many tokens (a prompt's chunk through a sparse FFN's gate and up): the union of the rows the
// tokens need is packed, eight rows to a group as jaxinfer.quant.pack_rows_x8 lays a whole weight out (qmatmul.h), and
// multiplied by the repacked kernels, tiled over rows and tokens. Row by row, a dot is bound by unpacking each block
// for a few tokens; packed, a band of rows costs one rearranging and then runs at the dense kernels' pace. The rows
// are packed in order of how many tokens take them, the tokens dotted four at a time in an order that keeps alike ones
// together, and a group's dots are skipped for four tokens none of which takes any of its rows. Rows few of the
// tokens take are not packed but dotted with the row kernels, token by token. The repacked kernels give the portable
// row kernels' bits, so with the portable set the result does not depend on the path (with SIMD sets, to f32
// rounding).
#include <algorithm>
#include <cstring>
#include <vector>

#if JAXINFER_CPU_X86
#include <immintrin.h>
#endif

#include "repacked_kernels.h"
#include "union_rows.h"

namespace jaxinfer_cpu {
namespace {

// Bytes of a block's scales (Q4_1: d and m) and its 4-byte chunks of quants, for the 32-value repacked types.
struct BlockParts {
  int type_size, scale_bytes, chunks;
  bool biased;  // Q8_0: quants stored + 128 in a group
};

bool block_parts(int64_t qtype, BlockParts* parts) {
  switch (qtype) {
    case kQ4_0: case kIQ4_NL: *parts = {18, 2, 4, false}; return true;
    case kQ4_1: *parts = {20, 4, 4, false}; return true;
    case kQ8_0: *parts = {34, 2, 8, true}; return true;
    default: return false;
  }
}

// One group of eight rows (rows[r], zero blocks for r >= n_rows), n_blocks blocks, into `out` (qmatmul.h):
// per block | scales of the eight rows, 2 bytes each (Q4_1: then the eight mins) | chunk c: row r's 4 bytes c |.
void pack_group(const uint8_t* const* rows, int n_rows, int64_t n_blocks, const BlockParts& p, uint8_t* out) {
  const int64_t group_block = kInterleave * p.type_size;
  for (int64_t b = 0; b < n_blocks; ++b) {
    uint8_t* o = out + b * group_block;
    for (int r = 0; r < kInterleave; ++r) {
      if (r >= n_rows) {
        for (int k = 0; k < p.scale_bytes / 2; ++k) std::memset(o + 16 * k + 2 * r, 0, 2);
        for (int c = 0; c < p.chunks; ++c) {
          std::memset(o + kInterleave * p.scale_bytes + 4 * (kInterleave * c + r), p.biased ? 0x80 : 0, 4);
        }
        continue;
      }
      const uint8_t* block = rows[r] + b * p.type_size;
      for (int k = 0; k < p.scale_bytes / 2; ++k) std::memcpy(o + 16 * k + 2 * r, block + 2 * k, 2);
      for (int c = 0; c < p.chunks; ++c) {
        uint32_t word;
        std::memcpy(&word, block + p.scale_bytes + 4 * c, 4);
        if (p.biased) word ^= 0x80808080u;
        std::memcpy(o + kInterleave * p.scale_bytes + 4 * (kInterleave * c + r), &word, 4);
      }
    }
  }
}

#if JAXINFER_CPU_X86
// pack_group with AVX2 shuffles for full groups: per block, the eight rows' 4-byte chunks are an 8 x chunks matrix of
// 32-bit words, transposed four chunks at a time (rows r and r + 4 share a vector, unpacks do the rest). The same
// bytes as pack_group's: moving bytes needs no rounding, so it serves every kernel set.
__attribute__((target("avx2"))) void pack_full_group_avx2(const uint8_t* const* rows, int64_t n_blocks,
                                                          const BlockParts& p, uint8_t* out) {
  const int64_t group_block = kInterleave * p.type_size;
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < n_blocks; ++b) {
    uint8_t* o = out + b * group_block;
    for (int r = 0; r < kInterleave; ++r) {
      const uint8_t* block = rows[r] + b * p.type_size;
      for (int k = 0; k < p.scale_bytes / 2; ++k) std::memcpy(o + 16 * k + 2 * r, block + 2 * k, 2);
    }
    auto* q = reinterpret_cast<__m256i*>(o + kInterleave * p.scale_bytes);
    for (int c0 = 0; c0 < p.chunks; c0 += 4) {
      __m256i y[4];
      for (int r = 0; r < 4; ++r) {
        auto chunks = [&](int row) {
          return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[row] + b * p.type_size + p.scale_bytes + 4 * c0));
        };
        y[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(chunks(r)), chunks(r + 4), 1);
      }
      const __m256i t0 = _mm256_unpacklo_epi32(y[0], y[1]), t1 = _mm256_unpackhi_epi32(y[0], y[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(y[2], y[3]), t3 = _mm256_unpackhi_epi32(y[2], y[3]);
      __m256i chunk[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2), _mm256_unpacklo_epi64(t1, t3),
                          _mm256_unpackhi_epi64(t1, t3)};
      for (int c = 0; c < 4; ++c) {
        _mm256_storeu_si256(q + c0 + c, p.biased ? _mm256_xor_si256(chunk[c], bias) : chunk[c]);
      }
    }
  }
}
#endif

// pack_group, with the AVX2 shuffles for full groups where the CPU has AVX2.
void pack(const uint8_t* const* rows, int n_rows, int64_t n_blocks, const BlockParts& p, uint8_t* out) {
#if JAXINFER_CPU_X86
  static const bool avx2 = __builtin_cpu_supports("avx2");
  if (avx2 && n_rows == kInterleave) return pack_full_group_avx2(rows, n_blocks, p, out);
#endif
  pack_group(rows, n_rows, n_blocks, p, out);
}

}  // namespace

bool packs_union(int64_t qtype, int64_t m) {
  BlockParts parts;
  return m >= kUnionPackMinTokens && block_parts(qtype, &parts);
}

namespace {

// Quarters of a union's rows by how many of the call's tokens take them: the rows are packed quarter by quarter, the
// most taken first, and in row order within a quarter. Rows that few tokens take then share groups, whose dots can be
// skipped for four tokens that take none of their rows: a 7B-shaped prompt's chunk of 512 tokens, each taking 11-27%
// of the rows, needs 68-84% of its (group, four tokens) tiles so, against 94-100% in row order; rows wholly sorted by
// takers need about as many (67-83%), but a group's rows then lie on 7-8 cache lines of an output row instead of 3,
// and writing them missed the caches.
constexpr int64_t kTakerQuarters = 4;

// takers[j]: how many of the m tokens take row j, into s.takers. Counted over bands of columns in parallel: the mask
// is m x rows bytes (5.6 MB for 512 tokens of a 7B-shaped FFN).
const int32_t* count_takers(ffi::ThreadPool& pool, const uint8_t* mask, int64_t m, int64_t rows, Scratch& s) {
  s.takers.assign(static_cast<size_t>(rows), 0);
  int32_t* takers = s.takers.data();
  constexpr int64_t kColumns = 1024;
  parallel_for(pool, (rows + kColumns - 1) / kColumns, [=](int64_t task) {
    const int64_t j0 = task * kColumns, j1 = std::min(rows, j0 + kColumns);
    for (int64_t t = 0; t < m; ++t) {
      const uint8_t* taken = mask + t * rows;
      for (int64_t j = j0; j < j1; ++j) takers[j] += taken[j] != 0;
    }
  });
  return takers;
}

// The rows (`active`, increasing; takers[j] tokens take row j) by kTakerQuarters of their takers, most first, into
// s.ordered; quarter q's rows are ordered[start[q] .. start[q + 1]).
const int32_t* order_by_takers(const int32_t* takers, int64_t m, const int32_t* active, int64_t n_active,
                               int64_t start[kTakerQuarters + 1], Scratch& s) {
  // A row's rank among the union's rows by takers (a counting sort over 1 .. m takers), then its quarter.
  std::vector<int64_t> first(static_cast<size_t>(m + 2), 0);
  for (int64_t e = 0; e < n_active; ++e) ++first[m - takers[active[e]] + 1];
  for (int64_t c = 1; c <= m + 1; ++c) first[c] += first[c - 1];
  std::vector<uint8_t> quarter(static_cast<size_t>(n_active));
  std::fill(start, start + kTakerQuarters + 1, 0);
  for (int64_t e = 0; e < n_active; ++e) {
    quarter[e] = static_cast<uint8_t>(first[m - takers[active[e]]]++ * kTakerQuarters / n_active);
    ++start[quarter[e] + 1];
  }
  for (int64_t q = 1; q <= kTakerQuarters; ++q) start[q] += start[q - 1];
  s.ordered.resize(static_cast<size_t>(n_active));
  int64_t next[kTakerQuarters];
  std::copy(start, start + kTakerQuarters, next);
  for (int64_t e = 0; e < n_active; ++e) s.ordered[next[quarter[e]]++] = active[e];
  return s.ordered.data();
}

// taken[g * m + t]: which rows of group g of `ordered` token t takes, bit r for its row r.
const uint8_t* taken_in_groups(ffi::ThreadPool& pool, const uint8_t* mask, int64_t m, int64_t rows,
                               const int32_t* ordered, int64_t n_active, int64_t groups, Scratch& s) {
  s.taken.resize(static_cast<size_t>(groups * m));
  uint8_t* taken = s.taken.data();
  // Token by token over a task's groups: a token's mask row is read where the groups' rows lie (mostly increasing),
  // instead of one byte of every token's row per group row.
  parallel_for(pool, (groups + 63) / 64, [=](int64_t task) {
    const int64_t g0 = task * 64, g1 = std::min(groups, (task + 1) * 64);
    for (int64_t t = 0; t < m; ++t) {
      const uint8_t* row = mask + t * rows;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t n_rows = std::min<int64_t>(kInterleave, n_active - g * kInterleave);
        const int32_t* group_rows = ordered + g * kInterleave;
        uint32_t bits = 0;
        for (int64_t r = 0; r < n_rows; ++r) bits |= static_cast<uint32_t>(row[group_rows[r]] != 0) << r;
        taken[g * m + t] = static_cast<uint8_t>(bits);
      }
    }
  });
  return taken;
}

// The bits set in a byte, in shifts and adds the compiler vectorizes (the portable build has no popcnt instruction,
// and __builtin_popcount is then a library call per byte).
inline int32_t bits_set(uint32_t v) {
  v = v - ((v >> 1) & 0x55u);
  v = (v & 0x33u) + ((v >> 2) & 0x33u);
  return static_cast<int32_t>((v + (v >> 4)) & 0x0fu);
}

// The call's tokens in the order their tiles of four are dotted: by a score of the rows they take, +3, +1, -1, -3 a row
// from the most taken quarter down (their first principal component, computed, orders them about as well). Neighbours
// then take much the same rows, and a group's dots are skipped for more tiles of four: on a 7B-shaped prompt of 512
// tokens, 86% of the tiles are dotted instead of 93% at 80% sparsity (the gate and up product 0.92x the time), 74%
// instead of 80% at 90% (0.98x). Into s.tokens, with `taken` (which rows of group g token t takes, taken[g * m + t])
// put in that order into s.taken_ordered.
const int32_t* order_tokens(const uint8_t* taken, int64_t m, int64_t groups, const int64_t start[kTakerQuarters + 1],
                            Scratch& s) {
  std::vector<int32_t> score(static_cast<size_t>(m), 0);
  int64_t q = 0;  // group g's quarter: that of its first row
  for (int64_t g = 0; g < groups; ++g) {
    while (q + 1 < kTakerQuarters && g * kInterleave >= start[q + 1]) ++q;
    const int32_t weight = static_cast<int32_t>(kTakerQuarters - 1 - 2 * q);
    for (int64_t t = 0; t < m; ++t) score[t] += weight * bits_set(taken[g * m + t]);
  }
  s.tokens.resize(static_cast<size_t>(m));
  for (int64_t t = 0; t < m; ++t) s.tokens[t] = static_cast<int32_t>(t);
  std::stable_sort(s.tokens.begin(), s.tokens.end(), [&](int32_t a, int32_t b) { return score[a] < score[b]; });
  const int32_t* tokens = s.tokens.data();
  s.taken_ordered.resize(static_cast<size_t>(groups * m));
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t t = 0; t < m; ++t) s.taken_ordered[g * m + t] = taken[g * m + tokens[t]];
  }
  return tokens;
}

// A row that fewer than one in kColdShare of the call's tokens take is dotted with the row kernels instead of being
// packed. A packed group's dots run for four tokens if any of them takes any of its eight rows, so rows that few
// tokens take cost nearly as much as rows that all take; a row's own dot costs about eight packed dots' time (its
// blocks unpacked for four tokens at most, the tokens' activations and outputs scattered), but only where a token
// takes it. A 7B-shaped predictor model's prompt (0.8 sparsity spec, 512 tokens, 21-36% of a layer's rows a token):
// an eighth leaves 0.63-0.79 of the packed tiles' work for 1-2% of the row-token pairs, and the gate or up product of
// layers 0 / 3 / 7 took 0.75-0.83 / 0.96-1.0 / 0.93-1.0x the dense repacked product's time, against 0.87-0.91 /
// 1.03-1.07 / 1.03-1.05x all packed (a sixth and a twelfth did about as well).
constexpr int64_t kColdShare = 8;

// Splits the union's rows (`active`, increasing) into the rows to pack (s.hot; their count returned) and the cold ones
// (s.cold, and as bits in s.cold_bits with their places in s.cold_index), both increasing.
int64_t split_cold(const int32_t* takers, int64_t m, int64_t rows, const int32_t* active, int64_t n_active,
                   Scratch& s) {
  s.hot.clear();
  s.cold.clear();
  for (int64_t e = 0; e < n_active; ++e) {
    (takers[active[e]] * kColdShare < m ? s.cold : s.hot).push_back(active[e]);
  }
  s.cold_bits.assign(static_cast<size_t>((rows + 7) / 8), 0);
  s.cold_index.resize(static_cast<size_t>(rows));
  for (size_t e = 0; e < s.cold.size(); ++e) {
    const int32_t row = s.cold[e];
    s.cold_bits[row / 8] |= static_cast<uint8_t>(1u << (row % 8));
    s.cold_index[row] = static_cast<int32_t>(e);
  }
  return static_cast<int64_t>(s.hot.size());
}

// Bit r of the result: whether byte r of `bytes` (eight mask bytes, little-endian) is nonzero.
inline uint32_t nonzero_bits(uint64_t bytes) {
  constexpr uint64_t kLow7 = 0x7f7f7f7f7f7f7f7full, kHigh = 0x8080808080808080ull;
  const uint64_t ones = ((((bytes & kLow7) + kLow7) | bytes) & kHigh) >> 7;  // 1 in each nonzero byte
  return static_cast<uint32_t>((ones * 0x0102040810204080ull) >> 56);  // byte r's 1 to bit r
}

// outs[i][token, row] for the cold rows (s.cold, increasing; s.cold_bits: bit j % 8 of byte j / 8 set for a cold row
// j, s.cold_index[j] its place in s.cold). Each task takes a run of them: it lists each row's takers, token by token
// with its columns of the mask read eight at a time, then dots each row with its takers four at a time (gather4, a
// row's blocks unpacked once for the four; null: one by one), the row in L1 meanwhile. Token t here is tokens[t] of
// the call, its activations xq + t blocks.
void cold_row_dots(ffi::ThreadPool& pool, QuantDot dot, QuantDotGather4 gather4, const BlockQ8* xq, int64_t blocks,
                   int64_t m, int64_t cols, const WeightsAndOutputs& wo, int64_t row_bytes, const uint8_t* mask,
                   int64_t rows, const int32_t* tokens, const Scratch& s) {
  const int64_t n_cold = static_cast<int64_t>(s.cold.size());
  if (n_cold == 0) return;
  const int64_t band = rows_per_task(pool, n_cold), most = (m + kColdShare - 1) / kColdShare;  // takers of a row
  const int32_t* cold = s.cold.data();
  const int32_t* cold_index = s.cold_index.data();
  const uint8_t* cold_bits = s.cold_bits.data();
  const int n = static_cast<int>(cols);
  const WeightsAndOutputs own = wo;
  parallel_for(pool, (n_cold + band - 1) / band, [=](int64_t task) {
    const int64_t e0 = task * band, e1 = std::min(n_cold, e0 + band);
    const int64_t j0 = cold[e0], j1 = cold[e1 - 1] + 1;  // columns of the task's cold rows, and no other task's
    thread_local std::vector<int32_t> takers, count;
    takers.resize(static_cast<size_t>((e1 - e0) * most));
    count.assign(static_cast<size_t>(e1 - e0), 0);
    for (int64_t t = 0; t < m; ++t) {
      const uint8_t* taken = mask + tokens[t] * rows;
      for (int64_t j8 = j0 & ~int64_t{7}; j8 < j1; j8 += 8) {
        uint32_t bits = cold_bits[j8 / 8];
        if (bits == 0) continue;
        if (j8 + 8 <= rows) {
          uint64_t bytes;
          std::memcpy(&bytes, taken + j8, 8);
          bits &= nonzero_bits(bytes);
        } else {
          for (int r = 0; j8 + r < rows; ++r) bits &= ~(static_cast<uint32_t>(taken[j8 + r] == 0) << r);
        }
        for (; bits != 0; bits &= bits - 1) {
          const int64_t row = j8 + __builtin_ctz(bits);
          if (row < j0 || row >= j1) continue;
          const int64_t e = cold_index[row] - e0;
          takers[e * most + count[e]++] = static_cast<int32_t>(t);
        }
      }
    }
    for (int64_t e = 0; e < e1 - e0; ++e) {
      const int64_t row = cold[e0 + e];
      const int32_t* row_takers = takers.data() + e * most;
      for (int64_t i = 0; i < own.n; ++i) {
        const uint8_t* w = own.ws[i] + row * row_bytes;
        float* out = own.outs[i] + row;
        int64_t k = 0;
        if (gather4 != nullptr) {
          for (; k + 4 <= count[e]; k += 4) {
            const BlockQ8* xs[4];
            float dots[4];
            for (int r = 0; r < 4; ++r) xs[r] = xq + row_takers[k + r] * blocks;
            gather4(w, xs, n, dots);
            for (int r = 0; r < 4; ++r) out[tokens[row_takers[k + r]] * rows] = dots[r];
          }
        }
        for (; k < count[e]; ++k) out[tokens[row_takers[k]] * rows] = dot(w, xq + row_takers[k] * blocks, n);
      }
    }
  });
}

}  // namespace

void union_row_products(ffi::ThreadPool& pool, int64_t qtype, const float* x, int64_t m, int64_t cols,
                        const WeightsAndOutputs& wo, int64_t row_bytes, const int32_t* active, int64_t n_active,
                        const uint8_t* mask, int64_t rows, Scratch& s) {
  BlockParts parts;
  block_parts(qtype, &parts);
  const Kernels& k = best_kernels();
  const X8Kernels<BlockQ8> kernels = x8_kernels(k, qtype);
  const int64_t blocks = cols / kQK, group_bytes = blocks * x8_block_bytes(qtype);
  const int32_t* takers = count_takers(pool, mask, m, rows, s);
  n_active = split_cold(takers, m, rows, active, n_active, s);
  const int64_t groups = (n_active + kInterleave - 1) / kInterleave, total = wo.n * groups;
  int64_t quarter_start[kTakerQuarters + 1];
  const int32_t* ordered = order_by_takers(takers, m, s.hot.data(), n_active, quarter_start, s);
  const int32_t* tokens = order_tokens(taken_in_groups(pool, mask, m, rows, ordered, n_active, groups, s), m, groups,
                                       quarter_start, s);
  // Token t here is tokens[t] of the call.
  const BlockQ8* xq = quantize_rows(pool, k.quantize_row, x, m, cols, blocks, s.xq, tokens);
  TypeInfo info;
  type_info(qtype, &info);
  const QuantDotGather4 gather4 = info.quant_dot_g4 != nullptr ? k.*info.quant_dot_g4 : nullptr;
  cold_row_dots(pool, k.*info.quant_dot, gather4, xq, blocks, m, cols, wo, row_bytes, mask, rows, tokens, s);
  if (total == 0) return;
  const uint8_t* taken = s.taken_ordered.data();
  int64_t band = (rows_per_task(pool, total * kInterleave) + kInterleave - 1) / kInterleave;
  band += kernels.two_groups != nullptr && band % 2;
  const int64_t chunk = std::max<int64_t>(8, kTokenChunkBytes / (blocks * int64_t{sizeof(BlockQ8)}) / 8 * 8);
  const int n = static_cast<int>(cols);
  const WeightsAndOutputs own = wo;
  parallel_for(pool, (total + band - 1) / band, [=](int64_t task) {
    const int64_t p0 = task * band, p1 = std::min(total, p0 + band);
    // The task's groups, packed once into a buffer of this thread's, then dotted with the tokens that need them.
    thread_local std::vector<uint8_t> packed;
    packed.resize(static_cast<size_t>((p1 - p0) * group_bytes));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t i = p / groups, g = p - i * groups;
      const uint8_t* group_rows[kInterleave];
      const int n_rows = static_cast<int>(std::min<int64_t>(kInterleave, n_active - g * kInterleave));
      for (int r = 0; r < n_rows; ++r) group_rows[r] = own.ws[i] + ordered[g * kInterleave + r] * row_bytes;
      pack(group_rows, n_rows, blocks, parts, packed.data() + (p - p0) * group_bytes);
    }
    float out[4 * 2 * kInterleave];
    // Tokens t .. t + count - 1's dots of the rows of groups p, p + 1 (n_groups of them; in `out`, a token's
    // n_groups * 8 dots together): kept where the token takes the row, else 0, as masked_matmul's outputs are: the
    // dot's bits and'ed with all ones or zeros (a select compiled to a branch, which a sparse mask mispredicts).
    auto store = [&](int64_t p, int64_t n_groups, int64_t t, int64_t count) {
      for (int64_t h = 0; h < n_groups; ++h) {
        const int64_t i = (p + h) / groups, g = (p + h) - i * groups;
        const int n_rows = static_cast<int>(std::min<int64_t>(kInterleave, n_active - g * kInterleave));
        const int32_t* group_rows = ordered + g * kInterleave;
        for (int64_t j = 0; j < count; ++j) {
          float* dst = own.outs[i] + tokens[t + j] * rows;
          const uint32_t takes = taken[g * m + t + j];
          const float* dots = out + (j * n_groups + h) * kInterleave;
          for (int r = 0; r < n_rows; ++r) {
            uint32_t bits;
            std::memcpy(&bits, dots + r, 4);
            bits &= 0u - ((takes >> r) & 1u);
            std::memcpy(dst + group_rows[r], &bits, 4);
          }
        }
      }
    };
    // Whether any of tokens t .. t + count - 1 takes a row of group p.
    auto need = [&](int64_t p, int64_t t, int64_t count) {
      const uint8_t* takes = taken + (p % groups) * m + t;
      uint8_t any = 0;
      for (int64_t j = 0; j < count; ++j) any |= takes[j];
      return any != 0;
    };
    for (int64_t t0 = 0; t0 < m; t0 += chunk) {
      const int64_t t1 = std::min(m, t0 + chunk);
      for (int64_t p = p0; p < p1;) {
        const uint8_t* group = packed.data() + (p - p0) * group_bytes;
        // Two groups at a time where the kernel set has the kernel and both belong to one weight.
        const bool pair = kernels.two_groups != nullptr && p + 2 <= p1 && t1 - t0 >= 4 && (p + 1) % groups != 0;
        const int64_t n_groups = pair ? 2 : 1;
        int64_t t = t0;
        for (; t + 4 <= t1; t += 4) {
          const bool first = need(p, t, 4), second = pair && need(p + 1, t, 4);
          if (first && second) {
            kernels.two_groups(group, group_bytes, xq + t * blocks, blocks, n, out);
            store(p, 2, t, 4);
            continue;
          }
          for (int64_t h = 0; h < n_groups; ++h) {
            if (!(h == 0 ? first : second)) continue;
            kernels.four(group + h * group_bytes, xq + t * blocks, blocks, n, out);
            store(p + h, 1, t, 4);
          }
        }
        for (; t < t1; ++t) {
          for (int64_t h = 0; h < n_groups; ++h) {
            if (!need(p + h, t, 1)) continue;
            kernels.one(group + h * group_bytes, xq + t * blocks, blocks, n, out);
            store(p + h, 1, t, 1);
          }
        }
        p += n_groups;
      }
    }
  });
}

}  // namespace jaxinfer_cpu

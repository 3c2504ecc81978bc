// down_rows.h's group kernel on AVX-512 (VNNI, VBMI, F16C): the coefficients sixteen blocks at a time, then per
// block and four neurons one 512-bit vector of their quants, interleaved by one byte permute so that lane j holds
// the four neurons' q of output j, against their four g8 broadcast to every lane.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "down_rows.h"

#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,f16c,fma")

namespace jaxinfer_cpu {
namespace {

// g = h d for the blocks of one neuron in `blocks` (up to 16, from its f16 scales at `scales`); 0 for the others.
inline __m512 coefficients(const uint8_t* scales, float h, __mmask16 blocks) {
  const __m512 d = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(blocks, scales));
  return _mm512_mul_ps(_mm512_set1_ps(h), d);
}

// Rounds the group's coefficients for blocks b0 .. b0 + 15 (those before nb) into c (see DownCoefficients): a lane
// per block, so that a row's last blocks, fewer than 16, are rounded as the others.
void round_coefficients16(const DownGroup& g, int nb, int b0, DownCoefficients& c) {
  const __mmask16 blocks = nb - b0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (nb - b0)) - 1);
  // Four running maxima (n is a multiple of 4): one would chain the group's maxes one after another. The
  // coefficients are kept for the rounding below rather than computed again.
  __m512 coefficient[kDownGroup];
  __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int i = 0; i < g.n; i += 4) {
    for (int r = 0; r < 4; ++r) {
      coefficient[i + r] = coefficients(g.rows[i + r] + 2 * b0, g.h[i + r], blocks);
      part[r] = _mm512_max_ps(part[r], _mm512_abs_ps(coefficient[i + r]));
    }
  }
  const __m512 amax = _mm512_max_ps(_mm512_max_ps(part[0], part[1]), _mm512_max_ps(part[2], part[3]));
  const __m512 k127 = _mm512_set1_ps(127.0f);
  const __mmask16 nonzero = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
  const __m512 inv = _mm512_maskz_div_ps(nonzero, k127, amax);
  _mm512_mask_storeu_ps(c.scale.data() + b0, blocks, _mm512_div_ps(amax, k127));
  __m512i sum = _mm512_setzero_si512();
  for (int k = 0; k < g.n / 4; ++k) {
    __m128i q[4];
    for (int r = 0; r < 4; ++r) {
      const int i = 4 * k + r;
      const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(coefficient[i], inv));
      sum = _mm512_add_epi32(sum, rounded);
      q[r] = _mm512_cvtepi32_epi8(rounded);  // |rounded| <= 127: no saturation
    }
    // Four neurons' 16 bytes to 16 words of four bytes, neuron r in byte r.
    const __m128i a = _mm_unpacklo_epi8(q[0], q[1]), a_hi = _mm_unpackhi_epi8(q[0], q[1]);
    const __m128i b = _mm_unpacklo_epi8(q[2], q[3]), b_hi = _mm_unpackhi_epi8(q[2], q[3]);
    // Blocks b0 + 4 v .. b0 + 4 v + 3 in the v-th store; past nb, the next neurons' words, which are left alone.
    int32_t* out = c.word.data() + static_cast<size_t>(k) * nb + b0;
    _mm_mask_storeu_epi32(out, blocks & 0xF, _mm_unpacklo_epi16(a, b));
    _mm_mask_storeu_epi32(out + 4, (blocks >> 4) & 0xF, _mm_unpackhi_epi16(a, b));
    _mm_mask_storeu_epi32(out + 8, (blocks >> 8) & 0xF, _mm_unpacklo_epi16(a_hi, b_hi));
    _mm_mask_storeu_epi32(out + 12, (blocks >> 12) & 0xF, _mm_unpackhi_epi16(a_hi, b_hi));
  }
  _mm512_mask_storeu_epi32(c.sum.data() + b0, blocks, sum);
}

// y[32 b ..] += s_b (isum - o S_b), sixteen outputs a vector.
inline void add_block(float* y, const DownCoefficients& c, int b, __m512i lo, __m512i hi, int offset) {
  const __m512i off = _mm512_set1_epi32(offset * c.sum[b]);
  const __m512 scale = _mm512_set1_ps(c.scale[b]);
  _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y),
                                    _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, off)))));
  _mm512_storeu_ps(y + 16, _mm512_add_ps(_mm512_loadu_ps(y + 16),
                                         _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, off)))));
}

}  // namespace

// The dot of four neurons' block b (rows at row[0..3] + kQsBytes b) with their four g8 in every lane, added to
// lo (outputs 0..15) and hi (16..31).
template <DownType T>
inline void dot4(const uint8_t* const* row, int b, __m512i coef, __m512i lo_perm, __m512i hi_perm, __m512i& lo,
                 __m512i& hi) {
  if constexpr (T == DownType::kQ4_0) {
    const __m512i nibbles = _mm512_set1_epi8(0x0F);
    __m512i z = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row[0] + 16 * b)));
    z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[1] + 16 * b)), 1);
    z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[2] + 16 * b)), 2);
    z = _mm512_inserti32x4(z, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row[3] + 16 * b)), 3);
    const __m512i low = _mm512_and_si512(z, nibbles), high = _mm512_and_si512(_mm512_srli_epi16(z, 4), nibbles);
    lo = _mm512_dpbusd_epi32(lo, _mm512_permutexvar_epi8(lo_perm, low), coef);
    hi = _mm512_dpbusd_epi32(hi, _mm512_permutexvar_epi8(lo_perm, high), coef);
  } else {
    auto block = [&](int r) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[r] + 32 * b)); };
    const __m512i z01 = _mm512_inserti64x4(_mm512_castsi256_si512(block(0)), block(1), 1);
    const __m512i z23 = _mm512_inserti64x4(_mm512_castsi256_si512(block(2)), block(3), 1);
    lo = _mm512_dpbusd_epi32(lo, _mm512_permutex2var_epi8(z01, lo_perm, z23), coef);
    hi = _mm512_dpbusd_epi32(hi, _mm512_permutex2var_epi8(z01, hi_perm, z23), coef);
  }
}

template <DownType T>
void down_group_avx512(const DownGroup& g, int cols, DownCoefficients& c, float* y) {
  const int nb = cols / kQK;
  constexpr int kQsBytes = down_qs_bytes(T);
  const uint8_t* qs[kDownGroup];
  for (int i = 0; i < g.n; ++i) qs[i] = g.rows[i] + 2 * nb;
  for (int b0 = 0; b0 < nb; b0 += 16) {
    for (int i = 0; i < std::min(8, g.n); ++i) {  // the first eight rows' quants, while the scales are read
      for (int line = 0; line < 16 * kQsBytes; line += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(qs[i] + kQsBytes * b0 + line), _MM_HINT_T1);
      }
    }
    round_coefficients16(g, nb, b0, c);
  }
  // Byte 4 j + r of a lane-interleaved vector: output j of neuron r. Q4_0: from byte 16 r + j of the four neurons'
  // 16-byte blocks side by side; Q8_0: from two vectors of two neurons' 32-byte blocks each (vpermt2b indexes both:
  // byte 32 r + j for outputs 0..15, 32 r + 16 + j for outputs 16..31).
  alignas(64) uint8_t lo_index[64], hi_index[64];
  for (int j = 0; j < 16; ++j) {
    for (int r = 0; r < 4; ++r) {
      lo_index[4 * j + r] = static_cast<uint8_t>(T == DownType::kQ4_0 ? 16 * r + j : 32 * r + j);
      hi_index[4 * j + r] = static_cast<uint8_t>(32 * r + 16 + j);
    }
  }
  const __m512i lo_perm = _mm512_load_si512(lo_index), hi_perm = _mm512_load_si512(hi_index);
  // Eight neurons at a time, each row read front to back (eight streams the hardware prefetchers follow; 32 rows
  // side by side, block by block, read at half the pace), their sums per block in c.acc between the passes.
  __m512i* acc = reinterpret_cast<__m512i*>(c.acc.data());
  std::memset(acc, 0, sizeof(int32_t) * kQK * nb);
  const int n_rows = g.n;
  for (int k = 0; k < g.n / 4; k += 2) {
    const bool two = k + 1 < g.n / 4;
    const uint8_t* const* row = qs + 4 * k;
    // The next eight rows are asked for a line a row per four blocks, so that they are on their way in full when this
    // pass ends (a row's start would otherwise wait for memory, a row being 36 lines at 4096 Q4_0 outputs).
    const int next = std::min(8, n_rows - 4 * (k + 2));
    for (int b = 0; b < nb; ++b) {
      if (b % (4 * 64 / kQsBytes) == 0) {
        for (int i = 0; i < next; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(row[8 + i] + kQsBytes * b), _MM_HINT_T1);
        }
      }
      __m512i lo = _mm512_load_si512(acc + 2 * b), hi = _mm512_load_si512(acc + 2 * b + 1);
      dot4<T>(row, b, _mm512_set1_epi32(c.word[static_cast<size_t>(k) * nb + b]), lo_perm, hi_perm, lo, hi);
      if (two) dot4<T>(row + 4, b, _mm512_set1_epi32(c.word[static_cast<size_t>(k + 1) * nb + b]), lo_perm, hi_perm,
                       lo, hi);
      _mm512_store_si512(acc + 2 * b, lo);
      _mm512_store_si512(acc + 2 * b + 1, hi);
    }
  }
  for (int b = 0; b < nb; ++b) add_block(y + kQK * b, c, b, acc[2 * b], acc[2 * b + 1], down_offset(T));
}

template void down_group_avx512<DownType::kQ4_0>(const DownGroup&, int, DownCoefficients&, float*);
template void down_group_avx512<DownType::kQ8_0>(const DownGroup&, int, DownCoefficients&, float*);

}  // namespace jaxinfer_cpu

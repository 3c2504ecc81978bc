// AVX2 + FMA + F16C kernels (x86 CPUs since Haswell / Zen 1). The target pragma comes after every #include, so no
// inline function from a shared header is compiled for AVX2 and then linked into the portable code.
#include <immintrin.h>

#include <cstring>
#include <type_traits>

#include "qmatmul.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace jaxinfer_cpu {
namespace avx2 {

// u8 × s8 -> 16-bit pair sums (saturating) -> 32-bit sums of four.
inline __m256i dot_u8s8(__m256i a, __m256i b) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}

// acc + int16 pair products summed into int32 lanes.
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }

// acc + dot_u8s8(a, b); a must stay below 128, as for dot_u8s8 (repacked_x86.inc).
inline __m256i dot_add_u8s8(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, dot_u8s8(a, b)); }
constexpr bool kWideUnsigned = false;

// Byte i takes byte i / 8 of qh (a shuffle within each 128-bit half, both holding qh), keeps bit i % 8 of it, and
// becomes 0x10 where that bit is set.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// The axpy kernels' 16 lanes (see kernels_x86.inc): two 256-bit vectors, lanes 0..7 and 8..15.
struct I32x16 {
  __m256i lo, hi;
};
struct F32x16 {
  __m256 lo, hi;
};

inline F32x16 zero_f32x16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }

inline I32x16 widen_u8(const uint8_t* p) {  // 16 bytes, zero-extended
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}

inline I32x16 widen_s8(const int8_t* p) {  // 16 bytes, sign-extended
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}

inline I32x16 and_mask(I32x16 q, int mask) {
  const __m256i m = _mm256_set1_epi32(mask);
  return {_mm256_and_si256(q.lo, m), _mm256_and_si256(q.hi, m)};
}

inline I32x16 shift_right(I32x16 q, int n) { return {_mm256_srli_epi32(q.lo, n), _mm256_srli_epi32(q.hi, n)}; }
inline I32x16 shift_left(I32x16 q, int n) { return {_mm256_slli_epi32(q.lo, n), _mm256_slli_epi32(q.hi, n)}; }
inline I32x16 bit_or(I32x16 a, I32x16 b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }

inline F32x16 load_f32x16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F32x16 load_f32x16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}

// acc + w * (lane 0 of scale)
inline F32x16 fmadd(F32x16 w, __m128 scale, F32x16 acc) {
  const __m256 s = _mm256_broadcastss_ps(scale);
  return {_mm256_fmadd_ps(w.lo, s, acc.lo), _mm256_fmadd_ps(w.hi, s, acc.hi)};
}
inline F32x16 fmadd(I32x16 q, __m128 scale, F32x16 acc) {
  return fmadd(F32x16{_mm256_cvtepi32_ps(q.lo), _mm256_cvtepi32_ps(q.hi)}, scale, acc);
}

// y[0, 16) += a + b + (lane 0 of offset)
inline void add_to(float* y, F32x16 a, F32x16 b, __m128 offset) {
  const __m256 o = _mm256_broadcastss_ps(offset);
  _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), _mm256_add_ps(_mm256_add_ps(a.lo, b.lo), o)));
  _mm256_storeu_ps(y + 8, _mm256_add_ps(_mm256_loadu_ps(y + 8), _mm256_add_ps(_mm256_add_ps(a.hi, b.hi), o)));
}

#include "kernels_x86.inc"
#include "repacked_x86.inc"
#include "repacked_k_x86.inc"

// The neuron-major down projection (NeuronBlockAxpy in qmatmul.h) without VBMI's byte permutes. A tile of 64 outputs
// is two halves of 32 (Q4: low and high nibbles of a neuron's 32 bytes; Q8_0: its two 32-byte halves); per half, the
// bytes of four neurons are interleaved with unpacks, which work within 128-bit lanes:
//
//   ab = unpack_epi8(n0, n1), cd = unpack_epi8(n2, n3); unpack_epi16(ab, cd) -> | n0 n1 n2 n3 | per output
//   sums[k], k < 4: lane 0 = outputs 4k .. 4k + 3, lane 1 = outputs 16 + 4k .. 16 + 4k + 3 (of the half)
//
// and the sums are put back in order once per tile. Q4: maddubs(weights u8, activations s8); Q8_0: weights are signed
// (stored + 128), so maddubs(|activation|, weight with the activation's sign), as the dense Q8_0 dot does: the 16-bit
// pair sums stay within 2 * 127 * 128, no saturation.
inline void interleave4(__m256i n0, __m256i n1, __m256i n2, __m256i n3, __m256i out[4]) {
  const __m256i ab_lo = _mm256_unpacklo_epi8(n0, n1), ab_hi = _mm256_unpackhi_epi8(n0, n1);
  const __m256i cd_lo = _mm256_unpacklo_epi8(n2, n3), cd_hi = _mm256_unpackhi_epi8(n2, n3);
  out[0] = _mm256_unpacklo_epi16(ab_lo, cd_lo);
  out[1] = _mm256_unpackhi_epi16(ab_lo, cd_lo);
  out[2] = _mm256_unpacklo_epi16(ab_hi, cd_hi);
  out[3] = _mm256_unpackhi_epi16(ab_hi, cd_hi);
}

// sums of one half (see above) -> outputs 0..31 in order, as four vectors of 8.
inline void in_order(const __m256i sums[4], __m256i out[4]) {
  out[0] = _mm256_permute2x128_si256(sums[0], sums[1], 0x20);
  out[1] = _mm256_permute2x128_si256(sums[2], sums[3], 0x20);
  out[2] = _mm256_permute2x128_si256(sums[0], sums[1], 0x31);
  out[3] = _mm256_permute2x128_si256(sums[2], sums[3], 0x31);
}

inline __m256 load_f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Four neurons' products per output, weights w interleaved as above, activations c (four bytes, repeated).
template <bool kSignedWeights>
inline __m256i dot4(__m256i w, __m256i c) {
  if (kSignedWeights) return dot_u8s8(_mm256_sign_epi8(c, c), _mm256_sign_epi8(w, c));  // |c| x (w with c's sign)
  return dot_u8s8(w, c);
}

// Per tile: load(r, at, half, v) leaves in v[k] neuron k's 32 bytes of the tile's half (unsigned 4-bit q, or signed
// 8-bit q with kSignedWeights); add_tile(t, scales, sums in order) updates y.
template <bool kSignedWeights, typename Load, typename AddTile>
inline void neuron_tiles_avx2(const NeuronLayout& layout, const uint8_t* block, const uint8_t* const* rows,
                              const int8_t* coef, int n, int d, const Load& load, const AddTile& add_tile) {
  const int n_tiles = d / 64;
  for (int t = 0; t < n_tiles; ++t) {
    if (t + 2 < n_tiles) layout.prefetch_tile(block, t + 2, rows, n);
    const int64_t at = layout.tile_offset(t);
    __m256i sums[2][4] = {};
    for (int g = 0; g < n; g += 4) {
      int32_t c4;
      std::memcpy(&c4, coef + g, 4);
      const __m256i c = _mm256_set1_epi32(c4);
      for (int half = 0; half < 2; ++half) {
        __m256i v[4], p[4];
        load(rows + g, at, half, v);
        interleave4(v[0], v[1], v[2], v[3], p);
        for (int k = 0; k < 4; ++k) sums[half][k] = _mm256_add_epi32(sums[half][k], dot4<kSignedWeights>(p[k], c));
      }
    }
    __m256i ordered[8];
    in_order(sums[0], ordered);
    in_order(sums[1], ordered + 4);
    add_tile(t, layout.scales(block, t), ordered);
  }
}

template <bool kHasMin>
void neuron_block_q4(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y) {
  const uint8_t* rows[kQK + 3];
  alignas(4) int8_t coef[kQK + 3];
  const int n = nonzero_neurons(x, block, layout, 4, rows, coef);
  if (n == 0) return;  // x.dsum is 0 too
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256 xd = _mm256_set1_ps(x.d), xdsum = _mm256_set1_ps(x.dsum), q4_0_offset = _mm256_set1_ps(-8 * x.dsum);
  const auto load = [nibble](const uint8_t* const* r, int64_t at, int half, __m256i v[4]) {
    for (int k = 0; k < 4; ++k) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[k] + at));
      v[k] = _mm256_and_si256(half ? _mm256_srli_epi16(bytes, 4) : bytes, nibble);
    }
  };
  neuron_tiles_avx2<false>(layout, block, rows, coef, n, d, load, [=](int t, const uint16_t* scale, const __m256i* s) {
    for (int i = 0; i < 8; ++i) {
      float* y_i = y + 64 * t + 8 * i;
      const __m256 sum = _mm256_cvtepi32_ps(s[i]), d_i = load_f16x8(scale + 8 * i);
      const __m256 add = kHasMin ? _mm256_fmadd_ps(_mm256_mul_ps(d_i, xd), sum,
                                                   _mm256_mul_ps(load_f16x8(scale + 64 * layout.span_tiles + 8 * i),
                                                                 xdsum))
                                 : _mm256_mul_ps(d_i, _mm256_fmadd_ps(xd, sum, q4_0_offset));
      _mm256_storeu_ps(y_i, _mm256_add_ps(_mm256_loadu_ps(y_i), add));
    }
  });
}

void neuron_block_q8_0(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y) {
  const uint8_t* rows[kQK + 3];
  alignas(4) int8_t coef[kQK + 3];
  const int n = nonzero_neurons(x, block, layout, 4, rows, coef);
  if (n == 0) return;
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256 xd = _mm256_set1_ps(x.d);
  const auto load = [bias](const uint8_t* const* r, int64_t at, int half, __m256i v[4]) {
    for (int k = 0; k < 4; ++k) {  // stored q + 128 -> q
      v[k] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r[k] + at + 32 * half)), bias);
    }
  };
  neuron_tiles_avx2<true>(layout, block, rows, coef, n, d, load, [=](int t, const uint16_t* scale, const __m256i* s) {
    for (int i = 0; i < 8; ++i) {
      float* y_i = y + 64 * t + 8 * i;
      const __m256 add = _mm256_mul_ps(_mm256_mul_ps(load_f16x8(scale + 8 * i), xd), _mm256_cvtepi32_ps(s[i]));
      _mm256_storeu_ps(y_i, _mm256_add_ps(_mm256_loadu_ps(y_i), add));
    }
  });
}

}  // namespace avx2

const Kernels& avx2_kernels() {
  static const Kernels k = {"avx2",
                            avx2::dot_q8_0,
                            avx2::dot_q4_0,
                            avx2::dot_q4_1,
                            avx2::dot_q5_0,
                            avx2::dot_q5_1,
                            avx2::dot_iq4_nl,
                            avx2::dot_q2_k,
                            avx2::dot_q3_k,
                            avx2::dot_q4_k,
                            avx2::dot_q5_k,
                            avx2::dot_q6_k,
                            avx2::dot_iq4_xs,
                            avx2::dot_f16,
                            avx2::dot_f32,
                            avx2::quantize_row,
                            avx2::quantize_row_k,
                            avx2::axpy_q8_0,
                            avx2::axpy_q4_0,
                            avx2::axpy_q4_1,
                            avx2::axpy_q5_0,
                            avx2::axpy_q5_1,
                            nullptr,  // Q2_K, Q3_K axpy: the portable ones (dispatch.cc)
                            nullptr,
                            avx2::axpy_k_scale_min<BlockQ4_K>,
                            avx2::axpy_k_scale_min<BlockQ5_K>,
                            avx2::axpy_q6_k,
                            nullptr,  // IQ4_NL, IQ4_XS axpy: the portable ones
                            nullptr,
                            avx2::axpy_floats<uint16_t>,
                            avx2::axpy_floats<float>,
                            avx2::neuron_block_q4<false>,
                            avx2::neuron_block_q4<true>,
                            avx2::neuron_block_q8_0,
                            avx2::x8_q8_0,
                            avx2::x8_q4_0,
                            avx2::x8_q4_1,
                            avx2::x8_iq4_nl,
                            avx2::x8_q8_0_x4,
                            avx2::x8_q4_0_x4,
                            avx2::x8_q4_1_x4,
                            avx2::x8_iq4_nl_x4,
                            avx2::x8_q4_k,
                            avx2::x8_q5_k,
                            avx2::x8_q6_k,
                            avx2::x8_iq4_xs,
                            avx2::x8_q4_k_x4,
                            avx2::x8_q5_k_x4,
                            avx2::x8_q6_k_x4,
                            avx2::x8_iq4_xs_x4,
                            avx2::dot_q8_0_x4,
                            avx2::dot_q4_0_x4,
                            avx2::dot_q4_1_x4,
                            avx2::dot_q5_0_x4,
                            avx2::dot_q5_1_x4,
                            avx2::dot_iq4_nl_x4,
                            avx2::dot_q2_k_x4,
                            avx2::dot_q3_k_x4,
                            avx2::dot_q4_k_x4,
                            avx2::dot_q5_k_x4,
                            avx2::dot_q6_k_x4,
                            avx2::dot_iq4_xs_x4,
                            avx2::dot_q8_0_2x4,
                            avx2::dot_q4_0_2x4,
                            avx2::dot_q4_1_2x4,
                            avx2::dot_q5_0_2x4,
                            avx2::dot_q5_1_2x4,
                            avx2::dot_iq4_nl_2x4,
                            nullptr,  // x16 repacked kernels: two calls of the one-group kernel
                            nullptr,
                            nullptr,
                            nullptr,
                            nullptr,
                            nullptr,
                            nullptr,
                            nullptr,
                            nullptr,
                            nullptr,
                            nullptr,
                            nullptr,
                            avx2::dot_q8_0_ahead,
                            avx2::dot_q4_0_ahead,
                            avx2::dot_q4_1_ahead,
                            avx2::dot_q5_0_ahead,
                            avx2::dot_q5_1_ahead,
                            avx2::dot_iq4_nl_ahead,
                            avx2::dot_q8_0_g4,
                            avx2::dot_q4_0_g4,
                            avx2::dot_q4_1_g4,
                            avx2::dot_iq4_nl_g4,
                            avx2::dot_q8_0_pair,
                            avx2::dot_q4_0_pair,
                            avx2::dot_q4_1_pair,
                            avx2::dot_q5_0_pair,
                            avx2::dot_q5_1_pair,
                            avx2::dot_iq4_nl_pair};
  return k;
}

}  // namespace jaxinfer_cpu

#pragma GCC pop_options

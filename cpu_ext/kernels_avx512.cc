// AVX-512 VNNI kernels (Ice Lake, Zen 4 and later): kernels_x86.inc with vpdpbusd as the u8 × s8 dot, on 256-bit
// vectors (AVX512VL), and the axpy kernels on 512-bit vectors. The target pragma comes after every #include, as in
// kernels_avx2.cc.
#include <immintrin.h>

#include <type_traits>

#include "qmatmul.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
// GCC 12 warns about the _mm512_undefined_* self-initialization inside its own 512-bit intrinsics (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace jaxinfer_cpu {
namespace avx512 {

// One instruction, no saturation: lane i = sum over j < 4 of a[4i+j] * b[4i+j].
inline __m256i dot_u8s8(__m256i a, __m256i b) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b); }

// acc + int16 pair products summed into int32 lanes, one instruction (vpdpwssd).
inline __m256i madd_add(__m256i acc, __m256i a, __m256i b) { return _mm256_dpwssd_epi32(acc, a, b); }

// acc + dot_u8s8(a, b), one instruction; a may take all 8 bits (repacked_x86.inc).
inline __m256i dot_add_u8s8(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(acc, a, b); }
constexpr bool kWideUnsigned = true;

// Byte i = 0x10 where bit i of qh is set: qh as a byte mask.
inline __m256i fifth_bits(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  return _mm256_maskz_mov_epi8(bits, _mm256_set1_epi8(0x10));
}

// The axpy kernels' 16 lanes (see kernels_x86.inc): one 512-bit vector. Zen 4 runs 512-bit operations on its
// 256-bit units, but decodes and retires half as many instructions: measured 4% (Q4_1) and 8% (Q8_0) faster than
// 256-bit pairs.
struct I32x16 {
  __m512i v;
};
struct F32x16 {
  __m512 v;
};

inline F32x16 zero_f32x16() { return {_mm512_setzero_ps()}; }
inline I32x16 widen_u8(const uint8_t* p) {  // 16 bytes, zero-extended
  return {_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline I32x16 widen_s8(const int8_t* p) {  // 16 bytes, sign-extended
  return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
}
inline I32x16 and_mask(I32x16 q, int mask) { return {_mm512_and_si512(q.v, _mm512_set1_epi32(mask))}; }
inline I32x16 shift_right(I32x16 q, int n) { return {_mm512_srli_epi32(q.v, n)}; }
inline I32x16 shift_left(I32x16 q, int n) { return {_mm512_slli_epi32(q.v, n)}; }
inline I32x16 bit_or(I32x16 a, I32x16 b) { return {_mm512_or_si512(a.v, b.v)}; }
inline F32x16 load_f32x16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F32x16 load_f32x16(const uint16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}

// acc + w * (lane 0 of scale)
inline F32x16 fmadd(F32x16 w, __m128 scale, F32x16 acc) {
  return {_mm512_fmadd_ps(w.v, _mm512_broadcastss_ps(scale), acc.v)};
}
inline F32x16 fmadd(I32x16 q, __m128 scale, F32x16 acc) { return fmadd(F32x16{_mm512_cvtepi32_ps(q.v)}, scale, acc); }

// y[0, 16) += a + b + (lane 0 of offset)
inline void add_to(float* y, F32x16 a, F32x16 b, __m128 offset) {
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(a.v, b.v), _mm512_broadcastss_ps(offset));
  _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), sum));
}

#include "kernels_x86.inc"
#include "repacked_x86.inc"
#include "repacked_k_x86.inc"

// Two repacked groups (sixteen rows) against four tokens, on 512-bit vectors: lanes 0..7 the first group's rows,
// 8..15 the second's, each group's 32-byte chunk loaded into one half. Each activation broadcast (one load, folded
// into vpdpbusd) then serves sixteen rows and each instruction does the work of two 256-bit ones: on Zen 4 the same
// arithmetic per cycle, half the instructions to issue (x8_dots at four tokens is issue-bound). The steps per lane
// are x8_dots's, so the bits are too.
inline __m512i halves(const uint8_t* first, const uint8_t* second) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load_256(first)), load_256(second), 1);
}
inline __m512 scales16(const uint8_t* first, const uint8_t* second) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(first));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(second));
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
}

template <X8Format F>
void x16_dots_x4(const uint8_t* group, int64_t group_bytes, const BlockQ8* x, int64_t stride, int n, float* out) {
  using T = X8Traits<F>;
  constexpr int N = 4;
  __m512 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  alignas(64) uint8_t biased[64];  // the IQ4 table + 128 in each 128-bit lane, for the byte shuffle
  for (int i = 0; i < 64; ++i) biased[i] = static_cast<uint8_t>(kIq4Values[i % 16] + 128);
  const __m512i table = _mm512_load_si512(biased);
  for (int b = 0; b < n / kQK; ++b) {
    const uint8_t* first = group + b * T::kBlockBytes;
    const uint8_t* second = first + group_bytes;
    __m512i w[8];
    if constexpr (F == X8Format::kQ8_0) {
      for (int k = 0; k < 8; ++k) w[k] = halves(first + 16 + 32 * k, second + 16 + 32 * k);
    } else {
      for (int c = 0; c < 4; ++c) {
        const __m512i bytes = halves(first + T::kScaleBytes + 32 * c, second + T::kScaleBytes + 32 * c);
        w[c] = _mm512_and_si512(bytes, nibble);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
      }
      if constexpr (F == X8Format::kIQ4_NL) {
        for (int k = 0; k < 8; ++k) w[k] = _mm512_shuffle_epi8(table, w[k]);
      }
    }
    const __m512 d = scales16(first, second);
    for (int i = 0; i < N; ++i) {
      const BlockQ8& xb = x[i * stride + b];
      __m512i even = _mm512_madd_epi16(_mm512_broadcastd_epi32(_mm_loadu_si32(xb.sum)), _mm512_set1_epi16(T::kOffset));
      __m512i odd = _mm512_setzero_si512();
      for (int k = 0; k < 8; k += 2) {
        even = _mm512_dpbusd_epi32(even, w[k], _mm512_broadcastd_epi32(_mm_loadu_si32(xb.qs + 4 * k)));
        odd = _mm512_dpbusd_epi32(odd, w[k + 1], _mm512_broadcastd_epi32(_mm_loadu_si32(xb.qs + 4 * k + 4)));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      __m512 add;
      if constexpr (T::kHasMin) {  // x.d (d dot + m S)
        const __m512 sum = _mm512_set1_ps((float)(xb.sum[0] + xb.sum[1]));
        add = _mm512_mul_ps(_mm512_set1_ps(xb.d), _mm512_add_ps(_mm512_mul_ps(d, dot),
                                                                _mm512_mul_ps(scales16(first + 16, second + 16), sum)));
      } else {  // (d x.d) dot
        add = _mm512_mul_ps(_mm512_mul_ps(d, _mm512_set1_ps(xb.d)), dot);
      }
      acc[i] = _mm512_add_ps(acc[i], add);
    }
  }
  for (int i = 0; i < N; ++i) _mm512_storeu_ps(out + 2 * kInterleave * i, acc[i]);
}

inline __m512i left_512(__m512i v, int n) { return _mm512_slli_epi16(v, static_cast<unsigned>(n)); }
inline __m512i right_512(__m512i v, int n) { return _mm512_srli_epi16(v, static_cast<unsigned>(n)); }

// The same for the K-quant and IQ4_XS groups (x8k_dots in repacked_k_x86.inc, per lane the same steps). Not for one
// token: a decode step reads the weights from memory, and two groups' bytes read interleaved came slower than one
// group's in order (4096 x 11008 Q6_K: 1.62 against 1.13-1.16 ms, alternating builds; the row kernel 1.16).
template <X8KFormat F>
inline void x16k_weights(const uint8_t* first, const uint8_t* second, int j, __m512i w[8]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  if constexpr (F == X8KFormat::kQ4_K || F == X8KFormat::kQ5_K) {
    const int pair = 160 + 256 * (j / 2);
    for (int k = 0; k < 8; ++k) {
      w[k] = _mm512_and_si512(_mm512_srli_epi16(halves(first + pair + 32 * k, second + pair + 32 * k), 4 * (j % 2)),
                              nibble);
      if constexpr (F == X8KFormat::kQ5_K) {
        const int qh = kQ4KGroupBytes + 32 * k;
        const __m512i fifth = q5_k_fifth_bits<__m512i, left_512, right_512>(halves(first + qh, second + qh), j);
        w[k] = _mm512_ternarylogic_epi32(w[k], fifth, _mm512_set1_epi8(0x10), 0xF8);  // w | (fifth & 0x10)
      }
    }
  } else if constexpr (F == X8KFormat::kQ6_K) {
    const int s = j % 4, half = 144 + 768 * (j / 4);
    for (int k = 0; k < 8; ++k) {
      const int ql = half + 256 * (s % 2) + 32 * k, qh = half + 512 + 32 * k;
      const __m512i low = _mm512_and_si512(_mm512_srli_epi16(halves(first + ql, second + ql), 4 * (s / 2)), nibble);
      const __m512i top = q6_k_top_bits<__m512i, left_512, right_512>(halves(first + qh, second + qh), s);
      w[k] = _mm512_ternarylogic_epi32(low, top, _mm512_set1_epi8(0x30), 0xF8);  // low | (top & 0x30)
    }
  } else {
    const __m512i table = _mm512_load_si512(kBiasedIq4.bytes);
    const int sub = 80 + 128 * j;
    for (int c = 0; c < 4; ++c) {
      const __m512i bytes = halves(first + sub + 32 * c, second + sub + 32 * c);
      w[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(bytes, nibble));
      w[c + 4] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble));
    }
  }
}

// 8 bytes of each group side by side, widened to 16 int32 lanes (signed for IQ4_XS's scales).
template <bool kSigned>
inline __m512i widen16(const uint8_t* first, const uint8_t* second) {
  const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(first)),
                                           _mm_loadl_epi64(reinterpret_cast<const __m128i*>(second)));
  return kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
}

// A sub-block's integer scales of the sixteen rows (x8k_scales' lanes, two groups).
struct X16KScales {
  __m512i first, second, pair;
};

template <X8KFormat F>
inline X16KScales x16k_scales(const uint8_t* first, const uint8_t* second, int j) {
  X16KScales s;
  if constexpr (F == X8KFormat::kQ6_K) {
    s.pair = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(first + 16 + 16 * j))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(second + 16 + 16 * j)), 1));
    s.first = _mm512_srai_epi32(_mm512_slli_epi32(s.pair, 16), 16);
    s.second = _mm512_srai_epi32(s.pair, 16);
  } else {
    constexpr bool kSigned = F == X8KFormat::kIQ4_XS;
    const int at = (kSigned ? 16 : 32) + 8 * j;
    s.first = s.second = widen16<kSigned>(first + at, second + at);
    const __m512i c = kSigned ? s.first : widen16<false>(first + 96 + 8 * j, second + 96 + 8 * j);
    s.pair = _mm512_or_si512(_mm512_and_si512(c, _mm512_set1_epi32(0xFFFF)), _mm512_slli_epi32(c, 16));
  }
  return s;
}

template <X8KFormat F, int N>
void x16k_dots(const uint8_t* group, int64_t group_bytes, const BlockQ8K* x, int64_t stride, int n, float* out) {
  using T = X8KTraits<F>;
  __m512 acc[N];
  for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_ps();
  for (int b = 0; b < n / kQK_K; ++b) {
    const uint8_t* first = group + b * T::kBlockBytes;
    const uint8_t* second = first + group_bytes;
    __m512i total[N];
    for (int i = 0; i < N; ++i) total[i] = _mm512_setzero_si512();
    // Unrolled, each sub-block's shifts and offsets are constants: 4096 x 4096 by 512 tokens, Q5_K 34.7-36.1 ->
    // 31.5-31.6 ms and Q4_K 30.7-32.1 -> 28.7-29.0 (alternating builds). Not in x8k_dots: there the one-token
    // kernel, faster from cache, streamed slower from memory, and AVX2's four-token one ran 5-10% slower.
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m512i w[8];
      x16k_weights<F>(first, second, j, w);
      const X16KScales sc = x16k_scales<F>(first, second, j);
      for (int i = 0; i < N; ++i) {
        const int8_t* xq = x[i * stride + b].qs + kQK * j;
        if constexpr (F == X8KFormat::kQ6_K) {  // a scale per 16 values: two chains
          __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
          for (int k = 0; k < 4; ++k) {
            lo = _mm512_dpbusd_epi32(lo, w[k], _mm512_broadcastd_epi32(_mm_loadu_si32(xq + 4 * k)));
            hi = _mm512_dpbusd_epi32(hi, w[k + 4], _mm512_broadcastd_epi32(_mm_loadu_si32(xq + 16 + 4 * k)));
          }
          total[i] = _mm512_add_epi32(total[i], _mm512_add_epi32(_mm512_mullo_epi32(lo, sc.first),
                                                                 _mm512_mullo_epi32(hi, sc.second)));
        } else {  // one chain: the tokens' chains overlap
          __m512i dot = _mm512_setzero_si512();
          for (int k = 0; k < 8; ++k) {  // w[k]: elements 4k .. 4k+3
            dot = _mm512_dpbusd_epi32(dot, w[k], _mm512_broadcastd_epi32(_mm_loadu_si32(xq + 4 * k)));
          }
          total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(dot, sc.first));
        }
      }
    }
    // The offsets after the dots, so that their accumulators do not hold registers through the dot loop.
    __m512i offset[N];
    for (int i = 0; i < N; ++i) offset[i] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      const __m512i pair = x16k_scales<F>(first, second, j).pair;
      for (int i = 0; i < N; ++i) {
        const __m512i sums = _mm512_broadcastd_epi32(_mm_loadu_si32(x[i * stride + b].bsums + 2 * j));
        offset[i] = _mm512_dpwssd_epi32(offset[i], pair, sums);
      }
    }
    const __m512 d = scales16(first, second);
    for (int i = 0; i < N; ++i) {
      const __m512 xd = _mm512_set1_ps(x[i * stride + b].d);
      __m512 add;
      if constexpr (T::kHasMin) {  // (x.d d) T - (x.d dmin) M
        add = _mm512_sub_ps(_mm512_mul_ps(_mm512_mul_ps(xd, d), _mm512_cvtepi32_ps(total[i])),
                            _mm512_mul_ps(_mm512_mul_ps(xd, scales16(first + 16, second + 16)),
                                          _mm512_cvtepi32_ps(offset[i])));
      } else {  // (d x.d) (T - kOffset O)
        const __m512i lanes = _mm512_sub_epi32(total[i], _mm512_slli_epi32(offset[i], T::kOffsetShift));
        add = _mm512_mul_ps(_mm512_mul_ps(d, xd), _mm512_cvtepi32_ps(lanes));
      }
      acc[i] = _mm512_add_ps(acc[i], add);
    }
  }
  for (int i = 0; i < N; ++i) _mm512_storeu_ps(out + 2 * kInterleave * i, acc[i]);
}

}  // namespace avx512

const Kernels& avx512_kernels() {
  static const Kernels k = {"avx512",
                            avx512::dot_q8_0,
                            avx512::dot_q4_0,
                            avx512::dot_q4_1,
                            avx512::dot_q5_0,
                            avx512::dot_q5_1,
                            avx512::dot_iq4_nl,
                            avx512::dot_q2_k,
                            avx512::dot_q3_k,
                            avx512::dot_q4_k,
                            avx512::dot_q5_k,
                            avx512::dot_q6_k,
                            avx512::dot_iq4_xs,
                            avx512::dot_f16,
                            avx512::dot_f32,
                            avx512::quantize_row,
                            avx512::quantize_row_k,
                            avx512::axpy_q8_0,
                            avx512::axpy_q4_0,
                            avx512::axpy_q4_1,
                            avx512::axpy_q5_0,
                            avx512::axpy_q5_1,
                            nullptr,  // Q2_K, Q3_K axpy: the portable ones (dispatch.cc)
                            nullptr,
                            avx512::axpy_k_scale_min<BlockQ4_K>,
                            avx512::axpy_k_scale_min<BlockQ5_K>,
                            avx512::axpy_q6_k,
                            nullptr,  // IQ4_NL, IQ4_XS axpy: the portable ones
                            nullptr,
                            avx512::axpy_floats<uint16_t>,
                            avx512::axpy_floats<float>,
                            nullptr,  // neuron-major: dispatch.cc picks VBMI's or AVX2's
                            nullptr,
                            nullptr,
                            avx512::x8_q8_0,
                            avx512::x8_q4_0,
                            avx512::x8_q4_1,
                            avx512::x8_iq4_nl,
                            avx512::x8_q8_0_x4,
                            avx512::x8_q4_0_x4,
                            avx512::x8_q4_1_x4,
                            avx512::x8_iq4_nl_x4,
                            avx512::x8_q4_k,
                            avx512::x8_q5_k,
                            avx512::x8_q6_k,
                            avx512::x8_iq4_xs,
                            avx512::x8_q4_k_x4,
                            avx512::x8_q5_k_x4,
                            avx512::x8_q6_k_x4,
                            avx512::x8_iq4_xs_x4,
                            avx512::dot_q8_0_x4,
                            avx512::dot_q4_0_x4,
                            avx512::dot_q4_1_x4,
                            avx512::dot_q5_0_x4,
                            avx512::dot_q5_1_x4,
                            avx512::dot_iq4_nl_x4,
                            avx512::dot_q2_k_x4,
                            avx512::dot_q3_k_x4,
                            avx512::dot_q4_k_x4,
                            avx512::dot_q5_k_x4,
                            avx512::dot_q6_k_x4,
                            avx512::dot_iq4_xs_x4,
                            avx512::dot_q8_0_2x4,
                            avx512::dot_q4_0_2x4,
                            avx512::dot_q4_1_2x4,
                            avx512::dot_q5_0_2x4,
                            avx512::dot_q5_1_2x4,
                            avx512::dot_iq4_nl_2x4,
                            avx512::x16_dots_x4<avx512::X8Format::kQ8_0>,
                            avx512::x16_dots_x4<avx512::X8Format::kQ4_0>,
                            avx512::x16_dots_x4<avx512::X8Format::kQ4_1>,
                            avx512::x16_dots_x4<avx512::X8Format::kIQ4_NL>,
                            avx512::x16k_dots<X8KFormat::kQ4_K, 4>,
                            avx512::x16k_dots<X8KFormat::kQ5_K, 4>,
                            avx512::x16k_dots<X8KFormat::kQ6_K, 4>,
                            avx512::x16k_dots<X8KFormat::kIQ4_XS, 4>,
                            avx512::x16k_dots<X8KFormat::kQ4_K, 8>,
                            avx512::x16k_dots<X8KFormat::kQ5_K, 8>,
                            avx512::x16k_dots<X8KFormat::kQ6_K, 8>,
                            avx512::x16k_dots<X8KFormat::kIQ4_XS, 8>,
                            avx512::dot_q8_0_ahead,
                            avx512::dot_q4_0_ahead,
                            avx512::dot_q4_1_ahead,
                            avx512::dot_q5_0_ahead,
                            avx512::dot_q5_1_ahead,
                            avx512::dot_iq4_nl_ahead,
                            avx512::dot_q8_0_g4,
                            avx512::dot_q4_0_g4,
                            avx512::dot_q4_1_g4,
                            avx512::dot_iq4_nl_g4,
                            avx512::dot_q8_0_pair,
                            avx512::dot_q4_0_pair,
                            avx512::dot_q4_1_pair,
                            avx512::dot_q5_0_pair,
                            avx512::dot_q5_1_pair,
                            avx512::dot_iq4_nl_pair};
  return k;
}

}  // namespace jaxinfer_cpu

#pragma GCC pop_options

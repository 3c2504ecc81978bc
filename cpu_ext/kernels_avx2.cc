// AVX2 + FMA + F16C kernels (x86 CPUs since Haswell / Zen 1). The target pragma comes after every #include, so no
// inline function from a shared header is compiled for AVX2 and then linked into the portable code.
#include <immintrin.h>

#include "qmatmul.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace jaxinfer_cpu {
namespace avx2 {

// u8 × s8 -> 16-bit pair sums (saturating) -> 32-bit sums of four.
inline __m256i dot_u8s8(__m256i a, __m256i b) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
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

}  // namespace avx2

const Kernels& avx2_kernels() {
  static const Kernels k = {"avx2",
                            avx2::dot_q8_0,
                            avx2::dot_q4_0,
                            avx2::dot_q4_1,
                            avx2::dot_q4_k,
                            avx2::dot_q6_k,
                            avx2::dot_f16,
                            avx2::dot_f32,
                            avx2::quantize_row,
                            avx2::axpy_q8_0,
                            avx2::axpy_q4_0,
                            avx2::axpy_q4_1,
                            avx2::axpy_q4_k,
                            avx2::axpy_q6_k,
                            avx2::axpy_floats<uint16_t>,
                            avx2::axpy_floats<float>,
                            avx2::dot_q8_0_x4,
                            avx2::dot_q4_0_x4,
                            avx2::dot_q4_1_x4};
  return k;
}

}  // namespace jaxinfer_cpu

#pragma GCC pop_options

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

#include "kernels_x86.inc"

}  // namespace avx2

const Kernels& avx2_kernels() {
  static const Kernels k = {"avx2",        avx2::dot_q8_0, avx2::dot_q4_0, avx2::dot_q4_1,     avx2::dot_q4_k,
                            avx2::dot_q6_k, avx2::dot_f16,  avx2::dot_f32,  avx2::quantize_row};
  return k;
}

}  // namespace jaxinfer_cpu

#pragma GCC pop_options

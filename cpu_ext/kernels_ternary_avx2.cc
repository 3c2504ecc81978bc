// AVX2 ternary kernels: kernels_ternary_x86.inc with maddubs + madd as the u8 × s8 dot. The target pragma comes after
// every #include, as in kernels_avx2.cc.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "ternary.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace jaxinfer_cpu {
namespace avx2 {

inline __m256i dot_add(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
}

#include "kernels_ternary_x86.inc"

}  // namespace avx2
}  // namespace jaxinfer_cpu

#pragma GCC pop_options

// AVX-512 VNNI ternary kernels: kernels_ternary_x86.inc with vpdpbusd as the u8 × s8 dot, on 256-bit vectors
// (AVX512VL: on Zen 4 a 256-bit vpdpbusd does as many bytes per cycle as the 512-bit one, see kernels_avx512.cc).
#include <immintrin.h>

#include <cstring>

#include "ternary.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

namespace jaxinfer_cpu {
namespace avx512 {

inline __m256i dot_add(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(acc, a, b); }

#include "kernels_ternary_x86.inc"

}  // namespace avx512
}  // namespace jaxinfer_cpu

#pragma GCC pop_options

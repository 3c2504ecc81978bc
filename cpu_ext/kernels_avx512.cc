// AVX-512 VNNI kernels (Ice Lake, Zen 4 and later): kernels_x86.inc with vpdpbusd as the u8 × s8 dot, on 256-bit
// vectors (AVX512VL). The target pragma comes after every #include, as in kernels_avx2.cc.
#include <immintrin.h>

#include "qmatmul.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

namespace jaxinfer_cpu {
namespace avx512 {

// One instruction, no saturation: lane i = sum over j < 4 of a[4i+j] * b[4i+j].
inline __m256i dot_u8s8(__m256i a, __m256i b) { return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b); }

#include "kernels_x86.inc"

}  // namespace avx512

const Kernels& avx512_kernels() {
  static const Kernels k = {"avx512",        avx512::dot_q8_0, avx512::dot_q4_0, avx512::dot_q4_1,
                            avx512::dot_q4_k, avx512::dot_q6_k, avx512::dot_f16,  avx512::dot_f32,
                            avx512::quantize_row};
  return k;
}

}  // namespace jaxinfer_cpu

#pragma GCC pop_options

// AVX-512 VNNI ternary kernels: kernels_ternary_x86.inc with vpdpbusd as the u8 × s8 dot, on 256-bit vectors
// (AVX512VL: on Zen 4 a 256-bit vpdpbusd does as many bytes per cycle as the 512-bit one, see kernels_avx512.cc).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "ternary.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")
// GCC 12 warns about the _mm512_undefined_* self-initialization inside its own 512-bit intrinsics (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace jaxinfer_cpu {
namespace avx512 {

inline __m256i dot_add(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(acc, a, b); }

#define JAXINFER_TERNARY_AXPY_512
#include "kernels_ternary_x86.inc"

// kernels_ternary_x86.inc's I2_S axpy on 512-bit vectors: a row's bytes 16k .. 16k + 15 of a group widen to 16 int32
// lanes (output 128 g + 32 s + 16 k + i in lane i), half the instructions per value of the 256-bit kernel: measured
// with one token and half the rows of a [4096, 11008] down projection, 1.09x -> 0.72x the dense TQ2_0 kernel's time.
void axpy_i2_s(const uint8_t* const* w_rows, const float* h, int n_rows, float* y, int n) {
  for (int r0 = 0; r0 < n_rows; r0 += kMaxAxpyRows) {
    const int panel = std::min(kMaxAxpyRows, n_rows - r0);
    int8_t q[kMaxAxpyRows + 3];
    const uint8_t* rows[kMaxAxpyRows + 3];
    const float d = quantize_coefs(h + r0, panel, q);
    int q_sum = 0, padded = panel;
    for (int r = 0; r < panel; ++r) rows[r] = w_rows[r0 + r], q_sum += q[r];
    for (; padded % 4; ++padded) rows[padded] = w_rows[r0], q[padded] = 0;
    const __m512i two_bits = _mm512_set1_epi8(3), minus = _mm512_set1_epi32(q_sum);
    const __m512 scale = _mm512_set1_ps(d);
    for (int g = 0; g < n / 128; ++g) {
      __m512i acc[2][4];
      for (int k = 0; k < 2; ++k) {
        for (int s = 0; s < 4; ++s) acc[k][s] = _mm512_setzero_si512();
      }
      for (int r = 0; r < padded; r += 4) {
        int32_t coefs;
        std::memcpy(&coefs, q + r, 4);
        const __m512i x = _mm512_set1_epi32(coefs);
        for (int k = 0; k < 2; ++k) {
          __m512i lanes = _mm512_setzero_si512();
          for (int i = 0; i < 4; ++i) {
            const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[r + i] + 32 * g + 16 * k));
            lanes = _mm512_or_si512(lanes, _mm512_slli_epi32(_mm512_cvtepu8_epi32(bytes), 8 * i));
          }
          for (int s = 0; s < 4; ++s) {
            const __m512i codes = _mm512_and_si512(_mm512_srli_epi32(lanes, 6 - 2 * s), two_bits);
            acc[k][s] = _mm512_dpbusd_epi32(acc[k][s], codes, x);
          }
        }
      }
      for (int k = 0; k < 2; ++k) {
        for (int s = 0; s < 4; ++s) {
          float* out = y + 128 * g + 32 * s + 16 * k;
          const __m512 value = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[k][s], minus)));
          _mm512_storeu_ps(out, _mm512_add_ps(_mm512_loadu_ps(out), value));
        }
      }
    }
  }
}

}  // namespace avx512
}  // namespace jaxinfer_cpu

#pragma GCC pop_options

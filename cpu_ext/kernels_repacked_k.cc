// Portable kernels of the repacked K-quant and IQ4_XS groups (qmatmul.h draws the bytes): the definition of what the
// SIMD ones in repacked_k_x86.inc compute, bit for bit, and the fallback on CPUs without AVX2. Per row and token,
// integer T and offset O of each super-block, then the float steps qmatmul.h gives.
#include <cstring>

#include "qmatmul.h"

namespace jaxinfer_cpu {
namespace {

// The byte of row r in chunk c of a run of chunks.
inline uint8_t chunk_byte(const uint8_t* chunks, int c, int r, int i) { return chunks[32 * c + 4 * r + i]; }

// Row r's q of element e (< 32) of sub-block j of one super-block group block, unsigned as the SIMD kernels take it
// (IQ4_XS: the table value + 128).
template <X8KFormat F>
int x8k_q(const uint8_t* blk, int r, int j, int e) {
  if constexpr (F == X8KFormat::kQ4_K || F == X8KFormat::kQ5_K) {
    const int q = (chunk_byte(blk + 160 + 256 * (j / 2), e / 4, r, e % 4) >> (4 * (j % 2))) & 0x0F;
    if constexpr (F == X8KFormat::kQ4_K) return q;
    return q | ((chunk_byte(blk + kQ4KGroupBytes, e / 4, r, e % 4) >> j) & 1) << 4;
  } else if constexpr (F == X8KFormat::kQ6_K) {
    const int h = j / 4, s = j % 4;
    const uint8_t* half = blk + 144 + 768 * h;
    const int low = (chunk_byte(half + 256 * (s % 2), e / 4, r, e % 4) >> (4 * (s / 2))) & 0x0F;
    constexpr int kTopAt[4] = {4, 0, 6, 2};  // a repacked qh byte holds sub-blocks 1, 3, 0, 2 from its low bits up
    return low | ((chunk_byte(half + 512, e / 4, r, e % 4) >> kTopAt[s]) & 3) << 4;
  } else {
    const int c = e % 16 / 4;
    const uint8_t byte = chunk_byte(blk + 80 + 128 * j, c, r, e % 4);
    return kIq4Values[e < 16 ? byte & 0x0F : byte >> 4] + 128;
  }
}

}  // namespace

template <X8KFormat F, int N>
void x8k_dots_portable(const uint8_t* group, const BlockQ8K* x, int64_t stride, int n, float* out) {
  for (int i = 0; i < N; ++i) {
    for (int r = 0; r < kInterleave; ++r) {
      float total = 0.0f;
      for (int b = 0; b < n / kQK_K; ++b) {
        const uint8_t* blk = group + b * x8k_group_block_bytes(F);
        const BlockQ8K& xb = x[i * stride + b];
        int32_t t = 0, o = 0;
        for (int j = 0; j < 8; ++j) {
          int32_t dots[2] = {};  // the sub-block's first and last 16 values
          for (int e = 0; e < kQK; ++e) dots[e / 16] += x8k_q<F>(blk, r, j, e) * xb.qs[kQK * j + e];
          const int sum = xb.bsums[2 * j] + xb.bsums[2 * j + 1];
          if constexpr (F == X8KFormat::kQ6_K) {
            const auto* sc = reinterpret_cast<const int8_t*>(blk + 16 + 16 * j + 2 * r);
            t += sc[0] * dots[0] + sc[1] * dots[1];
            o += sc[0] * xb.bsums[2 * j] + sc[1] * xb.bsums[2 * j + 1];
          } else if constexpr (F == X8KFormat::kIQ4_XS) {
            const int sc = static_cast<int8_t>(blk[16 + 8 * j + r]);
            t += sc * (dots[0] + dots[1]);
            o += sc * sum;
          } else {
            t += blk[32 + 8 * j + r] * (dots[0] + dots[1]);
            o += blk[96 + 8 * j + r] * sum;
          }
        }
        uint16_t d;
        std::memcpy(&d, blk + 2 * r, 2);
        if constexpr (F == X8KFormat::kQ4_K || F == X8KFormat::kQ5_K) {
          uint16_t dmin;
          std::memcpy(&dmin, blk + 16 + 2 * r, 2);
          total += xb.d * fp16_to_f32(d) * (float)t - xb.d * fp16_to_f32(dmin) * (float)o;
        } else {
          const int offset = F == X8KFormat::kQ6_K ? 32 : 128;
          total += fp16_to_f32(d) * xb.d * (float)(t - offset * o);
        }
      }
      out[kInterleave * i + r] = total;
    }
  }
}

// The instances the portable kernel set (kernels_scalar.cc) names.
template void x8k_dots_portable<X8KFormat::kQ4_K, 1>(const uint8_t*, const BlockQ8K*, int64_t, int, float*);
template void x8k_dots_portable<X8KFormat::kQ5_K, 1>(const uint8_t*, const BlockQ8K*, int64_t, int, float*);
template void x8k_dots_portable<X8KFormat::kQ6_K, 1>(const uint8_t*, const BlockQ8K*, int64_t, int, float*);
template void x8k_dots_portable<X8KFormat::kIQ4_XS, 1>(const uint8_t*, const BlockQ8K*, int64_t, int, float*);
template void x8k_dots_portable<X8KFormat::kQ4_K, 4>(const uint8_t*, const BlockQ8K*, int64_t, int, float*);
template void x8k_dots_portable<X8KFormat::kQ5_K, 4>(const uint8_t*, const BlockQ8K*, int64_t, int, float*);
template void x8k_dots_portable<X8KFormat::kQ6_K, 4>(const uint8_t*, const BlockQ8K*, int64_t, int, float*);
template void x8k_dots_portable<X8KFormat::kIQ4_XS, 4>(const uint8_t*, const BlockQ8K*, int64_t, int, float*);

}  // namespace jaxinfer_cpu

// Portable kernels: the definition of what every SIMD kernel computes, and the fallback on CPUs without AVX2.
// Integer dots per block, then one float multiply-add per block (or per 16 elements for Q6_K).
#include <cmath>

#include "qmatmul.h"

namespace jaxinfer_cpu {
namespace {

void quantize_row(const float* x, BlockQ8* out, int n) {
  for (int b = 0; b < n / kQK; ++b, x += kQK) {
    float amax = 0.0f;
    for (int i = 0; i < kQK; ++i) amax = std::fmax(amax, std::fabs(x[i]));
    const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
    out[b].d = d;
    for (int h = 0; h < 2; ++h) {
      int sum = 0;
      for (int i = 16 * h; i < 16 * h + 16; ++i) {
        out[b].qs[i] = (int8_t)std::lrintf(x[i] * inv);
        sum += out[b].qs[i];
      }
      out[b].sum[h] = (int16_t)sum;
    }
  }
}

int block_sum(const BlockQ8& x) { return x.sum[0] + x.sum[1]; }

float dot_q8_0(const uint8_t* w_row, const BlockQ8* x, int n) {
  const auto* w = reinterpret_cast<const BlockQ8_0*>(w_row);
  float total = 0.0f;
  for (int b = 0; b < n / kQK; ++b) {
    int dot = 0;
    for (int i = 0; i < kQK; ++i) dot += w[b].qs[i] * x[b].qs[i];
    total += fp16_to_f32(w[b].d) * x[b].d * (float)dot;
  }
  return total;
}

// Q4_0 and Q4_1 nibbles: byte i holds element i (low) and element i + 16 (high).
int nibble_dot(const uint8_t qs[16], const int8_t* x) {
  int dot = 0;
  for (int i = 0; i < 16; ++i) dot += (qs[i] & 0x0F) * x[i] + (qs[i] >> 4) * x[i + 16];
  return dot;
}

float dot_q4_0(const uint8_t* w_row, const BlockQ8* x, int n) {
  const auto* w = reinterpret_cast<const BlockQ4_0*>(w_row);
  float total = 0.0f;
  for (int b = 0; b < n / kQK; ++b) {
    total += fp16_to_f32(w[b].d) * x[b].d * (float)(nibble_dot(w[b].qs, x[b].qs) - 8 * block_sum(x[b]));
  }
  return total;
}

float dot_q4_1(const uint8_t* w_row, const BlockQ8* x, int n) {
  const auto* w = reinterpret_cast<const BlockQ4_1*>(w_row);
  float total = 0.0f;
  for (int b = 0; b < n / kQK; ++b) {
    total += x[b].d * (fp16_to_f32(w[b].d) * (float)nibble_dot(w[b].qs, x[b].qs) +
                       fp16_to_f32(w[b].m) * (float)block_sum(x[b]));
  }
  return total;
}

float dot_q4_k(const uint8_t* w_row, const BlockQ8* x, int n) {
  const auto* w = reinterpret_cast<const BlockQ4_K*>(w_row);
  float total = 0.0f;
  for (int b = 0; b < n / kQK_K; ++b, x += 8) {
    const float d = fp16_to_f32(w[b].d), dmin = fp16_to_f32(w[b].dmin);
    uint8_t sc[8], mn[8];
    unpack_q4_k_scales(w[b].scales, sc, mn);
    for (int j = 0; j < 8; ++j) {  // sub-block j: low (j even) or high (j odd) nibbles of qs[32 * (j / 2) ...]
      const uint8_t* q = w[b].qs + 32 * (j / 2);
      const int shift = 4 * (j % 2);
      int dot = 0;
      for (int i = 0; i < kQK; ++i) dot += ((q[i] >> shift) & 0x0F) * x[j].qs[i];
      total += x[j].d * (d * sc[j] * (float)dot - dmin * mn[j] * (float)block_sum(x[j]));
    }
  }
  return total;
}

// Q6_K: element 128h + 32s + l (half h, sub-block s, l < 32) has its low nibble in ql[64h + 32(s % 2) + l]
// (low nibble for s < 2, high for s >= 2), its top two bits in qh[32h + l] >> 2s, and scale scales[(128h+32s+l)/16].
float dot_q6_k(const uint8_t* w_row, const BlockQ8* x, int n) {
  const auto* w = reinterpret_cast<const BlockQ6_K*>(w_row);
  float total = 0.0f;
  for (int b = 0; b < n / kQK_K; ++b) {
    const float d = fp16_to_f32(w[b].d);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s) {
        const BlockQ8& xb = x[8 * b + 4 * h + s];
        const uint8_t* ql = w[b].ql + 64 * h + 32 * (s % 2);
        const uint8_t* qh = w[b].qh + 32 * h;
        int dot[2] = {0, 0};
        for (int l = 0; l < kQK; ++l) {
          const int q = ((ql[l] >> (4 * (s / 2))) & 0x0F) | (((qh[l] >> (2 * s)) & 3) << 4);
          dot[l / 16] += q * xb.qs[l];
        }
        const int8_t* sc = w[b].scales + 8 * h + 2 * s;
        total += d * xb.d * (sc[0] * (float)(dot[0] - 32 * xb.sum[0]) + sc[1] * (float)(dot[1] - 32 * xb.sum[1]));
      }
    }
  }
  return total;
}

float dot_f16(const void* w_row, const float* x, int n) {
  const auto* w = static_cast<const uint16_t*>(w_row);
  float total = 0.0f;
  for (int i = 0; i < n; ++i) total += fp16_to_f32(w[i]) * x[i];
  return total;
}

float dot_f32(const void* w_row, const float* x, int n) {
  const auto* w = static_cast<const float*>(w_row);
  float total = 0.0f;
  for (int i = 0; i < n; ++i) total += w[i] * x[i];
  return total;
}

}  // namespace

const Kernels& scalar_kernels() {
  static const Kernels k = {"scalar", dot_q8_0, dot_q4_0, dot_q4_1, dot_q4_k, dot_q6_k, dot_f16, dot_f32, quantize_row};
  return k;
}

}  // namespace jaxinfer_cpu

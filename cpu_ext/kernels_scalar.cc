// Portable kernels: the definition of what every SIMD kernel computes, and the fallback on CPUs without AVX2.
// Integer dots per block, then one float multiply-add per block (or per 16 elements for Q6_K).
#include <cmath>

#include "qmatmul.h"

namespace jaxinfer_cpu {
namespace {

// n values x to qs = round(x / d) with d = max |x| / 127, and the sums of each 16 of them into sums; returns d.
float quantize_values(const float* x, int n, int8_t* qs, int16_t* sums) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
  for (int g = 0; g < n / 16; ++g) {
    int sum = 0;
    for (int i = 16 * g; i < 16 * g + 16; ++i) {
      qs[i] = (int8_t)std::lrintf(x[i] * inv);
      sum += qs[i];
    }
    sums[g] = (int16_t)sum;
  }
  return d;
}

void quantize_row(const float* x, BlockQ8* out, int n) {
  for (int b = 0; b < n / kQK; ++b, x += kQK) {
    out[b].d = quantize_values(x, kQK, out[b].qs, out[b].sum);
    out[b].dsum = out[b].d * (float)(out[b].sum[0] + out[b].sum[1]);
  }
}

void quantize_row_k(const float* x, BlockQ8K* out, int n) {
  for (int b = 0; b < n / kQK_K; ++b, x += kQK_K) out[b].d = quantize_values(x, kQK_K, out[b].qs, out[b].bsums);
}

int block_sum(const BlockQ8& x) { return x.sum[0] + x.sum[1]; }

// Q4_0 and Q4_1 nibbles: byte i holds element i (low) and element i + 16 (high).
int nibble_dot(const uint8_t qs[16], const int8_t* x) {
  int dot = 0;
  for (int i = 0; i < 16; ++i) dot += (qs[i] & 0x0F) * x[i] + (qs[i] >> 4) * x[i + 16];
  return dot;
}

// Q5_0 and Q5_1: the nibble of element i plus bit i of qh as its fifth bit.
int fifth_bit_dot(const uint8_t qh[4], const int8_t* x) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  int dot = 0;
  for (int i = 0; i < kQK; ++i) dot += (int)((bits >> i) & 1) * 16 * x[i];
  return dot;
}

// The integer dot of a Q4_0/Q4_1/Q5_0/Q5_1 block's q with 32 activations.
int q_dot(const BlockQ4_0& w, const int8_t* x) { return nibble_dot(w.qs, x); }
int q_dot(const BlockQ4_1& w, const int8_t* x) { return nibble_dot(w.qs, x); }
int q_dot(const BlockQ5_0& w, const int8_t* x) { return nibble_dot(w.qs, x) + fifth_bit_dot(w.qh, x); }
int q_dot(const BlockQ5_1& w, const int8_t* x) { return nibble_dot(w.qs, x) + fifth_bit_dot(w.qh, x); }

// Q4_0 (kOffset 8), Q5_0 (16): x = d (q - kOffset).
template <typename Block, int kOffset>
float dot_offset(const uint8_t* w_row, const BlockQ8* x, int n) {
  const auto* w = reinterpret_cast<const Block*>(w_row);
  float total = 0.0f;
  for (int b = 0; b < n / kQK; ++b) {
    total += fp16_to_f32(w[b].d) * x[b].d * (float)(q_dot(w[b], x[b].qs) - kOffset * block_sum(x[b]));
  }
  return total;
}

// Q4_1, Q5_1: x = d q + m.
template <typename Block>
float dot_min(const uint8_t* w_row, const BlockQ8* x, int n) {
  const auto* w = reinterpret_cast<const Block*>(w_row);
  float total = 0.0f;
  for (int b = 0; b < n / kQK; ++b) {
    const float dot = (float)q_dot(w[b], x[b].qs);
    total += x[b].d * (fp16_to_f32(w[b].d) * dot + fp16_to_f32(w[b].m) * (float)block_sum(x[b]));
  }
  return total;
}

// Q4_K and Q5_K: q of element i of sub-block j, which is in the low (j even) or high (j odd) nibbles of
// qs[32 * (j / 2) ...], and for Q5_K bit j of qh[i] as its fifth bit.
int k_quant_q(const BlockQ4_K& w, int j, int i) { return (w.qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 0x0F; }
int k_quant_q(const BlockQ5_K& w, int j, int i) {
  return ((w.qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 0x0F) | ((w.qh[i] >> j) & 1) << 4;
}

// The K-quant dots sum in the 8 lanes of the SIMD kernels (dots_k_scale_min in kernels_x86.inc) so that every kernel
// set gives the same bits: per super-block, lane l holds an int32 sum over elements 4l..4l+3 of each 32-value
// sub-block, scaled into a float lane by one FMA; a row's result adds the lanes in hsum's order.
struct KLanes {
  float v[8] = {};
  void add(float scale, const int32_t lanes[8]) {
    for (int l = 0; l < 8; ++l) v[l] = std::fma(scale, (float)lanes[l], v[l]);
  }
  float sum() const {  // hsum: the 128-bit halves added, then lanes (0, 2) and (1, 3), then the two
    return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7]));
  }
};

// K-quants against super-block activations: the sub-blocks' integer dots times their integer scales, summed in
// integers per lane, then float lanes; Q4_K/Q5_K subtract the mins' lane m_l (bsums_{2l} + bsums_{2l+1}).
template <typename Block>
float dot_k_scale_min(const uint8_t* w_row, const BlockQ8K* x, int n) {
  const auto* w = reinterpret_cast<const Block*>(w_row);
  KLanes total;
  for (int b = 0; b < n / kQK_K; ++b) {
    uint8_t sc[8], mn[8];
    unpack_q4_k_scales(w[b].scales, sc, mn);
    int32_t sum[8] = {}, offset[8];
    for (int j = 0; j < 8; ++j) {
      for (int i = 0; i < kQK; ++i) sum[i / 4] += sc[j] * k_quant_q(w[b], j, i) * x[b].qs[kQK * j + i];
      offset[j] = mn[j] * (x[b].bsums[2 * j] + x[b].bsums[2 * j + 1]);
    }
    total.add(x[b].d * fp16_to_f32(w[b].d), sum);
    total.add(-(x[b].d * fp16_to_f32(w[b].dmin)), offset);
  }
  return total.sum();
}

// Q2_K and Q3_K: q of element e (see BlockQ2_K), unsigned as the SIMD kernels take it: Q3_K's is q + 4, in 0..7.
int low_two_bits(const uint8_t* qs, int e) { return (qs[32 * (e / 128) + e % 32] >> (2 * (e / 32 % 4))) & 3; }
int q3_k_q_plus_4(const BlockQ3_K& w, int e) {
  return low_two_bits(w.qs, e) | ((w.hmask[e % 32] >> (e / 32)) & 1) << 2;
}

// Q2_K: sum_g sc_g (q_g . x_g), less the mins' lane m_2l bsums_2l + m_2l+1 bsums_2l+1.
float dot_q2_k(const uint8_t* w_row, const BlockQ8K* x, int n) {
  const auto* w = reinterpret_cast<const BlockQ2_K*>(w_row);
  KLanes total;
  for (int b = 0; b < n / kQK_K; ++b) {
    int32_t sum[8] = {}, offset[8];
    for (int e = 0; e < kQK_K; ++e) {
      sum[e % 32 / 4] += (w[b].scales[e / 16] & 0x0F) * low_two_bits(w[b].qs, e) * x[b].qs[e];
    }
    for (int l = 0; l < 8; ++l) {
      const int g = 2 * l;
      offset[l] = (w[b].scales[g] >> 4) * x[b].bsums[g] + (w[b].scales[g + 1] >> 4) * x[b].bsums[g + 1];
    }
    total.add(x[b].d * fp16_to_f32(w[b].d), sum);
    total.add(-(x[b].d * fp16_to_f32(w[b].dmin)), offset);
  }
  return total.sum();
}

// Q3_K: sum_g sc_g ((q + 4)_g . x_g - 4 bsums_g), the -4 taken per lane as Q6_K's -32.
float dot_q3_k(const uint8_t* w_row, const BlockQ8K* x, int n) {
  const auto* w = reinterpret_cast<const BlockQ3_K*>(w_row);
  KLanes total;
  for (int b = 0; b < n / kQK_K; ++b) {
    int8_t sc[16];
    unpack_q3_k_scales(w[b].scales, sc);
    int32_t sum[8] = {};
    for (int e = 0; e < kQK_K; ++e) sum[e % 32 / 4] += sc[e / 16] * q3_k_q_plus_4(w[b], e) * x[b].qs[e];
    for (int l = 0; l < 8; ++l) sum[l] -= 4 * (sc[2 * l] * x[b].bsums[2 * l] + sc[2 * l + 1] * x[b].bsums[2 * l + 1]);
    total.add(fp16_to_f32(w[b].d) * x[b].d, sum);
  }
  return total.sum();
}

// Q6_K: element 128h + 32s + l (half h, sub-block s, l < 32) has its low nibble in ql[64h + 32(s % 2) + l]
// (low nibble for s < 2, high for s >= 2), its top two bits in qh[32h + l] >> 2s, and scale scales[(128h+32s+l)/16],
// the scale of activation group (128h + 32s + l) / 16. Lane l's -32 offset is that of groups 2l and 2l + 1.
float dot_q6_k(const uint8_t* w_row, const BlockQ8K* x, int n) {
  const auto* w = reinterpret_cast<const BlockQ6_K*>(w_row);
  KLanes total;
  for (int b = 0; b < n / kQK_K; ++b) {
    int32_t sum[8] = {};
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s) {
        const uint8_t* ql = w[b].ql + 64 * h + 32 * (s % 2);
        const uint8_t* qh = w[b].qh + 32 * h;
        const int8_t* xq = x[b].qs + 128 * h + 32 * s;
        for (int l = 0; l < kQK; ++l) {
          const int q = ((ql[l] >> (4 * (s / 2))) & 0x0F) | (((qh[l] >> (2 * s)) & 3) << 4);
          sum[l / 4] += w[b].scales[8 * h + 2 * s + l / 16] * q * xq[l];
        }
      }
    }
    for (int l = 0; l < 8; ++l) {
      const int g = 2 * l;
      sum[l] -= 32 * (w[b].scales[g] * x[b].bsums[g] + w[b].scales[g + 1] * x[b].bsums[g + 1]);
    }
    total.add(fp16_to_f32(w[b].d) * x[b].d, sum);
  }
  return total.sum();
}

// IQ4_NL and IQ4_XS: the table values of sub-block (or block) nibbles, element order as Q4_0's.
int iq4_value(const uint8_t qs[16], int i) { return kIq4Values[i < 16 ? qs[i] & 0x0F : qs[i - 16] >> 4]; }

// Q8_0 and IQ4_NL: signed values, d * v, dotted in integers.
int signed_value(const BlockQ8_0& w, int i) { return w.qs[i]; }
int signed_value(const BlockIQ4_NL& w, int i) { return iq4_value(w.qs, i); }

template <typename Block>
float dot_signed(const uint8_t* w_row, const BlockQ8* x, int n) {
  const auto* w = reinterpret_cast<const Block*>(w_row);
  float total = 0.0f;
  for (int b = 0; b < n / kQK; ++b) {
    int dot = 0;
    for (int i = 0; i < kQK; ++i) dot += signed_value(w[b], i) * x[b].qs[i];
    total += fp16_to_f32(w[b].d) * x[b].d * (float)dot;
  }
  return total;
}

// IQ4_XS: each sub-block's integer dot times its integer scale, in the K-quant lanes.
float dot_iq4_xs(const uint8_t* w_row, const BlockQ8K* x, int n) {
  const auto* w = reinterpret_cast<const BlockIQ4_XS*>(w_row);
  KLanes total;
  for (int b = 0; b < n / kQK_K; ++b) {
    int32_t sum[8] = {};
    for (int j = 0; j < 8; ++j) {
      const int scale = iq4_xs_scale(w[b], j);
      for (int i = 0; i < kQK; ++i) sum[i / 4] += scale * iq4_value(w[b].qs + 16 * j, i) * x[b].qs[kQK * j + i];
    }
    total.add(x[b].d * fp16_to_f32(w[b].d), sum);
  }
  return total.sum();
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

// Block dequantizers for the axpy kernels: one block of `type_size` bytes -> its values in f32, computed as
// jaxinfer.quant and gguf-py do (d * q + m, in f32), so the scalar axpy only differs from dequantize(W) and an f32
// product in summation order.
void dequantize_q8_0(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockQ8_0*>(block);
  const float d = fp16_to_f32(w->d);
  for (int i = 0; i < kQK; ++i) out[i] = d * (float)w->qs[i];
}

// Q4_0/Q4_1: byte i of qs holds element i in its low nibble and element i + 16 in its high nibble.
void dequantize_q4_0(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockQ4_0*>(block);
  const float d = fp16_to_f32(w->d);
  for (int i = 0; i < 16; ++i) {
    out[i] = d * (float)((w->qs[i] & 0x0F) - 8);
    out[i + 16] = d * (float)((w->qs[i] >> 4) - 8);
  }
}

void dequantize_q4_1(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockQ4_1*>(block);
  const float d = fp16_to_f32(w->d), m = fp16_to_f32(w->m);
  for (int i = 0; i < 16; ++i) {
    out[i] = d * (float)(w->qs[i] & 0x0F) + m;
    out[i + 16] = d * (float)(w->qs[i] >> 4) + m;
  }
}

// The 5-bit q of a Q5_0/Q5_1 block's element i.
int q5(const uint8_t qh[4], const uint8_t qs[16], int i) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const int nibble = i < 16 ? qs[i] & 0x0F : qs[i - 16] >> 4;
  return nibble | (int)((bits >> i) & 1) << 4;
}

void dequantize_q5_0(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockQ5_0*>(block);
  const float d = fp16_to_f32(w->d);
  for (int i = 0; i < kQK; ++i) out[i] = d * (float)(q5(w->qh, w->qs, i) - 16);
}

void dequantize_q5_1(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockQ5_1*>(block);
  const float d = fp16_to_f32(w->d), m = fp16_to_f32(w->m);
  for (int i = 0; i < kQK; ++i) out[i] = d * (float)q5(w->qh, w->qs, i) + m;
}

template <typename Block>
void dequantize_k_scale_min(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const Block*>(block);
  const float d = fp16_to_f32(w->d), dmin = fp16_to_f32(w->dmin);
  uint8_t sc[8], mn[8];
  unpack_q4_k_scales(w->scales, sc, mn);
  for (int j = 0; j < 8; ++j) {
    const float scale = d * sc[j], min = dmin * mn[j];
    for (int i = 0; i < kQK; ++i) out[32 * j + i] = scale * (float)k_quant_q(*w, j, i) - min;
  }
}

void dequantize_q2_k(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockQ2_K*>(block);
  const float d = fp16_to_f32(w->d), dmin = fp16_to_f32(w->dmin);
  for (int e = 0; e < kQK_K; ++e) {
    const int g = e / 16;
    out[e] = d * (float)(w->scales[g] & 0x0F) * (float)low_two_bits(w->qs, e) - dmin * (float)(w->scales[g] >> 4);
  }
}

void dequantize_q3_k(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockQ3_K*>(block);
  const float d = fp16_to_f32(w->d);
  int8_t sc[16];
  unpack_q3_k_scales(w->scales, sc);
  for (int e = 0; e < kQK_K; ++e) out[e] = d * (float)sc[e / 16] * (float)(q3_k_q_plus_4(*w, e) - 4);
}

// Element 128h + 32s + l as in dot_q6_k.
void dequantize_q6_k(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockQ6_K*>(block);
  const float d = fp16_to_f32(w->d);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 4; ++s) {
      for (int l = 0; l < kQK; ++l) {
        const int e = 128 * h + 32 * s + l;
        const int low = (w->ql[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 0x0F;
        const int q = low | (((w->qh[32 * h + l] >> (2 * s)) & 3) << 4);
        out[e] = d * (float)w->scales[e / 16] * (float)(q - 32);
      }
    }
  }
}

void dequantize_iq4_nl(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockIQ4_NL*>(block);
  const float d = fp16_to_f32(w->d);
  for (int i = 0; i < kQK; ++i) out[i] = d * (float)iq4_value(w->qs, i);
}

void dequantize_iq4_xs(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockIQ4_XS*>(block);
  const float d = fp16_to_f32(w->d);
  for (int j = 0; j < 8; ++j) {
    const float scale = d * (float)iq4_xs_scale(*w, j);
    for (int i = 0; i < kQK; ++i) out[kQK * j + i] = scale * (float)iq4_value(w->qs + 16 * j, i);
  }
}

void dequantize_f16(const uint8_t* value, float* out) {
  uint16_t h;
  std::memcpy(&h, value, 2);
  *out = fp16_to_f32(h);
}

void dequantize_f32(const uint8_t* value, float* out) { std::memcpy(out, value, 4); }

template <int kBlock, size_t kBytes, void (*dequantize)(const uint8_t*, float*)>
void axpy(const uint8_t* const* w_rows, const float* h, int n_rows, float* y, int n) {
  float w[kBlock];
  for (int r = 0; r < n_rows; ++r) {
    for (int b = 0; b < n / kBlock; ++b) {
      dequantize(w_rows[r] + b * kBytes, w);
      for (int i = 0; i < kBlock; ++i) y[kBlock * b + i] += h[r] * w[i];
    }
  }
}

template <bool kHasMin>
void neuron_block_q4(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y) {
  const uint8_t* rows[kQK];
  int8_t coef[kQK];
  const int n = nonzero_neurons(x, block, layout, 1, rows, coef);
  if (n == 0) return;  // x.dsum is 0 too
  for (int t = 0; t < d / 64; ++t) {
    int32_t sum[64] = {};
    for (int i = 0; i < n; ++i) {
      const uint8_t* q = rows[i] + layout.tile_offset(t);
      for (int j = 0; j < 32; ++j) {
        sum[j] += (q[j] & 0x0F) * coef[i];
        sum[32 + j] += (q[j] >> 4) * coef[i];
      }
    }
    const uint16_t* scale = layout.scales(block, t);
    const uint16_t* min = scale + 64 * layout.span_tiles;
    for (int j = 0; j < 64; ++j) {
      const float s = fp16_to_f32(scale[j]);
      y[64 * t + j] += kHasMin ? s * x.d * sum[j] + fp16_to_f32(min[j]) * x.dsum : s * (x.d * sum[j] - 8 * x.dsum);
    }
  }
}

void neuron_block_q8_0(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y) {
  const uint8_t* rows[kQK];
  int8_t coef[kQK];
  const int n = nonzero_neurons(x, block, layout, 1, rows, coef);
  if (n == 0) return;
  for (int t = 0; t < d / 64; ++t) {
    const uint16_t* scale = layout.scales(block, t);
    for (int j = 0; j < 64; ++j) {
      int32_t sum = 0;
      for (int i = 0; i < n; ++i) sum += (rows[i][layout.tile_offset(t) + j] - 128) * coef[i];
      y[64 * t + j] += fp16_to_f32(scale[j]) * x.d * sum;
    }
  }
}

// Repacked groups (qmatmul.h): the q of element e of row r in block `blk` (after the scales), unsigned as stored.
int x8_nibble(const uint8_t* q, int r, int e) {
  const uint8_t byte = q[32 * (e % 16 / 4) + 4 * r + e % 4];
  return e < 16 ? byte & 0x0F : byte >> 4;
}

// Per row and token, the portable row kernels' steps: Q4_0 (d x.d) (q·x - 8 S); Q8_0, IQ4_NL (d x.d) (v·x), here
// (v + 128)·x - 128 S; Q4_1 x.d (d q·x + m S).
enum class X8Format { kQ4_0, kQ4_1, kQ8_0, kIQ4_NL };

template <X8Format F, int N>
void x8_dots(const uint8_t* group, const BlockQ8* x, int64_t stride, int n, float* out) {
  constexpr bool kHasMin = F == X8Format::kQ4_1;
  constexpr int kScaleBytes = kHasMin ? 32 : 16, kBlockBytes = F == X8Format::kQ8_0 ? 272 : kScaleBytes + 128;
  constexpr int kOffset = F == X8Format::kQ4_0 ? -8 : F == X8Format::kQ4_1 ? 0 : -128;
  for (int i = 0; i < N; ++i) {
    for (int r = 0; r < kInterleave; ++r) {
      float total = 0.0f;
      for (int b = 0; b < n / kQK; ++b) {
        const uint8_t* blk = group + b * kBlockBytes;
        const uint8_t* q = blk + kScaleBytes;
        const BlockQ8& xb = x[i * stride + b];
        const int sum = xb.sum[0] + xb.sum[1];
        int dot = kOffset * sum;
        for (int e = 0; e < kQK; ++e) {
          int v;
          if constexpr (F == X8Format::kQ8_0) {
            v = q[32 * (e / 4) + 4 * r + e % 4];
          } else if constexpr (F == X8Format::kIQ4_NL) {
            v = kIq4Values[x8_nibble(q, r, e)] + 128;
          } else {
            v = x8_nibble(q, r, e);
          }
          dot += v * xb.qs[e];
        }
        uint16_t d, m;
        std::memcpy(&d, blk + 2 * r, 2);
        if constexpr (kHasMin) {
          std::memcpy(&m, blk + 16 + 2 * r, 2);
          total += xb.d * (fp16_to_f32(d) * (float)dot + fp16_to_f32(m) * (float)sum);
        } else {
          total += fp16_to_f32(d) * xb.d * (float)dot;
        }
      }
      out[kInterleave * i + r] = total;
    }
  }
}

}  // namespace

const Kernels& scalar_kernels() {
  static const Kernels k = {"scalar",
                            dot_signed<BlockQ8_0>,
                            dot_offset<BlockQ4_0, 8>,
                            dot_min<BlockQ4_1>,
                            dot_offset<BlockQ5_0, 16>,
                            dot_min<BlockQ5_1>,
                            dot_signed<BlockIQ4_NL>,
                            dot_q2_k,
                            dot_q3_k,
                            dot_k_scale_min<BlockQ4_K>,
                            dot_k_scale_min<BlockQ5_K>,
                            dot_q6_k,
                            dot_iq4_xs,
                            dot_f16,
                            dot_f32,
                            quantize_row,
                            quantize_row_k,
                            axpy<kQK, sizeof(BlockQ8_0), dequantize_q8_0>,
                            axpy<kQK, sizeof(BlockQ4_0), dequantize_q4_0>,
                            axpy<kQK, sizeof(BlockQ4_1), dequantize_q4_1>,
                            axpy<kQK, sizeof(BlockQ5_0), dequantize_q5_0>,
                            axpy<kQK, sizeof(BlockQ5_1), dequantize_q5_1>,
                            axpy<kQK_K, sizeof(BlockQ2_K), dequantize_q2_k>,
                            axpy<kQK_K, sizeof(BlockQ3_K), dequantize_q3_k>,
                            axpy<kQK_K, sizeof(BlockQ4_K), dequantize_k_scale_min<BlockQ4_K>>,
                            axpy<kQK_K, sizeof(BlockQ5_K), dequantize_k_scale_min<BlockQ5_K>>,
                            axpy<kQK_K, sizeof(BlockQ6_K), dequantize_q6_k>,
                            axpy<kQK, sizeof(BlockIQ4_NL), dequantize_iq4_nl>,
                            axpy<kQK_K, sizeof(BlockIQ4_XS), dequantize_iq4_xs>,
                            axpy<1, sizeof(uint16_t), dequantize_f16>,
                            axpy<1, sizeof(float), dequantize_f32>,
                            neuron_block_q4<false>,
                            neuron_block_q4<true>,
                            neuron_block_q8_0,
                            x8_dots<X8Format::kQ8_0, 1>,
                            x8_dots<X8Format::kQ4_0, 1>,
                            x8_dots<X8Format::kQ4_1, 1>,
                            x8_dots<X8Format::kIQ4_NL, 1>,
                            x8_dots<X8Format::kQ8_0, 4>,
                            x8_dots<X8Format::kQ4_0, 4>,
                            x8_dots<X8Format::kQ4_1, 4>,
                            x8_dots<X8Format::kIQ4_NL, 4>,
                            x8k_dots_portable<X8KFormat::kQ4_K, 1>,
                            x8k_dots_portable<X8KFormat::kQ5_K, 1>,
                            x8k_dots_portable<X8KFormat::kQ6_K, 1>,
                            x8k_dots_portable<X8KFormat::kIQ4_XS, 1>,
                            x8k_dots_portable<X8KFormat::kQ4_K, 4>,
                            x8k_dots_portable<X8KFormat::kQ5_K, 4>,
                            x8k_dots_portable<X8KFormat::kQ6_K, 4>,
                            x8k_dots_portable<X8KFormat::kIQ4_XS, 4>};
  return k;
}

}  // namespace jaxinfer_cpu

// Portable ternary kernels (see ternary.h), the choice of ternary kernels per instruction set, and the activation
// rounding of I2_S.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "ternary.h"

namespace jaxinfer_cpu {
namespace {

int block_sum(const BlockQ8K& x) {
  int sum = 0;
  for (int g = 0; g < 16; ++g) sum += x.bsums[g];
  return sum;
}

int tq2_0_code(const BlockTQ2_0& w, int e) { return (w.qs[32 * (e / 128) + e % 32] >> (2 * (e / 32 % 4))) & 3; }

int trit(uint8_t byte, int k) {
  static constexpr uint8_t kPow3[5] = {1, 3, 9, 27, 81};
  return ((uint8_t)(byte * kPow3[k]) * 3) >> 8;
}

int tq1_0_code(const BlockTQ1_0& w, int e) {
  if (e < 160) return trit(w.qs[e % 32], e / 32);
  if (e < 240) return trit(w.qs[32 + (e - 160) % 16], (e - 160) / 16);
  return trit(w.qh[(e - 240) % 4], (e - 240) / 4);
}

// The SIMD kernels' 8 lanes (kernels_ternary_x86.inc), so that every kernel set gives the same bits: per super-block,
// lane l holds the integer sum of code * x over the elements e with e % 32 / 4 == l (the lane vpdpbusd and
// maddubs + madd put them in), less bsums[2l] + bsums[2l + 1]; one FMA per super-block scales it into a float lane,
// and a row's result adds the lanes in hsum's order.
struct Lanes {
  float v[8] = {};
  void add(float scale, const int32_t lanes[8]) {
    for (int l = 0; l < 8; ++l) v[l] = std::fma(scale, (float)lanes[l], v[l]);
  }
  float sum() const { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }
};

template <typename Block, int (*Code)(const Block&, int)>
float dot_tq(const uint8_t* w_row, const BlockQ8K* x, int n) {
  const auto* w = reinterpret_cast<const Block*>(w_row);
  Lanes total;
  for (int b = 0; b < n / kQK_K; ++b) {
    int32_t lanes[8];
    for (int l = 0; l < 8; ++l) lanes[l] = -(x[b].bsums[2 * l] + x[b].bsums[2 * l + 1]);  // the -1 of q - 1
    for (int e = 0; e < kQK_K; ++e) lanes[e % 32 / 4] += Code(w[b], e) * x[b].qs[e];
    total.add(x[b].d * fp16_to_f32(w[b].d), lanes);
  }
  return total.sum();
}

int i2_s_code(const uint8_t* group, int j) { return (group[j % 32] >> (6 - 2 * (j / 32))) & 3; }

// Value i of a 256-value block of ternary weights, as f32 (I2_S: without the tensor's scale, as jaxinfer.ternary).
void dequantize_tq1_0(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockTQ1_0*>(block);
  const float d = fp16_to_f32(w->d);
  for (int e = 0; e < kQK_K; ++e) out[e] = d * (float)(tq1_0_code(*w, e) - 1);
}

void dequantize_tq2_0(const uint8_t* block, float* out) {
  const auto* w = reinterpret_cast<const BlockTQ2_0*>(block);
  const float d = fp16_to_f32(w->d);
  for (int e = 0; e < kQK_K; ++e) out[e] = d * (float)(tq2_0_code(*w, e) - 1);
}

template <size_t kBytes, void (*Dequantize)(const uint8_t*, float*)>
void axpy(const uint8_t* const* w_rows, const float* h, int n_rows, float* y, int n) {
  float w[kQK_K];
  for (int r = 0; r < n_rows; ++r) {
    for (int b = 0; b < n / kQK_K; ++b) {
      Dequantize(w_rows[r] + b * kBytes, w);
      for (int i = 0; i < kQK_K; ++i) y[kQK_K * b + i] += h[r] * w[i];
    }
  }
}

// The I2_S rows' axpy as the SIMD kernels compute it (kernels_ternary_x86.inc): integer sums of the int8 coefficients
// times the codes, then one float multiply and add per output.
void axpy_i2_s_panel(const uint8_t* const* w_rows, const float* h, int n_rows, float* y, int n) {
  int8_t q[kMaxAxpyRows];
  const float d = quantize_coefs(h, n_rows, q);
  int q_sum = 0;
  for (int r = 0; r < n_rows; ++r) q_sum += q[r];
  for (int o = 0; o < n; ++o) {
    int sum = 0;
    for (int r = 0; r < n_rows; ++r) sum += q[r] * i2_s_code(w_rows[r] + kI2sGroupBytes * (o / 128), o % 128);
    y[o] += d * (float)(sum - q_sum);
  }
}

void axpy_i2_s(const uint8_t* const* w_rows, const float* h, int n_rows, float* y, int n) {
  for (int r = 0; r < n_rows; r += kMaxAxpyRows) {
    axpy_i2_s_panel(w_rows + r, h + r, std::min(kMaxAxpyRows, n_rows - r), y, n);
  }
}

#if JAXINFER_CPU_X86
template <void (*Dots)(const uint8_t*, const BlockQ8K*, int64_t, int, float*)>
float one_token(const uint8_t* w_row, const BlockQ8K* x, int n) {
  float out;
  Dots(w_row, x, 0, n, &out);
  return out;
}
#endif

}  // namespace

float dot_tq1_0_scalar(const uint8_t* w_row, const BlockQ8K* x, int n) {
  return dot_tq<BlockTQ1_0, tq1_0_code>(w_row, x, n);
}

float dot_tq2_0_scalar(const uint8_t* w_row, const BlockQ8K* x, int n) {
  return dot_tq<BlockTQ2_0, tq2_0_code>(w_row, x, n);
}

// The row's integer dot, times the activations' one scale.
float dot_i2_s_scalar(const uint8_t* w_row, const BlockQ8K* x, int n) {
  int dot = 0;
  for (int b = 0; b < n / kQK_K; ++b) {
    const uint8_t* block = w_row + 2 * kI2sGroupBytes * b;
    for (int e = 0; e < kQK_K; ++e) dot += i2_s_code(block + kI2sGroupBytes * (e / 128), e % 128) * x[b].qs[e];
    dot -= block_sum(x[b]);
  }
  return x[0].d * (float)dot;
}

// jaxinfer.ternary.absmax_int8's rounding in f32, the same operations: s = 127 / max(max|x|, 1e-5),
// q = clip(round-half-even(x s), -128, 127); d = 1 / s in every block.
void quantize_row_absmax(const float* x, BlockQ8K* out, int n) {
  float amax = 0.0f;
  for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = 127.0f / std::max(amax, 1e-5f), d = 1.0f / scale;
  for (int b = 0; b < n / kQK_K; ++b, x += kQK_K) {
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        out[b].qs[i] = (int8_t)std::min(std::max(std::lrintf(x[i] * scale), -128L), 127L);
        sum += out[b].qs[i];
      }
      out[b].bsums[g] = (int16_t)sum;
    }
    out[b].d = d;
  }
}

Kernels with_ternary_kernels(Kernels k, const char* isa) {
  k.tq1_0 = dot_tq1_0_scalar;
  k.tq2_0 = dot_tq2_0_scalar;
  k.i2_s = dot_i2_s_scalar;
  k.tq1_0_x4 = k.tq2_0_x4 = k.i2_s_x4 = nullptr;  // single dots
  k.tq1_0_2x4 = k.tq2_0_2x4 = k.i2_s_2x4 = nullptr;
  k.axpy_tq1_0 = axpy<sizeof(BlockTQ1_0), dequantize_tq1_0>;
  k.axpy_tq2_0 = axpy<sizeof(BlockTQ2_0), dequantize_tq2_0>;
  k.axpy_i2_s = axpy_i2_s;
  k.quantize_row_absmax = quantize_row_absmax;
#if JAXINFER_CPU_X86
  if (std::strcmp(isa, "avx2") == 0) {
    k.tq1_0 = one_token<avx2::dots_tq1_0>;
    k.tq2_0 = one_token<avx2::dots_tq2_0>;
    k.i2_s = one_token<avx2::dots_i2_s>;
    k.tq1_0_x4 = avx2::dots_tq1_0_x4;
    k.tq2_0_x4 = avx2::dots_tq2_0_x4;
    k.i2_s_x4 = avx2::dots_i2_s_x4;
    k.tq1_0_2x4 = avx2::dots_tq1_0_2x4;
    k.tq2_0_2x4 = avx2::dots_tq2_0_2x4;
    k.i2_s_2x4 = avx2::dots_i2_s_2x4;
    k.axpy_i2_s = avx2::axpy_i2_s;
  } else if (std::strcmp(isa, "avx512") == 0) {
    k.tq1_0 = one_token<avx512::dots_tq1_0>;
    k.tq2_0 = one_token<avx512::dots_tq2_0>;
    k.i2_s = one_token<avx512::dots_i2_s>;
    k.tq1_0_x4 = avx512::dots_tq1_0_x4;
    k.tq2_0_x4 = avx512::dots_tq2_0_x4;
    k.i2_s_x4 = avx512::dots_i2_s_x4;
    k.tq1_0_2x4 = avx512::dots_tq1_0_2x4;
    k.tq2_0_2x4 = avx512::dots_tq2_0_2x4;
    k.i2_s_2x4 = avx512::dots_i2_s_2x4;
    k.axpy_i2_s = avx512::axpy_i2_s;
  }
#endif
  return k;
}

}  // namespace jaxinfer_cpu

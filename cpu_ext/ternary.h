// Ternary weights (values in {-1, 0, +1} times a scale; jaxinfer/ternary.py) against 8-bit activations: llama.cpp's
// TQ1_0 and TQ2_0, and Microsoft BitNet's I2_S. The kernels fill the Kernels fields that follow the other types'
// (qmatmul.h), set by with_ternary_kernels for each instruction set.
//
// Activations: TQ1_0 and TQ2_0 take llama.cpp's vec_dot_type, Q8_K (BlockQ8K, one f32 scale per 256 values, from
// quantize_row_k). I2_S takes BitNet's own activation rounding, one scale for the whole row of a token
// (jaxinfer.ternary.absmax_int8: q = round(x * 127 / max|x|), max|x| floored at 1e-5), stored as BlockQ8K blocks that
// all carry the same d = max|x| / 127 (quantize_row_absmax): the K-quant row-dot plumbing takes them unchanged.
//
// Every kernel sums each 256-value super-block in integers; floats enter once per super-block (TQ1_0, TQ2_0: the
// weight's f16 scale times the activations') or once per row (I2_S: its only scale is the tensor's, applied by the
// caller, and the activations' d is the same in every block), in the same order in every kernel set, so SIMD and
// portable kernels give the same bits. A code q in 0..2 means q - 1: the dots take q unsigned (vpdpbusd's, maddubs'
// unsigned operand) and subtract the activations' block sum (BlockQ8K::bsums) once, llama.cpp's trick.
#pragma once

#include <cmath>

#include "qmatmul.h"

namespace jaxinfer_cpu {

// TQ2_0, 66 bytes per 256 values: | qs[64] | d:f16 |; bits 2s..2s+1 of qs[32c + l] are q of element 128c + 32s + l
//
//   qs[32c + l] = | e+96 | e+64 | e+32 | e |      e = 128c + l, two bits each, element e lowest
struct BlockTQ2_0 { uint8_t qs[64]; uint16_t d; };
// TQ1_0, 54 bytes per 256 values: | qs[48] | qh[4] | d:f16 |. Each byte holds trits as a base-3 fraction of 256:
// trit k of byte b is (uint8(b * 3^k) * 3) >> 8, i.e. 0, 1 or 2 as uint8(b * 3^k) is below 86, below 171 or not.
//   qs[l] (l < 32), trit k < 5      -> element 32k + l
//   qs[32 + l] (l < 16), trit k < 5 -> element 160 + 16k + l
//   qh[l] (l < 4), trit k < 4       -> element 240 + 4k + l
struct BlockTQ1_0 { uint8_t qs[48]; uint8_t qh[4]; uint16_t d; };
static_assert(sizeof(BlockTQ2_0) == 66 && sizeof(BlockTQ1_0) == 54, "GGUF layout");
// I2_S (x86), 32 bytes per 128 values (a group), no per-group scale; here two groups make one 256-value block:
//   byte k of a group = | e=k | e=k+32 | e=k+64 | e=k+96 |   bits 7-6, 5-4, 3-2, 1-0: code q, value q - 1
constexpr int kI2sGroupBytes = 32;

// The sparse down projection of a ternary FFN: its rows, one per neuron, are I2_S (jaxinfer.quant.transpose_ternary,
// exact), and an axpy call adds a panel of at most kMaxAxpyRows of them. Their coefficients h (f32) are rounded to
// int8 with the panel's absmax (d = max |h| / 127: finer than BitNet's one scale per token) so that the codes meet
// them in vpdpbusd, four rows at a time: y[o] += d (sum_r q_r code_r[o] - sum_r q_r). Returns d; q gets n entries.
inline float quantize_coefs(const float* h, int n, int8_t* q) {
  float amax = 0.0f;
  for (int r = 0; r < n; ++r) amax = std::fmax(amax, std::fabs(h[r]));
  const float d = amax / 127.0f, inv = d != 0.0f ? 1.0f / d : 0.0f;
  for (int r = 0; r < n; ++r) q[r] = static_cast<int8_t>(std::lrintf(h[r] * inv));
  return d;
}
constexpr int kMaxAxpyRows = 64;  // more than sparse_handlers.cc's panels (kRowsPerTask)

// The ternary fields of k (its other fields unchanged) for the named instruction set: "avx512", "avx2" or "scalar".
Kernels with_ternary_kernels(Kernels k, const char* isa);

// The portable kernels, which define what the SIMD ones compute.
float dot_tq1_0_scalar(const uint8_t* w_row, const BlockQ8K* x, int n);
float dot_tq2_0_scalar(const uint8_t* w_row, const BlockQ8K* x, int n);
float dot_i2_s_scalar(const uint8_t* w_row, const BlockQ8K* x, int n);
void quantize_row_absmax(const float* x, BlockQ8K* out, int n);

#if JAXINFER_CPU_X86
namespace avx2 {
void dots_tq1_0(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_tq1_0_x4(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_tq1_0_2x4(const uint8_t* w_row, int64_t w_stride, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_tq2_0(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_tq2_0_x4(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_tq2_0_2x4(const uint8_t* w_row, int64_t w_stride, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_i2_s(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_i2_s_x4(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_i2_s_2x4(const uint8_t* w_row, int64_t w_stride, const BlockQ8K* x, int64_t stride, int n, float* out);
void axpy_i2_s(const uint8_t* const* w_rows, const float* h, int n_rows, float* y, int n);
}  // namespace avx2
namespace avx512 {
void dots_tq1_0(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_tq1_0_x4(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_tq1_0_2x4(const uint8_t* w_row, int64_t w_stride, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_tq2_0(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_tq2_0_x4(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_tq2_0_2x4(const uint8_t* w_row, int64_t w_stride, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_i2_s(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_i2_s_x4(const uint8_t* w_row, const BlockQ8K* x, int64_t stride, int n, float* out);
void dots_i2_s_2x4(const uint8_t* w_row, int64_t w_stride, const BlockQ8K* x, int64_t stride, int n, float* out);
void axpy_i2_s(const uint8_t* const* w_rows, const float* h, int n_rows, float* y, int n);
}  // namespace avx512
#endif

}  // namespace jaxinfer_cpu

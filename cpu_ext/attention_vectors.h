// The f32 vectors both attention kernels are written in (attention.cc: a few queries, attention_prefill.cc: many):
// GCC vector extensions, one source compiled for AVX-512, AVX2 and baseline x86-64 (target_clones picks one per CPU
// at load time).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace jaxinfer_cpu {
namespace attention_vectors {

#if JAXINFER_CPU_X86
#define JAXINFER_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define JAXINFER_VECTOR_CLONES
#endif

constexpr int kLanes = 16;
// The vector helpers below are always inlined into each clone, so the ABI of passing 64-byte vectors, which GCC notes
// differs between the clones' targets, never applies (CMakeLists.txt builds the attention files with -Wno-psabi).
typedef float F32x16 __attribute__((vector_size(64)));
typedef int32_t I32x16 __attribute__((vector_size(64)));

__attribute__((always_inline)) inline F32x16 load(const float* p) {
  F32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
__attribute__((always_inline)) inline void store(float* p, F32x16 v) { std::memcpy(p, &v, sizeof v); }
__attribute__((always_inline)) inline F32x16 splat(float x) { return F32x16{} + x; }

// A tree, so the halves add in vector registers.
__attribute__((always_inline)) inline float sum_lanes(const F32x16& v) {
  typedef float F32x8 __attribute__((vector_size(32)));
  typedef float F32x4 __attribute__((vector_size(16)));
  const F32x8 v8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const F32x4 v4 = __builtin_shufflevector(v8, v8, 0, 1, 2, 3) + __builtin_shufflevector(v8, v8, 4, 5, 6, 7);
  return (v4[0] + v4[2]) + (v4[1] + v4[3]);
}

// exp(x) for x <= 0 (scores minus their maximum), to about 2e-7 relative: x = (n + r) ln 2 with n an integer and
// |r| <= 1/2, 2^n built in the exponent bits, e^(r ln 2) a degree-6 Taylor polynomial. Below -87 the result is
// ~1e-38 instead of 0 (harmless as a softmax weight).
__attribute__((always_inline)) inline F32x16 exp_nonpositive(const F32x16& x) {
  const F32x16 t = (x < -87.0f ? splat(-87.0f) : x) * 1.44269504f;
  const I32x16 n = __builtin_convertvector(t - 0.5f, I32x16);  // truncation toward zero: round(t) for t <= 0
  const F32x16 y = (t - __builtin_convertvector(n, F32x16)) * 0.69314718f;
  F32x16 p = splat(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = p * y + c;
  const I32x16 bits = (n + 127) << 23;
  F32x16 two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

// cap * tanh(x / cap), llama.cpp's logit soft-capping (Gemma 2's attention scores), as tanh(|y|) = (1 - e) / (1 + e)
// with e = exp(-2|y|) <= 1: about 1e-7 of the cap from the exact value.
__attribute__((always_inline)) inline F32x16 soft_cap(const F32x16& x, float cap) {
  const F32x16 y = x * (1.0f / cap);
  const F32x16 e = exp_nonpositive(-2.0f * (y < 0 ? -y : y));
  const F32x16 t = (1.0f - e) / (1.0f + e);
  return (y < 0 ? -t : t) * cap;
}

}  // namespace attention_vectors

// n f16 values -> f32 (an f16 cache's keys or values).
void widen_f16(const uint16_t* src, int64_t n, float* dst);

}  // namespace jaxinfer_cpu

// The sparse down projection in integers: y = sum over a token's active neurons i of h_i W_t[i], from a transposed
// Q4_0 or Q8_0 weight W_t [n_ff, d] (one row per neuron, as PowerInfer files store ffn_down_t) laid out as "down
// rows" (jaxinfer.quant.pack_down_rows, made once at load: the same bytes, rearranged): each row's block scales
// first, then its quants,
//
//   row = | d: f16[nb] | qs of block 0 | qs of block 1 | ... | qs of block nb - 1 |          nb = cols / 32
//     Q4_0: 16 bytes a block as stored (byte i: element i low nibble, element i + 16 high)    x = d (q - 8)
//     Q8_0: 32 bytes a block, q + 128 (unsigned, as vpdpbusd takes it)                        x = d (q - 128)
//
// so that one pass over a row's scales gives all its coefficients, and its quants are read front to back.
//
// A token's active neurons (those with a nonzero h) are taken in groups of kDownGroup, in order. Within a group, the
// coefficient of neuron i on block b, g_ib = h_i d_ib, is rounded to 8 bits with one scale per block over the group
// (s_b = max_i |g_ib| / 127, g8_ib = round(g_ib 127 / max_i |g_ib|), as llama.cpp rounds activations per 32
// values), so that a block's 32 outputs are integer sums over the group's neurons, taken four neurons at a time by
// one vpdpbusd per 16 outputs, and floats enter once per group and block:
//
//   y[32 b + j] += s_b (sum_i g8_ib q_ij - o sum_i g8_ib)          o = 8 (Q4_0), 128 (Q8_0)
//
// The f32 axpy (masked_axpy) spends a widening, a convert and a multiply-add on every weight of every active row,
// which makes it compute-bound at 4096-wide rows; this spends about a third of the instructions a weight.
//
// Every ISA gives the portable kernel's bits: g and its rounding are the same f32 operations in the same order (f16
// to f32 is exact, products and the division IEEE-rounded, rounding to the nearest even integer), the integer sums
// are exact, and y += s_b * isum is a multiply then an add, no fused multiply-add (-ffp-contract=off).
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#include "qmatmul.h"

namespace jaxinfer_cpu {

template <typename T>
struct AlignedAllocator {  // 64-byte aligned vectors of T
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  bool operator==(const AlignedAllocator&) const { return true; }
  bool operator!=(const AlignedAllocator&) const { return false; }
};

constexpr int kDownGroup = 32;  // neurons whose coefficients share a scale per block

enum class DownType { kQ4_0, kQ8_0 };

constexpr int down_qs_bytes(DownType t) { return t == DownType::kQ4_0 ? 16 : 32; }  // a block's quants
constexpr int down_offset(DownType t) { return t == DownType::kQ4_0 ? 8 : 128; }

// One group of active neurons: their rows (pointing at the scales) and coefficients; n a multiple of 4 (padding:
// the first row again, with coefficient 0).
struct DownGroup {
  const uint8_t* rows[kDownGroup];
  float h[kDownGroup];
  int n;
};

// A thread's space for a group's rounded coefficients: word[k nb + b] holds g8 of neurons 4k .. 4k + 3 on block b
// (byte r for neuron 4k + r, as vpdpbusd broadcasts it), sum[b] = sum_i g8_ib, scale[b] = s_b.
// acc: the SIMD kernel's integer sums of a block's 32 outputs, 64-byte aligned.
struct DownCoefficients {
  std::vector<int32_t> word, sum;
  std::vector<float> scale;
  std::vector<int32_t, AlignedAllocator<int32_t>> acc;

  void resize(int nb) {
    word.resize(static_cast<size_t>(kDownGroup / 4) * nb);
    sum.resize(nb);
    scale.resize(nb);
    acc.resize(static_cast<size_t>(kQK) * nb);
  }
};

// y[0, cols) += the group's sum (see above).
using DownGroupKernel = void (*)(const DownGroup& g, int cols, DownCoefficients& c, float* y);

template <DownType T>
void down_group_portable(const DownGroup& g, int cols, DownCoefficients& c, float* y);
// AVX-512 VNNI with VBMI's byte permutes (down_rows_avx512.cc); x86-64 builds only.
template <DownType T>
void down_group_avx512(const DownGroup& g, int cols, DownCoefficients& c, float* y);

}  // namespace jaxinfer_cpu

// The neuron-major Q4_0/Q4_1/Q8_0 down projection (NeuronBlockAxpy in qmatmul.h) on AVX-512 VBMI + VNNI. Its own
// file: the target pragma lets the compiler use VBMI anywhere below, and dispatch.cc only calls this on CPUs that
// have it.
#include <immintrin.h>

#include <cstring>

#include "qmatmul.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // as in kernels_avx512.cc (GCC bug 105593)

namespace jaxinfer_cpu {
namespace {

// Permute indices: dword j of the result = (a, b, c, d)[first + j] from a = [row 0 | row 1] and b = [row 2 | row 3]
// (32 bytes each; index bit 6 picks b), so that lane j sums four neurons' products for output first + j.
__m512i interleave_four(int first) {
  alignas(64) uint8_t index[64];
  for (int j = 0; j < 16; ++j) {
    for (int r = 0; r < 4; ++r) index[4 * j + r] = static_cast<uint8_t>(32 * r + first + j);
  }
  return _mm512_load_si512(index);
}

// Pairs (a[first + j], b[first + j]) of bytes (T = uint8_t, j < 32) or of 16-bit words (uint16_t, j < 16), from two
// vectors a and b (the index bit just above the element number picks b).
template <typename T>
__m512i interleave_pairs(int first) {
  constexpr int kCount = 64 / sizeof(T);
  alignas(64) T index[kCount];
  for (int j = 0; j < kCount / 2; ++j) {
    index[2 * j] = static_cast<T>(first + j);
    index[2 * j + 1] = static_cast<T>(kCount + first + j);
  }
  return _mm512_load_si512(index);
}

// The loop both formats share. Per tile t of 64 outputs, for each group of four neurons (rows[g..g+3], coefficients
// coef[g..g+3] as one int32), interleave(r, at, p) leaves in p[i] the four neurons' weights for outputs 16 i ..
// 16 i + 15 of the tile (their q at r[k] + at), four bytes per output (n0 n1 n2 n3), and one vpdpbusd per 16
// outputs adds their products with the four activations (u8 weight x s8 activation) into int32 lanes; add_tile(t,
// scales, sum) then scales the tile's sums into y. The scales and active neurons' q of the tile two ahead are asked
// for as each tile starts (the handler does the first two of the next block).
template <typename Interleave, typename AddTile>
inline void neuron_tiles(const NeuronLayout& layout, const uint8_t* block, const uint8_t* const* rows,
                         const int8_t* coef, int n, int d, const Interleave& interleave, const AddTile& add_tile) {
  const int n_tiles = d / 64;
  for (int t = 0; t < n_tiles; ++t) {
    if (t + 2 < n_tiles) layout.prefetch_tile(block, t + 2, rows, n);
    const int64_t at = layout.tile_offset(t);
    __m512i sum[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int g = 0; g < n; g += 4) {
      const uint8_t* const* r = rows + g;
      __m512i p[4];
      interleave(r, at, p);
      int32_t c4;
      std::memcpy(&c4, coef + g, 4);
      const __m512i c = _mm512_set1_epi32(c4);
      for (int i = 0; i < 4; ++i) sum[i] = _mm512_dpbusd_epi32(sum[i], p[i], c);
    }
    add_tile(t, layout.scales(block, t), sum);
  }
}

inline __m512 load_f16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// y[0, 16) += d[0, 16) * (d_factor sum + offset)
inline void add_scaled(float* y, const uint16_t* d, __m512i sum, __m512 d_factor, __m512 offset) {
  const __m512 v = _mm512_mul_ps(load_f16x16(d), _mm512_fmadd_ps(d_factor, _mm512_cvtepi32_ps(sum), offset));
  _mm512_storeu_ps(y, _mm512_add_ps(_mm512_loadu_ps(y), v));
}

template <bool kHasMin>
void neuron_block_q4(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y) {
  const uint8_t* rows[kQK + 3];
  alignas(4) int8_t coef[kQK + 3];
  const int n = nonzero_neurons(x, block, layout, 4, rows, coef);
  if (n == 0) return;  // x.dsum is 0 too
  const __m512i first0 = interleave_four(0), first16 = interleave_four(16), nibble = _mm512_set1_epi8(0x0F);
  const __m512 xd = _mm512_set1_ps(x.d), xdsum = _mm512_set1_ps(x.dsum);
  const __m512 q4_0_offset = _mm512_set1_ps(-8.0f * x.dsum);  // d (x.d sum - 8 x.dsum)
  const auto interleave = [=](const uint8_t* const* r, int64_t at, __m512i p[4]) {
    const auto load2 = [at](const uint8_t* a, const uint8_t* b) {
      return _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + at))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + at)), 1);
    };
    const __m512i rows01 = load2(r[0], r[1]), rows23 = load2(r[2], r[3]);
    const __m512i lo01 = _mm512_and_si512(rows01, nibble), lo23 = _mm512_and_si512(rows23, nibble);
    const __m512i hi01 = _mm512_and_si512(_mm512_srli_epi16(rows01, 4), nibble);
    const __m512i hi23 = _mm512_and_si512(_mm512_srli_epi16(rows23, 4), nibble);
    p[0] = _mm512_permutex2var_epi8(lo01, first0, lo23);
    p[1] = _mm512_permutex2var_epi8(lo01, first16, lo23);
    p[2] = _mm512_permutex2var_epi8(hi01, first0, hi23);
    p[3] = _mm512_permutex2var_epi8(hi01, first16, hi23);
  };
  neuron_tiles(layout, block, rows, coef, n, d, interleave, [=](int t, const uint16_t* scale, const __m512i sum[4]) {
    for (int i = 0; i < 4; ++i) {
      float* y_i = y + 64 * t + 16 * i;
      if (kHasMin) {  // d x.d sum + m x.dsum
        _mm512_storeu_ps(y_i, _mm512_add_ps(_mm512_loadu_ps(y_i), _mm512_fmadd_ps(
            _mm512_mul_ps(load_f16x16(scale + 16 * i), xd), _mm512_cvtepi32_ps(sum[i]),
            _mm512_mul_ps(load_f16x16(scale + 64 * layout.span_tiles + 16 * i), xdsum))));
      } else {
        add_scaled(y_i, scale + 16 * i, sum[i], xd, q4_0_offset);
      }
    }
  });
}

}  // namespace

// Neurons with a nonzero activation are taken four at a time (the last group padded with a zero coefficient).
// Q4_0/Q4_1: for a tile of 64 outputs, each neuron row gives 32 bytes, low nibbles for outputs 0..31, high for
// 32..63. Two rows per 512-bit register, masked to nibbles, and byte-permuted into (n0, n1, n2, n3) per output:
//
//   rows01 = [n0 bytes 0..31 | n1 bytes 0..31]   low nibbles -> lo01, high -> hi01 (same for rows 2, 3)
//   permute(lo01, lo23, first 0)  -> outputs  0..15: | n0 n1 n2 n3 | n0 n1 n2 n3 | ...   (4 bytes per output)
//   permute(lo01, lo23, first 16) -> outputs 16..31;  hi01/hi23 -> outputs 32..47, 48..63
//
// Per 256 weights: 2 loads + 2 inserts, 6 mask/shift, 4 permutes, 4 vpdpbusd, against 2 converts and 2 FMAs per 32
// in the f32 axpy.
void neuron_block_q4_0_vbmi(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y) {
  neuron_block_q4<false>(block, d, layout, x, y);
}

void neuron_block_q4_1_vbmi(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y) {
  neuron_block_q4<true>(block, d, layout, x, y);
}

// Q8_0: a tile of 64 outputs is one 64-byte register per neuron row (weights + 128, unsigned). Bytes of rows 0 and 1
// (and 2 and 3) are paired, then the pairs paired:
//
//   ab_lo = (n0, n1)[j], j < 32      ab_hi: j = 32..63      (cd_lo, cd_hi: rows 2 and 3)
//   words(ab_lo, cd_lo, first 0)  -> outputs 0..15: | n0 n1 n2 n3 | ...      first 16 -> outputs 16..31, ab_hi/cd_hi
//                                                                           -> outputs 32..63
//
// and the +128 comes back out per block as 128 x.d S per output, S the sum of the block's activations.
void neuron_block_q8_0_vbmi(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y) {
  const uint8_t* rows[kQK + 3];
  alignas(4) int8_t coef[kQK + 3];
  const int n = nonzero_neurons(x, block, layout, 4, rows, coef);
  if (n == 0) return;
  const __m512i bytes_lo = interleave_pairs<uint8_t>(0), bytes_hi = interleave_pairs<uint8_t>(32);
  const __m512i words_lo = interleave_pairs<uint16_t>(0), words_hi = interleave_pairs<uint16_t>(16);
  const __m512 xd = _mm512_set1_ps(x.d), offset = _mm512_set1_ps(-128.0f * x.d * (x.sum[0] + x.sum[1]));
  const auto interleave = [=](const uint8_t* const* r, int64_t at, __m512i p[4]) {
    __m512i row[4];
    for (int i = 0; i < 4; ++i) row[i] = _mm512_loadu_si512(r[i] + at);
    const __m512i ab_lo = _mm512_permutex2var_epi8(row[0], bytes_lo, row[1]);
    const __m512i ab_hi = _mm512_permutex2var_epi8(row[0], bytes_hi, row[1]);
    const __m512i cd_lo = _mm512_permutex2var_epi8(row[2], bytes_lo, row[3]);
    const __m512i cd_hi = _mm512_permutex2var_epi8(row[2], bytes_hi, row[3]);
    p[0] = _mm512_permutex2var_epi16(ab_lo, words_lo, cd_lo);
    p[1] = _mm512_permutex2var_epi16(ab_lo, words_hi, cd_lo);
    p[2] = _mm512_permutex2var_epi16(ab_hi, words_lo, cd_hi);
    p[3] = _mm512_permutex2var_epi16(ab_hi, words_hi, cd_hi);
  };
  neuron_tiles(layout, block, rows, coef, n, d, interleave, [=](int t, const uint16_t* scale,
                                                                      const __m512i sum[4]) {
    for (int i = 0; i < 4; ++i) add_scaled(y + 64 * t + 16 * i, scale + 16 * i, sum[i], xd, offset);
  });
}

}  // namespace jaxinfer_cpu

#pragma GCC pop_options

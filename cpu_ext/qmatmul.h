// Quantized matmul y = x · Wᵀ for GGUF weights, the way llama.cpp's CPU backend does it: the f32 activations are
// quantized to 8 bits per 32-element block once per call, and each weight block is dotted with its activation
// block in integers; floats only enter once per block, through the scales.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace jaxinfer_cpu {

constexpr int kQK = 32;    // activation block, and the block of Q4_0/Q4_1/Q8_0 and the sub-block of Q4_K
constexpr int kQK_K = 256; // K-quant super-block

// One activation block (44 bytes):  | d:f32 | dsum:f32 | sum:int16[2] | qs:int8[32] |      x[i] ≈ d * qs[i]
//   qs in [-127, 127]; sum[h] = qs[16h] + ... + qs[16h+15], dsum = d * (sum[0] + sum[1]). The sums turn every weight
//   offset into one multiply per block: Q4_0 (q - 8) and Q4_1 (+ m) take dsum, which sits beside d so that one load
//   and one multiply by a weight block's [d, m] give its scale and its offset; Q4_K (- min) uses sum[0] + sum[1];
//   Q6_K (q - 32) has one scale per 16 elements and uses each half on its own.
struct BlockQ8 {
  float d, dsum;
  int16_t sum[2];
  int8_t qs[kQK];
};
static_assert(sizeof(BlockQ8) == 44, "BlockQ8 is packed by construction");

// One activation super-block for the K-quant dots (292 bytes; llama.cpp's block_q8_K):
//   | d:f32 | bsums:int16[16] | qs:int8[256] |      x[i] ≈ d * qs[i], bsums[g] = qs[16g] + ... + qs[16g+15]
// One scale per 256 values lets a K-quant dot add its sub-blocks' integer dots, each times the sub-block's integer
// scale, in integers, and use floats once per super-block: with a scale per 32 values (BlockQ8) every sub-block
// needed its own float multiply-add, and Q4_K/Q6_K decode ran at 0.58x llama.cpp's speed on 4096-wide rows.
struct BlockQ8K {
  float d;
  int16_t bsums[16];
  int8_t qs[kQK_K];
};
static_assert(sizeof(BlockQ8K) == 292, "BlockQ8K is packed by construction");

// GGUF weight blocks, as stored (little-endian fp16 scales kept as raw bits).
struct BlockQ8_0 { uint16_t d; int8_t qs[32]; };                         // x = d * q
struct BlockQ4_0 { uint16_t d; uint8_t qs[16]; };                        // x = d * (q - 8)
struct BlockQ4_1 { uint16_t d, m; uint8_t qs[16]; };                     // x = d * q + m
// Q5_0/Q5_1: Q4_0/Q4_1's nibbles plus a fifth bit per element, bit j of qh (little-endian u32) for element j.
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; };         // x = d * (q - 16)
struct BlockQ5_1 { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; };      // x = d * q + m
// Q2_K and Q3_K: 16 groups of 16 values; element e = 128c + 32s + l (c < 2, s < 4, l < 32) has its low two bits at
// bits 2s of qs[32c + l]. Q2_K: scales[g] = min m_g << 4 | scale sc_g. Q3_K: bit e / 32 of hmask[e % 32] is the
// third bit, and a clear one means -4 (q = low - 4 (1 - high), in -4..3); 6-bit scales minus 32 (q3_k_scale).
struct BlockQ2_K { uint8_t scales[16]; uint8_t qs[64]; uint16_t d, dmin; };   // x = d sc_g q - dmin m_g
struct BlockQ3_K { uint8_t hmask[32]; uint8_t qs[64]; uint8_t scales[12]; uint16_t d; };  // x = d sc_g q
struct BlockQ4_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; };  // see unpack_q4_k_scales
// Q5_K: Q4_K's scales and nibbles plus a fifth bit, bit j of qh[l] for element l of sub-block j.
struct BlockQ5_K { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
// IQ4_NL and IQ4_XS: 4-bit indices into one fixed non-linear table of int8 values (llama.cpp's kvalues_iq4nl), laid
// out as Q4_0's nibbles (byte i: element i low, element i + 16 high) per 32 values. IQ4_XS has eight such sub-blocks
// with 6-bit scales stored plus 32: sub-block j's low 4 bits in nibble j % 2 of scales_l[j / 2], its top 2 bits at
// bits 2j..2j+1 of scales_h (iq4_xs_scale).
struct BlockIQ4_NL { uint16_t d; uint8_t qs[16]; };                                          // x = d v[q]
struct BlockIQ4_XS { uint16_t d, scales_h; uint8_t scales_l[4]; uint8_t qs[128]; };        // x = d (ls_j - 32) v[q]
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20, "GGUF layout");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24, "GGUF layout");
static_assert(sizeof(BlockQ2_K) == 84 && sizeof(BlockQ3_K) == 110, "GGUF layout");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "GGUF layout");
static_assert(sizeof(BlockIQ4_NL) == 18 && sizeof(BlockIQ4_XS) == 136, "GGUF layout");

// The values the IQ4 nibbles index.
constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Sub-block j's scale of an IQ4_XS block, in -32..31.
inline int iq4_xs_scale(const BlockIQ4_XS& w, int j) {
  return (((w.scales_l[j / 2] >> (4 * (j % 2))) & 0x0F) | ((w.scales_h >> (2 * j)) & 3) << 4) - 32;
}

// Portable IEEE half -> float (the SIMD kernels use F16C instead).
inline float fp16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000 | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: shift the mantissa up until its leading one is the implicit bit
    exp = 113;
    while (!(mant & 0x400)) { mant <<= 1; --exp; }
    bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K packs eight 6-bit scales and eight 6-bit mins in 12 bytes (A..H scales, a..h mins):
//   0 EEAAAAAA    4 eeaaaaaa    8 eeeeEEEE
//   1 FFBBBBBB    5 ffbbbbbb    9 ffffFFFF
//   2 GGCCCCCC    6 ggcccccc   10 ggggGGGG
//   3 HHDDDDDD    7 hhdddddd   11 hhhhHHHH
// Scale and min of sub-block j (A and a for j = 0):
inline void q4_k_scale_min(const uint8_t* s, int j, uint8_t* sc, uint8_t* mn) {
  if (j < 4) {
    *sc = s[j] & 0x3F;
    *mn = s[j + 4] & 0x3F;
  } else {
    *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    *mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

inline void unpack_q4_k_scales(const uint8_t* s, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 8; ++j) q4_k_scale_min(s, j, sc + j, mn + j);
}

// Q3_K packs sixteen 6-bit scales, stored plus 32, in 12 bytes (A..P scales 0..15):
//   bytes 0..7:  IIIIAAAA JJJJBBBB ... PPPPHHHH      low 4 bits
//   bytes 8..11: MMIIEEAA NNJJFFBB OOKKGGCC PPLLHHDD   top 2 bits: scale 4k + j in bits 2k..2k+1 of byte 8 + j
inline void unpack_q3_k_scales(const uint8_t* s, int8_t sc[16]) {
  for (int g = 0; g < 16; ++g) {
    const int low = (g < 8 ? s[g] : s[g - 8] >> 4) & 0x0F, high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
    sc[g] = static_cast<int8_t>((low | high << 4) - 32);
  }
}

// Row dot products. A quantized row of `n` values is n / 32 activation blocks and n / block_size weight blocks.
using QuantDot = float (*)(const uint8_t* w_row, const BlockQ8* x_row, int n);
// QuantDot, the same operations in the same order (the same bits), asking meanwhile for the row at `ahead`, a line
// every weight block: a decode step's next active row arrives while this one is dotted, where asking for all its
// lines at once stalled on the cache's few outstanding misses.
using QuantDotAhead = float (*)(const uint8_t* w_row, const BlockQ8* x_row, int n, const uint8_t* ahead);
// Two rows (w0, w1) against one token: out[r] = W row r · x, each with the QuantDot's bits, asking meanwhile for the
// rows at ahead0 and ahead1 (ahead1 may be null) as QuantDotAhead does: two rows' reads and sums in flight.
using QuantDotPair = void (*)(const uint8_t* w0, const uint8_t* w1, const BlockQ8* x_row, int n, const uint8_t* ahead0,
                              const uint8_t* ahead1, float* out);
// One row against any four tokens' activations (x_rows[0..3], in blocks): out[i] = W row · x_rows[i], the QuantDot's
// bits for each.
using QuantDotGather4 = void (*)(const uint8_t* w_row, const BlockQ8* const* x_rows, int n, float* out);
using FloatDot = float (*)(const void* w_row, const float* x_row, int n);
// One row against four tokens' activations (rows x_row, x_row + x_stride, ... in blocks): out[i] = W row · x[i].
// Each weight block is unpacked once for the four, which is most of a block's work.
using QuantDot4 = void (*)(const uint8_t* w_row, const BlockQ8* x_row, int64_t x_stride, int n, float* out);
// Two rows (w_row, w_row + w_stride) against four tokens: out[4 r + i] = W row r · x[i].
using QuantDot2x4 = void (*)(const uint8_t* w_row, int64_t w_stride, const BlockQ8* x_row, int64_t x_stride, int n,
                             float* out);
// The same for K-quant rows, against activations in super-blocks (x_stride counted in them).
using QuantDotK = float (*)(const uint8_t* w_row, const BlockQ8K* x_row, int n);
using QuantDotK4 = void (*)(const uint8_t* w_row, const BlockQ8K* x_row, int64_t x_stride, int n, float* out);
using QuantDotK2x4 = void (*)(const uint8_t* w_row, int64_t w_stride, const BlockQ8K* x_row, int64_t x_stride, int n,
                              float* out);
// Row axpys for the sparse down projection: y[0, n) += sum over r < n_rows of h[r] * W_r[0, n), where w_rows[r]
// points at the first block of n values of row r (n a multiple of the block size). h stays f32: each weight block
// is dequantized to f32 and multiplied in, as dequantize(W) and an f32 product would.
using Axpy = void (*)(const uint8_t* const* w_rows, const float* h, int n_rows, float* y, int n);

// The sparse down projection of a Q4_0/Q4_1/Q8_0 weight W [d, n_ff] (blocks along n_ff, the neurons), repacked
// neuron-major so that the neurons a token does not use are not read, while the products stay 8-bit integer dots.
// Each 32-neuron block b becomes one run of bytes holding the values of W's blocks of that column, rearranged
// (lossless; W[o, 32 b + k] below). The outputs are cut into spans of S outputs (S a multiple of 64 dividing d), each
// span into tiles of 64:
//
//   block b = span 0 | span 1 | ... | span d/S - 1
//   span    = | d: f16[S] | m: f16[S] (Q4_1) | piece of neuron 0 | ... | piece of neuron 31 |
//   piece   = the neuron's q for the span's tiles, tile after tile:
//     Q4_0/Q4_1: 32 bytes per tile t, byte j = q_k[64 t + j] | q_k[64 t + 32 + j] << 4
//     Q8_0:      64 bytes per tile t, byte j = q_k[64 t + j] + 128 (unsigned, as vpdpbusd takes it)
//   W[o, 32 b + k] = d[o] q_k[o] + m[o] (Q4_1), d[o] (q_k[o] - 8) (Q4_0), d[o] q_k[o] (Q8_0)
//
// With S = d a neuron's q is one run (long rows: the skipped ones are whole runs of memory); with S = 64 the block is
// read front to back in tile order, which the hardware prefetchers follow when rows are short (jaxinfer.quant picks S).
// y[0, d) += sum over k of W[:, 32 b + k] x[k], x the block's 8-bit activations (x.qs[k] = 0 for an inactive
// neuron, whose pieces are then not read): per output the integer sum over the block's neurons, then d x.d sum +
// m x.dsum, the dense dot's formula, so the two agree to float rounding.
struct NeuronLayout {
  int scale_bytes, piece_bytes;  // per tile of 64 outputs: scales (and mins), one neuron's q
  int span_tiles;                // tiles per span

  int64_t span_bytes() const { return int64_t{span_tiles} * (scale_bytes + kQK * piece_bytes); }
  // Neuron k's q for tile 0, and how far tile t's is from there.
  const uint8_t* piece(const uint8_t* block, int k) const {
    return block + int64_t{span_tiles} * (scale_bytes + k * piece_bytes);
  }
  int64_t tile_offset(int t) const { return t / span_tiles * span_bytes() + int64_t{t % span_tiles} * piece_bytes; }
  // The 64 scales of tile t (Q4_1: its 64 mins follow the span's scales, at + 64 span_tiles).
  const uint16_t* scales(const uint8_t* block, int t) const {
    return reinterpret_cast<const uint16_t*>(block + t / span_tiles * span_bytes()) + 64 * (t % span_tiles);
  }
  // Asks for tile t's scales (and mins) and the q of the neurons in rows[0, n) (pointers from `piece`), into L2.
  void prefetch_tile(const uint8_t* block, int t, const uint8_t* const* rows, int n) const {
    const auto* scale = reinterpret_cast<const uint8_t*>(scales(block, t));
    for (int half = 0; half < scale_bytes / 128; ++half) {  // 64 scales, then 64 mins: 128 bytes each
      __builtin_prefetch(scale + half * 128 * span_tiles, 0, 1);
      __builtin_prefetch(scale + half * 128 * span_tiles + 64, 0, 1);
    }
    const int64_t at = tile_offset(t);
    for (int i = 0; i < n; ++i) {
      for (int b = 0; b < piece_bytes; b += 64) __builtin_prefetch(rows[i] + at + b, 0, 1);
    }
  }
};
// Per type; the handler sets span_tiles from the call's span.
constexpr NeuronLayout kQ4_0Layout{128, 32, 1}, kQ4_1Layout{256, 32, 1}, kQ8_0Layout{128, 64, 1};

using NeuronBlockAxpy = void (*)(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y);

// The neurons of a block with a nonzero activation, as pointers to their q for tile 0 and coefficients, padded
// with zero coefficients (on the first neuron) to a multiple of `group`; returns how many, 0 if none. rows/coef hold
// kQK + group - 1 entries.
inline int nonzero_neurons(const BlockQ8& x, const uint8_t* block, const NeuronLayout& layout, int group,
                           const uint8_t** rows, int8_t* coef) {
  int n = 0;
  for (int k = 0; k < kQK; ++k) {  // branch-free: half the neurons, at random, are active
    rows[n] = layout.piece(block, k);
    coef[n] = x.qs[k];
    n += x.qs[k] != 0;
  }
  if (n == 0) return 0;
  for (; n % group; ++n) {
    rows[n] = rows[0];
    coef[n] = 0;
  }
  return n;
}

// Repacked weights for prompts and decode (jaxinfer.quant.pack_rows_x8, made once at load): row by row, a dot is
// bound by unpacking each block for a few tokens; with eight rows' blocks side by side, one 256-bit vector holds four
// consecutive q of each of eight rows, and one vpdpbusd against four activations broadcast to every lane adds eight
// rows' partial dots (llama.cpp's repacked block_q4_0x8 idea, with its own layout). A Q4_0/Q4_1/Q8_0/IQ4_NL weight
// [rows, cols] becomes ceil(rows / 8) groups of eight rows (the last one padded with zero blocks), each group one run
// of bytes, its blocks in order:
//
//   group     = block 0 | block 1 | ... | block cols/32 - 1             (the eight rows' blocks b, side by side)
//   Q4_0, IQ4_NL: 144 bytes  | d: f16[8] |           chunk 0 | chunk 1 | chunk 2 | chunk 3 |
//   Q4_1:         160 bytes  | d: f16[8] | m: f16[8] | chunk 0 | chunk 1 | chunk 2 | chunk 3 |
//   Q8_0:         272 bytes  | d: f16[8] |           chunk 0 | ... | chunk 7 |
//   chunk c   = | row 0: 4 bytes | row 1: 4 bytes | ... | row 7: 4 bytes |      (32 bytes: one vector, lane r = row r)
//     Q4_0/Q4_1/IQ4_NL: row r's qs bytes 4c .. 4c+3 as stored (byte i: element i low nibble, element i + 16 high),
//                       so that the low nibbles are elements 4c .. 4c+3 and the high ones 16+4c .. 16+4c+3
//     Q8_0:             row r's q of elements 4c .. 4c+3, each + 128 (unsigned, as vpdpbusd takes it)
//
// Scales come eight at a time, one f16 vector: one multiply scales the eight rows' dots of a block. The weight
// offsets enter as integers: the dot of a block starts from -8 S (Q4_0: q - 8) or -128 S (Q8_0, IQ4_NL: stored +128;
// the IQ4 table is read + 128), S the block's activation sum, so the integer dot is the row kernels' exactly; Q4_1
// adds m S. The float steps are those of the portable row kernels, per row and block in order, with no fused
// multiply-add: every ISA's repacked kernels, for one token or four, give the portable row kernels' bits.
// Every 32-value block type of the Kernels table can take this layout; K-quants take the one below.
constexpr int kInterleave = 8;

// Eight rows of a group (`group` points at its block 0) against N tokens x, x + x_stride, ... (N = 1 or 4):
// out[8 i + r] = row r · token i, n values a row.
using RepackedDots = void (*)(const uint8_t* group, const BlockQ8* x, int64_t x_stride, int n, float* out);

// K-quants and IQ4_XS repacked the same way, per 256-value super-block: a group is its super-blocks in order, each
// the eight rows' super-blocks side by side, sub-block scales unpacked to one byte each and grouped so that one
// load (and a widening) gives the eight rows' scales of one sub-block:
//
//   Q4_K   1184 bytes | d: f16[8] | dmin: f16[8] | sc: u8[8 j][8 r] | mn: u8[8 j][8 r] | pair 0 | ... | pair 3 |
//   Q5_K   1440 bytes   Q4_K's, then | qh: chunk 0 | ... | chunk 7 |
//   Q6_K   1680 bytes | d: f16[8] | sc: i8[8 j][8 r][2] | half 0 | half 1 |
//   IQ4_XS 1104 bytes | d: f16[8] | sc: i8[8 j][8 r] | sub-block 0 | ... | sub-block 7 |
//
//   chunk   = | row 0: 4 bytes | row 1: 4 bytes | ... | row 7: 4 bytes |     (32 bytes, one vector, lane r = row r)
//   Q4_K/Q5_K pair p = chunks 0..7, chunk c: row r's qs bytes 32p + 4c .. +3 (low nibbles: elements 4c .. 4c+3 of
//             sub-block 2p, high nibbles: of sub-block 2p + 1); Q5_K qh chunk c: row r's qh bytes 4c .. +3 (bit j:
//             the fifth bit of those elements of sub-block j); sc, mn: 6-bit scale and min of sub-block j, row r
//   Q6_K half h = | ql chunks 0..7 (t = 0) | ql chunks 0..7 (t = 1) | qh chunks 0..7 |: row r's ql bytes
//             64h + 32t + 4c .. +3 (low nibbles: sub-block 4h + t, high: 4h + t + 2) and qh bytes 32h + 4c .. +3,
//             their bit pairs reordered so that sub-block 0's sit at bits 4..5 (one mask, no shift, merges them):
//               GGUF qh byte  | s3 | s2 | s1 | s0 |   ->   repacked  | s2 | s0 | s3 | s1 |   (bits 7..0, 2 each)
//             sc[j][r] = row r's scales 2j, 2j + 1 (16 values each)
//   IQ4_XS sub-block j = chunks 0..3, chunk c: row r's qs bytes 16j + 4c .. +3 (low nibbles: elements 4c .. 4c+3,
//             high: 16 + 4c ..); sc = the 6-bit scale - 32
//
// The same information as the rows (a Q4_K's 12 scale bytes are its 16 6-bit values; IQ4_XS's 6 likewise), 1-3%
// more bytes. One vpdpbusd adds four products of eight rows; each sub-block's (Q6_K: each 16 values') eight
// products per row are summed in integers, then times the row's integer scale (vpmulld), so a row's super-block is
// one integer T; the offsets (Q4_K/Q5_K mins, Q6_K's -32, IQ4_XS's table + 128) are one integer O per row from the
// activation sums: M = sum_j mn_j S_j (Q4_K/Q5_K), O = sum_g sc_g S_g (Q6_K, groups of 16; IQ4_XS, sub-blocks).
// Per row and super-block, in this order and without FMA (the bits of every ISA):
//   Q4_K/Q5_K  y += (x.d d) T - (x.d dmin) M      Q6_K  y += (d x.d) (T - 32 O)      IQ4_XS  y += (d x.d) (T - 128 O)
// Integer sums as the row kernels', floats not: the row kernels keep eight lanes per row (KLanes), which here would
// take eight scale multiplies per sub-block instead of one.
constexpr int kQ4KGroupBytes = 1184, kQ5KGroupBytes = 1440, kQ6KGroupBytes = 1680, kIQ4XSGroupBytes = 1104;
enum class X8KFormat { kQ4_K, kQ5_K, kQ6_K, kIQ4_XS };
constexpr int x8k_group_block_bytes(X8KFormat f) {
  return f == X8KFormat::kQ4_K ? kQ4KGroupBytes : f == X8KFormat::kQ5_K ? kQ5KGroupBytes
                                                : f == X8KFormat::kQ6_K ? kQ6KGroupBytes : kIQ4XSGroupBytes;
}
using RepackedDotsK = void (*)(const uint8_t* group, const BlockQ8K* x, int64_t x_stride, int n, float* out);
using RepackedDotsK2 = void (*)(const uint8_t* group, int64_t group_bytes, const BlockQ8K* x, int64_t x_stride,
                                int n, float* out);  // two groups, four tokens: out[16 i + r]
// The portable ones (kernels_repacked_k.cc, instantiated there for N = 1 and 4 tokens).
template <X8KFormat F, int N>
void x8k_dots_portable(const uint8_t* group, const BlockQ8K* x, int64_t x_stride, int n, float* out);
// Two consecutive groups (group, group + group_bytes: sixteen rows) against four tokens: out[16 i + r].
using RepackedDots2 = void (*)(const uint8_t* group, int64_t group_bytes, const BlockQ8* x, int64_t x_stride, int n,
                               float* out);

// One implementation per instruction set; a null entry means "use the scalar one" (but see the SIMD-only
// entries at the end).
struct Kernels {
  const char* isa;
  QuantDot q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl;
  QuantDotK q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs;
  FloatDot f16, f32;
  void (*quantize_row)(const float* x, BlockQ8* out, int n);
  void (*quantize_row_k)(const float* x, BlockQ8K* out, int n);  // n a multiple of 256
  Axpy axpy_q8_0, axpy_q4_0, axpy_q4_1, axpy_q5_0, axpy_q5_1, axpy_q2_k, axpy_q3_k, axpy_q4_k, axpy_q5_k, axpy_q6_k;
  Axpy axpy_iq4_nl, axpy_iq4_xs, axpy_f16, axpy_f32;
  NeuronBlockAxpy neuron_block_q4_0, neuron_block_q4_1, neuron_block_q8_0;
  RepackedDots x8_q8_0, x8_q4_0, x8_q4_1, x8_iq4_nl;              // one token
  RepackedDots x8_q8_0_x4, x8_q4_0_x4, x8_q4_1_x4, x8_iq4_nl_x4;  // four tokens
  RepackedDotsK x8_q4_k, x8_q5_k, x8_q6_k, x8_iq4_xs;              // K-quants and IQ4_XS, one token
  RepackedDotsK x8_q4_k_x4, x8_q5_k_x4, x8_q6_k_x4, x8_iq4_xs_x4;  // four tokens
  // SIMD only, last so that the portable table can leave them out; null: single dots.
  QuantDot4 q8_0_x4, q4_0_x4, q4_1_x4, q5_0_x4, q5_1_x4, iq4_nl_x4;
  QuantDotK4 q2_k_x4, q3_k_x4, q4_k_x4, q5_k_x4, q6_k_x4, iq4_xs_x4;
  QuantDot2x4 q8_0_2x4, q4_0_2x4, q4_1_2x4, q5_0_2x4, q5_1_2x4, iq4_nl_2x4;
  RepackedDots2 x16_q8_0_x4, x16_q4_0_x4, x16_q4_1_x4, x16_iq4_nl_x4;  // null: two calls of the one-group kernel
  RepackedDotsK2 x16_q4_k_x4, x16_q5_k_x4, x16_q6_k_x4, x16_iq4_xs_x4;
  RepackedDotsK2 x16_q4_k_x8, x16_q5_k_x8, x16_q6_k_x8, x16_iq4_xs_x8;  // eight tokens
  QuantDotAhead q8_0_ahead, q4_0_ahead, q4_1_ahead, q5_0_ahead, q5_1_ahead, iq4_nl_ahead;
  QuantDotGather4 q8_0_g4, q4_0_g4, q4_1_g4, iq4_nl_g4;  // the row-sparse products' cold rows (union_rows.cc)
  QuantDotPair q8_0_pair, q4_0_pair, q4_1_pair, q5_0_pair, q5_1_pair, iq4_nl_pair;  // a decode step's active rows
  // Ternary weights (ternary.h), set by with_ternary_kernels for every kernel set; the x4 ones null in the portable
  // set. I2_S's activations come from quantize_row_absmax.
  QuantDotK tq1_0, tq2_0, i2_s;
  QuantDotK4 tq1_0_x4, tq2_0_x4, i2_s_x4;
  QuantDotK2x4 tq1_0_2x4, tq2_0_2x4, i2_s_2x4;
  Axpy axpy_tq1_0, axpy_tq2_0, axpy_i2_s;
  void (*quantize_row_absmax)(const float* x, BlockQ8K* out, int n);
};

const Kernels& scalar_kernels();
const Kernels& avx2_kernels();
const Kernels& avx512_kernels();
// AVX-512 VBMI (Ice Lake, Zen 4): the byte permutes that interleave four neurons' q for vpdpbusd (AVX2 and AVX-512
// without VBMI use AVX2's unpacks, in kernels_avx2.cc).
void neuron_block_q4_0_vbmi(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y);
void neuron_block_q4_1_vbmi(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y);
void neuron_block_q8_0_vbmi(const uint8_t* block, int d, const NeuronLayout& layout, const BlockQ8& x, float* y);
// The best kernels this CPU runs (chosen once, with __builtin_cpu_supports); every null entry filled from scalar.
const Kernels& best_kernels();

}  // namespace jaxinfer_cpu

"""GGML's block formats in jnp: each `dequantize_<TYPE>` is a port of gguf-py's `<TYPE>.dequantize_blocks`
(gguf/quants.py), laid out the same way so the two can be read side by side; `gguf.quants.dequantize` is the test
oracle. A function maps uint8 blocks [..., type_size] to f32 values [..., block_size]."""

import jax
import jax.numpy as jnp
from gguf import GGMLQuantizationType

from jaxinfer import ternary
from jaxinfer.ternary import I2_S

QK_K = 256


def f16_values(two_bytes: jax.Array) -> jax.Array:
    """Little-endian fp16 stored as uint8 [..., 2] -> f32 [...]."""
    return jax.lax.bitcast_convert_type(two_bytes, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """uint8 [..., n] -> [..., 2n]: all low nibbles first, then all high nibbles (GGML's order within a block)."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


# Q8_0, 34 bytes per 32 values:  | d:f16 | qs:int8[32] |           x = d * q
def dequantize_Q8_0(blocks):
    d = f16_values(blocks[..., 0:2])[..., None]
    q = jax.lax.bitcast_convert_type(blocks[..., 2:], jnp.int8).astype(jnp.float32)
    return d * q


# Q4_0, 18 bytes per 32 values:  | d:f16 | qs[16] |                x = d * (q - 8)
#   byte j holds element j in its low nibble and element j+16 in its high nibble.
def dequantize_Q4_0(blocks):
    d = f16_values(blocks[..., 0:2])[..., None]
    q = _nibbles(blocks[..., 2:]).astype(jnp.float32) - 8.0
    return d * q


# Q4_1, 20 bytes per 32 values:  | d:f16 | m:f16 | qs[16] |        x = d * q + m
def dequantize_Q4_1(blocks):
    d = f16_values(blocks[..., 0:2])[..., None]
    m = f16_values(blocks[..., 2:4])[..., None]
    q = _nibbles(blocks[..., 4:]).astype(jnp.float32)
    return d * q + m


# Q5_0, 22 bytes per 32 values:  | d:f16 | qh:u32 | qs[16] |       x = d * (q - 16)
def _q5(qh_bytes, qs):
    """Q5_0/Q5_1 q: low nibble (as Q4_0) | bit j of the little-endian u32 qh << 4, for element j."""
    qh = jax.lax.bitcast_convert_type(qh_bytes, jnp.uint32)[..., None]
    high = ((qh >> jnp.arange(32, dtype=jnp.uint32)) & 1).astype(jnp.uint8)
    return (_nibbles(qs) | (high << 4)).astype(jnp.float32)


def dequantize_Q5_0(blocks):
    d = f16_values(blocks[..., 0:2])[..., None]
    return d * (_q5(blocks[..., 2:6], blocks[..., 6:]) - 16.0)


# Q5_1, 24 bytes per 32 values:  | d:f16 | m:f16 | qh:u32 | qs[16] |   x = d * q + m, q as Q5_0's
def dequantize_Q5_1(blocks):
    d = f16_values(blocks[..., 0:2])[..., None]
    m = f16_values(blocks[..., 2:4])[..., None]
    return d * _q5(blocks[..., 4:8], blocks[..., 8:]) + m


# Q2_K, 84 bytes per 256 values: | scales[16] | qs[64] | d:f16 | dmin:f16 |
#   16 groups of 16; scales[g] = min m_g << 4 | scale sc_g. qs is 2 chunks of 32 bytes; bits 2s..2s+1 of
#   qs[32c + l] are q of element 128c + 32s + l.                     x = d * sc_g * q - dmin * m_g
def dequantize_Q2_K(blocks):
    lead = blocks.shape[:-1]
    scales = blocks[..., 0:16]
    qs = blocks[..., 16:80].reshape(*lead, 2, 1, 32)
    d = f16_values(blocks[..., 80:82])[..., None] * (scales & 0x0F).astype(jnp.float32)
    m = f16_values(blocks[..., 82:84])[..., None] * (scales >> 4).astype(jnp.float32)
    q = ((qs >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)) & 3).astype(jnp.float32)
    return (d[..., None] * q.reshape(*lead, 16, 16) - m[..., None]).reshape(*lead, QK_K)


# Q3_K, 110 bytes per 256 values: | hmask[32] | qs[64] | scales[12] | d:f16 |
#   low two bits of q as Q2_K's; bit i of hmask[l] is the third bit of element 32i + l, and a set bit means +0, a
#   clear one -4: q = low - 4 (1 - high), in -4..3. Sixteen 6-bit scales, offset by 32:
#       bytes 0..7:  IIIIAAAA ... PPPPHHHH      A..H low 4 bits of scales 0..7, I..P of scales 8..15
#       bytes 8..11: MMIIEEAA NNJJFFBB OOKKGGCC PPLLHHDD   top 2 bits: scale 4k + j in bits 2k of byte 8 + j
#                                                                   x = d * (sc_g - 32) * q
def dequantize_Q3_K(blocks):
    lead = blocks.shape[:-1]
    hmask = blocks[..., 0:32].reshape(*lead, 1, 32)
    qs = blocks[..., 32:96].reshape(*lead, 2, 1, 32)
    low_scales = blocks[..., 96:104].reshape(*lead, 1, 8) >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)
    high_scales = blocks[..., 104:108].reshape(*lead, 1, 4) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)
    scales = (low_scales.reshape(*lead, 16) & 0x0F) | ((high_scales.reshape(*lead, 16) & 0x03) << 4)
    d = f16_values(blocks[..., 108:110])[..., None] * (scales.astype(jnp.float32) - 32.0)
    low = (qs >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)) & 3
    high = (hmask >> jnp.arange(8, dtype=jnp.uint8).reshape(8, 1)) & 1
    q = low.reshape(*lead, 8, 32).astype(jnp.float32) - 4.0 * (1 - high).astype(jnp.float32)
    return (d[..., None] * q.reshape(*lead, 16, 16)).reshape(*lead, QK_K)


def _q4_k_scale_min(scales):
    """Eight 6-bit scales and eight 6-bit mins packed in 12 bytes (gguf-py `Q4_K.get_scale_min`):

         0 EEAAAAAA    4 eeaaaaaa    8 eeeeEEEE      A..H: scales 0..7 (E..H: low 4 bits in 8..11, top 2 in 0..3)
         1 FFBBBBBB    5 ffbbbbbb    9 ffffFFFF      a..h: mins   0..7 (e..h: low 4 bits in 8..11, top 2 in 4..7)
         2 GGCCCCCC    6 ggcccccc   10 ggggGGGG
         3 HHDDDDDD    7 hhdddddd   11 hhhhHHHH
    """
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(jnp.float32), mn.astype(jnp.float32)


# Q4_K, 144 bytes per 256 values: | d:f16 | dmin:f16 | scales[12] | qs[128] |
#   8 sub-blocks of 32; qs is 4 chunks of 32 bytes, chunk c: low nibbles = sub-block 2c, high = 2c+1.
#   x = d * sc_j * q - dmin * m_j
def dequantize_Q4_K(blocks):
    lead = blocks.shape[:-1]
    d = f16_values(blocks[..., 0:2])[..., None]
    dmin = f16_values(blocks[..., 2:4])[..., None]
    sc, mn = _q4_k_scale_min(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(*lead, 4, 32)
    q = jnp.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*lead, 8, 32).astype(jnp.float32)
    x = (d * sc)[..., None] * q - (dmin * mn)[..., None]
    return x.reshape(*lead, QK_K)


# Q5_K, 176 bytes per 256 values: | d:f16 | dmin:f16 | scales[12] | qh[32] | qs[128] |
#   Q4_K's scales and nibbles, plus bit j of qh[l] as the fifth bit of element l of sub-block j.
def dequantize_Q5_K(blocks):
    lead = blocks.shape[:-1]
    d = f16_values(blocks[..., 0:2])[..., None]
    dmin = f16_values(blocks[..., 2:4])[..., None]
    sc, mn = _q4_k_scale_min(blocks[..., 4:16])
    qh = blocks[..., 16:48].reshape(*lead, 1, 32)
    qs = blocks[..., 48:].reshape(*lead, 4, 32)
    low = jnp.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*lead, 8, 32)
    high = (qh >> jnp.arange(8, dtype=jnp.uint8).reshape(8, 1)) & 1
    q = (low | (high << 4)).astype(jnp.float32)
    x = (d * sc)[..., None] * q - (dmin * mn)[..., None]
    return x.reshape(*lead, QK_K)


# Q6_K, 210 bytes per 256 values: | ql[128] | qh[64] | scales:int8[16] | d:f16 |
#   two halves of 128 values; in half h, for l in 0..63: ql[64h+l] low nibble -> element 128h+l, high nibble ->
#   128h+64+l; for l in 0..31: qh[32h+l] bits 2s..2s+1 are the top two bits of element 128h+32s+l.
#   x = d * scales[e // 16] * (q - 32)
def dequantize_Q6_K(blocks):
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    scales = jax.lax.bitcast_convert_type(blocks[..., 192:208], jnp.int8).astype(jnp.float32)
    d = f16_values(blocks[..., 208:210])[..., None] * scales
    low = (ql >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)) & 0x0F
    high = (qh >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)) & 0x03
    q = (low.reshape(*lead, 2, 4, 32) | (high.reshape(*lead, 2, 4, 32) << 4)).astype(jnp.float32) - 32.0
    return (d.reshape(*lead, 16, 1) * q.reshape(*lead, 16, 16)).reshape(*lead, QK_K)


# IQ4_NL, 18 bytes per 32 values:  | d:f16 | qs[16] |             x = d * IQ4_VALUES[q]
#   4-bit indices into a fixed non-linear table, nibbles as Q4_0's.
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_values(q):
    return jnp.asarray(IQ4_VALUES, jnp.float32)[q]


def dequantize_IQ4_NL(blocks):
    return f16_values(blocks[..., 0:2])[..., None] * _iq4_values(_nibbles(blocks[..., 2:]))


# IQ4_XS, 136 bytes per 256 values: | d:f16 | scales_h:u16 | scales_l[4] | qs[128] |
#   eight sub-blocks of 32, sub-block j's nibbles in qs[16j .. 16j+16] as IQ4_NL's; 6-bit scales stored plus 32:
#       scales_l[j / 2], nibble j % 2 (low first): bits 0..3 of scale j;  scales_h bits 2j..2j+1: its bits 4..5
#                                                                   x = d * (scale_j - 32) * IQ4_VALUES[q]
def dequantize_IQ4_XS(blocks):
    lead = blocks.shape[:-1]
    scales_h = blocks[..., 2].astype(jnp.uint32) | blocks[..., 3].astype(jnp.uint32) << 8
    low = (blocks[..., 4:8, None] >> jnp.array([0, 4], jnp.uint8)) & 0x0F
    high = (scales_h[..., None] >> (2 * jnp.arange(8, dtype=jnp.uint32))) & 3
    scales = (low.reshape(*lead, 8) | (high << 4).astype(jnp.uint8)).astype(jnp.float32) - 32.0
    q = _nibbles(blocks[..., 8:].reshape(*lead, 8, 16))
    return ((f16_values(blocks[..., 0:2])[..., None] * scales)[..., None] * _iq4_values(q)).reshape(*lead, QK_K)


BLOCK_DEQUANTIZERS = {
    GGMLQuantizationType.Q8_0: dequantize_Q8_0,
    GGMLQuantizationType.Q4_0: dequantize_Q4_0,
    GGMLQuantizationType.Q4_1: dequantize_Q4_1,
    GGMLQuantizationType.Q5_0: dequantize_Q5_0,
    GGMLQuantizationType.Q5_1: dequantize_Q5_1,
    GGMLQuantizationType.Q2_K: dequantize_Q2_K,
    GGMLQuantizationType.Q3_K: dequantize_Q3_K,
    GGMLQuantizationType.Q4_K: dequantize_Q4_K,
    GGMLQuantizationType.Q5_K: dequantize_Q5_K,
    GGMLQuantizationType.Q6_K: dequantize_Q6_K,
    GGMLQuantizationType.IQ4_NL: dequantize_IQ4_NL,
    GGMLQuantizationType.IQ4_XS: dequantize_IQ4_XS,
    GGMLQuantizationType.TQ1_0: ternary.dequantize_TQ1_0,
    GGMLQuantizationType.TQ2_0: ternary.dequantize_TQ2_0,
    I2_S: ternary.dequantize_I2_S,
}

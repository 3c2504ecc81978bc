"""Ternary weight formats (values in {-1, 0, +1} times a scale): llama.cpp's TQ1_0 and TQ2_0, and Microsoft BitNet's
I2_S, which gguf-py does not know.

The dequantizers follow ggml_blocks' convention (uint8 blocks [..., type_size] -> f32 [..., block_size]); TQ1_0's and
TQ2_0's are jnp ports of gguf-py's `dequantize_blocks`, its test oracle. I2_S has no per-block scale: its "blocks"
are 128-value groups of 32 bytes, and one f32 scale for the whole tensor follows the data (quant.QuantArray.scale).
"""

import enum

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

QK_K = 256


class BitNetType(enum.IntEnum):
    """GGML type ids used by BitNet's llama.cpp fork (and ik_llama.cpp) that gguf-py lacks: I2_S, the one read."""

    I2_S = 36


# The other ids of bitnet.cpp's llama.cpp fork (Eddie-Wang1120/llama.cpp, gguf-py/gguf/constants.py: I2_S 36,
# TL1 38, TL2 39): lookup-table layouts whose tiles bitnet.cpp generates per model shape, not read here. llama.cpp
# had IQ4_NL_8_8 at 38 and has MXFP4 at 39, so a refusal names both readings.
BITNET_FORK_LAYOUTS = {38: "TL1", 39: "TL2"}


def unsupported_type_note(type_id: int) -> str:
    """What to say of a tensor type id jaxinfer does not read: which BitNet layout it is, if it may be one."""
    layout = BITNET_FORK_LAYOUTS.get(int(type_id))
    if layout is None:
        return ""
    return (f" (in bitnet.cpp's files: its {layout} lookup-table layout, which jaxinfer does not read; convert the "
            f"model to I2_S, TQ1_0 or TQ2_0)")


I2_S = BitNetType.I2_S
I2_S_GROUP = 128  # values per group of 32 bytes
I2_S_GROUP_BYTES = 32
I2_S_TAIL_BYTES = 32  # after the packed values: the f32 scale, then 28 bytes of padding


# TQ2_0, 66 bytes per 256 values: | qs[64] | d:f16 |            x = d * (q - 1), q in 0..2
#   byte qs[32c + l] (c < 2) holds element 128c + 32s + l in bits 2s..2s+1.
def dequantize_TQ2_0(blocks):
    lead = blocks.shape[:-1]
    qs = blocks[..., :64].reshape(*lead, 2, 1, 32)
    d = jnp.asarray(blocks[..., 64:66]).view(jnp.float16).astype(jnp.float32)
    q = (qs >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)) & 3
    return d * (q.reshape(*lead, QK_K).astype(jnp.float32) - 1.0)


# TQ1_0, 54 bytes per 256 values: | qs[48] | qh[4] | d:f16 |    x = d * (t - 1), t a trit in 0..2
#   Each byte holds trits as a base-3 fixed-point fraction, byte = ceil(Σ t_k 3^(4-k) * 256 / 243): trit k is the
#   integer part of 3 * (byte * 3^k mod 256) / 256, read by multiplying in uint8 (mod 256). Five trits per byte of qs,
#   four per byte of qh:   qs[0..31] -> elements 32k + l (k < 5);   qs[32..47] -> 160 + 16k + l;   qh[0..3] -> 240 + 4k + l
def dequantize_TQ1_0(blocks):
    lead = blocks.shape[:-1]
    powers5 = jnp.array([1, 3, 9, 27, 81], jnp.uint8).reshape(5, 1)
    first = (blocks[..., None, 0:32] * powers5).reshape(*lead, 160)
    second = (blocks[..., None, 32:48] * powers5).reshape(*lead, 80)
    high = (blocks[..., None, 48:52] * jnp.array([1, 3, 9, 27], jnp.uint8).reshape(4, 1)).reshape(*lead, 16)
    trits = (jnp.concatenate([first, second, high], axis=-1).astype(jnp.uint16) * 3) >> 8
    d = jnp.asarray(blocks[..., 52:54]).view(jnp.float16).astype(jnp.float32)
    return d * (trits.astype(jnp.float32) - 1.0)


# I2_S (x86 layout), 32 bytes per 128 values, no per-group scale:  code 0 -> -1, 1 -> 0, 2 -> +1
#   byte k of a group holds elements k, k + 32, k + 64, k + 96 in bits 7-6, 5-4, 3-2, 1-0.
#   The whole tensor is n / 4 bytes of groups, then I2_S_TAIL_BYTES: | scale:f32 | 28 bytes |   x = scale * (code - 1)
def dequantize_I2_S(groups):
    """The codes' values (code - 1) without the tensor's scale, which QuantArray.scale applies."""
    lead = groups.shape[:-1]
    codes = (groups[..., None, :] >> jnp.array([6, 4, 2, 0], jnp.uint8).reshape(4, 1)) & 3
    return codes.reshape(*lead, I2_S_GROUP).astype(jnp.float32) - 1.0


def _trits(b, power):
    """Trit k of TQ1_0 bytes b, power = 3^k (see dequantize_TQ1_0): products in uint8 wrap, as they must."""
    return ((b * power).astype(jnp.uint16) * 3 >> 8).astype(jnp.uint8)


@jax.jit
def tq1_0_as_tq2_0(data):
    """TQ1_0 rows [..., k * 54] (k blocks) -> the TQ2_0 rows [..., k * 66] of the same values: each trit becomes its
    2-bit code, d is kept. TQ1_0's trits cost multiplies and compares per byte to unpack, TQ2_0's codes a shift and a
    mask; its decode kernel is ~1.6x faster from 22% more bytes (repack.py reads TQ1_0 weights so). A 11008 x 4096
    matrix in 0.03 s.

    TQ2_0's byte qs[32c + l] holds elements 128c + 32s + l (s < 4) in bits 2s. For c = 0 they are trits 0-3 of TQ1_0's
    qs[l]; for c = 1: trit 4 of qs[l], trits l/16 and 2 + l/16 of qs[32 + l % 16], and element 224 + l, which is
    trit 4 of qs[32 + l] (l < 16) or trit (l - 16) / 4 of qh[(l - 16) % 4] (l >= 16)."""
    blocks = data.reshape(-1, QUANT_SIZES[GGMLQuantizationType.TQ1_0][1])
    first, second, high = blocks[:, :32], blocks[:, 32:48], blocks[:, 48:52]
    powers = [jnp.uint8(3**k) for k in range(5)]
    low = (_trits(first, powers[0]) | _trits(first, powers[1]) << 2 | _trits(first, powers[2]) << 4
           | _trits(first, powers[3]) << 6)
    lanes = np.arange(16)
    even = _trits(second, powers[0]) << 2 | _trits(second, powers[2]) << 4 | _trits(second, powers[4]) << 6
    odd = (_trits(second, powers[1]) << 2 | _trits(second, powers[3]) << 4
           | _trits(high[:, lanes % 4], jnp.asarray(3 ** (lanes // 4), jnp.uint8)) << 6)
    upper = _trits(first, powers[4]) | jnp.concatenate([even, odd], axis=1)
    return jnp.concatenate([low, upper, blocks[:, 52:54]], axis=1).reshape(*data.shape[:-1], -1)


def i2_s_nbytes(n_values: int) -> int:
    """Bytes of an I2_S tensor of n_values in a GGUF file: its groups and the tail (ik_llama.cpp's size rule;
    gguf-py's table says one byte per value)."""
    return n_values // 4 + I2_S_TAIL_BYTES


def split_i2_s(data: np.ndarray, n_values: int) -> tuple[np.ndarray, float]:
    """An I2_S tensor's bytes as stored -> (its groups, a view of the first n_values / 4 bytes; its scale)."""
    groups = data[: n_values // 4]
    scale = float(np.frombuffer(data[n_values // 4 : n_values // 4 + 4].tobytes(), np.float32)[0])
    return groups, scale


def encode_i2_s(codes: np.ndarray, scale: float) -> np.ndarray:
    """Codes in 0..2 (value + 1) of a tensor, in order, a multiple of 128 of them -> its I2_S bytes with the tail, as
    BitNet's converter writes them (the scale, then zeros)."""
    groups = codes.reshape(-1, 4, I2_S_GROUP_BYTES).astype(np.uint8)  # [group, element // 32, element % 32]
    packed = groups[:, 0] << 6 | groups[:, 1] << 4 | groups[:, 2] << 2 | groups[:, 3]
    tail = np.zeros(I2_S_TAIL_BYTES, np.uint8)
    tail[:4] = np.frombuffer(np.float32(scale).tobytes(), np.uint8)
    return np.concatenate([packed.reshape(-1), tail])


def absmax_int8(x):
    """x [..., k] quantized per token (its last axis) to int8 and back: round(x * 127 / max|x|) * max|x| / 127 -> f32,
    the activation quantization of BitNet b1.58's BitLinear (max|x| floored at 1e-5), which bitnet.cpp's I2_S kernels
    apply to their inputs."""
    scale = 127.0 / jnp.maximum(jnp.max(jnp.abs(x), axis=-1, keepdims=True), 1e-5)
    return jnp.clip(jnp.round(x * scale), -128, 127) / scale


# gguf-py's (values per block, bytes per block) with BitNet's types: I2_S's 128-value groups (its tail aside).
QUANT_SIZES = {**GGML_QUANT_SIZES, I2_S: (I2_S_GROUP, I2_S_GROUP_BYTES)}


def quant_type(type_id: int) -> GGMLQuantizationType | BitNetType:
    """The GGML type of a tensor type id read from a file; ValueError for an id neither gguf-py nor BitNetType knows."""
    try:
        return GGMLQuantizationType(type_id)
    except ValueError:
        return BitNetType(type_id)

"""GGML tensors as JAX pytrees: quantized weights stay quantized in memory, and one `matmul` hides the format.

Blocks run along the last (input) dimension of a weight, so a row of a [rows, cols] weight is `cols / block_size`
consecutive blocks (ggml_blocks decodes them).
"""

import contextlib
import contextvars
import dataclasses
import functools
import mmap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from absl import logging
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from jaxinfer import ternary, x8_kquants
from jaxinfer.ggml_blocks import BLOCK_DEQUANTIZERS, QK_K, f16_values
from jaxinfer.jax_compat import where_zero
from jaxinfer.ternary import I2_S, QUANT_SIZES

FLOAT_TYPES = {
    GGMLQuantizationType.F32: np.dtype(np.float32),
    GGMLQuantizationType.F16: np.dtype(np.float16),
    GGMLQuantizationType.BF16: np.dtype(ml_dtypes.bfloat16),
}


SUPPORTED_TYPES = frozenset(FLOAT_TYPES) | frozenset(BLOCK_DEQUANTIZERS)
TERNARY_TYPES = frozenset({GGMLQuantizationType.TQ1_0, GGMLQuantizationType.TQ2_0, I2_S})


ROW_BLOCKS = "rows"  # GGUF's layout: blocks run along each row
NEURON_MAJOR = "neuron_major"  # a down projection repacked for the sparse FFN: see pack_neuron_major
ROWS_X8 = "rows_x8"  # eight rows' blocks side by side, for the repacked kernels: see pack_rows_x8
DOWN_ROWS = "down_rows"  # a transposed down projection's rows, scales in front, for down_rows_axpy: see pack_down_rows
ROW_LAYOUTS = (ROW_BLOCKS, DOWN_ROWS)  # data row i holds the weight's row i: rows can be taken, split and cut


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuantArray:
    """A 2-D [rows, cols] GGML tensor. `data` is the float array itself for F32/F16/BF16, otherwise the raw
    blocks as uint8 [rows, cols / block_size * type_size] (layout ROW_BLOCKS), or the packing of pack_neuron_major
    or of pack_rows_x8. Its values are `scale` times what the data encode."""

    data: jax.Array
    qtype: GGMLQuantizationType | ternary.BitNetType = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, int] = dataclasses.field(metadata=dict(static=True))
    # Multiply exactly (x with the dequantized weight) even where 8-bit-activation kernels would run. Static, so
    # it is part of every jit cache key: exact and kernel traces never mix.
    exact: bool = dataclasses.field(default=False, metadata=dict(static=True))
    layout: str = dataclasses.field(default=ROW_BLOCKS, metadata=dict(static=True))
    # One factor of the whole tensor: I2_S's per-tensor scale, or the `*.scale` tensor that llama.cpp's bitnet
    # architecture multiplies a projection's result by. Static: a model's programs carry its factors as constants.
    scale: float = dataclasses.field(default=1.0, metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        return self.data.size * self.data.dtype.itemsize


def tree_nbytes(tree) -> int:
    """Bytes of the arrays of a weights pytree, each counted once (a tied output head is the embedding)."""
    arrays = {id(leaf): leaf for leaf in jax.tree.leaves(tree)}
    return sum(leaf.size * leaf.dtype.itemsize for leaf in arrays.values())


def from_gguf_data(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, int]) -> QuantArray:
    """Wrap a tensor as gguf-py's reader returns it (numpy, byte shape for block types) without copying; an I2_S
    tensor's bytes are its groups and its scale (gguf_reader reads them whole)."""
    scale = 1.0
    if qtype in FLOAT_TYPES:
        data = data.view(FLOAT_TYPES[qtype]).reshape(shape)
    else:
        if qtype == I2_S:
            data, scale = ternary.split_i2_s(data.reshape(-1), shape[0] * shape[1])
        block_size, type_size = QUANT_SIZES[qtype]
        data = data.reshape(shape[0], shape[1] // block_size * type_size)
    return QuantArray(data, qtype, tuple(shape), scale=scale)


def dequantize(w: QuantArray) -> jax.Array:
    """QuantArray -> f32 [..., cols] (leading dims of `w.data`, so row-gathered arrays work too)."""
    if w.layout == ROWS_X8:
        return dequantize(unpack_rows_x8(w))  # GGUF's rows, w's scale with them
    if w.layout == DOWN_ROWS:
        return dequantize(unpack_down_rows(w))
    if w.layout == NEURON_MAJOR:
        values = dequantize_neuron_major(w)
    elif w.qtype in FLOAT_TYPES:
        values = w.data.astype(jnp.float32)
    else:
        block_size, type_size = QUANT_SIZES[w.qtype]
        lead = w.data.shape[:-1]
        values = BLOCK_DEQUANTIZERS[w.qtype](w.data.reshape(*lead, -1, type_size)).reshape(*lead, w.shape[1])
    return values if w.scale == 1.0 else values * w.scale


# The sparse down projection, as the row-skipping kernel reads it. GGUF's ffn_down [d, n_ff] has the neurons as
# columns, inside the blocks, so skipping a neuron skips no bytes; PowerInfer stores it transposed (one row per neuron),
# which for block types means decoding and quantizing again (`transpose`: a second rounding) and an f32 axpy per
# weight. Instead, a Q4_0/Q4_1/Q8_0 ffn_down keeps its own blocks' values, regrouped per 32 neurons, the outputs cut
# into spans of S (cpu_ext/qmatmul.h, NeuronLayout):
#
#   data[b] = span 0 | span 1 | ...                                                 one run of bytes per block b
#   span s  = | scale: f16[S] | min: f16[S] (Q4_1) | neuron 0's q | ... | neuron 31's q |
#   a neuron's q, per tile t of 64 outputs o = 64t + j (t counted in the span):
#     Q4_0/Q4_1: 32 bytes, byte j = q[o, 32b + k] | q[o + 32, 32b + k] << 4 (j < 32)
#     Q8_0:      64 bytes, byte j = q[o, 32b + k] + 128
#
# (scale, min and q of W[o, 32b + k] are block b of row o's). As many bytes as W, no rounding; the shape stays that
# of the transposed matrix, [n_ff, d], as ffn_down_t's. neuron_span picks S.
NEURON_MAJOR_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0"))
NEURON_BLOCK = 32  # neurons of a data row (block b)
_SCALE_BYTES = {GGMLQuantizationType.Q4_0: 2, GGMLQuantizationType.Q4_1: 4, GGMLQuantizationType.Q8_0: 2}  # per block


def _q_bytes(qtype: GGMLQuantizationType) -> int:
    """Bytes of a block's quants (not its scales)."""
    return QUANT_SIZES[qtype][1] - _SCALE_BYTES[qtype]

# A neuron's q stays one run when it is at least this long (S = d): skipping a neuron then skips whole stretches of
# memory. Shorter, the kernel reads the block front to back one tile of 64 outputs at a time (S = 64), an order the
# hardware prefetchers follow: the default model's 288-byte rows (d = 576, Q4_1) as one run each made its sparse FFN
# 1.11x the dense one's time with weights from memory, in tiles 1.03x; 2 KiB rows (d = 4096) in tiles took 0.82x the
# dense kernel's time against 0.62x as runs (Q4_0, half the neurons active).
NEURON_RUN_MIN_BYTES = 1024


def neuron_span(d: int, qtype: GGMLQuantizationType) -> int:
    """Outputs per span of a NEURON_MAJOR packing of a [d, n_ff] weight (see above)."""
    return d if d * _q_bytes(qtype) // 32 >= NEURON_RUN_MIN_BYTES else 64


def layout_name(w: QuantArray) -> str:
    """How w is stored, for what the CLIs print: "Q4_1", or "Q4_1 neuron-major in spans of 64 outputs"."""
    if w.layout == NEURON_MAJOR:
        return f"{w.qtype.name} neuron-major in spans of {neuron_span(w.shape[1], w.qtype)} outputs"
    return w.qtype.name


def can_pack_neuron_major(w: QuantArray) -> bool:
    return w.layout == ROW_BLOCKS and w.qtype in NEURON_MAJOR_TYPES and not w.exact and w.shape[0] % 64 == 0


def neuron_row_bytes(w: QuantArray) -> int:
    """Bytes of a NEURON_MAJOR weight that belong to single neurons (their q, not the shared scales)."""
    return w.nbytes * _q_bytes(w.qtype) // QUANT_SIZES[w.qtype][1]


def pack_neuron_major(w: QuantArray, span: int | None = None) -> QuantArray:
    """A Q4_0/Q4_1/Q8_0 down projection W [d, n_ff] (d a multiple of 64) -> the same weight as a QuantArray [n_ff, d]
    of layout NEURON_MAJOR (the transposed matrix: per neuron, its q in every span), bytes as drawn above, in spans of
    `span` outputs (default: neuron_span's)."""
    if not can_pack_neuron_major(w):
        raise ValueError(f"cannot pack a {w.qtype.name} {w.layout} weight of shape {w.shape} neuron-major "
                         f"({sorted(t.name for t in NEURON_MAJOR_TYPES)}, not exact, rows a multiple of 64)")
    d, n_ff = w.shape
    span = span or neuron_span(d, w.qtype)
    n_blocks, n_spans, type_size, scale_bytes = n_ff // 32, d // span, QUANT_SIZES[w.qtype][1], \
        _SCALE_BYTES[w.qtype]
    blocks = np.asarray(jax.device_get(w.data)).reshape(d, n_blocks, type_size).transpose(1, 0, 2)  # [nb, d, bytes]
    scales = [blocks[:, :, i : i + 2].reshape(n_blocks, n_spans, 2 * span) for i in range(0, scale_bytes, 2)]
    qs = blocks[:, :, scale_bytes:]
    if w.qtype == GGMLQuantizationType.Q8_0:
        q = (qs ^ 0x80).transpose(0, 2, 1)  # [nb, 32 neurons, d outputs]: int8 q + 128 as uint8
    else:  # byte j of qs: neuron j (low nibble), neuron 16 + j (high)
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).transpose(0, 2, 1)  # [nb, 32 neurons, d outputs]
        halves = nibbles.reshape(n_blocks, 32, d // 64, 2, 32)
        q = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)  # [nb, 32, tiles, 32]
    pieces = q.reshape(n_blocks, 32, n_spans, -1).transpose(0, 2, 1, 3).reshape(n_blocks, n_spans, -1)
    packed = np.concatenate([*scales, pieces], axis=2).reshape(n_blocks, -1)
    return QuantArray(placed_copy(packed), w.qtype, (n_ff, d), layout=NEURON_MAJOR, scale=w.scale)


def dequantize_neuron_major(w: QuantArray, span: int | None = None) -> jax.Array:
    """pack_neuron_major's bytes (in spans of `span` outputs, default neuron_span's) -> f32 [n_ff, d], the transposed
    weight; dequantize(w) for a NEURON_MAJOR w."""
    n_ff, d = w.shape
    span = span or neuron_span(d, w.qtype)
    n_blocks, n_spans, scale_bytes = n_ff // 32, d // span, _SCALE_BYTES[w.qtype]
    spans = w.data.reshape(n_blocks, n_spans, -1)
    scale = f16_values(spans[:, :, : 2 * span].reshape(n_blocks, n_spans, span, 2))[:, :, None]  # [nb, spans, 1, S]
    pieces = spans[:, :, scale_bytes * span :].reshape(n_blocks, n_spans, 32, span // 64, -1)
    if w.qtype == GGMLQuantizationType.Q8_0:
        values = scale * (pieces.reshape(n_blocks, n_spans, 32, span).astype(jnp.float32) - 128.0)
    else:
        q = jnp.concatenate([pieces & 0x0F, pieces >> 4], axis=-1).reshape(n_blocks, n_spans, 32, span)
        q = q.astype(jnp.float32)
        if w.qtype == GGMLQuantizationType.Q4_1:
            minimum = f16_values(spans[:, :, 2 * span : 4 * span].reshape(n_blocks, n_spans, span, 2))[:, :, None]
            values = scale * q + minimum
        else:
            values = scale * (q - 8.0)
    return values.transpose(0, 2, 1, 3).reshape(n_ff, d)  # [nb, 32 neurons, spans, S] -> [n_ff, d]


# Prompts and decode through the repacked kernels (cpu_ext/qmatmul.h draws the bytes): a Q4_0/Q4_1/Q8_0/IQ4_NL weight
# [rows, cols] as ceil(rows / 8) groups of eight rows, data uint8 [groups, 8 * row bytes], block b of the eight rows
# side by side (rows past `rows` padded with zero blocks):
#
#   group g = block 0 | ... | block cols/32 - 1,   block = | d: f16[8] | m: f16[8] (Q4_1) | chunk 0 | chunk 1 | ...
#   chunk c = | row 8g: 4 bytes | row 8g+1: 4 bytes | ... | row 8g+7: 4 bytes |
#     Q4_0/Q4_1/IQ4_NL: 4 chunks, row r's qs bytes 4c .. 4c+3 as GGUF stores them
#     Q8_0:             8 chunks, row r's q of elements 4c .. 4c+3, + 128 (as uint8)
#
# The same bytes as the rows (plus the padding), rearranged without rounding: unpack_rows_x8 gives the rows back.
# A group's blocks are one run, so a tensor-parallel cut of rows is whole groups (rows a multiple of 8 tp) and a cut
# of columns whole blocks of all eight rows, as for GGUF's rows.
# Q4_K, Q5_K, Q6_K and IQ4_XS take the same groups per 256-value super-block, with their scales unpacked (x8_kquants).
# The sparse down projection stored transposed (ffn_down_t [n_ff, d], one row per neuron: PowerInfer's layout, or a
# transposed copy), laid out for cpu_ext's down_rows_axpy (cpu_ext/down_rows.h), which rounds each group of 32 active
# neurons' coefficients to 8 bits and dots them in integers: each row's block scales first, then its blocks' quants
# (Q8_0's + 128, unsigned), so that one pass over a row's scales gives a neuron's coefficients on every block. The
# same bytes as GGUF's row, rearranged; rows stay rows (ROW_LAYOUTS).
#
#   row = | d: f16[nb] | qs of block 0 | ... | qs of block nb - 1 |        nb = d / 32
DOWN_ROWS_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_0", "Q8_0"))


def can_pack_down_rows(w: QuantArray) -> bool:
    return w.layout == ROW_BLOCKS and w.qtype in DOWN_ROWS_TYPES and not w.exact and w.scale == 1.0


def _down_rows_parts(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """(bytes of a block's scale, of its quants) of a DOWN_ROWS type."""
    return 2, QUANT_SIZES[qtype][1] - 2


def pack_down_rows(w: QuantArray) -> QuantArray:
    """w [rows, cols] (ROW_BLOCKS) laid out as DOWN_ROWS (see above), in numpy at load."""
    scale_bytes, q_bytes = _down_rows_parts(w.qtype)
    data = np.asarray(w.data)
    blocks = data.reshape(data.shape[0], -1, scale_bytes + q_bytes)
    quants = blocks[:, :, scale_bytes:]
    if w.qtype == GGMLQuantizationType.Q8_0:
        quants = quants ^ np.uint8(0x80)
    packed = aligned_empty(data.size).reshape(data.shape[0], -1)
    packed[:, :scale_bytes * blocks.shape[1]] = blocks[:, :, :scale_bytes].reshape(data.shape[0], -1)
    packed[:, scale_bytes * blocks.shape[1]:] = quants.reshape(data.shape[0], -1)
    # Placed here, as pack_rows_x8 places its groups: a numpy array in the weights would be an argument that every
    # call of a compiled program converts (copied each time where it is not 64-byte aligned).
    return dataclasses.replace(w, data=jax.device_put(packed), layout=DOWN_ROWS)


def unpack_down_rows(w: QuantArray) -> QuantArray:
    """A DOWN_ROWS w back in GGUF's rows (any leading dims of its data, as dequantize takes them)."""
    scale_bytes, q_bytes = _down_rows_parts(w.qtype)
    lead, n_blocks = w.data.shape[:-1], w.shape[1] // QUANT_SIZES[w.qtype][0]
    scales = w.data[..., :scale_bytes * n_blocks].reshape(*lead, n_blocks, scale_bytes)
    quants = w.data[..., scale_bytes * n_blocks:].reshape(*lead, n_blocks, q_bytes)
    if w.qtype == GGMLQuantizationType.Q8_0:
        quants = quants ^ jnp.uint8(0x80)
    rows = jnp.concatenate([scales, quants], axis=-1).reshape(*lead, n_blocks * (scale_bytes + q_bytes))
    return dataclasses.replace(w, data=rows, layout=ROW_BLOCKS)


REPACKED_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0", "IQ4_NL")) | \
    frozenset(x8_kquants.GROUP_BYTES)
INTERLEAVE = 8


def _x8_parts(qtype: GGMLQuantizationType) -> tuple[int, int]:
    """(bytes of scales per row block, 4-byte chunks per block) of a repacked type."""
    return (4 if qtype == GGMLQuantizationType.Q4_1 else 2), (8 if qtype == GGMLQuantizationType.Q8_0 else 4)


def can_pack_rows_x8(w: QuantArray) -> bool:
    return w.layout == ROW_BLOCKS and w.qtype in REPACKED_TYPES and not w.exact


HUGE_PAGE_BYTES = 2 << 20


def aligned_empty(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] starting on a 64-byte boundary: what XLA's CPU client takes without a copy (jax.device_put).
    From 4 MiB on, in memory of its own, 2 MiB-aligned and marked for transparent huge pages before it is touched
    (XLA's own buffers and the heap get 4 KiB pages): weights read a row at a time from scattered places, as a sparse
    FFN's active rows are, are read faster from huge pages."""
    if nbytes >= 2 * HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        buffer = np.frombuffer(mapping, np.uint8)  # holds the mapping: unmapped with the last array using it
        start = -buffer.ctypes.data % HUGE_PAGE_BYTES
        # Whole huge pages only: a last one partly used would be resident in full (up to 2 MiB more per weight).
        mapping.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
        return buffer[start : start + nbytes]
    buffer = np.empty(nbytes + 64, np.uint8)
    start = -buffer.ctypes.data % 64
    return buffer[start : start + nbytes]


def placed_copy(array: np.ndarray) -> jax.Array:
    """A weight made at load, copied into aligned_empty's memory (huge pages from 4 MiB) and placed there without a
    further copy."""
    out = aligned_empty(array.nbytes).view(array.dtype).reshape(array.shape)
    out[...] = array
    return jax.device_put(out)


def _fill_groups(out: np.ndarray, blocks: np.ndarray, qtype: GGMLQuantizationType) -> None:
    """out [g, b, group block bytes] = the groups of blocks [8 g, b, type_size] (rows in order), drawn above."""
    groups, n_blocks, _ = out.shape
    scale_bytes, chunks = _x8_parts(qtype)
    rows = blocks.reshape(groups, INTERLEAVE, n_blocks, -1)
    # Moved as the 2- and 4-byte units they are (f16 scales, 4-byte chunks of quants): one element each instead of
    # bytes, half the time (the quants first copied contiguous, so that they can be viewed as uint32).
    words = out.view(np.uint16)
    for i in range(0, scale_bytes, 2):  # [g, b, 8 rows]: one f16 of each row
        words[..., 4 * i : 4 * i + 8] = rows[..., i : i + 2].view(np.uint16)[..., 0].transpose(0, 2, 1)
    q = out[..., 8 * scale_bytes :].view(np.uint32).reshape(groups, n_blocks, chunks, INTERLEAVE)
    q[...] = np.ascontiguousarray(rows[..., scale_bytes:]).view(np.uint32).transpose(0, 2, 3, 1)
    if qtype == GGMLQuantizationType.Q8_0:
        np.bitwise_xor(q, np.uint32(0x80808080), out=q)


def _group_block_bytes(qtype: GGMLQuantizationType) -> int:
    """Bytes of a group per block of the type (32 or 256 values)."""
    return x8_kquants.GROUP_BYTES.get(qtype) or INTERLEAVE * QUANT_SIZES[qtype][1]


_PACK_GROUPS = 256  # groups packed at a time: the temporaries of the rearranging stay small (a tied Q8_0 head of
# 49152 x 576 packed whole took 28 MiB more than its own bytes)


def pack_rows_x8(w: QuantArray) -> QuantArray:
    """A weight of REPACKED_TYPES in GGUF's rows (numpy, a view of the file, or a jax array) -> the same weight of
    layout ROWS_X8 (see above, and x8_kquants). Made once at load straight from the file (gguf_io): the result is
    written in place into one new buffer that XLA takes without a copy, so the weight is held once."""
    if not can_pack_rows_x8(w):
        raise ValueError(f"cannot repack a {w.qtype.name} {w.layout} weight (exact={w.exact}) in groups of eight "
                         f"rows: {sorted(t.name for t in REPACKED_TYPES)} in GGUF's rows, not exact")
    rows, cols = w.shape
    block_size, type_size = QUANT_SIZES[w.qtype]
    n_blocks, groups = cols // block_size, -(-rows // INTERLEAVE)
    blocks = np.asarray(w.data).reshape(rows, n_blocks, type_size)
    out = aligned_empty(groups * n_blocks * _group_block_bytes(w.qtype)).reshape(groups, n_blocks, -1)

    def fill(at: int, group_blocks: np.ndarray) -> None:  # groups from `at` on, from their rows' blocks
        for start in range(0, len(group_blocks) // INTERLEAVE, _PACK_GROUPS):
            part = group_blocks[INTERLEAVE * start : INTERLEAVE * (start + _PACK_GROUPS)]
            into = out[at + start : at + start + len(part) // INTERLEAVE]
            if w.qtype in x8_kquants.GROUP_BYTES:
                into[...] = x8_kquants.to_groups(part.reshape(-1, INTERLEAVE, n_blocks, type_size), w.qtype)
            else:
                _fill_groups(into, part, w.qtype)

    whole = rows // INTERLEAVE
    if whole:
        fill(0, blocks[: whole * INTERLEAVE])
    if whole < groups:  # the last group's rows past `rows` are zero blocks
        padded = np.zeros((INTERLEAVE, n_blocks, type_size), np.uint8)
        padded[: rows - whole * INTERLEAVE] = blocks[whole * INTERLEAVE :]
        fill(whole, padded)
    return QuantArray(jax.device_put(out.reshape(groups, -1)), w.qtype, w.shape, layout=ROWS_X8, scale=w.scale)


def unpack_rows_x8(w: QuantArray) -> QuantArray:
    """pack_rows_x8's inverse, in jnp: the weight in GGUF's rows (where a consumer reads rows: XLA's products, rows
    looked up)."""
    rows, cols = w.shape
    groups = w.data.shape[0]
    if w.qtype in x8_kquants.GROUP_BYTES:
        data = w.data.reshape(groups, cols // QK_K, -1)
        blocks = x8_kquants.from_groups(jnp, data, w.qtype).reshape(groups * INTERLEAVE, -1)
        return QuantArray(blocks[:rows], w.qtype, w.shape, w.exact, scale=w.scale)
    scale_bytes, chunks = _x8_parts(w.qtype)
    n_blocks = cols // 32
    data = w.data.reshape(groups, n_blocks, -1)
    scales = [data[..., 8 * i : 8 * i + 16].reshape(groups, n_blocks, INTERLEAVE, 2) for i in range(0, scale_bytes, 2)]
    qs = data[..., 8 * scale_bytes :].reshape(groups, n_blocks, chunks, INTERLEAVE, 4).transpose(0, 1, 3, 2, 4)
    qs = qs.reshape(groups, n_blocks, INTERLEAVE, 4 * chunks)
    if w.qtype == GGMLQuantizationType.Q8_0:
        qs = qs ^ jnp.uint8(0x80)
    blocks = jnp.concatenate([*scales, qs], axis=-1).transpose(0, 2, 1, 3).reshape(groups * INTERLEAVE, -1)
    return QuantArray(blocks[:rows], w.qtype, w.shape, w.exact, scale=w.scale)


def take_rows_in_layout(w: QuantArray, rows: np.ndarray) -> QuantArray:
    """w's rows `rows` (numpy indices, at load), in w's layout: the data's rows where they are the weight's rows
    (ROW_LAYOUTS, float types); a weight repacked eight rows to a group is read back in GGUF's rows, taken and
    repacked."""
    if w.layout == ROWS_X8:
        unpacked = unpack_rows_x8(w)
        return pack_rows_x8(take_rows_in_layout(dataclasses.replace(unpacked, data=np.asarray(unpacked.data)), rows))
    if w.layout not in ROW_LAYOUTS:
        raise ValueError(f"rows of a {w.layout} weight cannot be taken one by one")
    return dataclasses.replace(w, data=np.take(np.asarray(w.data), rows, axis=0), shape=(len(rows), w.shape[1]))


def dynamic_row_range(w: QuantArray, start, count: int) -> QuantArray:
    """Rows start .. start + count - 1 (start traced; count static) of a weight whose data rows are its rows
    (ROW_LAYOUTS) or repacked (then start and count multiples of INTERLEAVE, and the rows may run into the last
    group's padding): a piece of an output head, an expert's rows."""
    if w.layout == ROWS_X8:
        data = jax.lax.dynamic_slice_in_dim(w.data, start // INTERLEAVE, count // INTERLEAVE)
    elif w.layout in ROW_LAYOUTS:
        data = jax.lax.dynamic_slice_in_dim(w.data, start, count)
    else:
        raise ValueError(f"no row range of a {w.layout} weight")
    return dataclasses.replace(w, data=data, shape=(count, w.shape[1]))


def take_rows(w: QuantArray, rows: jax.Array) -> jax.Array:
    """Dequantized rows `w[rows]` -> f32 [*rows.shape, cols], reading only those rows' blocks (embeddings; of a
    repacked weight, the groups of eight holding them, unpacked)."""
    if w.layout == ROWS_X8:
        flat = rows.reshape(-1)
        groups = dataclasses.replace(w, data=jnp.take(w.data, flat // INTERLEAVE, axis=0),
                                     shape=(flat.size * INTERLEAVE, w.shape[1]))
        in_groups = unpack_rows_x8(groups).data.reshape(flat.size, INTERLEAVE, -1)
        data = jnp.take_along_axis(in_groups, (flat % INTERLEAVE)[:, None, None], axis=1).reshape(*rows.shape, -1)
    else:
        data = jnp.take(w.data, rows, axis=0)
    return dequantize(dataclasses.replace(w, data=data, exact=False, layout=ROW_BLOCKS))


# GGUF types sent to the cpu_ext kernels on the CPU backend: all but F32, which stays with XLA (its own f32 GEMM is as
# good), and BF16, which has no kernel (a rare GGUF weight type). The ternary types' kernels take 256-value blocks:
# I2_S rows of 128 times an odd number stay with XLA (_kernels).
CPU_KERNEL_TYPES = SUPPORTED_TYPES - {GGMLQuantizationType.F32, GGMLQuantizationType.BF16}
# The row kernels read each weight once per call and unpack each block once for four tokens, but are not tiled
# further: up to this many tokens per call they beat dequantize + XLA's f32 GEMM (prefill of the default model: 20-30x
# at 1 token, 2.5x at 32, 1.8x at 64, 1.15x at 128), beyond it XLA wins (0.9x at 256, 0.77x at 512).
CPU_KERNEL_MAX_TOKENS = 128
# Repacked weights (ROWS_X8) take their kernels for any number of tokens: tiled over rows x tokens they beat
# dequantize + XLA's GEMM at every length measured, 1 to 2048 tokens a call (scripts/bench_repacked_kernels.py; README,
# CPU kernels). So do ternary weights: XLA would dequantize 16 values per byte read before its GEMM, and their kernels
# won at every size measured (a 7B-shaped ffn_up [11008, 4096], 512 tokens: 0.31x XLA's time for TQ2_0, 0.41x TQ1_0,
# 0.40x I2_S; 0.10-0.14x at 64 tokens).
CPU_KERNEL_UNBOUNDED_TYPES = TERNARY_TYPES


# Row-sparse products of these types take cpu_ext for any number of tokens: from cpu_ext's kUnionPackMinTokens (16)
# a call packs the union of its tokens' active rows eight to a group and runs the repacked kernels on them
# (cpu_ext/union_rows.cc), so a prompt's chunk through a sparse gate/up costs the dense repacked product's time times
# the share of rows it needs, plus the packing (11008 x 4096 Q4_0, 512 tokens: 0.36x the dense product's time at 30%
# of the rows, 1.1x at all of them); rows that few of the tokens take are dotted by the row kernels instead. A transposed down projection laid out as DOWN_ROWS is summed token
# by token over its active rows, at any length.
UNION_PACKED_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0", "IQ4_NL"))


def kernel_token_limit(w: QuantArray, masked: bool = False) -> int | None:
    """The most tokens a call for which cpu_ext's kernels multiply by w (beyond, XLA's GEMM on dequantized weights),
    in a row-sparse product with `masked`; None: any number."""
    if w.layout in (ROWS_X8, DOWN_ROWS) or w.qtype in CPU_KERNEL_UNBOUNDED_TYPES:
        return None
    if masked and w.qtype in UNION_PACKED_TYPES:
        return None
    return CPU_KERNEL_MAX_TOKENS


@functools.cache
def cpu_kernels():
    """The cpu_ext module, or None (warned once) if its library is not built."""
    try:
        import cpu_ext  # here, not at the top: loading its library may fail, and this module works without it
    except ImportError as e:
        logging.warning("cpu_ext kernels unavailable, quantized matmuls dequantize to f32 instead: %s", e)
        return None
    return cpu_ext


_PRODUCTS = contextvars.ContextVar("jaxinfer_products", default="xla")

# "xla_fused" (the GPU plan): a product of this many tokens or fewer (decode) is written as a multiply-and-reduce,
# which XLA fuses with the dequantization into one pass over the quantized bytes. As a dot, XLA:GPU writes the
# dequantized f32 weight to memory and reads it back for the GEMM, about 8 bytes per weight against Q4_0's 0.56.
FUSED_MAX_TOKENS = 4


@contextlib.contextmanager
def products(kind: str):
    """Trace the products inside with `kind`'s kernels: "cpu_ext" (where `_kernels` allows), "xla" or "xla_fused"
    (XLA, decode-sized products fused with the dequantization: FUSED_MAX_TOKENS). Set from the
    Plan (plan.py) by model.forward for device memory and by sparse_ffn for host parts; the Plan is a static argument
    of every program that traces a model, so traces for different kinds never mix. Unset: "xla"."""
    token = _PRODUCTS.set(kind)
    try:
        yield
    finally:
        _PRODUCTS.reset(token)


def _kernels(x: jax.Array, w: QuantArray, layouts: tuple[str, ...] = (ROW_BLOCKS,), masked: bool = False):
    """The cpu_ext module where it should multiply x by w, else None: under products("cpu_ext"), for block-quantized
    and F16 weights not marked exact, in one of `layouts`, for up to kernel_token_limit(w, masked) rows of x."""
    limit = kernel_token_limit(w, masked)
    use_kernels = (
        w.layout in layouts
        and not w.exact
        and w.qtype in CPU_KERNEL_TYPES
        and (w.qtype != I2_S or w.shape[1] % QK_K == 0)
        and (limit is None or x.size // x.shape[-1] <= limit)
        and _PRODUCTS.get() == "cpu_ext"
    )
    return cpu_kernels() if use_kernels else None


DENSE_LAYOUTS = (ROW_BLOCKS, ROWS_X8)  # what quantized_matmul reads


def interleave(w: QuantArray) -> int:
    """Rows to a group of w's data as cpu_ext's kernels take it: 8 repacked (ROWS_X8), else 1."""
    return INTERLEAVE if w.layout == ROWS_X8 else 1


def matmul(x: jax.Array, w: QuantArray) -> jax.Array:
    """x [..., cols] @ w.T -> [..., rows] in f32, whatever the storage format of `w`.

    Where `_kernels` allows, the cpu_ext FFI kernels quantize x to 8 bits per 32 values and dot in integers as
    llama.cpp does (about 1e-2 relative difference on random data), row by row or, for a repacked w, eight rows at a
    time; otherwise XLA multiplies x with the dequantized weight."""
    kernels = _kernels(x, w, DENSE_LAYOUTS)
    if kernels is not None:
        return _scaled(kernels.quantized_matmul(x, w.data, qtype=w.qtype, rows=w.shape[0], cols=w.shape[1],
                                                interleave=interleave(w)), w)
    if w.qtype == I2_S and not w.exact:  # BitNet's reference quantizes the activations per token to int8
        x = ternary.absmax_int8(x)
    if _fused(x):
        return jnp.sum(x[..., None, :] * dequantize(w), axis=-1)
    return jnp.einsum("...i,oi->...o", x, dequantize(w))


def _fused(x: jax.Array) -> bool:
    """Whether XLA multiplies x by a dequantized weight as a fused multiply-and-reduce (FUSED_MAX_TOKENS)."""
    return _PRODUCTS.get() == "xla_fused" and x.size // x.shape[-1] <= FUSED_MAX_TOKENS


def _scaled(y: jax.Array, w: QuantArray) -> jax.Array:
    """A kernel's product with w's data, times w's scale."""
    return y if w.scale == 1.0 else y * w.scale


def matmuls(x: jax.Array, ws) -> list[jax.Array]:
    """[matmul(x, w) for w in ws]. Where cpu_ext would run each of them and they share a type, input size and layout
    (a layer's q/k/v, gate/up), it runs them as one kernel call: x is quantized once and one split of the rows over
    the threads serves all the weights (the default model's decode: 4.9 -> 4.2 ms per token)."""
    first = ws[0]
    kernels = _kernels(x, first, DENSE_LAYOUTS)
    if kernels is not None and all(_kernels(x, w, DENSE_LAYOUTS) is not None and
                                   (w.qtype, w.shape[1], w.layout) == (first.qtype, first.shape[1], first.layout)
                                   for w in ws[1:]):
        products = kernels.quantized_matmul_group(x, [w.data for w in ws], qtype=first.qtype,
                                                  rows=[w.shape[0] for w in ws], cols=first.shape[1],
                                                  interleave=interleave(first))
        return [_scaled(y, w) for y, w in zip(products, ws)]
    return [matmul(x, w) for w in ws]


def masked_matmul(x: jax.Array, w: QuantArray, mask: jax.Array) -> jax.Array:
    """matmul(x, w) where `mask` [..., rows] is set, else 0. The cpu_ext kernel reads only the rows some token
    needs (sparse up/gate projections); the XLA path computes all rows and masks them, the reference semantics."""
    kernels = _kernels(x, w, masked=True)
    if kernels is not None:
        return _scaled(kernels.masked_matmul(x, w.data, mask, qtype=w.qtype, rows=w.shape[0], cols=w.shape[1]), w)
    return where_zero(mask, matmul(x, w))


def masked_matmuls(x: jax.Array, ws, mask: jax.Array) -> list[jax.Array]:
    """[masked_matmul(x, w, mask) for w in ws]. Where cpu_ext would run each of them and they share a type and shape
    (a sparse FFN's gate and up), it runs them as one kernel call: the active rows are found and x quantized once,
    and one split of all the weights' rows over the threads serves them (one call fewer per FFN part)."""
    kernels = _kernels(x, ws[0], masked=True)
    if kernels is not None and all(_kernels(x, w, masked=True) is not None and (w.qtype, w.shape) ==
                                   (ws[0].qtype, ws[0].shape) for w in ws[1:]):
        products = kernels.masked_matmul_group(x, [w.data for w in ws], mask, qtype=ws[0].qtype,
                                               rows=ws[0].shape[0], cols=ws[0].shape[1])
        return [_scaled(y, w) for y, w in zip(products, ws)]
    return [masked_matmul(x, w, mask) for w in ws]


def masked_axpy(h: jax.Array, w_t: QuantArray, mask: jax.Array) -> jax.Array:
    """Σ_j mask[..., j] h[..., j] w_t[j, :] -> [..., cols]: a product with a transposed weight (one row per input
    feature, PowerInfer's ffn_down_t) over the active inputs only. cpu_ext reads only active rows: of a DOWN_ROWS
    weight with each group of 32 neurons' coefficients in 8 bits, of a NEURON_MAJOR one with h in 8 bits, both dotted
    in integers, of a transposed one in GGUF's rows with h in f32; the XLA path zeroes inactive inputs and multiplies
    with the dequantized weight."""
    if (kernels := _kernels(h, w_t, (DOWN_ROWS,))) is not None:
        return kernels.down_rows_axpy(h, w_t.data, mask, qtype=w_t.qtype, rows=w_t.shape[0], cols=w_t.shape[1])
    if (kernels := _kernels(h, w_t, (NEURON_MAJOR,))) is not None:
        return _scaled(kernels.neuron_major_axpy(h, w_t.data, mask, qtype=w_t.qtype, rows=w_t.shape[0],
                                                 cols=w_t.shape[1], span=neuron_span(w_t.shape[1], w_t.qtype)), w_t)
    if (kernels := _kernels(h, w_t)) is not None:
        return _scaled(kernels.masked_axpy(h, w_t.data, mask, qtype=w_t.qtype, rows=w_t.shape[0], cols=w_t.shape[1]),
                       w_t)
    if _fused(h):
        return jnp.sum(where_zero(mask, h)[..., :, None] * dequantize(w_t), axis=-2)
    return jnp.einsum("...f,fd->...d", where_zero(mask, h), dequantize(w_t))


def transpose_ternary(w: QuantArray) -> QuantArray | None:
    """wᵀ of a ternary weight as I2_S, exactly, where w is one scale times values in {-1, 0, +1} (every BitNet
    checkpoint: its weights are quantized per tensor; I2_S always, TQ1_0/TQ2_0 when all their blocks' scales agree)
    and its rows are a multiple of 256 values (I2_S's kernels); else None. A transposed TQ1_0/TQ2_0 would need a
    scale per 256 outputs of each neuron, which it does not have, and `transpose`'s Q8_0 is 4x the bytes."""
    if w.qtype not in TERNARY_TYPES or w.exact or w.layout != ROW_BLOCKS or w.shape[0] % QK_K:
        return None
    values = np.asarray(jax.device_get(dequantize(w)))
    magnitudes = np.abs(values[values != 0])
    scale = float(magnitudes.max()) if magnitudes.size else 1.0
    if magnitudes.size and float(magnitudes.min()) != scale:
        return None
    codes = np.rint(values.T / scale).astype(np.int8) + 1
    groups, scale = ternary.split_i2_s(ternary.encode_i2_s(codes.reshape(-1), scale), values.size)
    rows, cols = values.shape[1], values.shape[0]
    return QuantArray(jnp.asarray(groups.reshape(rows, cols // 4)), I2_S, (rows, cols), scale=scale)


# Types gguf-py can quantize to, so a transposed copy keeps its source's bytes per value; others become Q8_0.
REQUANTIZABLE_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"))


def transpose(w: QuantArray, qtype: GGMLQuantizationType | None = None) -> QuantArray:
    """wᵀ, in w's own format or in `qtype` (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0). Quantized blocks run along rows, so a block
    type is decoded, transposed and quantized again with gguf-py: a second rounding, about the error of the format
    itself (Q8_0 adds almost none; see README's sparsity table). A K-quant becomes Q8_0 (gguf-py cannot quantize
    K-quants); float types and exact weights transpose exactly."""
    values = np.asarray(jax.device_get(dequantize(w))).T
    rows, cols = values.shape
    if w.exact or (w.qtype in FLOAT_TYPES and qtype is None):
        dtype = np.float32 if w.exact else FLOAT_TYPES[w.qtype]
        float_type = GGMLQuantizationType.F32 if w.exact else w.qtype
        return QuantArray(jnp.asarray(values.astype(dtype)), float_type, (rows, cols), w.exact)
    qtype = qtype or (w.qtype if w.qtype in REQUANTIZABLE_TYPES else GGMLQuantizationType.Q8_0)
    if qtype not in REQUANTIZABLE_TYPES:
        raise ValueError(f"cannot quantize to {qtype.name}: one of {sorted(t.name for t in REQUANTIZABLE_TYPES)}")
    if cols % QUANT_SIZES[qtype][0]:
        return QuantArray(jnp.asarray(values), GGMLQuantizationType.F32, (rows, cols))
    return QuantArray(placed_copy(gguf_quants.quantize(np.ascontiguousarray(values), qtype)), qtype, (rows, cols))

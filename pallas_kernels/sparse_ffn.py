"""Masked sparse FFN in Pallas: only the FFN neurons listed in `idx` are read and computed.

    h[b, k]  = gate_act(x[b] · W_gate[idx[k]]) * up_act(x[b] · W_up[idx[k]])      (idx[k] = -1: padding, h = 0)
    out[b]   = Σ_k h[b, k] · W_down_t[idx[k]]

Weights are neuron-major rows [n_ff, d] (gate, up, and the down projection transposed), so an active neuron is one
contiguous row of each. They arrive either as floats or as Q8_0 repacked into int8 values [n_ff, d] and one f32
scale per 32 values [n_ff, d/32] (the same numbers as GGUF's 34-byte blocks, with the scale split off so rows stay
aligned), and are dequantized in the kernel.

Two kernels, so that no two programs ever write the same output (GPU programs run concurrently):
  1. grid over blocks of `block_k` active neurons: gather their gate/up rows, write h [B, K];
  2. grid over tiles of `block_d` output columns: loop over all K neurons, accumulate h · W_down_t rows.
Only generic Pallas (BlockSpec, ref indexing, fori_loop), so the same code runs in interpret mode on a CPU and
compiles for a GPU (through Triton in JAX 0.11); tiles are powers of two as Triton requires.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

Q8_0_BLOCK = 32
# Written out rather than jax.nn.silu/relu: those are custom_jvp functions, which GPU lowering of a kernel rejects.
ACTIVATIONS = {"silu": lambda v: v / (1.0 + jnp.exp(-v)), "relu": lambda v: jnp.maximum(v, 0.0),
               "relu_sqr": lambda v: jnp.square(jnp.maximum(v, 0.0)), "identity": lambda v: v,
               "gelu_tanh": lambda v: 0.5 * v * (1.0 + jnp.tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)))}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_k: int = 32  # active neurons per program of kernel 1 (and per step of kernel 2's loop)
    block_d: int = 128  # output columns per program of kernel 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowWeights:
    """Neuron-major weight rows [n_ff, d]: floats (scales None) or Q8_0 values int8 with scales f32 [n_ff, d/32]."""

    values: jax.Array
    scales: jax.Array | None = None


def repack_q8_0(blocks: jax.Array, cols: int) -> RowWeights:
    """GGUF Q8_0 bytes [rows, cols/32*34] (| d:f16 | qs:int8[32] | per block) -> RowWeights."""
    rows = blocks.shape[0]
    b = blocks.reshape(rows, cols // Q8_0_BLOCK, 2 + Q8_0_BLOCK)
    scales = jax.lax.bitcast_convert_type(b[..., :2], jnp.float16).astype(jnp.float32)
    values = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).reshape(rows, cols)
    return RowWeights(values, scales)


def _dequantize_rows(values, scales):
    """[k, d] rows (and [k, d/32] scales) -> f32 [k, d]."""
    if scales is None:
        return values.astype(jnp.float32)
    k, d = values.shape
    blocks = values.astype(jnp.float32).reshape(k, d // Q8_0_BLOCK, Q8_0_BLOCK)
    return (blocks * scales[:, :, None]).reshape(k, d)


def _hidden_kernel(x_ref, idx_ref, gate_ref, up_ref, *refs, quantized, gate_act, up_act):
    # x_ref [B, d]; idx_ref [block_k]; gate_ref, up_ref whole [n_ff, d]; then, when quantized, their scales
    # [n_ff, d/32]; last, h_ref [B, block_k]
    *scale_refs, h_ref = refs
    gate_scale_ref, up_scale_ref = scale_refs if quantized else (None, None)
    idx = idx_ref[...]
    rows = jnp.maximum(idx, 0)  # padding (-1) reads row 0 and is zeroed below

    def gathered(w_ref, s_ref):
        return _dequantize_rows(w_ref[rows, :], None if s_ref is None else s_ref[rows, :])

    x = x_ref[...].astype(jnp.float32)
    gate = jax.lax.dot_general(x, gathered(gate_ref, gate_scale_ref), (((1,), (1,)), ((), ())))
    up = jax.lax.dot_general(x, gathered(up_ref, up_scale_ref), (((1,), (1,)), ((), ())))
    h = ACTIVATIONS[gate_act](gate) * ACTIVATIONS[up_act](up)
    h_ref[...] = jnp.where(idx[None, :] >= 0, h, 0.0)


def _down_kernel(h_ref, idx_ref, down_ref, *refs, quantized, block_k, block_d):
    # h_ref [B, K]; idx_ref [K]; down_ref whole [n_ff, d]; its scales [n_ff, d/32] when quantized;
    # last, o_ref [B, block_d]: this program's columns
    *scale_refs, o_ref = refs
    tile = pl.program_id(0)
    columns = pl.ds(tile * block_d, block_d)
    scale_columns = pl.ds(tile * (block_d // Q8_0_BLOCK), block_d // Q8_0_BLOCK)  # whole Q8_0 blocks of the tile

    def step(i, acc):
        neurons = pl.ds(i * block_k, block_k)
        rows = jnp.maximum(idx_ref[neurons], 0)
        scales = scale_refs[0][rows, scale_columns] if quantized else None
        return acc + jnp.dot(h_ref[:, neurons], _dequantize_rows(down_ref[rows, columns], scales))

    o_ref[...] = jax.lax.fori_loop(0, idx_ref.shape[0] // block_k, step, jnp.zeros(o_ref.shape, jnp.float32))


@functools.partial(jax.jit, static_argnames=("gate_act", "up_act", "block_sizes", "interpret"))
def sparse_ffn(x, idx, gate: RowWeights, up: RowWeights, down_t: RowWeights, *, gate_act="relu",
               up_act="identity", block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
    """x [B, d], idx [K] int32 (active neuron ids; -1 pads) -> out [B, d] f32. K must be a multiple of block_k and d
    of block_d (pad idx with -1; d of real models is a multiple of 128). All three weights are floats, or all Q8_0.
    Triton takes arrays whose sizes are powers of two, so B is padded up to one with zero rows."""
    tokens, d = x.shape
    b = 1 << (tokens - 1).bit_length()
    x = jnp.pad(x, ((0, b - tokens), (0, 0)))
    k = idx.shape[0]
    bk, bd = block_sizes.block_k, block_sizes.block_d
    quantized = gate.scales is not None
    assert k % bk == 0, f"{k=} must be a multiple of block_k={bk} (pad idx with -1)"
    assert d % bd == 0 and bd % Q8_0_BLOCK == 0, f"{d=} must be a multiple of block_d={bd}, itself of 32"
    assert (up.scales is not None) == quantized == (down_t.scales is not None), "mixed float and Q8_0 weights"
    whole = pl.BlockSpec(memory_space=pl.ANY)  # gathered by row inside the kernel

    def with_scales(*weights):
        return [w.values for w in weights] + ([w.scales for w in weights] if quantized else [])

    hidden_inputs = with_scales(gate, up)
    h = pl.pallas_call(
        functools.partial(_hidden_kernel, quantized=quantized, gate_act=gate_act, up_act=up_act),
        grid=(k // bk,),
        in_specs=[pl.BlockSpec((b, d), lambda i: (0, 0)), pl.BlockSpec((bk,), lambda i: (i,))]
        + [whole] * len(hidden_inputs),
        out_specs=pl.BlockSpec((b, bk), lambda i: (0, i)),
        out_shape=jax.ShapeDtypeStruct((b, k), jnp.float32),
        interpret=interpret,
        name="sparse_ffn_hidden",
    )(x, idx, *hidden_inputs)
    down_inputs = with_scales(down_t)
    return pl.pallas_call(
        functools.partial(_down_kernel, quantized=quantized, block_k=bk, block_d=bd),
        grid=(d // bd,),
        in_specs=[pl.BlockSpec((b, k), lambda j: (0, 0)), pl.BlockSpec((k,), lambda j: (0,))]
        + [whole] * len(down_inputs),
        out_specs=pl.BlockSpec((b, bd), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((b, d), jnp.float32),
        interpret=interpret,
        name="sparse_ffn_down",
    )(h, idx, *down_inputs)[:tokens]


def sparse_ffn_reference(x, idx, gate: RowWeights, up: RowWeights, down_t: RowWeights, *, gate_act="relu",
                         up_act="identity"):
    """Plain jnp: the same function, computed on the gathered rows without Pallas."""
    rows = jnp.maximum(idx, 0)

    def gathered(w: RowWeights):
        return _dequantize_rows(w.values[rows], None if w.scales is None else w.scales[rows])

    x = x.astype(jnp.float32)
    h = ACTIVATIONS[gate_act](x @ gathered(gate).T) * ACTIVATIONS[up_act](x @ gathered(up).T)
    h = jnp.where(idx[None, :] >= 0, h, 0.0)
    return h @ gathered(down_t)

"""Products with some experts' rows of a stacked expert weight (moe.py), read where they lie.

Expert e's rows of a projection stacked over the experts are rows e * count .. (e + 1) * count - 1 of one
QuantArray. Sliced out (quant.dynamic_row_range) they are a copy the step writes and then reads again: at
Qwen3-30B-A3B's width a decode step copied 8 experts x 3 projections of 0.9 MB (Q4_0) per layer before its products
read them.
Where cpu_ext multiplies by the weight (quant's rules: products "cpu_ext", a block type or F16, not exact), its
gather_matmul reads the rows through an index, in the stacked weight itself, with the dense products' arithmetic
(8-bit activations, as quant.matmul's kernels on the sliced rows): in GGUF's rows a row at a time, and where the
weight is repacked (repack.packs_experts: each expert's rows whole groups of eight) through the repacked kernels, an
expert's rows being consecutive groups. Elsewhere (XLA; F32, BF16 or exact weights) the rows are sliced and
multiplied. A down projection held a row per neuron (moe.down_rows_per_neuron) is summed over the experts' rows whose
hidden values are nonzero by cpu_ext's down_rows_gather_axpy, reading no other row (ranges_axpy).
"""

import jax
import jax.numpy as jnp

from jaxinfer import jax_compat, quant
from jaxinfer.quant import QuantArray, dynamic_row_range


def row_ranges(starts, count: int) -> jax.Array:
    """int32 [len(starts) * count]: rows starts[i] .. starts[i] + count - 1, range after range."""
    starts = jnp.asarray(starts, jnp.int32).reshape(-1)
    return (starts[:, None] + jax_compat.like(starts, jnp.arange(count, dtype=jnp.int32))).reshape(-1)


def ranges_matmul(x: jax.Array, w: QuantArray, starts, count: int) -> jax.Array:
    """x [..., cols] · w[rows]ᵀ -> f32 [..., len(starts) * count], rows = row_ranges(starts, count) (starts traced,
    each range inside w, or starting below 0: an expert another part of a split holds, whose outputs are 0). The
    kernel reads only those rows, in place (rows outside w are its padding: 0, never read); XLA multiplies by the
    slices."""
    kernels = quant._kernels(x, w, quant.DENSE_LAYOUTS)
    if kernels is not None:
        y = kernels.gather_matmul(x, w.data, row_ranges(starts, count), qtype=w.qtype, rows=w.shape[0],
                                  cols=w.shape[1], interleave=quant.interleave(w))
        return y if w.scale == 1.0 else y * w.scale
    starts = jnp.asarray(starts, jnp.int32).reshape(-1)
    parts = [jax_compat.where_zero(starts[i] >= 0, quant.matmul(x, dynamic_row_range(w, starts[i], count)))
             for i in range(starts.shape[0])]
    return jnp.concatenate(parts, axis=-1)


def ranges_axpy(h: jax.Array, w_t: QuantArray, starts, count: int) -> jax.Array:
    """Σ_i h[..., i] w_t[rows[i]] -> f32 [..., cols] for h [..., len(starts) * count], rows = row_ranges(starts,
    count) (starts traced; a range starting below 0: an expert another part of a split holds, left out): a product
    with a transposed weight (one row per neuron) over some experts' neurons. cpu_ext reads only the rows whose h is
    nonzero (w_t laid out as DOWN_ROWS), rounding each range's coefficients apart (an expert's alone, as a prompt's
    tiles take it); XLA multiplies by the slices."""
    kernels = quant._kernels(h, w_t, (quant.DOWN_ROWS,))
    if kernels is not None:
        return kernels.down_rows_gather_axpy(h, w_t.data, row_ranges(starts, count), qtype=w_t.qtype,
                                             rows=w_t.shape[0], cols=w_t.shape[1], segment=count)
    starts = jnp.asarray(starts, jnp.int32).reshape(-1)
    parts = [jax_compat.where_zero(starts[i] >= 0, quant.masked_axpy(h[..., i * count:(i + 1) * count],
                                                                      dynamic_row_range(w_t, starts[i], count), True))
             for i in range(starts.shape[0])]
    return sum(parts[1:], parts[0])


def expert_ffn(x: jax.Array, e, gate: QuantArray, up: QuantArray, down: QuantArray, activations, f: int) -> jax.Array:
    """Expert e's (traced) gated FFN of x [..., d] -> f32 [..., d]: down_e(gate_act(gate_e x) * up_act(up_e x)),
    reading only its rows of the stacked projections ([n_expert * f, d], [n_expert * f, d], [n_expert * d, f]; a
    down projection a row per neuron [n_expert * f, d]: the rows of the neurons the hidden values leave nonzero)."""
    gate_act, up_act = activations
    d = x.shape[-1]
    hidden = gate_act(ranges_matmul(x, gate, e * f, f)) * up_act(ranges_matmul(x, up, e * f, f))
    if down.layout == quant.DOWN_ROWS:
        return ranges_axpy(hidden, down, e * f, f)
    return ranges_matmul(hidden, down, e * d, d)


def routed_ffn(x: jax.Array, chosen: jax.Array, weights: jax.Array, gate: QuantArray, up: QuantArray,
               down: QuantArray, activations, f: int) -> jax.Array:
    """One token's mixture: x [1, d], chosen int [k], weights f32 [k] -> Σ_j weights[j] expert_ffn(x, chosen[j]),
    added in j's order. The k experts' gate and up rows are read in one call each, their down projections (each with
    its own input) in one segmented call (cpu_ext's; XLA: one product per expert); a down projection a row per neuron
    in one call over the routed experts' rows, the routing weights folded into the hidden values, so that only the
    rows of their nonzero neurons are read."""
    gate_act, up_act = activations
    k, d = chosen.shape[0], x.shape[-1]
    hidden = (gate_act(ranges_matmul(x, gate, chosen * f, f)) * up_act(ranges_matmul(x, up, chosen * f, f)))
    hidden = hidden.reshape(k, f)
    if down.layout == quant.DOWN_ROWS:
        return ranges_axpy((weights[:, None] * jax_compat.like(weights, hidden)).reshape(1, -1), down, chosen * f, f)
    kernels = quant._kernels(hidden, down, quant.DENSE_LAYOUTS)
    if kernels is not None:  # every expert's down rows in one call, each expert's with its own hidden values
        y = kernels.gather_matmul(hidden, down.data, row_ranges(chosen * d, d), qtype=down.qtype, rows=down.shape[0],
                                  cols=down.shape[1], segment=d,
                                  interleave=quant.interleave(down))  # [k, k d]: row j holds expert j's d outputs
        y = y if down.scale == 1.0 else y * down.scale
        per_expert = y.reshape(k, k, d).sum(axis=0)  # the blocks off the diagonal are zeros: an exact sum
        outs = [weights[j] * per_expert[j:j + 1] for j in range(k)]
    else:
        outs = [weights[j] * ranges_matmul(hidden[j:j + 1], down, chosen[j] * d, d) for j in range(k)]
    return sum(outs[1:], outs[0])

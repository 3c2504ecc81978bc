"""The gated FFN and its activation sparsity: which neurons run for a token is decided here, in one place.

    h = gate_act(x W_gateᵀ) * up_act(x W_upᵀ)          one value per neuron (n_ff of them)
    out = (h * active) W_downᵀ                          only active neurons contribute

`cfg.plan.ffn_sparsity` chooses `active`:
    dense      h != 0: ReLU models skip their natural zeros; nothing is skipped for SwiGLU
    predictor  fc2(relu(fc1 · ffn_inp)) >= cfg.sparse_threshold: PowerInfer's low-rank predictor, read before the
               FFN from the pre-norm residual, so gate, up and down rows of inactive neurons need not be read
    gate       |gate_act(gate)| > t_layer (CATS): the gate is computed densely, up and down rows skipped
    hidden     |h| > t_layer: gate and up are dense, only down rows are skipped (cheapest in quality)
Thresholds t_layer are calibrated per layer (jaxinfer.calibrate). Products with a mask go through quant.masked_matmul
and masked_axpy: off the CPU kernels they multiply the mask into dense results (the reference); cpu_ext's row-
skipping kernels read only the active rows and agree with it.

The FFN is a sum over its neurons, so it is the sum of the same FFN over any partition of them. A split model
(hybrid.py) holds each layer's neurons in parts, `Layer.ffn_parts`: the hot ones in device memory, the cold ones in
host memory, each in the layer's stored formats. `ffn` sums over the parts inside the one compiled program: a cold
part's inputs move to host memory, it runs under compute_on("device_host") with the Plan's host products (cpu_ext's
row-sparse kernels), and its output moves back. A hot part of a predictor model on a GPU runs the Pallas masked
sparse FFN (KernelPart). The predictor's input projection fc1 and the thresholds are shared by all parts.
"""

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp

from jaxinfer import jax_compat, quant
from jaxinfer.config import Config
from jaxinfer.quant import QuantArray, masked_axpy, masked_matmul, masked_matmuls, matmul, matmuls
from pallas_kernels import sparse_ffn as pallas_ffn

ACTIVATIONS = {"silu": jax.nn.silu, "relu": jax.nn.relu, "relu_sqr": lambda v: jnp.square(jax.nn.relu(v)),
               "gelu_tanh": partial(jax.nn.gelu, approximate=True), "identity": lambda v: v}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FFNTrace:
    """What one FFN call did, for profiling, calibration and predictor training (see model.forward's `observe`).
    For a split model the neurons come part after part (Layer.ffn_parts), not in the layer's order."""

    ffn_inp: jax.Array  # [..., d] pre-norm residual: the predictor's input
    gate: jax.Array  # [..., n_ff] gate_act(gate projection)
    hidden: jax.Array  # [..., n_ff] h before masking
    active: jax.Array  # [..., n_ff] bool
    # A mixture of experts with natural zeros (moe.ffn): [..., n_expert] int32, how many of each routed expert's
    # neurons the token leaves nonzero (0 for the experts it was not routed to); None otherwise.
    nonzero: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FFNPart:
    """Some of a layer's FFN neurons: their rows of gate and up and their down projection, each in the layer's stored
    format (hybrid.ffn_part)."""

    ffn_gate: QuantArray  # [n, d]
    ffn_up: QuantArray  # [n, d]
    ffn_down: QuantArray | None  # [d, n]
    ffn_down_t: QuantArray | None  # [n, d], one row per neuron
    on_host: bool = dataclasses.field(default=False, metadata=dict(static=True))  # in host memory (see above)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KernelPart:
    """A hot part laid out for the Pallas masked sparse FFN: neuron-major rows, Q8_0 (repacked) or float."""

    gate: pallas_ffn.RowWeights
    up: pallas_ffn.RowWeights
    down_t: pallas_ffn.RowWeights


def predictor_logits(ffn_inp, fc1: QuantArray, fc2: QuantArray):
    """PowerInfer's predictor: fc2(relu(fc1 x)), no biases. [..., d] -> [..., n_ff]."""
    return matmul(jax.nn.relu(matmul(ffn_inp, fc1)), fc2)


def down_projection(h, active, part):
    """Σ over active neurons of h · down -> [..., d]. From PowerInfer's transposed ffn_down_t [n_ff, d] (one row per
    neuron, so the rows of inactive neurons are never read) or from ffn_down [d, n_ff] (all of it is read)."""
    if part.ffn_down_t is not None:
        return masked_axpy(h, part.ffn_down_t, active)
    return matmul(jax_compat.where_zero(active, h), part.ffn_down)


def _part_ffn(x, decider, part: FFNPart, cfg: Config, trace: bool, hidden_norm=None):
    """One part's neurons: x [..., d] normed input; `decider` is what decides `active` beside x: the predicted
    `active` [..., n] itself for a predictor, the layer's threshold for gate/hidden, None for dense;
    `hidden_norm(h)`, if given, normalizes h before anything reads it (BitNet's ffn_sub_norm).
    -> out [..., d], and (gate, hidden, active) with `trace`.

    Each mode computes only what decides `active` densely, and the rest for active neurons only (masked kernels):
    in predictor mode gate and hidden are therefore 0 for inactive neurons."""
    gate_act, up_act = ACTIVATIONS[cfg.gate_activation], ACTIVATIONS[cfg.up_activation]
    projections = (part.ffn_gate,) if part.ffn_up is None else (part.ffn_gate, part.ffn_up)
    if cfg.plan.ffn_sparsity == "predictor":
        active = decider
        gate, *up = masked_matmuls(x, projections, active)
        gate = gate_act(gate)
        hidden = _normed(_times_up(gate, up, up_act), hidden_norm)
    elif cfg.plan.ffn_sparsity == "gate":
        gate = gate_act(matmul(x, part.ffn_gate))
        active = jnp.abs(gate) > decider
        up = [masked_matmul(x, w, active) for w in projections[1:]]
        hidden = _normed(_times_up(gate, up, up_act), hidden_norm)
    else:
        gate, *up = matmuls(x, projections)
        gate = gate_act(gate)
        hidden = _normed(_times_up(gate, up, up_act), hidden_norm)
        active = jnp.abs(hidden) > decider if cfg.plan.ffn_sparsity == "hidden" else hidden != 0
    out = down_projection(hidden, active, part)
    return (out, gate, hidden, active) if trace else (out,)


def _times_up(gate, up: list, up_act):
    """h: gate * up_act(up), or the gate alone in an FFN without an up projection (Falcon's; `up` is then [])."""
    return gate * up_act(up[0]) if up else gate


def _normed(hidden, hidden_norm):
    """h, or hidden_norm(h): an RMSNorm keeps zeros zero (ReLU-family FFNs stay sparse)."""
    return hidden if hidden_norm is None else hidden_norm(hidden)


def _host_part_ffn(x, decider, part: FFNPart, cfg: Config, trace: bool):
    """_part_ffn traced for the host: its products are the Plan's host products."""
    with quant.products(cfg.plan.host_products):
        return _part_ffn(x, decider, part, cfg, trace)


def _kernel_part_ffn(x, active, part: KernelPart, cfg: Config):
    """The predicted neurons of a hot part through the Pallas kernel. The kernel takes one neuron list for all
    tokens of a call: the union of their predictions (a decode step's own; a prefill computes, for each token, a few
    neurons predicted only for others, whose ReLU output is then mostly zero anyway)."""
    d = x.shape[-1]
    active = jnp.any(active.reshape(-1, active.shape[-1]), axis=0)
    blocks = pallas_ffn.BlockSizes(block_d=math.gcd(d, pallas_ffn.BlockSizes.block_d))
    padded = -(-active.shape[0] // blocks.block_k) * blocks.block_k
    idx = jnp.nonzero(active, size=padded, fill_value=-1)[0].astype(jnp.int32)
    out = pallas_ffn.sparse_ffn(x.reshape(-1, d), idx, part.gate, part.up, part.down_t,
                                gate_act=cfg.gate_activation, up_act=cfg.up_activation, block_sizes=blocks,
                                interpret=cfg.plan.hot_ffn == "pallas_interpret")
    return out.reshape(x.shape)


def layer_parts(layer) -> list:
    """The parts a layer's FFN neurons are held in: its `ffn_parts` when split, else one part of all of them."""
    if layer.ffn_parts is not None:
        return layer.ffn_parts
    return [FFNPart(layer.ffn_gate, layer.ffn_up, layer.ffn_down, layer.ffn_down_t)]


def _neurons(part) -> int:
    return part.gate.values.shape[0] if isinstance(part, KernelPart) else part.ffn_gate.shape[0]


def ffn(x, ffn_inp, layer, cfg: Config, trace: bool = True, hidden_norm=None):
    """x [..., d] (normed FFN input), ffn_inp [..., d] (pre-norm residual) -> ([..., d], FFNTrace or None), summed
    over the layer's parts; without `trace` the trace is None (a split's host parts then send back only their
    output). `hidden_norm(h)` normalizes the hidden values over all the layer's neurons: one part only."""
    if cfg.plan.ffn_sparsity == "predictor":
        predicted = predictor_logits(ffn_inp, layer.fc1, layer.fc2) >= cfg.sparse_threshold  # rows part by part
    threshold = layer.ffn_threshold if cfg.plan.ffn_sparsity in ("gate", "hidden") else None
    outs, traces, first = [], [], 0
    if hidden_norm is not None and len(layer_parts(layer)) > 1:
        raise ValueError("a norm over the FFN's hidden values (BitNet's ffn_sub_norm) needs all its neurons in one "
                         "part: not with a hot/cold split")
    for part in layer_parts(layer):
        n = _neurons(part)
        decider = predicted[..., first:first + n] if cfg.plan.ffn_sparsity == "predictor" else threshold
        first += n
        if isinstance(part, KernelPart):
            if trace:
                raise ValueError("a Pallas kernel part computes no FFN trace: observe an unsplit model")
            outs.append(_kernel_part_ffn(x, decider, part, cfg))
            continue
        if part.on_host:
            run = jax_compat.on_host(partial(_host_part_ffn, cfg=cfg, trace=trace))
            out, *traced = run(*jax_compat.to_host((x, decider)), part)
        else:
            out, *traced = _part_ffn(x, decider, part, cfg, trace, hidden_norm)
        outs.append(out)
        traces.append(traced)
    out = outs[0] if len(outs) == 1 else sum(outs[1:], outs[0])
    if not trace:
        return out, None
    gate, hidden, active = (jnp.concatenate(pieces, axis=-1) for pieces in zip(*traces))
    return out, FFNTrace(ffn_inp, gate, hidden, active)

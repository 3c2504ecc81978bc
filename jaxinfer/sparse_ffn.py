"""The gated FFN and its activation sparsity: which neurons run for a token is decided here, in one place.

    h = gate_act(x W_gateᵀ) * up_act(x W_upᵀ)          one value per neuron (n_ff of them)
    out = (h * active) W_downᵀ                          only active neurons contribute

`cfg.ffn_sparsity` chooses `active`:
    dense      h != 0: ReLU models skip their natural zeros; nothing is skipped for SwiGLU
    predictor  fc2(relu(fc1 · ffn_inp)) >= cfg.sparse_threshold: PowerInfer's low-rank predictor, read before the
               FFN from the pre-norm residual, so gate, up and down rows of inactive neurons need not be read
    gate       |gate_act(gate)| > t_layer (CATS): the gate is computed densely, up and down rows skipped
    hidden     |h| > t_layer: gate and up are dense, only down rows are skipped (cheapest in quality)
Thresholds t_layer are calibrated per layer (jaxinfer.calibrate). Products with a mask go through quant.masked_matmul
and masked_axpy: off the CPU kernels they multiply the mask into dense results (the reference); cpu_ext's row-
skipping kernels (and pallas_kernels' in hybrid.py) read only the active rows and agree with it.
"""

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.config import Config
from jaxinfer.quant import QuantArray, masked_axpy, masked_matmul, matmul, matmuls

ACTIVATIONS = {"silu": jax.nn.silu, "relu": jax.nn.relu, "identity": lambda v: v}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FFNTrace:
    """What one FFN call did, for profiling, calibration and predictor training (see model.forward's `observe`)."""

    ffn_inp: jax.Array  # [..., d] pre-norm residual: the predictor's input
    gate: jax.Array  # [..., n_ff] gate_act(gate projection)
    hidden: jax.Array  # [..., n_ff] h before masking
    active: jax.Array  # [..., n_ff] bool


def predictor_logits(ffn_inp, fc1: QuantArray, fc2: QuantArray):
    """PowerInfer's predictor: fc2(relu(fc1 x)), no biases. [..., d] -> [..., n_ff]."""
    return matmul(jax.nn.relu(matmul(ffn_inp, fc1)), fc2)


def down_projection(h, active, layer):
    """Σ over active neurons of h · down -> [..., d]. From PowerInfer's transposed ffn_down_t [n_ff, d] (one row per
    neuron, so the rows of inactive neurons are never read) or from ffn_down [d, n_ff] (all of it is read)."""
    if layer.ffn_down_t is not None:
        return masked_axpy(h, layer.ffn_down_t, active)
    return matmul(jnp.where(active, h, 0.0), layer.ffn_down)


def ffn(x, ffn_inp, layer, cfg: Config):
    """x [..., d] (normed FFN input), ffn_inp [..., d] (pre-norm residual) -> ([..., d], FFNTrace).

    Each mode computes only what decides `active` densely, and the rest for active neurons only (masked kernels):
    in predictor mode the trace's gate and hidden are therefore 0 for inactive neurons."""
    gate_act, up_act = ACTIVATIONS[cfg.gate_activation], ACTIVATIONS[cfg.up_activation]
    if cfg.ffn_sparsity == "predictor":
        active = predictor_logits(ffn_inp, layer.fc1, layer.fc2) >= cfg.sparse_threshold
        gate = gate_act(masked_matmul(x, layer.ffn_gate, active))
        hidden = gate * up_act(masked_matmul(x, layer.ffn_up, active))
    elif cfg.ffn_sparsity == "gate":
        gate = gate_act(matmul(x, layer.ffn_gate))
        active = jnp.abs(gate) > layer.ffn_threshold
        hidden = gate * up_act(masked_matmul(x, layer.ffn_up, active))
    else:
        gate, up = matmuls(x, (layer.ffn_gate, layer.ffn_up))
        gate = gate_act(gate)
        hidden = gate * up_act(up)
        active = jnp.abs(hidden) > layer.ffn_threshold if cfg.ffn_sparsity == "hidden" else hidden != 0
    out = down_projection(hidden, active, layer)
    return out, FFNTrace(ffn_inp, gate, hidden, active)

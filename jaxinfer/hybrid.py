"""Hot/cold hybrid execution: hot FFN neurons on the accelerator, cold ones on the host CPU, per layer, summed.

A split (placement.py) partitions each layer's neurons. The FFN is a sum over neurons,
    out = Σ_j active_j h_j down_j,
so it is the sum of the same FFN over any partition of its neurons: each part is an ordinary `Layer` whose gate, up,
down_t and predictor-output rows are that part's rows, run by the unchanged `sparse_ffn.ffn` on the device holding
them. Everything else (embedding lookup, attention, KV cache, norms, predictor input projection, output head) lives on
the accelerator.

Where things live is decided by one `Placement` (no device branches in model code): on a machine with a GPU, the GPU
and the host CPU; on a CPU-only machine, two CPU devices (`jax_num_cpu_devices >= 2`), which runs the same code and
lets CI test it. The host part's jit is dispatched before the accelerator part's, and both are asynchronous, so the
two overlap (§4a of the GPU study measured nearly full overlap; a `compute_on` single-jit variant is the next step).
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from jaxinfer import model, sparse_ffn
from jaxinfer.config import Config
from jaxinfer.errors import JaxinferError
from jaxinfer.quant import QuantArray, dequantize, take_rows


@dataclasses.dataclass(frozen=True)
class Placement:
    accelerator: jax.Device
    host: jax.Device

    @classmethod
    def detect(cls) -> "Placement":
        host_devices = jax.devices("cpu")
        if jax.default_backend() != "cpu":
            return cls(jax.devices()[0], host_devices[0])
        if len(host_devices) < 2:
            raise JaxinferError("a hybrid split on a CPU-only machine needs two CPU devices: set "
                                "JAX_NUM_CPU_DEVICES=2 (or XLA_FLAGS=--xla_force_host_platform_device_count=2)")
        return cls(host_devices[1], host_devices[0])


def _rows(w: QuantArray | None, rows: np.ndarray) -> QuantArray | None:
    if w is None:
        return None
    return QuantArray(jnp.take(w.data, jnp.asarray(rows), axis=0), w.qtype, (len(rows), w.shape[1]))


def transposed_down(layer: model.Layer) -> QuantArray:
    """The down projection one row per neuron. GGUF's ffn_down [d, n_ff] has neurons as columns, which quantized
    blocks (running along a row) cannot be sliced by, so it is decoded once and stored f32 [n_ff, d]."""
    if layer.ffn_down_t is not None:
        return layer.ffn_down_t
    values = dequantize(layer.ffn_down).T
    return QuantArray(values, GGMLQuantizationType.F32, tuple(values.shape))


def ffn_part(layer: model.Layer, rows: np.ndarray, device) -> model.Layer | None:
    """Just the FFN of the layer (and its predictor) restricted to neurons `rows`, on `device`; None for no rows."""
    if len(rows) == 0:
        return None
    no_attention = dict.fromkeys(("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"))
    part = model.Layer(**no_attention, ffn_gate=_rows(layer.ffn_gate, rows), ffn_up=_rows(layer.ffn_up, rows),
                       ffn_down=None, ffn_down_t=_rows(transposed_down(layer), rows), fc1=layer.fc1,
                       fc2=_rows(layer.fc2, rows), ffn_threshold=layer.ffn_threshold)
    return jax.device_put(part, device)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridWeights:
    dense: model.Weights  # everything on the accelerator; its layers' FFN rows are the hot parts
    hot: list[model.Layer | None]  # per layer, on the accelerator
    cold: list[model.Layer | None]  # per layer, on the host


def split_weights(weights: model.Weights, hot: list[np.ndarray], placement: Placement) -> HybridWeights:
    """Place `weights` for a split: `hot[i]` are layer i's neurons on the accelerator, the rest go to the host."""
    hot_parts, cold_parts = [], []
    for layer, hot_rows in zip(weights.layers, hot):
        n_ff = layer.ffn_gate.shape[0]
        cold_rows = np.setdiff1d(np.arange(n_ff), hot_rows)
        hot_parts.append(ffn_part(layer, np.asarray(hot_rows), placement.accelerator))
        cold_parts.append(ffn_part(layer, cold_rows, placement.host))
    without_ffn = [dataclasses.replace(layer, ffn_gate=None, ffn_up=None, ffn_down=None, ffn_down_t=None, fc1=None,
                                       fc2=None) for layer in weights.layers]
    dense = jax.device_put(dataclasses.replace(weights, layers=without_ffn), placement.accelerator)
    return HybridWeights(dense, hot_parts, cold_parts)


def ffn_bytes(parts: list[model.Layer | None]) -> int:
    return sum(w.nbytes for p in parts if p is not None for w in (p.ffn_gate, p.ffn_up, p.ffn_down_t))


@partial(jax.jit, donate_argnames=("cache",))
def _attention(x, layer, index, positions, cache, cfg: Config):
    """One layer's attention with the residual; index is traced, so all layers share one executable."""
    attn_out, cache = model.attention_block(model.rms_norm(x, layer.attn_norm, cfg.rms_eps), layer, index, positions,
                                            cache, cfg)
    x = x + attn_out
    return x, model.rms_norm(x, layer.ffn_norm, cfg.rms_eps), cache


@jax.jit
def _ffn(normed, ffn_inp, part, cfg: Config):
    return sparse_ffn.ffn(normed, ffn_inp, part, cfg)[0]


def forward(tokens, hw: HybridWeights, cfg: Config, cache: model.KVCache, placement: Placement):
    """model.forward with the FFN split: tokens [B, T] after the cache's positions -> (normed hidden, cache)."""
    positions = cache.length + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x = _embed(jax.device_put(tokens, placement.accelerator), hw.dense.token_embd)
    for index, (layer, hot, cold) in enumerate(zip(hw.dense.layers, hw.hot, hw.cold)):
        x, normed, cache = _attention(x, layer, jnp.int32(index), positions, cache, cfg)
        cold_out = None
        if cold is not None:  # dispatched first: the host works while the accelerator runs the hot part
            cold_out = _ffn(jax.device_put(normed, placement.host), jax.device_put(x, placement.host), cold, cfg)
        if hot is not None:
            x = x + _ffn(normed, x, hot, cfg)
        if cold_out is not None:
            x = x + jax.device_put(cold_out, placement.accelerator)
    return _final_norm(x, hw.dense.output_norm, cfg), cache


@jax.jit
def _embed(tokens, token_embd):
    return take_rows(token_embd, tokens)


@jax.jit
def _final_norm(x, gamma, cfg: Config):
    return model.rms_norm(x, gamma, cfg.rms_eps)


@jax.jit
def _last_logits(hidden, n_valid, weights: model.Weights):
    last = jax.lax.dynamic_index_in_dim(hidden, n_valid - 1, axis=1, keepdims=False)
    return model.logits(last, weights)


def prefill(tokens, n_valid, hw: HybridWeights, cache: model.KVCache, cfg: Config, placement: Placement):
    """model.prefill for a split model: (logits after the last real token, cache advanced by n_valid)."""
    hidden, cache = forward(tokens, hw, cfg, cache, placement)
    return _last_logits(hidden, n_valid, hw.dense), dataclasses.replace(cache, length=cache.length + n_valid)


def decode_step(tokens, hw: HybridWeights, cache: model.KVCache, cfg: Config, placement: Placement):
    """model.decode_step for a split model."""
    return prefill(tokens[:, None], jnp.int32(1), hw, cache, cfg, placement)

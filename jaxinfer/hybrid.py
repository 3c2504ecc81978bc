"""Hot/cold hybrid execution: hot FFN neurons on the accelerator, cold ones on the host CPU, per layer, summed.

A split (placement.py) partitions each layer's neurons. The FFN is a sum over neurons,
    out = Σ_j active_j h_j down_j,
so it is the sum of the same FFN over any partition of its neurons: each part is an ordinary `Layer` whose gate, up,
down and predictor-output rows are that part's rows, run by the unchanged `sparse_ffn.ffn` on the device holding
them. Every part keeps the stored format and values of its weights (a down projection quantized across neurons is
split by whole blocks: unit_neurons), and placement_costs prices exactly what split_weights places. Everything else
(embedding lookup, attention, KV cache, norms, predictor input projection, output head) lives on the accelerator.

Where things live and which kernels run is decided by one `Placement` (no device branches in model code): on a
machine with a GPU, the GPU and the host CPU; on a CPU-only machine, two CPU devices (`jax_num_cpu_devices >= 2`),
which runs the same code and lets CI test it. The host part is traced for the CPU, so its predicted neurons go
through cpu_ext's row-sparse kernels (only active rows are read); with a predictor, the accelerator part runs the
Pallas masked sparse FFN (`pallas_kernels/sparse_ffn.py`) on a GPU. The host part's jit is dispatched before the
accelerator part's, and both are asynchronous, so the two overlap (§4a of the GPU study measured nearly full
overlap; a `compute_on` single-jit variant is the next step).
"""

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxinfer import model, sparse_ffn
from jaxinfer.config import Config
from jaxinfer.errors import JaxinferError
from jaxinfer.placement import ModelCosts
from jaxinfer.quant import FLOAT_TYPES, NEURON_MAJOR, ROW_BLOCKS, QuantArray, take_rows, tracing_for, tree_nbytes
from pallas_kernels import sparse_ffn as pallas_ffn


@dataclasses.dataclass(frozen=True)
class Placement:
    accelerator: jax.Device
    host: jax.Device
    # How the accelerator runs its hot neurons when a predictor decides them: "pallas" (pallas_kernels.sparse_ffn,
    # reading only the predicted rows), "pallas_interpret" (the same, interpreted: tests) or "xla" (sparse_ffn.ffn).
    hot_ffn_kernel: str = "xla"

    @classmethod
    def detect(cls) -> "Placement":
        host_devices = jax.devices("cpu")
        if jax.default_backend() != "cpu":
            return cls(jax.devices()[0], host_devices[0], "pallas" if jax.default_backend() == "gpu" else "xla")
        if len(host_devices) < 2:
            raise JaxinferError("a hybrid split on a CPU-only machine needs two CPU devices: set "
                                "JAX_NUM_CPU_DEVICES=2 (or XLA_FLAGS=--xla_force_host_platform_device_count=2)")
        return cls(host_devices[1], host_devices[0])


def _rows(w: QuantArray | None, rows: np.ndarray) -> QuantArray | None:
    if w is None:
        return None
    return dataclasses.replace(w, data=jnp.take(w.data, jnp.asarray(rows), axis=0), shape=(len(rows), w.shape[1]))


NEURON_MAJOR_BLOCK = 32  # neurons per block of quant.pack_neuron_major


def unit_neurons(layer: model.Layer) -> int:
    """How many consecutive neurons move together between accelerator and host, so that every part keeps the layer's
    own down projection bytes: 1 where it has one row per neuron (ffn_down_t, or a float ffn_down, transposed
    exactly); a quantized ffn_down [d, n_ff] has blocks running across neurons, and a neuron-major packing (quant.py)
    shares scales among 32 neurons, so their parts hold whole blocks."""
    if layer.ffn_down_t is not None:
        return NEURON_MAJOR_BLOCK if layer.ffn_down_t.layout == NEURON_MAJOR else 1
    return 1 if layer.ffn_down.qtype in FLOAT_TYPES else GGML_QUANT_SIZES[layer.ffn_down.qtype][0]


def _down_part(layer: model.Layer, rows: np.ndarray) -> dict:
    """The down projection of neurons `rows` (whole units, see unit_neurons) in the layer's own format and values:
    {"ffn_down": ...} or {"ffn_down_t": ...} of the part."""
    down, down_t = layer.ffn_down, layer.ffn_down_t
    if down_t is not None and down_t.layout == ROW_BLOCKS:
        return {"ffn_down_t": _rows(down_t, rows)}
    unit = unit_neurons(layer)
    if unit == 1:  # a float ffn_down: its transpose is exact, one row per neuron
        return {"ffn_down_t": _rows(QuantArray(down.data.T, down.qtype, down.shape[::-1], down.exact), rows)}
    blocks = jnp.asarray(rows[::unit] // unit)
    if down_t is not None:  # neuron-major: one run of bytes per block of 32 neurons
        return {"ffn_down_t": dataclasses.replace(down_t, data=jnp.take(down_t.data, blocks, axis=0),
                                                  shape=(len(rows), down_t.shape[1]))}
    d, n_ff = down.shape
    per_block = down.data.reshape(d, n_ff // unit, -1)  # [d, blocks across neurons, block bytes]
    data = jnp.take(per_block, blocks, axis=1).reshape(d, -1)
    return {"ffn_down": dataclasses.replace(down, data=data, shape=(d, len(rows)))}


def _row_bytes(w: QuantArray) -> int:
    """Bytes of one row of a weight whose rows can be sliced (layout ROW_BLOCKS)."""
    return w.nbytes // w.shape[0]


def _down_unit_bytes(layer: model.Layer) -> int:
    """Bytes of one unit's down projection as _down_part places it."""
    down = layer.ffn_down if layer.ffn_down_t is None else layer.ffn_down_t
    n_ff = layer.ffn_gate.shape[0]
    return down.nbytes // (n_ff // unit_neurons(layer))


def unit_bytes(layer: model.Layer, kernel: bool = False) -> int:
    """Bytes one unit of `layer`'s neurons takes in a part as split_weights places it: the rows of gate, up, the
    down projection (laid out for the Pallas kernel with `kernel`, where it takes their types, see kernel_part) and
    the predictor's output projection."""
    unit = unit_neurons(layer)
    predictor = 0 if layer.fc2 is None else _row_bytes(layer.fc2)
    if kernel and _kernel_takes(layer.ffn_gate, layer.ffn_up, layer.ffn_down_t) == "q8_0":
        d = layer.ffn_gate.shape[1]
        return 3 * (d + 4 * (d // pallas_ffn.Q8_0_BLOCK)) + predictor  # int8 values and an f32 scale per block
    return unit * (_row_bytes(layer.ffn_gate) + _row_bytes(layer.ffn_up) + predictor) + _down_unit_bytes(layer)


def _uses_kernel(devices: "Placement", cfg: Config | None) -> bool:
    return cfg is not None and cfg.ffn_sparsity == "predictor" and devices.hot_ffn_kernel != "xla"


def placement_costs(weights: model.Weights, cfg: Config, devices: "Placement", kv_bytes: int) -> ModelCosts:
    """What split_weights will place on the accelerator, for placement.solve: the dense part (everything but the
    FFN neurons' rows; each layer's predictor input projection fc1 and threshold, which a hot part carries, are
    counted for every layer) and each layer's units of neurons (unit_neurons, unit_bytes)."""
    shared = [(layer.fc1, layer.ffn_threshold) for layer in weights.layers]
    dense = tree_nbytes(_without_ffn(weights)) + tree_nbytes(shared)
    kernel = _uses_kernel(devices, cfg)
    per_unit = np.array([unit_bytes(layer, kernel) for layer in weights.layers], np.int64)
    units = np.array([unit_neurons(layer) for layer in weights.layers], np.int64)
    return ModelCosts(cfg.n_ff, per_unit, dense, kv_bytes, units)


def ffn_part(layer: model.Layer, rows: np.ndarray, device) -> model.Layer | None:
    """Just the FFN of the layer (and its predictor) restricted to neurons `rows`, whole units of unit_neurons, on
    `device`; None for no rows."""
    if len(rows) == 0:
        return None
    unit = unit_neurons(layer)
    starts = rows[::unit]
    if len(rows) % unit or np.any(starts % unit) or np.any(rows.reshape(-1, unit) != starts[:, None] + np.arange(unit)):
        raise ValueError(f"a part of this layer holds whole aligned units of {unit} neurons (its down projection's "
                         f"blocks)")
    no_attention = dict.fromkeys(("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm"))
    part = model.Layer(**no_attention, ffn_gate=_rows(layer.ffn_gate, rows), ffn_up=_rows(layer.ffn_up, rows),
                       **{"ffn_down": None, "ffn_down_t": None, **_down_part(layer, rows)}, fc1=layer.fc1,
                       fc2=_rows(layer.fc2, rows), ffn_threshold=layer.ffn_threshold)
    return jax.device_put(part, device)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KernelPart:
    """A hot part laid out for the Pallas sparse FFN kernel: neuron-major rows, Q8_0 (repacked) or float."""

    gate: pallas_ffn.RowWeights
    up: pallas_ffn.RowWeights
    down_t: pallas_ffn.RowWeights
    fc1: QuantArray
    fc2: QuantArray  # [n_hot, rank]: the predictor rows of this part's neurons


def _kernel_takes(gate: QuantArray, up: QuantArray, down_t: QuantArray | None) -> str | None:
    """"q8_0" or "float" where the Pallas kernel takes these weights (rows per neuron, one kind of type), else None."""
    if down_t is None or down_t.layout != ROW_BLOCKS:
        return None
    types = {w.qtype for w in (gate, up, down_t)}
    if types == {GGMLQuantizationType.Q8_0}:
        return "q8_0"
    return "float" if types <= {GGMLQuantizationType.F32, GGMLQuantizationType.F16} else None


def kernel_part(part: model.Layer) -> KernelPart | None:
    """`part` in the Pallas kernel's layout, or None where the kernel does not take its weights."""
    weights = (part.ffn_gate, part.ffn_up, part.ffn_down_t)
    kind = _kernel_takes(*weights)
    if kind == "q8_0":
        rows = [pallas_ffn.repack_q8_0(w.data, w.shape[1]) for w in weights]
    elif kind == "float":
        rows = [pallas_ffn.RowWeights(w.data) for w in weights]
    else:
        return None
    return KernelPart(*rows, part.fc1, part.fc2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class HybridWeights:
    dense: model.Weights  # everything on the accelerator; its layers' FFN rows are the hot parts
    hot: list[model.Layer | KernelPart | None]  # per layer, on the accelerator
    cold: list[model.Layer | None]  # per layer, on the host


def split_weights(weights: model.Weights, hot: list[np.ndarray], placement: Placement,
                  cfg: Config | None = None) -> HybridWeights:
    """Place `weights` for a split: `hot[i]` are layer i's neurons on the accelerator, the rest go to the host.
    With a predictor (`cfg.ffn_sparsity == "predictor"`) and a Pallas `placement.hot_ffn_kernel`, hot parts whose
    types the kernel takes are laid out for it."""
    use_kernel = _uses_kernel(placement, cfg)
    hot_parts, cold_parts = [], []
    for layer, hot_rows in zip(weights.layers, hot):
        n_ff = layer.ffn_gate.shape[0]
        cold_rows = np.setdiff1d(np.arange(n_ff), hot_rows)
        part = ffn_part(layer, np.asarray(hot_rows), placement.accelerator)
        if part is not None and use_kernel:
            part = kernel_part(part) or part  # types the kernel does not take stay with sparse_ffn.ffn
        hot_parts.append(part)
        cold_parts.append(ffn_part(layer, cold_rows, placement.host))
    dense = _without_ffn(weights)
    tied = dense.output is dense.token_embd
    dense = jax.device_put(dataclasses.replace(dense, output=None if tied else dense.output), placement.accelerator)
    if tied:  # one copy: device_put would transfer the shared arrays twice
        dense = dataclasses.replace(dense, output=dense.token_embd)
    return HybridWeights(dense, hot_parts, cold_parts)


def _without_ffn(weights: model.Weights) -> model.Weights:
    """`weights` less the FFN neurons' arrays: what the accelerator holds for every token."""
    layers = [dataclasses.replace(layer, ffn_gate=None, ffn_up=None, ffn_down=None, ffn_down_t=None, fc1=None,
                                  fc2=None) for layer in weights.layers]
    return dataclasses.replace(weights, layers=layers)


def ffn_bytes(parts: list[model.Layer | KernelPart | None]) -> int:
    """Bytes of the parts' neuron rows (gate, up, down and predictor output): what placement.solve priced."""
    def rows(p):
        if isinstance(p, KernelPart):
            return p.gate, p.up, p.down_t, p.fc2
        return p.ffn_gate, p.ffn_up, p.ffn_down, p.ffn_down_t, p.fc2

    return sum(a.size * a.dtype.itemsize for p in parts if p is not None for a in jax.tree.leaves(rows(p)))


@partial(jax.jit, donate_argnames=("cache",))
def _attention(x, layer, index, positions, cache, cfg: Config):
    """One layer's attention with the residual; index is traced, so all layers share one executable."""
    attn_out, cache = model.attention_block(model.rms_norm(x, layer.attn_norm, cfg.rms_eps), layer, index, positions,
                                            cache, cfg)
    x = x + attn_out
    return x, model.rms_norm(x, layer.ffn_norm, cfg.rms_eps), cache


@partial(jax.jit, static_argnames=("platform", "kernel"))
def _ffn(normed, ffn_inp, part, cfg: Config, platform: str, kernel: str = "xla"):
    """One part's FFN, traced for the platform of the device it runs on (the host part of a GPU machine runs
    cpu_ext's row-sparse kernels)."""
    if isinstance(part, KernelPart):
        return _kernel_ffn(normed, ffn_inp, part, cfg, interpret=kernel == "pallas_interpret")
    with tracing_for(platform):
        return sparse_ffn.ffn(normed, ffn_inp, part, cfg)[0]


def _kernel_ffn(normed, ffn_inp, part: KernelPart, cfg: Config, interpret: bool):
    """The predicted neurons of a hot part through the Pallas kernel. The kernel takes one neuron list for all
    tokens of a call: the union of their predictions (a decode step's own; a prefill computes, for each token, a few
    neurons predicted only for others, whose ReLU output is then mostly zero anyway)."""
    d = normed.shape[-1]
    x, inp = normed.reshape(-1, d), ffn_inp.reshape(-1, d)
    active = jnp.any(sparse_ffn.predictor_logits(inp, part.fc1, part.fc2) >= cfg.sparse_threshold, axis=0)
    blocks = pallas_ffn.BlockSizes(block_d=math.gcd(d, pallas_ffn.BlockSizes.block_d))
    padded = -(-active.shape[0] // blocks.block_k) * blocks.block_k
    idx = jnp.nonzero(active, size=padded, fill_value=-1)[0].astype(jnp.int32)
    out = pallas_ffn.sparse_ffn(x, idx, part.gate, part.up, part.down_t, gate_act=cfg.gate_activation,
                                up_act=cfg.up_activation, block_sizes=blocks, interpret=interpret)
    return out.reshape(normed.shape)


def forward(tokens, hw: HybridWeights, cfg: Config, cache: model.KVCache, placement: Placement):
    """model.forward with the FFN split: tokens [B, T] after the cache's positions -> (normed hidden, cache)."""
    positions = cache.length + jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x = _embed(jax.device_put(tokens, placement.accelerator), hw.dense.token_embd)
    for index, (layer, hot, cold) in enumerate(zip(hw.dense.layers, hw.hot, hw.cold)):
        x, normed, cache = _attention(x, layer, jnp.int32(index), positions, cache, cfg)
        cold_out = None
        if cold is not None:  # dispatched first: the host works while the accelerator runs the hot part
            cold_out = _ffn(jax.device_put(normed, placement.host), jax.device_put(x, placement.host), cold, cfg,
                            placement.host.platform)
        if hot is not None:
            x = x + _ffn(normed, x, hot, cfg, placement.accelerator.platform, placement.hot_ffn_kernel)
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

"""Hot/cold split: a layer's FFN neurons in two parts, the hot ones in device memory and the cold ones in host
memory, in the one model (model.Layer.ffn_parts) that the one forward runs (sparse_ffn.ffn sums over the parts).

A split (placement.py) partitions each layer's neurons. The FFN is a sum over neurons,
    out = Σ_j active_j h_j down_j,
so it is the sum of the same FFN over any partition of its neurons: each part holds that part's rows of gate, up,
down and predictor output, in the stored format and values of its weights (a down projection quantized across
neurons is split by whole blocks: unit_neurons), and placement_costs prices exactly what split_weights places.
Everything else (embedding, attention, KV cache, norms, predictor input projection, output head) stays in device
memory. Which memory and kernels each part gets is the model's Plan (plan.py): cold parts in `pinned_host` run under
compute_on("device_host") through cpu_ext's row-sparse kernels, inside the same compiled step as the rest; with a
predictor on a GPU, hot parts are laid out for the Pallas masked sparse FFN (KernelPart).
"""

import dataclasses

import jax
import numpy as np
from gguf import GGMLQuantizationType

from jaxinfer import model, moe, quant, repack
from jaxinfer.config import Config
from jaxinfer.placement import ModelCosts
from jaxinfer.quant import DOWN_ROWS, FLOAT_TYPES, NEURON_MAJOR, ROW_LAYOUTS, QuantArray, tree_nbytes
from jaxinfer.ternary import QUANT_SIZES
from jaxinfer.sparse_ffn import FFNPart, KernelPart
from pallas_kernels import sparse_ffn as pallas_ffn


# Parts are cut with numpy on the host, where the cold ones go anyway: jnp.take would compile a program per weight
# shape on first use (1.3 s of the small synthetic model's 1.4 s split, against 0.06 s once compiled).
def _rows(w: QuantArray | None, rows: np.ndarray) -> QuantArray | None:
    if w is None:
        return None
    return dataclasses.replace(w, data=np.take(np.asarray(w.data), rows, axis=0), shape=(len(rows), w.shape[1]))


def unit_neurons(layer: model.Layer) -> int:
    """How many consecutive neurons move together between accelerator and host, so that every part keeps the layer's
    own down projection bytes: 1 where it has one row per neuron (ffn_down_t, or a float ffn_down, transposed
    exactly); a quantized ffn_down [d, n_ff] has blocks running across neurons, and a neuron-major packing (quant.py)
    shares scales among 32 neurons, so their parts hold whole blocks."""
    if layer.ffn_down_t is not None:
        return quant.NEURON_BLOCK if layer.ffn_down_t.layout == NEURON_MAJOR else 1
    return 1 if layer.ffn_down.qtype in FLOAT_TYPES else QUANT_SIZES[layer.ffn_down.qtype][0]


def _down_part(layer: model.Layer, rows: np.ndarray) -> dict:
    """The down projection of neurons `rows` (whole units, see unit_neurons) in the layer's own format and values:
    {"ffn_down": ...} or {"ffn_down_t": ...} of the part."""
    down, down_t = layer.ffn_down, layer.ffn_down_t
    if down_t is not None and down_t.layout in ROW_LAYOUTS:
        return {"ffn_down_t": _rows(down_t, rows)}
    unit = unit_neurons(layer)
    if unit == 1:  # a float ffn_down: its transpose is exact, one row per neuron
        transposed = np.asarray(down.data).T
        return {"ffn_down_t": _rows(QuantArray(transposed, down.qtype, down.shape[::-1], down.exact), rows)}
    blocks = rows[::unit] // unit
    if down_t is not None:  # neuron-major: one run of bytes per block of 32 neurons
        return {"ffn_down_t": dataclasses.replace(down_t, data=np.take(np.asarray(down_t.data), blocks, axis=0),
                                                  shape=(len(rows), down_t.shape[1]))}
    d, n_ff = down.shape
    per_block = np.asarray(down.data).reshape(d, n_ff // unit, -1)  # [d, blocks across neurons, block bytes]
    data = np.take(per_block, blocks, axis=1).reshape(d, -1)
    return {"ffn_down": dataclasses.replace(down, data=data, shape=(d, len(rows)))}


def _row_bytes(w: QuantArray) -> int:
    """Bytes of one row of a weight whose rows can be sliced (quant.ROW_LAYOUTS)."""
    return w.nbytes // w.shape[0]


def _down_unit_bytes(layer: model.Layer) -> int:
    """Bytes of one unit's down projection as _down_part places it."""
    down = layer.ffn_down if layer.ffn_down_t is None else layer.ffn_down_t
    n_ff = layer.ffn_gate.shape[0]
    return down.nbytes // (n_ff // unit_neurons(layer))


def unit_bytes(layer: model.Layer, kernel: bool = False) -> int:
    """Bytes one unit of `layer`'s neurons takes in a part as split_weights places it: the rows of gate, up and the
    down projection (laid out for the Pallas kernel with `kernel`, where it takes their types, see kernel_part)."""
    unit = unit_neurons(layer)
    if kernel and kernel_takes(layer.ffn_gate, layer.ffn_up, layer.ffn_down_t) == "q8_0":
        d = layer.ffn_gate.shape[1]
        return 3 * (d + 4 * (d // pallas_ffn.Q8_0_BLOCK))  # int8 values and an f32 scale per block
    inputs = (layer.ffn_gate,) if layer.ffn_up is None else (layer.ffn_gate, layer.ffn_up)  # Falcon's: no up
    return unit * sum(_row_bytes(w) for w in inputs) + _down_unit_bytes(layer)


def _uses_kernel(cfg: Config) -> bool:
    return cfg.plan.ffn_sparsity == "predictor" and cfg.plan.hot_ffn != "xla"


def expert_bytes(experts: moe.Experts) -> int:
    """Bytes of one expert's rows of the stacked gate, up and down projections: a mixture's unit of placement."""
    return sum(w.nbytes for w in (experts.gate, experts.up, experts.down)) // experts.router.shape[0]


def placement_costs(weights: model.Weights, cfg: Config, kv_bytes: int) -> ModelCosts:
    """What split_weights will place in device memory, for placement.solve: the dense part (everything but the FFN
    neurons' rows, the predictors and thresholds included) and each layer's units of neurons (unit_neurons,
    unit_bytes). A mixture of experts places whole experts: a unit is one expert (its router stays with the dense
    part)."""
    if cfg.n_expert:
        per_expert = np.array([expert_bytes(layer.experts) for layer in weights.layers], np.int64)
        return ModelCosts(cfg.n_expert, per_expert, tree_nbytes(_without_ffn(weights)), kv_bytes)
    kernel = _uses_kernel(cfg)
    per_unit = np.array([unit_bytes(layer, kernel) for layer in weights.layers], np.int64)
    units = np.array([unit_neurons(layer) for layer in weights.layers], np.int64)
    return ModelCosts(cfg.n_ff, per_unit, tree_nbytes(_without_ffn(weights)), kv_bytes, units)


def ffn_part(layer: model.Layer, rows: np.ndarray, on_host: bool = False) -> FFNPart | None:
    """The layer's FFN neurons `rows` (whole units of unit_neurons) as a part; None for no rows. An FFN repacked at
    load is read in GGUF's rows (repack.ffn_rows): a part is rows."""
    if len(rows) == 0:
        return None
    layer = repack.ffn_rows(layer)
    unit = unit_neurons(layer)
    starts = rows[::unit]
    if len(rows) % unit or np.any(starts % unit) or np.any(rows.reshape(-1, unit) != starts[:, None] + np.arange(unit)):
        raise ValueError(f"a part of this layer holds whole aligned units of {unit} neurons (its down projection's "
                         f"blocks)")
    down = {"ffn_down": None, "ffn_down_t": None, **_down_part(layer, rows)}
    return FFNPart(_rows(layer.ffn_gate, rows), _rows(layer.ffn_up, rows), down["ffn_down"], down["ffn_down_t"],
                   on_host)


def kernel_takes(gate: QuantArray, up: QuantArray, down_t: QuantArray | None) -> str | None:
    """"q8_0" or "float" where the Pallas kernel takes these weights (rows per neuron, one kind of type), else None."""
    if down_t is None or up is None or down_t.layout not in ROW_LAYOUTS:  # the kernel multiplies a gate by an up
        return None
    types = {w.qtype for w in (gate, up, down_t)}
    if types == {GGMLQuantizationType.Q8_0}:
        return "q8_0"
    return "float" if types <= {GGMLQuantizationType.F32, GGMLQuantizationType.F16} else None


def kernel_part(part: FFNPart) -> KernelPart | None:
    """`part` in the Pallas kernel's layout, or None where the kernel does not take its weights."""
    down_t = part.ffn_down_t
    if down_t is not None and down_t.layout == DOWN_ROWS:  # the Pallas kernel reads GGUF's rows
        down_t = quant.unpack_down_rows(dataclasses.replace(down_t, data=np.asarray(down_t.data)))
    weights = (part.ffn_gate, part.ffn_up, down_t)
    kind = kernel_takes(*weights)
    if kind == "q8_0":
        rows = [pallas_ffn.repack_q8_0(w.data, w.shape[1]) for w in weights]
    elif kind == "float":
        rows = [pallas_ffn.RowWeights(w.data) for w in weights]
    else:
        return None
    return KernelPart(*rows)


def split_weights(weights: model.Weights, hot: list[np.ndarray], cfg: Config) -> model.Weights:
    """`weights` with each layer's FFN in parts: `hot[i]`, layer i's neurons kept in device memory, and the rest in
    host memory (cfg.plan.host_memory_kind of the same device). The predictor stays whole in device memory, its
    output rows reordered part after part (one product decides every part's neurons). With a predictor and a Pallas
    `cfg.plan.hot_ffn`, hot parts whose types the kernel takes are laid out for it."""
    device = jax.devices()[0]
    in_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    in_host = jax.sharding.SingleDeviceSharding(device, memory_kind=cfg.plan.host_memory_kind)
    layers = []
    for layer, hot_rows in zip(weights.layers, hot):
        hot_rows = np.asarray(hot_rows)
        if layer.experts is not None:
            layers.append(dataclasses.replace(layer, experts=split_experts(layer.experts, hot_rows, in_device,
                                                                           in_host)))
            continue
        cold_rows = np.setdiff1d(np.arange(layer.ffn_gate.shape[0]), hot_rows)
        hot_part, cold_part = ffn_part(layer, hot_rows), ffn_part(layer, cold_rows, on_host=True)
        if hot_part is not None and _uses_kernel(cfg):
            hot_part = kernel_part(hot_part) or hot_part  # types the kernel does not take stay with XLA/cpu_ext
        parts = [jax.device_put(hot_part, in_device)] if hot_part is not None else []
        parts += [jax.device_put(cold_part, in_host)] if cold_part is not None else []
        order = np.concatenate([hot_rows, cold_rows])
        fc2 = None if layer.fc2 is None else jax.device_put(quant.take_rows_in_layout(layer.fc2, order), in_device)
        layers.append(dataclasses.replace(_without_ffn_rows(layer), fc2=fc2, ffn_parts=parts))
    return dataclasses.replace(weights, layers=layers)


def _expert_rows(w: QuantArray, experts: np.ndarray, n_expert: int) -> QuantArray:
    """The rows of `experts` (in that order) of a projection stacked over n_expert experts: each expert's data rows
    (its rows; repacked, its groups; a neuron-major down projection, its spans of 32 neurons: moe.py)."""
    per_expert = w.data.shape[0] // n_expert
    data = np.take(np.asarray(w.data), (experts[:, None] * per_expert + np.arange(per_expert)).reshape(-1), axis=0)
    return dataclasses.replace(w, data=data, shape=(len(experts) * w.shape[0] // n_expert, w.shape[1]))


def split_experts(experts: moe.Experts, hot: np.ndarray, in_device, in_host) -> moe.Experts:
    """`experts` with the experts `hot` in device memory and the rest in host memory, each part stacked in expert
    order as the file stacks them; the router stays where it was."""
    n = experts.router.shape[0]
    parts = []
    for ids, on_host, memory in ((hot, False, in_device), (np.setdiff1d(np.arange(n), hot), True, in_host)):
        if len(ids) == 0:
            continue
        local = np.full(n, -1, np.int32)
        local[ids] = np.arange(len(ids), dtype=np.int32)
        projections = [jax.device_put(_expert_rows(w, ids, n), memory)
                       for w in (experts.gate, experts.up, experts.down)]
        # The map of the experts stays in device memory with the router: the routing is worked out there.
        parts.append(moe.ExpertPart(*projections, jax.device_put(local, in_device), on_host))
    return dataclasses.replace(experts, gate=None, up=None, down=None, parts=parts)


def _without_ffn_rows(layer: model.Layer) -> model.Layer:
    if layer.experts is not None:
        return dataclasses.replace(layer, experts=dataclasses.replace(layer.experts, gate=None, up=None, down=None,
                                                                      parts=None))
    return dataclasses.replace(layer, ffn_gate=None, ffn_up=None, ffn_down=None, ffn_down_t=None, ffn_parts=None)


def _without_ffn(weights: model.Weights) -> model.Weights:
    """`weights` less the FFN neurons' arrays: what device memory holds for every token."""
    return dataclasses.replace(weights, layers=[_without_ffn_rows(layer) for layer in weights.layers])


def ffn_bytes(weights: model.Weights, on_host: bool) -> int:
    """Bytes of a split model's FFN parts in host memory (`on_host`) or in device memory: what placement.solve
    priced for the latter."""
    return sum(tree_nbytes(weights_of) for layer in weights.layers for part, weights_of in _parts(layer)
               if getattr(part, "on_host", False) == on_host)


def _parts(layer: model.Layer) -> list:
    """A split layer's parts, each with the weights it places: an FFN part's all, an expert part's projections
    (not its map of the experts, n_expert int32)."""
    if layer.experts is not None:
        return [(p, (p.gate, p.up, p.down)) for p in layer.experts.parts or []]
    return [(p, p) for p in layer.ffn_parts or []]

"""Hot/cold neuron placement under an accelerator memory budget, and PowerInfer's `.gpuidx` file.

The budget first pays for what every token needs on the accelerator: the weights outside the FFN neurons (embedding,
attention, norms, predictors, output head), the KV cache and a workspace reserve. What is left buys FFN neurons, in
units: one neuron, or the neurons sharing a quantization block of the down projection, which move together so that
each part keeps the stored bytes (hybrid.unit_neurons). A unit costs its rows of gate, up and down exactly as
hybrid.split_weights places them (hybrid.placement_costs prices them from the
same layout: what is placed is what was priced); its value is how often its neurons fired in the activation profile.
Choosing units is then a knapsack whose items are tiny against the budget: taking them in decreasing
fired-count-per-byte order (ties: layer, then neuron id) is optimal up to one item's bytes per distinct cost,
deterministic, and linear-time after one sort (a 70B model's 2.3M neurons solve in well under a second, with no ILP
solver or subprocess). PowerInfer's solver instead counts 3 x n_embd x bytes for every neuron (31% too much for
Bamboo and 70B) and buckets neurons by 256.

`.gpuidx` (written as PowerInfer does: a GGUF with `PWRI` magic, architecture "generic.gpu_index"): per layer, in
order, `blk.N.gpu_idx` (I32 [n_ff], 1 where the neuron lives on the accelerator) and `blk.N.gpu_bucket` (I32, the
sorted ids of those neurons; left out where there are none, as GGUF has no empty tensors), plus
`split.vram_capacity` (u64, bytes of FFN the split may use) and `generic.gpu_index.block_count`. jaxinfer adds the
model's fingerprint and every input of the solve (solve_inputs: the budget, the bytes of the dense weights and of
the KV cache, digests of the per-unit costs and of the activation counts), so an index made for another model,
another version of it, another budget, context, cache type, batch, sparsity layout or profile is rebuilt, not
trusted; so is a malformed one, one splitting a unit, or one placing more neurons than its budget buys. It lives
beside the model, or in the model's cache folder when the model's folder is read-only or an installed package's
(sidecar.derived_path).
"""

import dataclasses
import hashlib
import os

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from jaxinfer import sidecar
from jaxinfer.config import CACHE_TYPES, Config
from jaxinfer.errors import JaxinferError

GIB = 1 << 30
WORKSPACE_BYTES = 256 << 20  # activations and compiler scratch kept free on the accelerator
GPU_INDEX_ARCH = "generic.gpu_index"
FINGERPRINT_KEY = "jaxinfer.model_fingerprint"
BUDGET_KEY = "jaxinfer.vram_budget"
DENSE_KEY = "jaxinfer.dense_bytes"
KV_KEY = "jaxinfer.kv_bytes"
NEURON_COSTS_KEY = "jaxinfer.neuron_bytes_sha256"
PROFILE_KEY = "jaxinfer.activation_counts_sha256"


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """Bytes the placement needs to know, as the split places them (hybrid.placement_costs)."""

    n_ff: int
    # [n_layer] bytes of one unit of placement in each layer: its neurons' gate, up, down and predictor rows
    unit_bytes: np.ndarray
    dense_bytes: int  # embedding, attention, norms, predictors, output head: on the accelerator for every token
    kv_bytes: int  # the KV cache for the context and batch
    # [n_layer] neurons per unit, consecutive and aligned (None: 1): a down projection stored in quantized blocks
    # across neurons moves a block's neurons together, so that it keeps its bytes and values
    unit_neurons: np.ndarray | None = None

    @property
    def n_layer(self) -> int:
        return len(self.unit_bytes)

    def neurons_per_unit(self) -> np.ndarray:
        return np.ones(self.n_layer, np.int64) if self.unit_neurons is None else np.asarray(self.unit_neurons)


def kv_cache_bytes(cfg: Config, n_ctx: int, batch: int = 1) -> int:
    """Bytes of model.init_cache(cfg, batch, n_ctx): K and V of every layer, in the cache's element type."""
    itemsize = np.dtype(CACHE_TYPES[cfg.cache_type]).itemsize
    return 2 * cfg.n_layer * batch * n_ctx * cfg.n_head_kv * cfg.head_dim * itemsize


@dataclasses.dataclass
class Split:
    hot: list[np.ndarray]  # per layer, sorted neuron ids placed on the accelerator
    ffn_capacity: int  # bytes of FFN the budget allowed
    ffn_bytes_used: int
    budget_bytes: int
    reused: bool = False  # read from a cached .gpuidx rather than solved
    rebuilt_because: str | None = None  # why a cached .gpuidx was not reused (None: there was none, or it was)

    def hot_share(self, n_ff: int) -> float:
        return sum(len(h) for h in self.hot) / (len(self.hot) * n_ff)


def ffn_capacity(costs: ModelCosts, budget_bytes: int, reserve: int = WORKSPACE_BYTES) -> int:
    """Bytes of FFN neurons the budget buys once the dense weights, the KV cache and the reserve are paid for."""
    return max(budget_bytes - costs.dense_bytes - costs.kv_bytes - reserve, 0)


def no_neurons_reason(costs: ModelCosts, budget_bytes: int, reserve: int = WORKSPACE_BYTES,
                      units: str = "FFN neurons") -> str:
    """Why a budget places no FFN neuron (or expert: `units`) on the accelerator, in the words of the split's
    summary."""
    mib = 1 << 20
    spent = (f"dense weights {costs.dense_bytes / mib:.2f} MiB, KV cache {costs.kv_bytes / mib:.2f} MiB and "
             f"workspace {reserve / mib:.2f} MiB")
    capacity = ffn_capacity(costs, budget_bytes, reserve)
    if capacity == 0:
        over = costs.dense_bytes + costs.kv_bytes + reserve - budget_bytes
        return (f"budget {budget_bytes / GIB:.2f} GiB: {spent} leave nothing for {units}"
                + (f" ({over / mib:.2f} MiB over the budget)" if over > 0 else ""))
    return (f"budget {budget_bytes / GIB:.2f} GiB: {spent} leave {capacity} bytes, less than one unit of {units} "
            f"({int(costs.unit_bytes.min())} bytes)")


def solve(counts: np.ndarray, costs: ModelCosts, budget_bytes: int, reserve: int = WORKSPACE_BYTES) -> Split:
    """counts [n_layer, n_ff] activation counts -> the hot neurons of each layer (see the module docstring)."""
    check_counts(counts, costs)
    capacity = ffn_capacity(costs, budget_bytes, reserve)
    if capacity == 0:
        return Split([np.zeros(0, np.int64) for _ in range(costs.n_layer)], 0, 0, budget_bytes)
    group = costs.neurons_per_unit()
    units = costs.n_ff // group  # per layer
    cost = np.repeat(costs.unit_bytes.astype(np.float64), units)
    value = np.concatenate([c.reshape(n, g).sum(axis=1) for c, n, g in zip(counts, units, group)]).astype(np.float64)
    # Best value per byte first. The arrays are laid out layer by layer, unit by unit, so a stable sort breaks ties
    # by layer, then by neuron id: the result never depends on the sort's whims.
    order = np.argsort(-(value / cost), kind="stable")
    chosen = order[np.cumsum(cost[order]) <= capacity]
    on_accelerator = np.zeros(len(order), bool)
    on_accelerator[chosen] = True
    bounds = np.cumsum(units)[:-1]
    hot = [np.flatnonzero(np.repeat(flags, g)) for flags, g in zip(np.split(on_accelerator, bounds), group)]
    return Split(hot, int(capacity), int(cost[chosen].sum()), budget_bytes)


def check_counts(counts: np.ndarray, costs: ModelCosts) -> None:
    if counts.shape != (costs.n_layer, costs.n_ff):
        raise JaxinferError(f"activation profile is {counts.shape}, the model has {costs.n_layer} layers of "
                            f"{costs.n_ff} neurons")
    if np.any(costs.n_ff % costs.neurons_per_unit()):
        raise ValueError(f"units of {costs.neurons_per_unit().tolist()} neurons do not divide {costs.n_ff}")


def _digest(array: np.ndarray) -> str:
    array = np.ascontiguousarray(array, np.int64)
    return hashlib.sha256(str(array.shape).encode() + array.tobytes()).hexdigest()


def solve_inputs(counts: np.ndarray, costs: ModelCosts, budget_bytes: int) -> dict[str, int | str]:
    """What a solve depends on besides the model file, as the .gpuidx records it: a change to any rebuilds it."""
    return {BUDGET_KEY: budget_bytes, DENSE_KEY: costs.dense_bytes, KV_KEY: costs.kv_bytes,
            NEURON_COSTS_KEY: _digest(np.stack([costs.unit_bytes, costs.neurons_per_unit()])),
            PROFILE_KEY: _digest(counts)}


# Why an index whose recorded input differs from this run's is not reused: what the user changed to cause it.
STALE_REASONS = {
    BUDGET_KEY: "another --vram-budget",
    DENSE_KEY: "other dense weights on the accelerator (another --sparsity, exactness or kernel layout)",
    KV_KEY: "another KV cache size (-c, --cache-type or batch)",
    NEURON_COSTS_KEY: "other per-neuron costs (another --sparsity, --down-t-type or kernel layout)",
    PROFILE_KEY: "another activation profile",
}


def gpuidx_path(model_path: str, create: bool = False) -> str:
    """`<model>.generated.gpuidx`, beside the model or in its cache folder (sidecar.derived_path)."""
    return sidecar.derived_path(model_path, os.path.basename(model_path) + ".generated.gpuidx", create)


def write_gpuidx(path: str, split: Split, n_ff: int, model_path: str, inputs: dict[str, int | str]) -> None:
    """The split as PowerInfer's index, with the model's fingerprint and the solve's `inputs` (solve_inputs)."""
    from jaxinfer.powerinfer import PendingTensor, write_gguf

    fields = [
        (f"{GPU_INDEX_ARCH}.block_count", len(split.hot), GGUFValueType.UINT32, None),
        ("split.vram_capacity", split.ffn_capacity, GGUFValueType.UINT64, None),
        (FINGERPRINT_KEY, sidecar.model_fingerprint(model_path), GGUFValueType.STRING, None),
    ] + [(key, value, GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.UINT64, None)
         for key, value in inputs.items()]
    tensors = []
    for i, hot in enumerate(split.hot):
        mask = np.zeros(n_ff, np.int32)
        mask[hot] = 1
        tensors.append(PendingTensor(f"blk.{i}.gpu_idx", (n_ff,), GGMLQuantizationType.I32, lambda m=mask: m))
        bucket = hot.astype(np.int32)
        if len(bucket):  # an empty tensor is not valid GGUF (our reader rejects it): no hot neuron, no bucket
            tensors.append(PendingTensor(f"blk.{i}.gpu_bucket", (len(bucket),), GGMLQuantizationType.I32,
                                         lambda b=bucket: b))
    write_gguf(path, GPU_INDEX_ARCH, fields, tensors, powerinfer=True)


def _hot_ids(g, i: int, n_ff: int, path: str) -> np.ndarray:
    """Layer i's hot neuron ids from an index, checked: an I32 0/1 mask of n_ff and the sorted ids it marks (no
    bucket where it marks none)."""
    mask, bucket = g.tensors.get(f"blk.{i}.gpu_idx"), g.tensors.get(f"blk.{i}.gpu_bucket")
    if mask is None:
        raise JaxinferError(f"GPU index {path} lacks layer {i}")
    if any(t.tensor_type != GGMLQuantizationType.I32 or len(t.shape) != 1 for t in (mask, bucket) if t is not None):
        raise JaxinferError(f"GPU index {path}: layer {i}'s tensors must be 1-D I32")
    if mask.n_elements != n_ff:
        raise JaxinferError(f"GPU index {path}: layer {i} has {mask.n_elements} neurons, the model {n_ff}")
    flags = np.asarray(mask.data).reshape(-1)
    if not np.all((flags == 0) | (flags == 1)):
        raise JaxinferError(f"GPU index {path}: layer {i}'s gpu_idx holds values other than 0 and 1")
    ids = np.zeros(0, np.int64) if bucket is None else np.asarray(bucket.data, np.int64).reshape(-1)
    if not np.array_equal(np.flatnonzero(flags), ids):
        raise JaxinferError(f"GPU index {path} is inconsistent in layer {i} (gpu_idx vs gpu_bucket)")
    return ids


def read_gpuidx(path: str, model_path: str, counts: np.ndarray, costs: ModelCosts, budget_bytes: int) -> Split:
    """A split from `path`; JaxinferError if it is unreadable, malformed, foreign, stale, solved from other inputs
    (solve_inputs) or places more neurons than the budget buys."""
    from jaxinfer.gguf_io import open_gguf

    try:
        g = open_gguf(path)
    except JaxinferError as e:
        raise JaxinferError(f"unusable GPU index {path}: {e}") from None
    if g.metadata.get(FINGERPRINT_KEY) != sidecar.model_fingerprint(model_path):
        raise JaxinferError(f"GPU index {path} was made for a different model file")
    for key, value in solve_inputs(counts, costs, budget_bytes).items():
        if g.metadata.get(key) != value:
            raise JaxinferError(f"GPU index {path} was solved for {STALE_REASONS[key]}")
    n_layer, n_ff = costs.n_layer, costs.n_ff
    if g.metadata.get(f"{GPU_INDEX_ARCH}.block_count") != n_layer:
        raise JaxinferError(f"GPU index {path} does not match the model's {n_layer} layers")
    capacity = ffn_capacity(costs, budget_bytes)
    if g.metadata.get("split.vram_capacity") != capacity:
        raise JaxinferError(f"GPU index {path}: split.vram_capacity is not the {capacity} bytes this budget buys")
    group = costs.neurons_per_unit()
    hot = [_hot_ids(g, i, n_ff, path) for i in range(n_layer)]
    for i, ids in enumerate(hot):
        flags = np.zeros(n_ff, bool)
        flags[ids] = True
        units = flags.reshape(-1, group[i])
        if np.any(units.any(axis=1) & ~units.all(axis=1)):
            raise JaxinferError(f"GPU index {path} splits layer {i}'s units of {group[i]} neurons")
    used = int(sum(len(ids) // group[i] * int(costs.unit_bytes[i]) for i, ids in enumerate(hot)))
    if used > capacity:
        raise JaxinferError(f"GPU index {path} places {used} bytes of neurons on the accelerator, more than the "
                            f"{capacity} the budget buys")
    return Split(hot, capacity, used, budget_bytes, reused=True)


def load_or_solve(model_path: str, counts: np.ndarray, costs: ModelCosts, budget_bytes: int,
                  reset: bool = False) -> Split:
    """The cached split when it was solved from this model, `counts`, `costs` and budget, or a new one (written
    atomically), whose `rebuilt_because` says why a cached one was not reused."""
    check_counts(counts, costs)
    path = gpuidx_path(model_path, create=True)
    reason = None
    if reset:
        reason = "--reset-gpu-index"
    elif os.path.exists(path):
        try:
            return read_gpuidx(path, model_path, counts, costs, budget_bytes)
        except JaxinferError as e:  # stale, foreign, malformed or solved from other inputs: rebuilt below
            reason = str(e)
    split = dataclasses.replace(solve(counts, costs, budget_bytes), rebuilt_because=reason)
    write_gpuidx(path, split, costs.n_ff, model_path, solve_inputs(counts, costs, budget_bytes))
    return split

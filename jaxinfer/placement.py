"""Hot/cold neuron placement under an accelerator memory budget, and PowerInfer's `.gpuidx` file.

The budget first pays for what every token needs on the accelerator: attention weights, norms, predictors, the output
head, the KV cache and a workspace reserve (the token embedding stays on the host, as in PowerInfer: it is a
lookup). What is left buys FFN neurons. A neuron costs its rows of gate, up and down at their storage types; its
value is how often it fired in the activation profile. Choosing neurons is then a knapsack whose items are tiny
against the budget: taking them in decreasing fired-count-per-byte order (ties: layer, then neuron id) is optimal up
to one item's bytes per distinct cost, deterministic, and linear-time after one sort (a 70B model's 2.3M neurons
solve in well under a second, with no ILP solver or subprocess). PowerInfer's solver instead counts 3 x n_embd x
bytes for every neuron (31% too much for Bamboo and 70B) and buckets neurons by 256.

`.gpuidx` (written as PowerInfer does: a GGUF with `PWRI` magic, architecture "generic.gpu_index"): per layer, in
order, `blk.N.gpu_idx` (I32 [n_ff], 1 where the neuron lives on the accelerator) and `blk.N.gpu_bucket` (I32, the
sorted ids of those neurons), plus `split.vram_capacity` (u64, bytes of FFN the split may use) and
`generic.gpu_index.block_count`. jaxinfer adds `jaxinfer.model_fingerprint` and `jaxinfer.vram_budget`, so an index
made for another model, another version of it or another budget is rebuilt, not trusted; so is a malformed one, or
one placing more neurons than its budget buys. It lives beside the model, or in the model's cache folder when the
model's folder is read-only or an installed package's (sidecar.derived_path).
"""

import dataclasses
import os

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from jaxinfer import sidecar
from jaxinfer.errors import JaxinferError

GIB = 1 << 30
WORKSPACE_BYTES = 256 << 20  # activations and compiler scratch kept free on the accelerator
GPU_INDEX_ARCH = "generic.gpu_index"
FINGERPRINT_KEY = "jaxinfer.model_fingerprint"
BUDGET_KEY = "jaxinfer.vram_budget"


def row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return cols // block_size * type_size


@dataclasses.dataclass(frozen=True)
class ModelCosts:
    """Bytes the placement needs to know, from the model's tensors."""

    n_ff: int
    neuron_bytes: np.ndarray  # [n_layer] bytes of one neuron (its gate, up and down rows) in each layer
    dense_bytes: int  # attention, norms, predictors, output head: on the accelerator for every token
    kv_bytes: int  # the KV cache for the context

    @property
    def n_layer(self) -> int:
        return len(self.neuron_bytes)


def model_costs(gguf, cfg, n_ctx: int, kv_bytes_per_value: int = 4) -> ModelCosts:
    """Costs from a GGUFFile's tensor table (nothing is loaded)."""
    neuron = np.zeros(cfg.n_layer, np.int64)
    dense = 0
    for name, t in gguf.tensors.items():
        qtype = GGMLQuantizationType(t.tensor_type)
        if name == "token_embd.weight":
            continue
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in ("ffn_gate", "ffn_up", "ffn_down_t"):
            neuron[int(parts[1])] += row_bytes(qtype, int(t.shape[0]))
        elif parts[0] == "blk" and parts[2] == "ffn_down":  # [d, n_ff] stored: a neuron is a column, d values
            neuron[int(parts[1])] += row_bytes(qtype, int(t.shape[0])) * cfg.n_embd // int(t.shape[0])
        else:
            dense += int(t.n_bytes)
    kv = 2 * cfg.n_layer * n_ctx * cfg.n_head_kv * cfg.head_dim * kv_bytes_per_value
    return ModelCosts(cfg.n_ff, neuron, dense, kv)


@dataclasses.dataclass
class Split:
    hot: list[np.ndarray]  # per layer, sorted neuron ids placed on the accelerator
    ffn_capacity: int  # bytes of FFN the budget allowed
    ffn_bytes_used: int
    budget_bytes: int
    reused: bool = False  # read from a cached .gpuidx rather than solved

    def hot_share(self, n_ff: int) -> float:
        return sum(len(h) for h in self.hot) / (len(self.hot) * n_ff)


def ffn_capacity(costs: ModelCosts, budget_bytes: int, reserve: int = WORKSPACE_BYTES) -> int:
    """Bytes of FFN neurons the budget buys once the dense weights, the KV cache and the reserve are paid for."""
    return max(budget_bytes - costs.dense_bytes - costs.kv_bytes - reserve, 0)


def solve(counts: np.ndarray, costs: ModelCosts, budget_bytes: int, reserve: int = WORKSPACE_BYTES) -> Split:
    """counts [n_layer, n_ff] activation counts -> the hot neurons of each layer (see the module docstring)."""
    if counts.shape != (costs.n_layer, costs.n_ff):
        raise JaxinferError(f"activation profile is {counts.shape}, the model has {costs.n_layer} layers of "
                            f"{costs.n_ff} neurons")
    capacity = ffn_capacity(costs, budget_bytes, reserve)
    if capacity == 0:
        return Split([np.zeros(0, np.int64) for _ in range(costs.n_layer)], 0, 0, budget_bytes)
    cost = np.repeat(costs.neuron_bytes.astype(np.float64), costs.n_ff)
    value = counts.reshape(-1).astype(np.float64)
    # Best value per byte first. The arrays are laid out layer by layer, neuron by neuron, so a stable sort breaks
    # ties by layer, then by neuron id: the result never depends on the sort's whims.
    order = np.argsort(-(value / cost), kind="stable")
    chosen = order[np.cumsum(cost[order]) <= capacity]
    on_accelerator = np.zeros(len(order), bool)
    on_accelerator[chosen] = True
    hot = [np.flatnonzero(row) for row in on_accelerator.reshape(costs.n_layer, costs.n_ff)]
    return Split(hot, int(capacity), int(cost[chosen].sum()), budget_bytes)


def gpuidx_path(model_path: str, create: bool = False) -> str:
    """`<model>.generated.gpuidx`, beside the model or in its cache folder (sidecar.derived_path)."""
    return sidecar.derived_path(model_path, os.path.basename(model_path) + ".generated.gpuidx", create)


def write_gpuidx(path: str, split: Split, n_ff: int, model_path: str) -> None:
    from jaxinfer.powerinfer import PendingTensor, write_gguf

    fields = [
        (f"{GPU_INDEX_ARCH}.block_count", len(split.hot), GGUFValueType.UINT32, None),
        ("split.vram_capacity", split.ffn_capacity, GGUFValueType.UINT64, None),
        (FINGERPRINT_KEY, sidecar.model_fingerprint(model_path), GGUFValueType.STRING, None),
        (BUDGET_KEY, split.budget_bytes, GGUFValueType.UINT64, None),
    ]
    tensors = []
    for i, hot in enumerate(split.hot):
        mask = np.zeros(n_ff, np.int32)
        mask[hot] = 1
        tensors.append(PendingTensor(f"blk.{i}.gpu_idx", (n_ff,), GGMLQuantizationType.I32, lambda m=mask: m))
        bucket = hot.astype(np.int32)
        tensors.append(PendingTensor(f"blk.{i}.gpu_bucket", (len(bucket),), GGMLQuantizationType.I32,
                                     lambda b=bucket: b))
    write_gguf(path, GPU_INDEX_ARCH, fields, tensors, powerinfer=True)


def _hot_ids(g, i: int, n_ff: int, path: str) -> np.ndarray:
    """Layer i's hot neuron ids from an index, checked: an I32 0/1 mask of n_ff and the sorted ids it marks."""
    mask, bucket = g.tensors.get(f"blk.{i}.gpu_idx"), g.tensors.get(f"blk.{i}.gpu_bucket")
    if mask is None or bucket is None:
        raise JaxinferError(f"GPU index {path} lacks layer {i}")
    if any(t.tensor_type != GGMLQuantizationType.I32 or len(t.shape) != 1 for t in (mask, bucket)):
        raise JaxinferError(f"GPU index {path}: layer {i}'s tensors must be 1-D I32")
    if mask.n_elements != n_ff:
        raise JaxinferError(f"GPU index {path}: layer {i} has {mask.n_elements} neurons, the model {n_ff}")
    flags = np.asarray(mask.data).reshape(-1)
    if not np.all((flags == 0) | (flags == 1)):
        raise JaxinferError(f"GPU index {path}: layer {i}'s gpu_idx holds values other than 0 and 1")
    ids = np.asarray(bucket.data, np.int64).reshape(-1)
    if not np.array_equal(np.flatnonzero(flags), ids):
        raise JaxinferError(f"GPU index {path} is inconsistent in layer {i} (gpu_idx vs gpu_bucket)")
    return ids


def read_gpuidx(path: str, model_path: str, budget_bytes: int, costs: ModelCosts) -> Split:
    """A split from `path`; JaxinferError if it is unreadable, malformed, foreign, stale, made for another budget or
    places more neurons than the budget buys."""
    from jaxinfer.gguf_io import open_gguf

    try:
        g = open_gguf(path)
    except JaxinferError as e:
        raise JaxinferError(f"unusable GPU index {path}: {e}") from None
    if g.metadata.get(FINGERPRINT_KEY) != sidecar.model_fingerprint(model_path):
        raise JaxinferError(f"GPU index {path} was made for a different model file (use --reset-gpu-index)")
    if g.metadata.get(BUDGET_KEY) != budget_bytes:
        raise JaxinferError(f"GPU index {path} was made for another --vram-budget (use --reset-gpu-index)")
    n_layer, n_ff = costs.n_layer, costs.n_ff
    if g.metadata.get(f"{GPU_INDEX_ARCH}.block_count") != n_layer:
        raise JaxinferError(f"GPU index {path} does not match the model's {n_layer} layers")
    capacity = ffn_capacity(costs, budget_bytes)
    if g.metadata.get("split.vram_capacity") != capacity:
        raise JaxinferError(f"GPU index {path}: split.vram_capacity is not the {capacity} bytes this budget buys")
    hot = [_hot_ids(g, i, n_ff, path) for i in range(n_layer)]
    used = int(sum(len(ids) * int(costs.neuron_bytes[i]) for i, ids in enumerate(hot)))
    if used > capacity:
        raise JaxinferError(f"GPU index {path} places {used} bytes of neurons on the accelerator, more than the "
                            f"{capacity} the budget buys")
    return Split(hot, capacity, used, budget_bytes, reused=True)


def load_or_solve(model_path: str, counts_fn, costs: ModelCosts, budget_bytes: int, reset: bool = False) -> Split:
    """The cached split for this model and budget, or a new one (solved from `counts_fn()`, written atomically)."""
    path = gpuidx_path(model_path, create=True)
    if os.path.exists(path) and not reset:
        try:
            return read_gpuidx(path, model_path, budget_bytes, costs)
        except JaxinferError:
            pass  # stale, foreign, malformed or another budget: rebuilt below
    split = solve(counts_fn(), costs, budget_bytes)
    write_gpuidx(path, split, costs.n_ff, model_path)
    return split

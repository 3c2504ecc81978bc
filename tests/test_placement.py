import itertools
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from jaxinfer import placement, sidecar
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_io import load_config, open_gguf
from jaxinfer.powerinfer import PendingTensor, write_gguf


def costs_for(neuron_bytes, n_ff, dense=1000, kv=500):
    return placement.ModelCosts(n_ff, np.asarray(neuron_bytes, np.int64), dense, kv)


def test_solver_respects_budget_and_partitions_every_neuron():
    rng = np.random.default_rng(0)
    costs = costs_for([300, 200, 500], 64)
    counts = rng.integers(0, 50, size=(3, 64))
    for budget in [0, 1500 + placement.WORKSPACE_BYTES + 5000, 10**9]:
        split = placement.solve(counts, costs, budget)
        used = sum(len(h) * costs.neuron_bytes[i] for i, h in enumerate(split.hot))
        assert used == split.ffn_bytes_used <= max(split.ffn_capacity, 0)
        for h in split.hot:
            assert len(np.unique(h)) == len(h) and np.all(np.diff(h) > 0) and (len(h) == 0 or h[-1] < 64)
    assert all(len(h) == 64 for h in placement.solve(counts, costs, 10**9).hot)  # everything fits: all hot
    assert all(len(h) == 0 for h in placement.solve(counts, costs, 0).hot)


def test_solver_is_deterministic_with_ties():
    costs = costs_for([100, 100], 8)
    counts = np.ones((2, 8), np.int64)  # all tied: lowest layer, then lowest ids win
    split = placement.solve(counts, costs, 1500 + placement.WORKSPACE_BYTES + 1000)
    assert [h.tolist() for h in split.hot] == [list(range(8)), [0, 1]]
    again = placement.solve(counts.copy(), costs, 1500 + placement.WORKSPACE_BYTES + 1000)
    assert all(np.array_equal(a, b) for a, b in zip(split.hot, again.hot))


def test_solver_is_within_one_item_of_the_exact_optimum():
    rng = np.random.default_rng(1)
    costs = costs_for([3, 5], 5, dense=0, kv=0)
    for trial in range(20):
        counts = rng.integers(0, 20, size=(2, 5))
        capacity = int(rng.integers(5, 40))
        split = placement.solve(counts, costs, capacity + placement.WORKSPACE_BYTES)
        value = sum(counts[i, h].sum() for i, h in enumerate(split.hot))
        items = [(counts[i, j], costs.neuron_bytes[i]) for i in range(2) for j in range(5)]
        best = max(sum(v for (v, _), t in zip(items, take) if t)
                   for take in itertools.product([0, 1], repeat=len(items))
                   if sum(c for (_, c), t in zip(items, take) if t) <= capacity)
        assert best - counts.max() <= value <= best


def test_model_costs_count_each_neuron_rows_at_their_types(make_model):
    g = open_gguf(make_model(n_embd=64, n_ff=128, sparsity=0.8, weight_type=Q.Q8_0))
    costs = placement.model_costs(g, load_config(g), n_ctx=32)
    assert costs.neuron_bytes.tolist() == [3 * 64 // 32 * 34] * 2  # gate, up, down_t rows of 64 values in Q8_0
    assert costs.kv_bytes == 2 * 2 * 32 * 2 * 16 * 4
    embd = g.tensors["token_embd.weight"].n_bytes
    ffn = sum(t.n_bytes for n, t in g.tensors.items() if n.split(".")[-2] in ("ffn_gate", "ffn_up", "ffn_down_t"))
    assert costs.dense_bytes == sum(t.n_bytes for t in g.tensors.values()) - embd - ffn


def test_gpuidx_round_trip_and_stale_rejection(make_model, tmp_path):
    path = make_model(n_embd=64, n_ff=128, sparsity=0.8)
    g = open_gguf(path)
    costs = placement.model_costs(g, load_config(g), n_ctx=32)
    counts = np.random.default_rng(2).integers(0, 100, size=(2, 128))
    budget = costs.dense_bytes + costs.kv_bytes + placement.WORKSPACE_BYTES + 60 * int(costs.neuron_bytes[0])
    split = placement.load_or_solve(path, lambda: counts, costs, budget)
    index = placement.gpuidx_path(path)
    assert open(index, "rb").read(4) == b"PWRI" and sum(len(h) for h in split.hot) == 60
    again = placement.read_gpuidx(index, path, budget, costs)
    assert all(np.array_equal(a, b) for a, b in zip(again.hot, split.hot))
    assert again.ffn_bytes_used == split.ffn_bytes_used
    with pytest.raises(JaxinferError, match="another --vram-budget"):
        placement.read_gpuidx(index, path, budget + 1, costs)
    other = make_model(name="other.gguf", n_embd=64, n_ff=128, sparsity=0.8, seed=7)
    with pytest.raises(JaxinferError, match="different model"):
        placement.read_gpuidx(index, other, budget, costs)
    with open(index, "r+b") as f:  # corrupt it: the cache is rebuilt, never trusted
        f.truncate(100)
    rebuilt = placement.load_or_solve(path, lambda: counts, costs, budget)
    assert all(np.array_equal(a, b) for a, b in zip(rebuilt.hot, split.hot))
    assert os.path.getsize(index) > 100


@pytest.fixture
def indexed_model(make_model):
    """(model path, costs, budget fitting 60 neurons) of a model whose .gpuidx is to be forged."""
    path = make_model(n_embd=64, n_ff=128, sparsity=0.8)
    g = open_gguf(path)
    costs = placement.model_costs(g, load_config(g), n_ctx=32)
    budget = costs.dense_bytes + costs.kv_bytes + placement.WORKSPACE_BYTES + 60 * int(costs.neuron_bytes[0])
    return path, costs, budget


def forge_gpuidx(path, costs, budget, hot, drop=(), mask_type=Q.I32, mask_value=1, capacity=None, n_layer=2):
    capacity = placement.ffn_capacity(costs, budget) if capacity is None else capacity
    fields = [(key, value, vtype, None) for key, value, vtype in [
        (f"{placement.GPU_INDEX_ARCH}.block_count", n_layer, GGUFValueType.UINT32),
        ("split.vram_capacity", capacity, GGUFValueType.UINT64),
        (placement.FINGERPRINT_KEY, sidecar.model_fingerprint(path), GGUFValueType.STRING),
        (placement.BUDGET_KEY, budget, GGUFValueType.UINT64)] if key not in drop]
    dtype = {Q.I32: np.int32, Q.F32: np.float32}[mask_type]
    tensors = []
    for i, ids in enumerate(hot):
        mask = np.zeros(costs.n_ff, dtype)
        mask[ids] = mask_value
        tensors.append(PendingTensor(f"blk.{i}.gpu_idx", (costs.n_ff,), mask_type, lambda m=mask: m))
        tensors.append(PendingTensor(f"blk.{i}.gpu_bucket", (len(ids),), Q.I32, lambda b=ids: b.astype(np.int32)))
    write_gguf(placement.gpuidx_path(path), placement.GPU_INDEX_ARCH, fields, tensors, powerinfer=True)


@pytest.mark.parametrize("case, message", [
    ("over budget", "more than the"),
    ("capacity lie", "vram_capacity"),
    ("no capacity", "vram_capacity"),
    ("no block count", "layers"),
    ("float mask", "1-D I32"),
    ("mask of twos", "other than 0 and 1"),
    ("missing layer", "lacks layer 1"),
    ("other layer count", "2 layers"),
])
def test_forged_gpu_indexes_are_rejected_and_rebuilt(indexed_model, case, message):
    path, costs, budget = indexed_model
    all_hot = [np.arange(128), np.arange(128)]  # every neuron: far more than 60 neurons' bytes
    few = [np.arange(30), np.arange(30)]
    forge_gpuidx(path, costs, budget, **{
        "over budget": dict(hot=all_hot),
        "capacity lie": dict(hot=all_hot, capacity=10**12),
        "no capacity": dict(hot=few, drop=("split.vram_capacity",)),
        "no block count": dict(hot=few, drop=(f"{placement.GPU_INDEX_ARCH}.block_count",)),
        "float mask": dict(hot=few, mask_type=Q.F32),
        "mask of twos": dict(hot=few, mask_value=2),
        "missing layer": dict(hot=few[:1]),
        "other layer count": dict(hot=few, n_layer=3),
    }[case])
    with pytest.raises(JaxinferError, match=message):
        placement.read_gpuidx(placement.gpuidx_path(path), path, budget, costs)
    counts = np.random.default_rng(3).integers(0, 100, size=(2, 128))
    split = placement.load_or_solve(path, lambda: counts, costs, budget)
    assert not split.reused and sum(len(h) for h in split.hot) == 60
    assert placement.load_or_solve(path, lambda: counts, costs, budget).reused


def test_a_forged_index_within_the_budget_is_used(indexed_model):
    path, costs, budget = indexed_model
    forge_gpuidx(path, costs, budget, hot=[np.arange(30), np.arange(60, 90)])
    split = placement.read_gpuidx(placement.gpuidx_path(path), path, budget, costs)
    assert [h.tolist() for h in split.hot] == [list(range(30)), list(range(60, 90))]

import dataclasses
import itertools
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from jaxinfer import model, placement, sidecar
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_io import load_config, open_gguf
from jaxinfer.powerinfer import PendingTensor, write_gguf


def costs_for(unit_bytes, n_ff, dense=1000, kv=500):
    return placement.ModelCosts(n_ff, np.asarray(unit_bytes, np.int64), dense, kv)


def test_solver_respects_budget_and_partitions_every_neuron():
    rng = np.random.default_rng(0)
    costs = costs_for([300, 200, 500], 64)
    counts = rng.integers(0, 50, size=(3, 64))
    for budget in [0, 1500 + placement.WORKSPACE_BYTES + 5000, 10**9]:
        split = placement.solve(counts, costs, budget)
        used = sum(len(h) * costs.unit_bytes[i] for i, h in enumerate(split.hot))
        assert used == split.ffn_bytes_used <= max(split.ffn_capacity, 0)
        for h in split.hot:
            assert len(np.unique(h)) == len(h) and np.all(np.diff(h) > 0) and (len(h) == 0 or h[-1] < 64)
    assert all(len(h) == 64 for h in placement.solve(counts, costs, 10**9).hot)  # everything fits: all hot
    assert all(len(h) == 0 for h in placement.solve(counts, costs, 0).hot)


def test_solver_moves_whole_units_of_neurons():
    counts = np.zeros((2, 16), np.int64)
    counts[0, 5] = 100  # one hot neuron in the unit 4..7 of layer 0
    counts[1] = np.arange(16)  # layer 1 (units of 1) rises steadily
    costs = placement.ModelCosts(16, np.array([4 * 10, 10]), 0, 0, unit_neurons=np.array([4, 1]))
    split = placement.solve(counts, costs, placement.WORKSPACE_BYTES + 4 * 10 + 3 * 10)
    assert [h.tolist() for h in split.hot] == [[4, 5, 6, 7], [13, 14, 15]]
    assert split.ffn_bytes_used == 70


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
        items = [(counts[i, j], costs.unit_bytes[i]) for i in range(2) for j in range(5)]
        best = max(sum(v for (v, _), t in zip(items, take) if t)
                   for take in itertools.product([0, 1], repeat=len(items))
                   if sum(c for (_, c), t in zip(items, take) if t) <= capacity)
        assert best - counts.max() <= value <= best


def test_kv_cache_bytes_are_those_init_cache_allocates(make_model):
    cfg = load_config(open_gguf(make_model(n_embd=64, n_ff=128)))
    for n_ctx, batch, cache_type in [(32, 1, "f32"), (512, 4, "f32"), (64, 2, "f16")]:
        typed = dataclasses.replace(cfg, cache_type=cache_type)
        cache = model.init_cache(typed, batch, n_ctx)
        assert placement.kv_cache_bytes(typed, n_ctx, batch) == cache.k.nbytes + cache.v.nbytes


def test_no_neurons_reason_names_what_took_the_budget():
    costs = costs_for([300, 200], 64, dense=10 << 20, kv=300 << 20)
    budget = int(0.3 * placement.GIB)
    reason = placement.no_neurons_reason(costs, budget)
    assert reason.startswith("budget 0.30 GiB: dense weights 10.00 MiB, KV cache 300.00 MiB and workspace 256.00 MiB "
                             "leave nothing for FFN neurons"), reason
    assert "over the budget" in reason
    tight = (10 << 20) + (300 << 20) + placement.WORKSPACE_BYTES + 150
    assert "less than one unit of FFN neurons (200 bytes)" in placement.no_neurons_reason(costs, tight)


TEST_COSTS = costs_for([2 * 68 + 34 + 8, 2 * 68 + 34 + 8], 128, dense=5000, kv=2048)
TEST_COUNTS = np.random.default_rng(2).integers(0, 100, size=(2, 128))
TEST_BUDGET = 5000 + 2048 + placement.WORKSPACE_BYTES + 60 * int(TEST_COSTS.unit_bytes[0])  # fits 60 neurons


def test_gpuidx_round_trip_and_stale_rejection(make_model):
    path, costs, counts, budget = make_model(n_embd=64, n_ff=128, sparsity=0.8), TEST_COSTS, TEST_COUNTS, TEST_BUDGET
    split = placement.load_or_solve(path, counts, costs, budget)
    index = placement.gpuidx_path(path)
    assert open(index, "rb").read(4) == b"PWRI" and sum(len(h) for h in split.hot) == 60
    assert not split.reused and split.rebuilt_because is None
    again = placement.read_gpuidx(index, path, counts, costs, budget)
    assert all(np.array_equal(a, b) for a, b in zip(again.hot, split.hot))
    assert again.ffn_bytes_used == split.ffn_bytes_used
    with pytest.raises(JaxinferError, match="another --vram-budget"):
        placement.read_gpuidx(index, path, counts, costs, budget + 1)
    other = make_model(name="other.gguf", n_embd=64, n_ff=128, sparsity=0.8, seed=7)
    with pytest.raises(JaxinferError, match="different model"):
        placement.read_gpuidx(index, other, counts, costs, budget)
    with open(index, "r+b") as f:  # corrupt it: the cache is rebuilt, never trusted
        f.truncate(100)
    rebuilt = placement.load_or_solve(path, counts, costs, budget)
    assert all(np.array_equal(a, b) for a, b in zip(rebuilt.hot, split.hot))
    assert "unusable GPU index" in rebuilt.rebuilt_because and os.path.getsize(index) > 100
    assert placement.load_or_solve(path, counts, costs, budget).reused
    assert placement.load_or_solve(path, counts, costs, budget, reset=True).rebuilt_because == "--reset-gpu-index"


@pytest.mark.parametrize("change, reason", [
    # -c 512 -> 4096 (or another cache type, or batch): the KV cache grows, fewer neurons fit
    (dict(costs=dataclasses.replace(TEST_COSTS, kv_bytes=8 * 2048)), "another KV cache size"),
    (dict(costs=dataclasses.replace(TEST_COSTS, dense_bytes=6000)), "other dense weights"),
    (dict(costs=dataclasses.replace(TEST_COSTS, unit_bytes=TEST_COSTS.unit_bytes * 2)), "per-neuron costs"),
    (dict(counts=TEST_COUNTS[:, ::-1].copy()), "another activation profile"),
    (dict(budget_bytes=TEST_BUDGET + 4096), "another --vram-budget"),
])
def test_an_index_solved_from_other_inputs_is_rebuilt(make_model, change, reason):
    path = make_model(n_embd=64, n_ff=128, sparsity=0.8)
    inputs = dict(counts=TEST_COUNTS, costs=TEST_COSTS, budget_bytes=TEST_BUDGET)
    placement.load_or_solve(path, **inputs)
    assert placement.load_or_solve(path, **inputs).reused
    changed = dict(inputs, **change)
    split = placement.load_or_solve(path, **changed)
    assert not split.reused and reason in split.rebuilt_because, split.rebuilt_because
    fresh = placement.solve(changed["counts"], changed["costs"], changed["budget_bytes"])
    assert all(np.array_equal(a, b) for a, b in zip(split.hot, fresh.hot))
    assert placement.load_or_solve(path, **changed).reused  # the rebuilt index now serves the changed inputs


@pytest.fixture
def indexed_model(make_model):
    """(model path, costs, budget fitting 60 neurons) of a model whose .gpuidx is to be forged."""
    return make_model(n_embd=64, n_ff=128, sparsity=0.8), TEST_COSTS, TEST_BUDGET


def forge_gpuidx(path, costs, budget, hot, drop=(), mask_type=Q.I32, mask_value=1, capacity=None, n_layer=2,
                 no_bucket=()):
    capacity = placement.ffn_capacity(costs, budget) if capacity is None else capacity
    fields = [(key, value, vtype, None) for key, value, vtype in [
        (f"{placement.GPU_INDEX_ARCH}.block_count", n_layer, GGUFValueType.UINT32),
        ("split.vram_capacity", capacity, GGUFValueType.UINT64),
        (placement.FINGERPRINT_KEY, sidecar.model_fingerprint(path), GGUFValueType.STRING),
        *((key, value, GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.UINT64)
          for key, value in placement.solve_inputs(TEST_COUNTS, costs, budget).items())] if key not in drop]
    dtype = {Q.I32: np.int32, Q.F32: np.float32}[mask_type]
    tensors = []
    for i, ids in enumerate(hot):
        mask = np.zeros(costs.n_ff, dtype)
        mask[ids] = mask_value
        tensors.append(PendingTensor(f"blk.{i}.gpu_idx", (costs.n_ff,), mask_type, lambda m=mask: m))
        if len(ids) and i not in no_bucket:  # as write_gpuidx: GGUF has no empty tensors
            tensors.append(PendingTensor(f"blk.{i}.gpu_bucket", (len(ids),), Q.I32, lambda b=ids: b.astype(np.int32)))
    write_gguf(placement.gpuidx_path(path), placement.GPU_INDEX_ARCH, fields, tensors, powerinfer=True)


@pytest.mark.parametrize("case, message", [
    ("over budget", "more than the"),
    ("capacity lie", "vram_capacity"),
    ("no capacity", "vram_capacity"),
    ("no solve inputs", "another KV cache size"),
    ("no block count", "layers"),
    ("float mask", "1-D I32"),
    ("mask of twos", "other than 0 and 1"),
    ("missing layer", "lacks layer 1"),
    ("missing bucket", "inconsistent in layer 1"),
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
        "no solve inputs": dict(hot=few, drop=(placement.KV_KEY,)),  # an index of an older version
        "no block count": dict(hot=few, drop=(f"{placement.GPU_INDEX_ARCH}.block_count",)),
        "float mask": dict(hot=few, mask_type=Q.F32),
        "mask of twos": dict(hot=few, mask_value=2),
        "missing layer": dict(hot=few[:1]),
        "missing bucket": dict(hot=few, no_bucket=(1,)),
        "other layer count": dict(hot=few, n_layer=3),
    }[case])
    with pytest.raises(JaxinferError, match=message):
        placement.read_gpuidx(placement.gpuidx_path(path), path, TEST_COUNTS, costs, budget)
    split = placement.load_or_solve(path, TEST_COUNTS, costs, budget)
    assert not split.reused and message in split.rebuilt_because and sum(len(h) for h in split.hot) == 60
    assert placement.load_or_solve(path, TEST_COUNTS, costs, budget).reused


def test_an_index_splitting_a_unit_of_neurons_is_rejected(indexed_model):
    path, costs, budget = indexed_model
    in_units = dataclasses.replace(costs, unit_bytes=costs.unit_bytes * 32, unit_neurons=np.array([32, 32]))
    forge_gpuidx(path, in_units, budget, hot=[np.arange(16, 48), np.arange(0)])
    with pytest.raises(JaxinferError, match="splits layer 0's units of 32 neurons"):
        placement.read_gpuidx(placement.gpuidx_path(path), path, TEST_COUNTS, in_units, budget)


def test_a_split_with_empty_layers_is_reused(make_model):
    path = make_model(n_embd=64, n_ff=128, sparsity=0.8)
    counts = TEST_COUNTS.copy()
    counts[1] = 0  # layer 1 never fires: its neurons are worth nothing, so 60 neurons of layer 0 are hot
    for budget in (TEST_BUDGET, 0):  # some layers empty; every layer empty (the budget buys nothing)
        split = placement.load_or_solve(path, counts, TEST_COSTS, budget)
        assert len(split.hot[1]) == 0 and not split.reused
        again = placement.load_or_solve(path, counts, TEST_COSTS, budget)
        assert again.reused and all(np.array_equal(a, b) for a, b in zip(again.hot, split.hot))


def test_a_forged_index_within_the_budget_is_used(indexed_model):
    path, costs, budget = indexed_model
    forge_gpuidx(path, costs, budget, hot=[np.arange(30), np.arange(60, 90)])
    split = placement.read_gpuidx(placement.gpuidx_path(path), path, TEST_COUNTS, costs, budget)
    assert [h.tolist() for h in split.hot] == [list(range(30)), list(range(60, 90))]

import itertools
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import placement
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_io import load_config, open_gguf


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

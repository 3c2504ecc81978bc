"""decode_bytes: the weight bytes a decode step reads, by class, against sums over the file's tensor sizes."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import decode_bytes, engine, sparsity
from jaxinfer.gguf_io import open_gguf


def sizes(path: str):
    """size(name) -> bytes of the file's tensor `name` (an independent count: what the file stores)."""
    tensors = open_gguf(path).tensors
    return lambda name: tensors[name].n_bytes


def test_a_powerinfer_model_reads_its_predictor_only_in_the_predictor_mode(make_model):
    """A PowerInfer file's dense mode reads all of gate and up, the down rows of its active neurons (a ReLU model's
    zeros are skipped) and no predictor, though the model holds one; the predictor mode reads active rows of gate, up
    and down, and all of fc1 and fc2. Counting fc1/fc2 in the dense bytes (as bench_generate did) overstated the
    promised speed-up."""
    path = make_model(n_layer=2, n_embd=64, n_ff=256, sparsity=0.8, weight_type=Q.Q4_0)
    size = sizes(path)
    m = engine.load_model(path)
    shares = [0.25, 0.6]
    blk = [f"blk.{i}." for i in range(2)]

    def layers_sum(name, weights=(1.0, 1.0)):
        return sum(w * size(f"{b}{name}.weight") for b, w in zip(blk, weights))

    attention = sum(layers_sum(n) for n in ("attn_q", "attn_k", "attn_v", "attn_output"))
    dense = decode_bytes.step_bytes(sparsity.apply(m, sparsity.SparsitySpec("dense")), shares)
    assert dense.read == pytest.approx({"attention": attention, "output": size("output.weight"),
                                        "ffn_gate": layers_sum("ffn_gate"), "ffn_up": layers_sum("ffn_up"),
                                        "ffn_down": layers_sum("ffn_down_t", shares), "predictor": 0.0})
    predictor = decode_bytes.step_bytes(sparsity.apply(m, sparsity.SparsitySpec("predictor")), shares)
    assert predictor.read == pytest.approx({
        "attention": attention, "output": size("output.weight"), "ffn_gate": layers_sum("ffn_gate", shares),
        "ffn_up": layers_sum("ffn_up", shares), "ffn_down": layers_sum("ffn_down_t", shares),
        "predictor": layers_sum("fc1") + layers_sum("fc2")})
    assert predictor.active_share == pytest.approx(np.mean(shares))
    # 36-byte Q4_0 rows share lines: whole lines read are more than the bytes, at most all of the rows' lines
    assert dense.read["ffn_down"] < dense.lines["ffn_down"] < layers_sum("ffn_down_t")
    assert dense.lines["ffn_gate"] == dense.read["ffn_gate"]
    assert dense.total == pytest.approx(sum(dense.read.values()))


def test_a_swiglu_model_skips_down_rows_for_hidden_and_up_rows_too_for_gate(make_model):
    """A plain SwiGLU model reads everything dense (its ffn_down whole, a tied head once); hidden:S skips the down
    projection's rows of inactive neurons (packed neuron-major, the blocks' scales are read for every block), gate:S
    also the up projection's rows."""
    path = make_model(n_layer=2, n_embd=64, n_ff=256, weight_type=Q.Q8_0, embedding_type=Q.Q8_0)
    size = sizes(path)
    m = engine.load_model(path)
    for method in ("hidden", "gate"):
        sparsity.save_thresholds(path, method, {0.5: np.array([0.1, 0.2])}, "test")
    shares = [0.5, 0.3]
    down = [size(f"blk.{i}.ffn_down.weight") for i in range(2)]
    up = [size(f"blk.{i}.ffn_up.weight") for i in range(2)]
    dense = decode_bytes.step_bytes(sparsity.apply(m, sparsity.SparsitySpec("dense")), [1.0, 1.0])
    assert dense.read["output"] == size("token_embd.weight") and dense.read["ffn_down"] == sum(down)
    assert dense.read["predictor"] == 0
    for method, skips_up in (("hidden", False), ("gate", True)):
        spec = sparsity.SparsitySpec(method, 0.5)
        own = 32 / 34 if sparsity.packs_neuron_major(spec, m.config.plan) else 1.0  # Q8_0: 2 of 34 bytes a scale
        step = decode_bytes.step_bytes(sparsity.apply(m, spec), shares)
        assert step.read["ffn_down"] == pytest.approx(sum(d * (1 - (1 - a) * own) for d, a in zip(down, shares)))
        expected_up = sum(u * a for u, a in zip(up, shares)) if skips_up else sum(up)
        assert step.read["ffn_up"] == pytest.approx(expected_up)
        assert step.read["attention"] == dense.read["attention"] and step.read["ffn_gate"] == dense.read["ffn_gate"]


@pytest.mark.parametrize("run_bytes", [18, 36, 64, 256])
def test_touched_line_share_matches_a_simulation(run_bytes):
    """Neurons' runs of bytes back to back, each active with probability 0.3: the share of 64-byte lines holding an
    active neuron's byte, counted over a simulated layer."""
    rng = np.random.default_rng(0)
    n = 64 * 4000
    active = rng.random(n) < 0.3
    owner = np.repeat(np.arange(n), run_bytes)
    touched = np.zeros(len(owner) // 64, bool)
    np.logical_or.at(touched, np.arange(len(touched) * 64) // 64, active[owner[:len(touched) * 64]])
    assert decode_bytes.touched_line_share(run_bytes, 0.3) == pytest.approx(touched.mean(), abs=0.01)


def test_active_shares_follow_the_mode(make_model):
    """Measured on tokens: a SwiGLU model's dense mode has every neuron active; a ReLU PowerInfer model's dense mode
    (its zeros) and predictor mode (its exact predictor) agree, well below all."""
    tokens = list(range(5, 45))
    plain = engine.load_model(make_model("plain.gguf", n_layer=2))
    assert decode_bytes.active_shares(plain, tokens) == pytest.approx([1.0, 1.0])
    m = engine.load_model(make_model("sparse.gguf", n_layer=2, n_ff=256, sparsity=0.8))
    dense = decode_bytes.active_shares(sparsity.apply(m, sparsity.SparsitySpec("dense")), tokens)
    predicted = decode_bytes.active_shares(sparsity.apply(m, sparsity.SparsitySpec("predictor")), tokens)
    assert dense.shape == (2,) and np.all((dense > 0.05) & (dense < 0.5))
    np.testing.assert_allclose(predicted, dense, atol=0.01)


def test_alternate_decode_times_the_models_in_turn(make_model):
    m = engine.load_model(make_model(n_layer=1))
    models = {"a": m, "b": sparsity.apply(m, sparsity.SparsitySpec("dense"))}
    order = []
    rates, tokens = decode_bytes.alternate_decode(models, [0], 3, 2, 32, lambda name, rate: order.append(name))
    assert order == ["a", "b", "a", "b"] and all(len(r) == 2 and min(r) > 0 for r in rates.values())
    assert len(tokens) == 1 + 4  # the prompt, then the first token and 3 decode steps

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import activation_profile, engine, evaluation, hybrid, model, placement, quant, sparsity
from jaxinfer.errors import JaxinferError


@pytest.fixture
def sparse_model(make_model):
    # Exact products: the Pallas kernel multiplies in f32, so the reference must too (cpu_ext's 8-bit activations
    # differ by ~1e-2; those kernels are compared with their references in test_cpu_ext).
    m = engine.load_model(make_model(n_embd=64, n_ff=256, sparsity=0.85, weight_type=Q.Q8_0, n_ctx=64), exact=True)
    return sparsity.apply(m, sparsity.SparsitySpec("predictor"))


@pytest.mark.parametrize("hot_share, hot_ffn_kernel", [(0.0, "xla"), (0.3, "xla"), (1.0, "xla"),
                                                     (0.3, "pallas_interpret")])
def test_hybrid_equals_the_dense_masked_model(sparse_model, hot_share, hot_ffn_kernel):
    m = sparse_model
    placement = dataclasses.replace(hybrid.Placement.detect(), hot_ffn_kernel=hot_ffn_kernel)
    assert placement.accelerator != placement.host
    n_ff = m.config.n_ff
    hot = [np.sort(np.random.default_rng(i).permutation(n_ff)[:int(hot_share * n_ff)]) for i in range(2)]
    hw = hybrid.split_weights(m.weights, hot, placement, m.config)
    assert all(isinstance(p, hybrid.KernelPart) == (hot_ffn_kernel != "xla") for p in hw.hot if p is not None)
    assert (hybrid.ffn_bytes(hw.hot) > 0) == (hot_share > 0) and (hybrid.ffn_bytes(hw.cold) > 0) == (hot_share < 1)
    assert all(p is None or p.ffn_gate.data.devices() == {placement.host} for p in hw.cold)

    tokens = np.random.default_rng(5).integers(3, 259, size=(1, 12)).astype(np.int32)
    prompt = np.zeros((1, 16), np.int32)
    prompt[0, :8] = tokens[0, :8]

    def run(prefill, decode_step, cache):
        """An 8-token prompt, then incremental decode: the same shapes for the unsplit and split models, so their
        predictor logits round alike and no neuron near the threshold flips between them."""
        logits, cache = prefill(prompt, jnp.int32(8), cache)
        out = [np.asarray(logits)[0]]
        for position in range(8, 12):
            logits, cache = decode_step(tokens[:, position], cache)
            out.append(np.asarray(logits)[0])
        return np.stack(out)

    expected = run(lambda t, n, c: model.prefill(t, n, m.weights, c, m.config),
                   lambda t, c: model.decode_step(t, m.weights, c, m.config), model.init_cache(m.config, 1, 32))
    got = run(lambda t, n, c: hybrid.prefill(t, n, hw, c, m.config, placement),
              lambda t, c: hybrid.decode_step(t, hw, c, m.config, placement),
              jax.device_put(model.init_cache(m.config, 1, 32), placement.accelerator))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("down", ["F32 ffn_down", "Q4_0 ffn_down", "Q4_0 neuron-major ffn_down_t"])
def test_swiglu_model_with_ffn_down_splits_too(make_model, down):
    """A dense model's down projection is split in its own format: a float one transposed exactly (any neurons), a
    quantized one by whole blocks across neurons, a neuron-major packing by whole blocks of 32 neurons."""
    if down.startswith("F32"):
        m = engine.load_model(make_model())
        hot = [np.arange(0, 128, 3), np.arange(5)]
    else:
        m = engine.load_model(make_model(weight_type=Q.Q4_0))
        hot = [np.arange(32, 96), np.arange(0, 32)]
    if "neuron-major" in down:
        m = dataclasses.replace(m, weights=dataclasses.replace(m.weights, layers=[
            sparsity.with_transposed_down(layer) for layer in m.weights.layers]))
        assert m.weights.layers[0].ffn_down_t.layout == quant.NEURON_MAJOR
    placement = hybrid.Placement.detect()
    hw = hybrid.split_weights(m.weights, hot, placement)
    original = m.weights.layers[0]
    for part in hw.hot + hw.cold:  # the stored type (and layout) is kept: no decoding to f32
        placed = part.ffn_down_t if part.ffn_down is None else part.ffn_down
        source = original.ffn_down_t if original.ffn_down is None else original.ffn_down
        assert (placed.qtype, placed.layout) == (source.qtype, source.layout)
    costs = hybrid.placement_costs(m.weights, m.config, placement, 0)
    assert hybrid.ffn_bytes(hw.hot) + hybrid.ffn_bytes(hw.cold) == sum(
        costs.unit_bytes * (m.config.n_ff // costs.neurons_per_unit()))  # as many bytes as the model's FFNs
    tokens = np.random.default_rng(6).integers(0, m.config.n_vocab, size=(2, 8)).astype(np.int32)
    reference, _, _ = jax.jit(model.forward, static_argnums=2)(tokens, m.weights, m.config)
    cache = jax.device_put(model.init_cache(m.config, 2, 8), placement.accelerator)
    hidden, _ = hybrid.forward(tokens, hw, m.config, cache, placement)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(reference), rtol=1e-5, atol=1e-5)
    if not down.startswith("F32"):  # half a block of neurons cannot move alone
        with pytest.raises(ValueError, match="whole aligned units"):
            hybrid.split_weights(m.weights, [np.arange(16, 48), np.arange(0)], placement)


@pytest.mark.parametrize("ubatch", [8, 32])
def test_perplexity_of_a_split_model_equals_the_unsplit_ones(sparse_model, ubatch):
    m = sparse_model
    devices = hybrid.Placement.detect()
    hot = [np.sort(np.random.default_rng(i).permutation(m.config.n_ff)[:77]) for i in range(2)]
    split = engine.Split(hybrid.split_weights(m.weights, hot, devices, m.config), devices, "")
    windows = evaluation.make_windows(np.random.default_rng(2).integers(3, 259, size=3 * 32), 32, -1, None)
    # Micro-batches through the KV cache for both, so that their predictor logits round alike (see above).
    expected = evaluation.evaluate_windows(m.weights, m.config, windows, n_seq=2, ubatch=8, progress=False)
    got = evaluation.evaluate_windows(split.weights.dense, m.config, windows, n_seq=2, ubatch=ubatch,
                                      progress=False, split=split)
    np.testing.assert_allclose(got.nll, expected.nll, rtol=0, atol=1e-4)
    assert abs(got.ppl - expected.ppl) < 1e-4 * expected.ppl


@pytest.fixture
def profiled_model(make_model):
    """(path, budget in GiB) of a predictor model with an activation profile, the budget fitting 100.5 neurons."""
    path = make_model(n_embd=64, n_ff=256, sparsity=0.85, n_ctx=64)
    m = sparsity.apply(engine.load_model(path), sparsity.SparsitySpec("predictor"))
    write_profile(m)
    kv = placement.kv_cache_bytes(m.config, 32)
    costs = hybrid.placement_costs(m.weights, m.config, hybrid.Placement.detect(), kv)
    budget = costs.dense_bytes + costs.kv_bytes + placement.WORKSPACE_BYTES + 100.5 * int(costs.unit_bytes[0])
    return path, budget / placement.GIB


def write_profile(m):
    """An activation profile of `m` where a split finds it by default."""
    tokens = np.random.default_rng(1).integers(3, 259, size=4 * 32)
    counts = activation_profile.profile_counts(m, evaluation.make_windows(tokens, 32, -1, None))
    directory = activation_profile.default_directory(m.path)
    activation_profile.write_profile(directory, m.path, counts, tokens.size, "predictor")


def accelerator_bytes(hw: hybrid.HybridWeights, device) -> int:
    """Bytes of the distinct arrays of a split's accelerator part, each checked to live on `device`."""
    arrays = {id(a): a for a in jax.tree.leaves((hw.dense, hw.hot))}
    assert all(a.devices() == {device} for a in arrays.values())
    return sum(a.size * a.dtype.itemsize for a in arrays.values())


@pytest.mark.parametrize("kind", ["dense Q8_0 SwiGLU (ffn_down decoded to f32 rows)", "predictor Q4_0 (ffn_down_t)"])
def test_what_is_placed_is_what_was_priced(make_model, kind):
    if kind.startswith("dense"):
        m = engine.load_model(make_model(n_embd=64, n_ff=256, weight_type=Q.Q8_0, embedding_type=Q.Q8_0))
    else:
        path = make_model(n_embd=64, n_ff=256, sparsity=0.85, weight_type=Q.Q4_0, n_ctx=64)
        m = sparsity.apply(engine.load_model(path), sparsity.SparsitySpec("predictor"))
    write_profile(m)
    devices = hybrid.Placement.detect()
    costs = hybrid.placement_costs(m.weights, m.config, devices, placement.kv_cache_bytes(m.config, 32))
    fixed = costs.dense_bytes + costs.kv_bytes + placement.WORKSPACE_BYTES
    all_neurons = int((costs.unit_bytes * (m.config.n_ff // costs.neurons_per_unit())).sum())
    for share in (0.1, 0.37, 0.8, 1.0):
        budget = fixed + int(share * all_neurons)
        split = engine.split_model(m, budget / placement.GIB, 32, None, reset=False).split
        assert 0 < split.plan.ffn_bytes_used <= budget - fixed
        assert hybrid.ffn_bytes(split.weights.hot) == split.plan.ffn_bytes_used, share  # placed == priced
        placed = accelerator_bytes(split.weights, devices.accelerator)
        assert placed <= costs.dense_bytes + split.plan.ffn_bytes_used  # fc1 is priced for layers with no hot row
        assert placed + costs.kv_bytes + placement.WORKSPACE_BYTES <= budget
        tied = m.weights.output is m.weights.token_embd
        assert (split.weights.dense.output is split.weights.dense.token_embd) == tied  # a tied head is placed once
    assert split.plan.ffn_bytes_used == all_neurons and hybrid.ffn_bytes(split.weights.cold) == 0


def test_split_summary_says_reused_rebuilt_and_why_nothing_was_offloaded(profiled_model):
    path, budget = profiled_model
    m = sparsity.apply(engine.load_model(path), sparsity.SparsitySpec("predictor"))
    index = placement.gpuidx_path(path)
    first = engine.split_model(m, budget, 32, None, reset=False).split.summary
    directory = activation_profile.default_directory(path)
    assert f"index {index} (solved from the activation profile in {directory})" in first
    assert f"index {index} (reused)" in engine.split_model(m, budget, 32, None, reset=False).split.summary
    longer = engine.split_model(m, budget, 64, None, reset=False).split  # twice the KV cache: fewer neurons fit
    assert "(rebuilt from the activation profile in" in longer.summary and "another KV cache size" in longer.summary
    assert sum(map(len, longer.plan.hot)) < 100
    # The solve depends on the KV cache's bytes: 2 sequences of 32 positions are 1 of 64 (reused), 2 of 64 are not
    assert "(reused)" in engine.split_model(m, budget, 32, None, reset=False, batch=2).split.summary
    batch = engine.split_model(m, budget, 64, None, reset=False, batch=2).split.summary
    assert "another KV cache size" in batch, batch
    nothing = engine.split_model(m, budget, 2048, None, reset=False).split.summary  # the KV cache takes it all
    assert "offloaded 0.00 MiB" in nothing and "leave nothing for FFN neurons" in nothing, nothing
    assert "KV cache 1.00 MiB" in nothing, nothing  # 2048 positions of 2 layers x 2 heads x 16 x K and V in f32


def test_a_split_without_a_profile_is_a_one_line_error(make_model):
    m = engine.load_model(make_model())
    with pytest.raises(JaxinferError, match=r"no activation profile in .*tiny\.gguf\.activation: make one with"):
        engine.split_model(m, 1.0, 32, None, reset=False)


def test_build_model_loads_applies_the_sparsity_and_splits(profiled_model, tmp_path):
    """The one sequence every CLI builds its model with: a context beyond the training one is capped for the split's
    KV cache (-c 4096 on this 64-token model prices the cache of 64, leaving fewer neurons than -c 32)."""
    path, budget = profiled_model
    predictor = sparsity.SparsitySpec("predictor")
    plain = engine.build_model(path, sparsity_spec=predictor)
    assert plain.split is None and plain.config.ffn_sparsity == "predictor"
    assert plain.weights.layers[0].ffn_down_t is not None
    split = engine.build_model(path, sparsity_spec=predictor, vram_budget_gib=budget, ctx=32)
    assert split.config == plain.config and "(19.5% of neurons)" in split.split.summary, split.split.summary
    capped = engine.build_model(path, sparsity_spec=predictor, vram_budget_gib=budget, ctx=4096, reset_gpu_index=True)
    assert capped.split.summary != split.split.summary and "% of neurons)" in capped.split.summary
    seen = []
    with pytest.raises(JaxinferError, match="no activation profile in .*none: make one"):
        engine.build_model(path, sparsity_spec=predictor, vram_budget_gib=budget, ctx=32,
                           activation_dir=str(tmp_path / "none"), reset_gpu_index=True, loaded=seen.append)
    assert len(seen) == 1 and seen[0].split is None  # `loaded` saw the model before the split failed


def run_cli(module, path, *args):
    return subprocess.run([sys.executable, "-m", module, "-m", path, "--sparsity", "predictor", "-c", "32", *args],
                          capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300)


def test_generate_cli_with_a_vram_budget(profiled_model):
    path, budget = profiled_model
    dense = run_cli("jaxinfer.generate", path, "-n", "6", "--temp", "0")
    split = run_cli("jaxinfer.generate", path, "-n", "6", "--temp", "0", "--vram-budget", f"{budget:.12f}")
    assert split.returncode == 0, split.stderr
    assert "offloaded" in split.stderr and "(19.5% of neurons)" in split.stderr, split.stderr
    assert split.stdout == dense.stdout  # the same greedy text, split or not
    assert os.path.exists(placement.gpuidx_path(path))
    assert (f"index {placement.gpuidx_path(path)} (solved from the activation profile in "
            f"{activation_profile.default_directory(path)})") in split.stderr, split.stderr


def test_perplexity_cli_with_a_vram_budget(profiled_model, tmp_path):
    path, budget = profiled_model
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    dense = run_cli("jaxinfer.perplexity", path, "-f", str(text), "-ub", "8")
    split = run_cli("jaxinfer.perplexity", path, "-f", str(text), "-ub", "8", "-b", "32",  # one window: the budget's KV
                    "--vram-budget", f"{budget:.12f}")
    assert split.returncode == 0, split.stderr
    assert "offloaded" in split.stderr and "(19.5% of neurons)" in split.stderr, split.stderr
    assert split.stdout.split("|")[0] == dense.stdout.split("|")[0]  # the same PPL line, split or not


@pytest.mark.parametrize("module", ["jaxinfer.generate", "jaxinfer.perplexity"])
def test_cli_help_lists_the_split_flags(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    for flag in ("vram_budget", "activation_dir", "reset_gpu_index", "disable_gpu_index"):
        assert flag in result.stdout, (module, flag)

import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import (activation_profile, engine, evaluation, hybrid, model, placement, quant, repack, sparse_ffn,
                      sparsity)
from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import SamplingParams


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The three ways a model's FFN decides its neurons, on tiny Q8_0 models: dense (SwiGLU), hidden:S (a threshold,
    the down projection one row per neuron) and predictor (a PowerInfer file)."""
    from jaxinfer.synthetic import SyntheticSpec, write_model

    folder = tmp_path_factory.mktemp("split")
    dense_path, predictor_path = str(folder / "dense.gguf"), str(folder / "predictor.gguf")
    write_model(dense_path, SyntheticSpec(n_embd=64, n_ff=256, weight_type=Q.Q8_0, sparsity=0.0, n_ctx=64))
    write_model(predictor_path, SyntheticSpec(n_embd=64, n_ff=256, weight_type=Q.Q8_0, sparsity=0.85, n_ctx=64))
    dense = engine.load_model(dense_path)
    hidden = dataclasses.replace(dense, config=dense.config.replan(ffn_sparsity="hidden"),
                                 weights=dataclasses.replace(dense.weights, layers=[
                                     sparsity.with_transposed_down(dataclasses.replace(
                                         layer, ffn_threshold=jnp.float32(0.02))) for layer in dense.weights.layers]))
    predictor = sparsity.apply(engine.load_model(predictor_path), sparsity.SparsitySpec("predictor"))
    exact = sparsity.apply(engine.load_model(predictor_path, exact=True), sparsity.SparsitySpec("predictor"))
    return {"dense": dense, "hidden": hidden, "predictor": predictor, "predictor_exact": exact}


# The predictor model's down projection (ffn_down_t rows, cpu_ext's down_rows_axpy) rounds each group of 32 active
# neurons' coefficients to 8 bits with one scale per block, and a part groups its own neurons: a split changes that
# rounding, not only the order of the parts' sums (measured: 0.03 at most on logits within +-3.5). With exact products
# ("predictor_exact") a split changes the order of additions only.
GROUPED_ROUNDING = 5e-2
# Beside a GPU the device multiplies with XLA in f32 and the host parts with cpu_ext's 8-bit activations: a split's
# logits differ from the unsplit model's by those kernels' rounding (measured on an H200: 0.033 at most).
KERNEL_ROUNDING = 5e-2
# The Pallas kernel sums in another order than XLA, and a ReLU gate within rounding of 0 can fire in one and not the
# other (measured on an H200, JAX 0.11.2: 4.9e-4 on logits within +-3.4, all neurons in the kernel's part).
PALLAS_ROUNDING = 5e-4


def split_tolerance(m, split, mode: str, hot_share: float) -> tuple[float, bool]:
    """(absolute tolerance of a split's logits against `m`'s, on its largest logit's scale, whether the rounding
    differs): GROUPED_ROUNDING where the parts regroup the down projection's neurons, KERNEL_ROUNDING where host
    and device multiply with different kernels, PALLAS_ROUNDING where a compiled Pallas kernel holds neurons."""
    plan = m.config.plan
    has_host = any(getattr(p, "on_host", False) for layer in split.weights.layers for p in layer.ffn_parts)
    if plan.down_rows and mode == "predictor" and 0 < hot_share < 1:
        return GROUPED_ROUNDING, True
    if has_host and plan.host_products != plan.products and mode != "predictor_exact":
        return KERNEL_ROUNDING, True
    kernel_parts = any(isinstance(p, sparse_ffn.KernelPart) for layer in split.weights.layers
                       for p in layer.ffn_parts)
    if kernel_parts and plan.hot_ffn == "pallas":
        return PALLAS_ROUNDING, True
    return 1e-5, False


def split_at(m, hot_share: float, seed: int = 0):
    """`m` with a random `hot_share` of each layer's neurons (whole units) in device memory, the rest in host memory."""
    hot = []
    for i, layer in enumerate(m.weights.layers):
        unit = hybrid.unit_neurons(layer)
        n_units = m.config.n_ff // unit
        units = np.sort(np.random.default_rng(seed + i).permutation(n_units)[:round(hot_share * n_units)])
        hot.append((units[:, None] * unit + np.arange(unit)).reshape(-1))
    return dataclasses.replace(m, weights=hybrid.split_weights(m.weights, hot, m.config))


def prefill_then_decode(m, prompt, steps):
    """Logits after an 8-token prompt (padded to 16), then after each of `steps` fed one at a time."""
    cache = model.init_cache(m.config, 1, 32)
    padded = np.zeros((1, 16), np.int32)
    padded[0, :len(prompt)] = prompt
    logits, cache = model.prefill(padded, jnp.int32(len(prompt)), m.weights, cache, m.config)
    out = [np.asarray(logits)[0]]
    for token in steps:
        logits, cache = model.decode_step(np.array([token], np.int32), m.weights, cache, m.config)
        out.append(np.asarray(logits)[0])
    return np.stack(out)


def greedy(m, prompt, n):
    """n greedy tokens through generate's own programs: the prefill, then decode chunks in one while_loop."""
    return list(engine.generate_tokens(m, list(prompt), n, 32, SamplingParams(temperature=0), 0,
                                       stop_ids=frozenset()))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dense", "hidden", "predictor", "predictor_exact"])
@pytest.mark.parametrize("hot_share", [0.0, 0.3, 1.0])
def test_a_split_model_equals_the_unsplit_one(models, mode, hot_share):
    """Split or not, the same weights give the same logits (to f32 rounding: the parts' sums are added in another
    order; a predictor model's down projection to GROUPED_ROUNDING where both parts hold neurons) in prefill and
    decode, and the same greedy tokens through generate's while_loop."""
    m = models[mode]
    split = split_at(m, hot_share)
    on_host = [getattr(p, "on_host", False) for layer in split.weights.layers for p in layer.ffn_parts]
    assert on_host == [False] * len(on_host) if hot_share == 1 else True in on_host
    assert (False in on_host) == (hot_share > 0)
    prompt, steps = [5, 17, 250, 3, 99, 42, 7, 128], [11, 200, 64, 9]
    expected, got = prefill_then_decode(m, prompt, steps), prefill_then_decode(split, prompt, steps)
    if m.config.plan.down_rows:  # cpu_ext's integer down projection takes a predictor model's ffn_down_t
        assert (m.weights.layers[0].ffn_down_t.layout == quant.DOWN_ROWS) == (mode == "predictor")
    tolerance, rounded = split_tolerance(m, split, mode, hot_share)
    scale = 1.0 if tolerance in (GROUPED_ROUNDING, KERNEL_ROUNDING) else np.abs(expected).max()
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance * scale)
    if not rounded:
        assert greedy(split, prompt, 12) == greedy(m, prompt, 12)


@pytest.mark.slow
def test_pallas_kernel_part_equals_the_unsplit_model(models):
    """The device part of a predictor model laid out for the Pallas masked sparse FFN (interpreted here; compiled
    on a GPU) gives the unsplit model's logits: exact weights, as the kernel multiplies in f32."""
    m = models["predictor"]
    exact = engine.load_model(m.path, exact=True)
    exact = sparsity.apply(dataclasses.replace(exact, config=exact.config.replan(hot_ffn="pallas_interpret")),
                           sparsity.SparsitySpec("predictor"))
    split = split_at(exact, 0.3)
    assert isinstance(split.weights.layers[0].ffn_parts[0], sparse_ffn.KernelPart)
    prompt, steps = [5, 17, 250, 3, 99, 42, 7, 128], [11, 200]
    expected, got = prefill_then_decode(exact, prompt, steps), prefill_then_decode(split, prompt, steps)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * np.abs(expected).max())


def test_the_cold_part_lives_and_runs_in_host_memory(models):
    """Not a mock: the compiled decode program takes the cold parts' weights in pinned_host memory and computes them
    in regions marked for the host (compute_on), and the hot parts' in device memory."""
    split = split_at(models["predictor"], 0.5)
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(split.weights))  # none copied in per call
    cache = model.init_cache(split.config, 1, 32)
    lowered = model.decode_step.lower(np.zeros(1, np.int32), split.weights, cache, split.config)
    compiled = lowered.compile()
    weight_kinds = [s.memory_kind for s in jax.tree.leaves(compiled.input_shardings[0][1])]
    parts = [(getattr(p, "on_host", False), w)  # a KernelPart (the Pallas kernel's, beside a GPU) is on the device
             for layer in split.weights.layers for p in layer.ffn_parts for w in jax.tree.leaves(p)]
    host_bytes = sum(w.nbytes for on_host, w in parts if on_host)
    assert host_bytes > 0 and weight_kinds.count("pinned_host") == sum(on_host for on_host, _ in parts)
    assert all(w.sharding.memory_kind == ("pinned_host" if on_host else "device") for on_host, w in parts)
    assert lowered.as_text().count('_xla_compute_type = "host"') >= split.config.n_layer


@pytest.mark.slow
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
    split = hybrid.split_weights(m.weights, hot, m.config)
    original = repack.ffn_rows(m.weights.layers[0])  # a dense FFN repacked at load is split as GGUF's rows
    for part in [p for layer in split.layers for p in layer.ffn_parts]:  # the stored type and layout are kept
        placed = part.ffn_down_t if part.ffn_down is None else part.ffn_down
        source = original.ffn_down_t if original.ffn_down is None else original.ffn_down
        assert (placed.qtype, placed.layout) == (source.qtype, source.layout)
    costs = hybrid.placement_costs(m.weights, m.config, 0)
    assert hybrid.ffn_bytes(split, on_host=False) + hybrid.ffn_bytes(split, on_host=True) == sum(
        costs.unit_bytes * (m.config.n_ff // costs.neurons_per_unit()))  # as many bytes as the model's FFNs
    tokens = np.random.default_rng(6).integers(0, m.config.n_vocab, size=(2, 8)).astype(np.int32)
    forward = jax.jit(model.forward, static_argnums=2)
    reference, _, _ = forward(tokens, m.weights, m.config)
    hidden, _, _ = forward(tokens, split, m.config)
    plan = m.config.plan
    mixed = plan.host_products != plan.products and not down.startswith("F32")  # beside a GPU: KERNEL_ROUNDING
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(reference), rtol=1e-5,
                               atol=KERNEL_ROUNDING if mixed else 1e-5)
    if not down.startswith("F32"):  # half a block of neurons cannot move alone
        with pytest.raises(ValueError, match="whole aligned units"):
            hybrid.split_weights(m.weights, [np.arange(16, 48), np.arange(0)], m.config)


@pytest.mark.slow
@pytest.mark.parametrize("ubatch", [8, 32])
def test_perplexity_of_a_split_model_equals_the_unsplit_ones(models, ubatch):
    windows = evaluation.make_windows(np.random.default_rng(2).integers(3, 259, size=3 * 32), 32, -1, None)
    for mode, tolerance in (("predictor_exact", 1e-4), ("predictor", 1e-2)):  # GROUPED_ROUNDING's share of a PPL
        m = models[mode]
        split = split_at(m, 0.3)
        expected = evaluation.evaluate_windows(m.weights, m.config, windows, n_seq=2, ubatch=ubatch, progress=False)
        got = evaluation.evaluate_windows(split.weights, m.config, windows, n_seq=2, ubatch=ubatch, progress=False)
        np.testing.assert_allclose(got.nll, expected.nll, rtol=tolerance, atol=tolerance, err_msg=mode)
        assert abs(got.ppl - expected.ppl) < tolerance * expected.ppl, mode


@pytest.fixture
def profiled_model(make_model):
    """(path, budget in GiB) of a predictor model with an activation profile, the budget fitting 100.5 neurons."""
    path = make_model(n_embd=64, n_ff=256, sparsity=0.85, n_ctx=64)
    m = sparsity.apply(engine.load_model(path), sparsity.SparsitySpec("predictor"))
    write_profile(m)
    kv = placement.kv_cache_bytes(m.config, 32)
    costs = hybrid.placement_costs(m.weights, m.config, kv)
    budget = costs.dense_bytes + costs.kv_bytes + placement.WORKSPACE_BYTES + 100.5 * int(costs.unit_bytes[0])
    return path, budget / placement.GIB


def write_profile(m):
    """An activation profile of `m` where a split finds it by default."""
    tokens = np.random.default_rng(1).integers(3, 259, size=4 * 32)
    counts = activation_profile.profile_counts(m, evaluation.make_windows(tokens, 32, -1, None))
    directory = activation_profile.default_directory(m.path)
    activation_profile.write_profile(directory, m.path, counts, tokens.size, "predictor")


def device_bytes(weights: model.Weights) -> int:
    """Bytes of the distinct arrays of a split model in device memory."""
    arrays = {id(a): a for a in jax.tree.leaves(weights) if a.sharding.memory_kind == "device"}
    return sum(a.size * a.dtype.itemsize for a in arrays.values())


@pytest.mark.parametrize("kind", ["dense Q8_0 SwiGLU (ffn_down decoded to f32 rows)", "predictor Q4_0 (ffn_down_t)"])
def test_what_is_placed_is_what_was_priced(make_model, kind):
    if kind.startswith("dense"):
        m = engine.load_model(make_model(n_embd=64, n_ff=256, weight_type=Q.Q8_0, embedding_type=Q.Q8_0))
    else:
        path = make_model(n_embd=64, n_ff=256, sparsity=0.85, weight_type=Q.Q4_0, n_ctx=64)
        m = sparsity.apply(engine.load_model(path), sparsity.SparsitySpec("predictor"))
    write_profile(m)
    costs = hybrid.placement_costs(m.weights, m.config, placement.kv_cache_bytes(m.config, 32))
    fixed = costs.dense_bytes + costs.kv_bytes + placement.WORKSPACE_BYTES
    all_neurons = int((costs.unit_bytes * (m.config.n_ff // costs.neurons_per_unit())).sum())
    for share in (0.1, 0.37, 0.8, 1.0):
        budget = fixed + int(share * all_neurons)
        split_model = engine.split_model(m, budget / placement.GIB, 32, None, reset=False)
        split = split_model.split
        assert 0 < split.plan.ffn_bytes_used <= budget - fixed
        assert hybrid.ffn_bytes(split_model.weights, on_host=False) == split.plan.ffn_bytes_used, share  # as priced
        placed = device_bytes(split_model.weights)
        assert placed == costs.dense_bytes + split.plan.ffn_bytes_used
        assert placed + costs.kv_bytes + placement.WORKSPACE_BYTES <= budget
    assert split.plan.ffn_bytes_used == all_neurons and hybrid.ffn_bytes(split_model.weights, on_host=True) == 0


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
    assert plain.split is None and plain.config.plan.ffn_sparsity == "predictor"
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_perplexity_cli_with_a_vram_budget(profiled_model, tmp_path):
    path, budget = profiled_model
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    dense = run_cli("jaxinfer.perplexity", path, "-f", str(text), "-ub", "8")
    split = run_cli("jaxinfer.perplexity", path, "-f", str(text), "-ub", "8", "-b", "32",  # one window: the budget's KV
                    "--vram-budget", f"{budget:.12f}")
    assert split.returncode == 0, split.stderr
    assert "offloaded" in split.stderr and "(19.5% of neurons)" in split.stderr, split.stderr
    # The same PPL, split or not (beside a GPU, to the rounding of the host's kernels against the device's).
    ppl = [float(re.search(r"PPL = ([0-9.]+)", run.stdout).group(1)) for run in (split, dense)]
    assert ppl[0] == pytest.approx(ppl[1], rel=1e-6)


@pytest.mark.parametrize("module", ["jaxinfer.generate", "jaxinfer.perplexity"])
def test_cli_help_lists_the_split_flags(module):
    result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    for flag in ("vram_budget", "activation_dir", "reset_gpu_index", "disable_gpu_index"):
        assert flag in result.stdout, (module, flag)

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine, hybrid, model, sparsity


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


def test_swiglu_model_with_ffn_down_splits_too(make_model):
    m = engine.load_model(make_model())  # ffn_down [d, n_ff]: decoded once to rows per neuron for the split
    placement = hybrid.Placement.detect()
    hot = [np.arange(0, 128, 3), np.arange(5)]
    hw = hybrid.split_weights(m.weights, hot, placement)
    tokens = np.random.default_rng(6).integers(0, m.config.n_vocab, size=(2, 8)).astype(np.int32)
    reference, _, _ = jax.jit(model.forward, static_argnums=2)(tokens, m.weights, m.config)
    cache = jax.device_put(model.init_cache(m.config, 2, 8), placement.accelerator)
    hidden, _ = hybrid.forward(tokens, hw, m.config, cache, placement)
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(reference), rtol=1e-5, atol=1e-5)


def test_generate_cli_with_a_vram_budget(make_model, tmp_path):
    import os
    import subprocess
    import sys

    from jaxinfer import perplexity, placement, profile

    path = make_model(n_embd=64, n_ff=256, sparsity=0.85, n_ctx=64)
    m = sparsity.apply(engine.load_model(path), sparsity.SparsitySpec("predictor"))
    tokens = np.random.default_rng(1).integers(3, 259, size=4 * 32)
    counts = profile.profile_counts(m, perplexity.make_windows(tokens, 32, -1, None))
    profile.write_profile(str(tmp_path / "activation"), path, counts, tokens.size, "predictor")
    costs = placement.model_costs(m.gguf, m.config, n_ctx=32)
    budget = costs.dense_bytes + costs.kv_bytes + placement.WORKSPACE_BYTES + 100.5 * int(costs.neuron_bytes[0])
    env = dict(os.environ, JAX_PLATFORMS="cpu")

    def run(*extra):
        return subprocess.run([sys.executable, "-m", "jaxinfer.generate", "-m", path, "--sparsity", "predictor",
                               "-n", "6", "-c", "32", "--temp", "0", *extra], capture_output=True, text=True, env=env,
                              timeout=300)

    dense = run()
    split = run("--vram-budget", f"{budget / placement.GIB:.12f}")
    assert split.returncode == 0, split.stderr
    assert "offloaded" in split.stderr and "(19.5% of neurons)" in split.stderr, split.stderr
    assert split.stdout == dense.stdout  # the same greedy text, split or not
    assert os.path.exists(placement.gpuidx_path(path))

import json
import os

import jax
import numpy as np
import pytest

from jaxinfer import calibrate, engine, model, perplexity, profile, sparsity, torch_format


def test_profile_counts_equal_a_direct_count(make_model, tmp_path):
    m = engine.load_model(make_model(n_layer=12, n_embd=64, n_ff=128, sparsity=0.8))
    tokens = np.random.default_rng(0).integers(3, 259, size=5 * 32)
    windows = perplexity.make_windows(tokens, 32, -1, bos_id=None)
    counts = profile.profile_counts(m, windows, n_seq=2)  # 3 batches, the last padded

    def hidden(index, trace):
        return trace.hidden

    _, _, observed = jax.jit(model.forward, static_argnums=(2, 4))(windows, m.weights, m.config, None, hidden)
    expected = np.stack([(np.asarray(h) != 0).sum(axis=(0, 1)) for h in observed])
    np.testing.assert_array_equal(counts, expected)

    directory = str(tmp_path / "activation")
    summary = profile.write_profile(directory, m.path, counts, windows.size, "dense")
    # Layer files are numbered, not sorted as strings: activation_10.pt is layer 10 (PowerInfer's export bug).
    np.testing.assert_array_equal(torch_format.load_tensor(os.path.join(directory, "activation_10.pt")), counts[10])
    np.testing.assert_array_equal(profile.read_profile(directory, m.path, 12, 128), counts)
    assert os.path.getsize(os.path.join(directory, "activation.png")) > 1000
    assert summary["layers"][3]["mean_active"] == pytest.approx(counts[3].sum() / (windows.size * 128))
    saved = json.load(open(os.path.join(directory, "profile.json")))
    assert saved["tokens"] == windows.size and "model_fingerprint" in saved


def test_coverage():
    counts = np.array([50, 30, 10, 5, 5, 0, 0, 0, 0, 0])
    assert sparsity.coverage(counts, (0.5, 0.8, 0.95)) == {0.5: 0.1, 0.8: 0.2, 0.95: 0.4}


@pytest.mark.parametrize("method", ["gate", "hidden"])
def test_calibrated_thresholds_reach_the_target_sparsity(make_model, method):
    m = engine.load_model(make_model())
    tokens = np.random.default_rng(1).integers(0, m.config.n_vocab, size=8 * 32)
    windows = perplexity.make_windows(tokens, 32, -1, bos_id=None)
    thresholds = calibrate.calibrate(m, windows, method, [0.3, 0.7], n_seq=4)
    for level, values in thresholds.items():
        sparsity.save_thresholds(m.path, method, {level: values}, "test")
        sparse = sparsity.apply(m, sparsity.SparsitySpec(method, level))
        active = profile.profile_counts(sparse, windows, n_seq=4).sum(axis=1) / (windows.size * m.config.n_ff)
        np.testing.assert_allclose(1 - active, level, atol=0.02)

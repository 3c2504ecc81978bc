import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import engine, evaluation, sparsity
from jaxinfer.errors import JaxinferError


def test_nonfinite_activations_stop_profiling_calibration_and_training(make_model):
    """calibrate, profile and train_predictor reduce what the FFNs did over windows; corrupt weights made NaN
    statistics (thresholds, firing counts, labels) before."""
    m = engine.load_model(make_model(n_ctx=64))
    up = m.weights.layers[1].ffn_up
    layers = list(m.weights.layers)
    layers[1] = dataclasses.replace(layers[1], ffn_up=dataclasses.replace(up, data=up.data.at[3, 0].set(jnp.nan)))
    broken = dataclasses.replace(m, weights=dataclasses.replace(m.weights, layers=layers))
    windows = evaluation.make_windows(np.arange(10, 10 + 5 * 16), 16, -1, bos_id=None)
    assert sparsity.reduce_over_windows(m, windows, sparsity.count_active, n_seq=2)[0].shape == (m.config.n_ff,)
    with pytest.raises(JaxinferError, match=r"activations are NaN or infinite in windows 0\.\.1"):
        sparsity.reduce_over_windows(broken, windows, sparsity.count_active, n_seq=2)


def test_thresholds_from_a_file_calibrate_wrote_with_o(make_model, tmp_path):
    m = engine.load_model(make_model())
    elsewhere = str(tmp_path / "elsewhere.json")
    sparsity.save_thresholds(m.path, "hidden", {0.5: np.array([0.25, 0.75])}, "test", elsewhere)
    with pytest.raises(JaxinferError, match="no calibrated hidden:0.5 thresholds"):  # not in the default sidecar
        sparsity.apply(m, sparsity.SparsitySpec("hidden", 0.5))
    applied = sparsity.apply(m, sparsity.SparsitySpec("hidden", 0.5), thresholds_file=elsewhere)
    assert [float(layer.ffn_threshold) for layer in applied.weights.layers] == [0.25, 0.75]
    assert applied.thresholds_path == elsewhere
    with pytest.raises(JaxinferError, match="--thresholds is for --sparsity gate:S or hidden:S, not predictor"):
        sparsity.apply(m, sparsity.SparsitySpec("predictor"), thresholds_file=elsewhere)

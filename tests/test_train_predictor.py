import dataclasses
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine, errors, evaluation, model, quant, sparsity, train_predictor
from jaxinfer.gguf_io import open_gguf


def windows_for(m, n, n_ctx=32, seed=0):
    tokens = np.random.default_rng(seed).integers(3, 259, size=n * n_ctx)
    return evaluation.make_windows(tokens, n_ctx, -1, bos_id=None)


def test_predictor_trained_on_a_relu_model_recalls_held_out_activity(make_model):
    m = engine.load_model(make_model(n_embd=64, n_ff=256, sparsity=0.85, seed=3))
    train_x, train_y = train_predictor.collect(m, windows_for(m, 24, seed=1))
    test_x, test_y = train_predictor.collect(m, windows_for(m, 6, seed=2))
    assert train_x[0].shape == (24 * 32, 64) and train_y[0].shape == (24 * 32, 256)
    ranks = train_predictor.choose_ranks(np.array([y.mean() for y in train_y]), 64, 256, budget=0.2)
    for i, rank in enumerate(ranks):
        p = train_predictor.train_layer(train_x[i], train_y[i], rank, steps=300, batch=256, learning_rate=3e-3,
                                        positive_weight=3.0, seed=i)
        metrics = train_predictor.evaluate_predictor(p, test_x[i], test_y[i])
        assert metrics["recall"] >= 0.9, (i, metrics)
        assert metrics["predicted_sparsity"] > 0.6, (i, metrics)


def test_choose_ranks_spends_the_budget_on_the_hardest_layers():
    ranks = train_predictor.choose_ranks(np.array([0.05, 0.5, 0.2]), 576, 1536, budget=0.1)
    assert ranks[1] > ranks[2] > ranks[0] and all(r % 16 == 0 for r in ranks)
    assert abs(sum(ranks) - 3 * 0.1 * 3 * 576 * 1536 / (576 + 1536)) < 3 * 16


def test_export_writes_a_powerinfer_file_that_runs_with_its_predictors(make_model, tmp_path):
    m = engine.load_model(make_model(weight_type=Q.Q8_0), exact=True)  # a SwiGLU model
    x, y = train_predictor.collect(sparsity.apply(m, sparsity.SparsitySpec("dense")), windows_for(m, 2))
    predictors = [train_predictor.train_layer(x[i], y[i], 16, steps=2, batch=32, learning_rate=1e-3,
                                              positive_weight=1.0, seed=i) for i in range(len(x))]
    path = train_predictor.export(m, predictors, str(tmp_path / "with_predictors.gguf"), threshold=0.25)
    g = open_gguf(path)
    assert g.powerinfer and g.metadata["powerinfer.sparse_threshold"] == 0.25
    exported = engine.load_model(path, exact=True)
    assert exported.config.gate_activation == "silu"  # kept through jaxinfer.gate_activation, not read as ReLU
    assert exported.weights.layers[0].ffn_down_t.qtype == Q.F16 and exported.weights.layers[0].ffn_down is None
    np.testing.assert_allclose(np.asarray(exported.weights.layers[1].fc1.data, np.float32), predictors[1].fc1,
                               rtol=1e-3, atol=1e-3)
    tokens = windows_for(m, 2)[:1]
    forward = jax.jit(model.forward, static_argnums=2)
    before = np.asarray(model.logits(forward(tokens, m.weights, m.config)[0], m.weights, m.config))
    after = np.asarray(model.logits(forward(tokens, exported.weights, exported.config)[0], exported.weights,
                                    exported.config))
    np.testing.assert_allclose(after, before, atol=2e-3 * np.abs(before).max())  # ffn_down_t is stored as F16
    predicted = sparsity.apply(exported, sparsity.SparsitySpec("predictor"))
    assert predicted.config.sparse_threshold == 0.25
    forward(tokens, predicted.weights, predicted.config)


def test_export_of_a_model_run_sparse_keeps_its_down_projection(make_model, tmp_path):
    """train_predictor --sparsity gate|hidden trains on a model whose down projections are repacked one row per
    neuron (ffn_down None in memory); the exported file must still carry them."""
    m = engine.load_model(make_model(weight_type=Q.Q8_0), exact=True)
    repacked = dataclasses.replace(m, weights=dataclasses.replace(
        m.weights, layers=[sparsity.with_transposed_down(layer) for layer in m.weights.layers]))
    assert repacked.weights.layers[0].ffn_down is None
    predictors = [train_predictor.Predictor(np.zeros((16, m.config.n_embd), np.float32),
                                            np.zeros((m.config.n_ff, 16), np.float32))
                  for _ in m.weights.layers]
    exported = engine.load_model(train_predictor.export(repacked, predictors, str(tmp_path / "p.gguf"), 0.0),
                                 exact=True)
    for layer, original in zip(exported.weights.layers, m.weights.layers):
        np.testing.assert_allclose(np.asarray(quant.dequantize(layer.ffn_down_t)).T,
                                   np.asarray(quant.dequantize(original.ffn_down)), rtol=1e-3, atol=1e-3)


def train_predictor_cli(*args, stderr=subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxinfer.train_predictor", *args], stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_cli_refuses_dense_labels_of_a_model_without_natural_zeros(make_model, tmp_path):
    """A SwiGLU model's activations are never zero: --sparsity dense (the default) would label every neuron active.
    Refused from the file's header, before the model loads, naming the modes that work."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    process = train_predictor_cli("-m", make_model(), "-f", str(text), "-c", "32")
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 2 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines() == [
        "error: --sparsity dense (the default) learns which neurons a ReLU-family model zeroes itself, and this llama "
        "model's FFN (silu gate) has no natural zeros: every neuron is active. Give --sparsity hidden:S or gate:S "
        "(thresholds from python -m jaxinfer.calibrate)"]


def test_cli_without_output_says_so_and_ctrl_c_ends_it_with_one_line(make_model, tmp_path):
    """A ReLU model trains on its natural zeros (--sparsity dense); without -o a note says nothing will be saved;
    SIGINT (Ctrl-C) while it trains ends it with status 130 and one line, no traceback."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        process = train_predictor_cli("-m", make_model(n_embd=64, n_ff=256, sparsity=0.85), "-f", str(text), "-c",
                                      "32", "--train_chunks", "4", "--heldout_chunks", "2", "--steps", "1000000",
                                      stderr=stderr)
    deadline = time.monotonic() + 120
    while "training:" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    process.wait(timeout=60)
    lines = log.read_text().replace("\r", "\n").strip().splitlines()
    assert process.returncode == 130 and "Traceback" not in log.read_text(), log.read_text()
    assert "note: no -o given: the predictors are trained and evaluated, not saved" in lines
    assert lines[-1] == errors.INTERRUPTED_LINE

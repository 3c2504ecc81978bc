import dataclasses
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine, errors, evaluation, model, quant, sparsity, synthetic, train_predictor
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
        assert isinstance(p, nnx.Module) and p.fc1.shape == (rank, 64) and p.fc2.shape == (256, rank)
        metrics = train_predictor.evaluate_predictor(p, test_x[i], test_y[i])  # as stored by default (Q8_0)
        assert metrics["recall"] >= 0.9, (i, metrics)
        assert metrics["predicted_sparsity"] > 0.6, (i, metrics)


def test_choose_ranks_spends_the_budget_on_the_hardest_layers():
    ranks = train_predictor.choose_ranks(np.array([0.05, 0.5, 0.2]), 576, 1536, budget=0.1, predictor_type=Q.F16)
    assert ranks[1] > ranks[2] > ranks[0] and all(r % 16 == 0 for r in ranks)
    assert abs(sum(ranks) - 3 * 0.1 * 3 * 576 * 1536 / (576 + 1536)) < 3 * 16
    for block_type in (Q.Q8_0, Q.Q4_0):  # fc2's rows are blocks of 32 along the rank: F16's ranks rounded up
        rounded = train_predictor.choose_ranks(np.array([0.05, 0.5, 0.2]), 576, 1536, 0.1, block_type)
        assert all(r % 32 == 0 and f16 <= r < f16 + 32 for r, f16 in zip(rounded, ranks)), (rounded, ranks)
    assert any(r % 32 for r in ranks)  # the rounding changed something


def test_quantized_predictors_round_trip_and_are_evaluated_as_stored(make_model, tmp_path):
    """export writes fc1/fc2 in the predictor type, rank a multiple of 32; evaluate_predictor's metrics are those of
    the values the file holds; with_predictors attaches exactly what loading the file gives."""
    m = engine.load_model(make_model(n_embd=64, n_ff=256, sparsity=0.85, seed=3))
    x, y = train_predictor.collect(m, windows_for(m, 4, seed=1))
    for qtype in (Q.Q8_0, Q.Q4_0):
        ranks = train_predictor.choose_ranks(np.array([v.mean() for v in y]), 64, 256, 0.1, qtype)
        predictors = [train_predictor.train_layer(x[i], y[i], rank, steps=20, batch=64, learning_rate=3e-3,
                                                  positive_weight=3.0, seed=i) for i, rank in enumerate(ranks)]
        path = train_predictor.export(m, predictors, str(tmp_path / f"{qtype.name}.gguf"), 0.0, qtype)
        g = open_gguf(path)
        exported = engine.load_model(path)
        attached = train_predictor.with_predictors(m.weights, predictors, qtype, m.config.plan)
        for i, (p, layer, in_memory) in enumerate(zip(predictors, exported.weights.layers, attached.layers)):
            assert g.tensors[f"blk.{i}.fc2.weight"].tensor_type == qtype and layer.fc1.shape[0] % 32 == 0
            stored_fc1, stored_fc2 = (np.asarray(quant.dequantize(w)) for w in (layer.fc1, layer.fc2))
            assert not np.array_equal(stored_fc2, p.arrays()[1])  # quantizing moved the values
            logits = np.maximum(x[i] @ stored_fc1.T, 0) @ stored_fc2.T
            metrics = train_predictor.evaluate_predictor(p, x[i], y[i], qtype)
            predicted = logits >= 0
            assert metrics["recall"] == pytest.approx((predicted & y[i]).sum() / y[i].sum(), abs=1e-3)
            assert metrics["predicted_sparsity"] == pytest.approx(1 - predicted.mean(), abs=1e-3)
            for fresh, loaded in ((in_memory.fc1, layer.fc1), (in_memory.fc2, layer.fc2)):
                assert (fresh.qtype, fresh.shape, fresh.layout, fresh.exact) == \
                       (loaded.qtype, loaded.shape, loaded.layout, loaded.exact)
                np.testing.assert_array_equal(np.asarray(fresh.data), np.asarray(loaded.data))
        tokens = windows_for(m, 2)[:1]
        forward = jax.jit(model.forward, static_argnums=2)
        predicted_model = sparsity.apply(dataclasses.replace(m, weights=attached), sparsity.SparsitySpec("predictor"))
        forward(tokens, predicted_model.weights, predicted_model.config)  # the engine runs quantized predictors
    with pytest.raises(errors.JaxinferError, match="multiples of 32"):
        train_predictor.export(m, [train_predictor.Predictor(np.zeros((16, 64)), np.zeros((256, 16)))] * 2,
                               str(tmp_path / "bad.gguf"), 0.0, Q.Q8_0)


def test_quantized_predictors_need_whole_blocks_of_n_embd(make_model):
    path = make_model(n_embd=48, n_head=4, n_head_kv=2)
    with pytest.raises(errors.JaxinferError, match=r"n_embd \(48\) is not a multiple of 32: use --predictor_type f16"):
        train_predictor._check_header(path, sparsity.SparsitySpec("hidden", 0.5), Q.Q4_0)
    train_predictor._check_header(path, sparsity.SparsitySpec("hidden", 0.5), Q.F16)


def test_export_writes_a_powerinfer_file_that_runs_with_its_predictors(make_model, tmp_path):
    m = engine.load_model(make_model(weight_type=Q.Q8_0), exact=True)  # a SwiGLU model
    x, y = train_predictor.collect(sparsity.apply(m, sparsity.SparsitySpec("dense")), windows_for(m, 2))
    predictors = [train_predictor.train_layer(x[i], y[i], 16, steps=2, batch=32, learning_rate=1e-3,
                                              positive_weight=1.0, seed=i) for i in range(len(x))]
    path = train_predictor.export(m, predictors, str(tmp_path / "with_predictors.gguf"), threshold=0.25,
                                  predictor_type=Q.F16)
    g = open_gguf(path)
    assert g.powerinfer and g.metadata["powerinfer.sparse_threshold"] == 0.25
    exported = engine.load_model(path, exact=True)
    assert exported.config.gate_activation == "silu"  # kept through jaxinfer.gate_activation, not read as ReLU
    assert exported.weights.layers[0].ffn_down_t.qtype == Q.F16 and exported.weights.layers[0].ffn_down is None
    assert exported.weights.layers[1].fc1.qtype == Q.F16
    np.testing.assert_allclose(np.asarray(exported.weights.layers[1].fc1.data, np.float32),
                               predictors[1].arrays()[0], rtol=1e-3, atol=1e-3)
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
    predictors = [train_predictor.Predictor(np.zeros((32, m.config.n_embd), np.float32),  # Q8_0 (the default):
                                            np.zeros((m.config.n_ff, 32), np.float32))    # ranks of whole blocks
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


@pytest.mark.slow
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
    try:
        deadline = time.monotonic() + 120
        while "training:" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after SIGINT: {log.read_text()[-2000:]}")
    finally:  # a million steps: never left running by a failure
        process.kill()
    lines = log.read_text().replace("\r", "\n").strip().splitlines()
    assert process.returncode == 130 and "Traceback" not in log.read_text(), log.read_text()
    assert "note: no -o given: the predictors are trained and evaluated, not saved" in lines
    assert lines[-1] == errors.INTERRUPTED_LINE


def test_cli_writes_the_predictor_type_it_evaluated(make_model, tmp_path):
    """--predictor_type q4_0: ranks rounded to multiples of 32, the metrics named as those of the stored Q4_0
    predictor, and the file's fc1/fc2 in Q4_0."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "q4.gguf"
    process = train_predictor_cli("-m", make_model(n_embd=64, n_ff=256, sparsity=0.85), "-f", str(text), "-c", "32",
                                  "--train_chunks", "4", "--heldout_chunks", "2", "--steps", "5", "--budget", "0.05",
                                  "--predictor_type", "q4_0", "-o", str(out))
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    lines = stdout.splitlines()
    ranks = [int(line.split()[1]) for line in lines[1:3]]
    assert ranks == [32, 32], stdout  # F16 would take 16 at this budget
    assert lines[3].startswith("mean (Q4_0, as stored): recall "), stdout
    g = open_gguf(str(out))
    assert {g.tensors[f"blk.{i}.{name}.weight"].tensor_type for i in range(2) for name in ("fc1", "fc2")} == {Q.Q4_0}


def test_synthetic_predictors_of_a_block_type_are_padded_exactly():
    """A block predictor_type pads the exact predictor's rank (2r + 2) with zero rows of fc1 and zero columns of fc2
    to whole blocks of 32: the same logits, the same gate."""
    spec = synthetic.SyntheticSpec(n_embd=64, n_ff=128, sparsity=0.9)
    plain = synthetic.sparse_layer(spec, np.random.default_rng(7))
    assert plain.fc1.shape == (10, 64) and synthetic.predictor_rank(spec) == 10
    v = np.random.default_rng(8).normal(size=(256, 64)).astype(np.float32)
    for qtype in (Q.Q8_0, Q.Q4_0):
        padded_spec = dataclasses.replace(spec, predictor_type=qtype)
        padded = synthetic.sparse_layer(padded_spec, np.random.default_rng(7))
        assert synthetic.predictor_rank(padded_spec) == 32
        assert padded.fc1.shape == (32, 64) and padded.fc2.shape == (128, 32)
        np.testing.assert_array_equal(padded.gate, plain.gate)
        np.testing.assert_allclose(np.maximum(v @ padded.fc1.T, 0) @ padded.fc2.T,
                                   np.maximum(v @ plain.fc1.T, 0) @ plain.fc2.T, rtol=1e-6, atol=1e-6)


def test_make_sparse_model_stores_its_predictors_q8_0_by_default(tmp_path):
    """The default --predictor_type q8_0 writes fc1/fc2 as Q8_0 with the rank padded to 32; the engine runs them and
    they predict the gate's firing as the F16 ones do; --predictor_type f16 keeps the unpadded rank."""
    shape = ["--n_layer", "1", "--n_embd", "64", "--n_ff", "128", "--n_vocab", "300", "--n_head", "4"]
    paths, env = {}, dict(os.environ, JAX_PLATFORMS="cpu")
    for args in ([], ["--predictor_type", "f16"]):
        paths[tuple(args)] = str(tmp_path / f"sparse{len(args)}.gguf")
        made = subprocess.run([sys.executable, "scripts/make_sparse_model.py", *shape, *args, "-o", paths[tuple(args)]],
                              capture_output=True, text=True, env=env)
        assert made.returncode == 0, made.stderr
    predicted = {}
    for args, path in paths.items():
        m = engine.load_model(path)
        x, _ = train_predictor.collect(m, windows_for(m, 2))
        layer = m.weights.layers[0]
        fc1, fc2 = (np.asarray(quant.dequantize(w)) for w in (layer.fc1, layer.fc2))
        predicted[args] = np.maximum(x[0] @ fc1.T, 0) @ fc2.T >= 0
        assert (layer.fc1.qtype, layer.fc2.qtype, layer.fc1.shape[0]) == \
               ((Q.Q8_0, Q.Q8_0, 32) if not args else (Q.F16, Q.F16, 10))
    assert np.mean(predicted[()] == predicted[("--predictor_type", "f16")]) > 0.99

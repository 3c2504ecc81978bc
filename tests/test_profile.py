import json
import os
import pickle
import shutil
import zipfile

import jax
import numpy as np
import pytest

from jaxinfer import activation_profile, calibrate, engine, evaluation, model, sidecar, sparsity, torch_format
from jaxinfer.errors import JaxinferError


@pytest.mark.slow
def test_profile_counts_equal_a_direct_count(make_model, tmp_path):
    m = engine.load_model(make_model(n_layer=12, n_embd=64, n_ff=128, sparsity=0.8))
    tokens = np.random.default_rng(0).integers(3, 259, size=5 * 32)
    windows = evaluation.make_windows(tokens, 32, -1, bos_id=None)
    counts = activation_profile.profile_counts(m, windows, n_seq=2)  # 3 batches, the last padded

    def hidden(index, trace):
        return trace.hidden

    _, _, observed = jax.jit(model.forward, static_argnums=(2, 4))(windows, m.weights, m.config, None, hidden)
    expected = np.stack([(np.asarray(h) != 0).sum(axis=(0, 1)) for h in observed])
    np.testing.assert_array_equal(counts, expected)

    directory = str(tmp_path / "activation")
    summary = activation_profile.write_profile(directory, m.path, counts, windows.size, "dense")
    # Layer files are numbered, not sorted as strings: activation_10.pt is layer 10 (PowerInfer's export bug).
    np.testing.assert_array_equal(torch_format.load_tensor(os.path.join(directory, "activation_10.pt")), counts[10])
    np.testing.assert_array_equal(activation_profile.read_profile(directory, m.path, 12, 128), counts)
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
    windows = evaluation.make_windows(tokens, 32, -1, bos_id=None)
    thresholds = calibrate.calibrate(m, windows, method, [0.3, 0.7], n_seq=4)
    for level, values in thresholds.items():
        sparsity.save_thresholds(m.path, method, {level: values}, "test")
        sparse = sparsity.apply(m, sparsity.SparsitySpec(method, level))
        counts = activation_profile.profile_counts(sparse, windows, n_seq=4)
        active = counts.sum(axis=1) / (windows.size * m.config.n_ff)
        np.testing.assert_allclose(1 - active, level, atol=0.02)


def counts_for(seed, n_layer=2, n_ff=64):
    return np.random.default_rng(seed).integers(0, 100, size=(n_layer, n_ff))


def test_a_killed_profile_run_leaves_the_previous_profile_whole(make_model, tmp_path, monkeypatch):
    model = make_model()
    directory = str(tmp_path / "activation")
    old = counts_for(0)
    activation_profile.write_profile(directory, model, old, 1000, "dense")

    def killed(*args):
        raise KeyboardInterrupt  # after every layer file of the new run was written

    monkeypatch.setattr(activation_profile, "plot", killed)
    with pytest.raises(KeyboardInterrupt):
        activation_profile.write_profile(directory, model, counts_for(1), 1000, "dense")
    np.testing.assert_array_equal(activation_profile.read_profile(directory, model, 2, 64), old)
    assert sorted(os.listdir(tmp_path)) == ["activation", "tiny.gguf"]  # no temp left behind


def test_profiles_of_models_sharing_a_folder_stay_apart(make_model):
    first, second = make_model(), make_model(name="other.gguf", seed=3)
    assert os.path.dirname(first) == os.path.dirname(second)
    for path, seed in ((first, 0), (second, 1)):
        directory = activation_profile.default_directory(path, create=True)
        activation_profile.write_profile(directory, path, counts_for(seed), 1000, "dense")
    for path, seed in ((first, 0), (second, 1)):
        directory = activation_profile.default_directory(path)
        assert os.path.basename(directory) == os.path.basename(path) + ".activation"
        assert sorted(os.listdir(directory)) == ["activation.png", "activation_0.pt", "activation_1.pt",
                                                 "profile.json"]  # PowerInfer's names inside
        np.testing.assert_array_equal(activation_profile.read_profile(directory, path, 2, 64), counts_for(seed))


def test_layer_files_of_different_runs_are_rejected(make_model, tmp_path):
    model = make_model()
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    activation_profile.write_profile(first, model, counts_for(0), 1000, "dense")
    activation_profile.write_profile(second, model, counts_for(1), 1000, "dense")
    shutil.copy(os.path.join(second, "activation_1.pt"), first)
    with pytest.raises(JaxinferError, match="mix of profiling runs"):
        activation_profile.read_profile(first, model, 2, 64)


def forged_tensor(path, pickle_bytes, storage=b"\0" * 512):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("t/data.pkl", pickle_bytes)
        z.writestr("t/data/0", storage)


@pytest.mark.parametrize("case", ["not a zip", "no pickle", "no storage", "short storage", "other global", "an int",
                                  "two-dimensional", "strided", "length", "negative", "nan", "too many"])
def test_bad_activation_files_are_one_line_errors(make_model, tmp_path, case):
    model = make_model()
    directory = tmp_path / "activation"
    directory.mkdir()
    torch_format.save_tensor(str(directory / "activation_0.pt"), np.arange(64))
    path = directory / "activation_1.pt"
    good = torch_format._tensor_pickle("LongStorage", 64)
    if case == "not a zip":
        path.write_bytes(b"PK\x03\x04 not really")
    elif case == "no pickle":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("t/data/0", b"")
    elif case == "no storage":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("t/data.pkl", good)
    elif case == "short storage":
        forged_tensor(path, good, b"\0" * 100)
    elif case == "other global":
        forged_tensor(path, pickle.dumps(os.getcwd, protocol=2))
    elif case == "an int":
        forged_tensor(path, pickle.dumps(7, protocol=2))
    elif case == "two-dimensional":
        forged_tensor(path, good.replace(b"J@\x00\x00\x00\x85", b"J \x00\x00\x00J\x02\x00\x00\x00\x86", 1))
    elif case == "strided":  # a stride of 10**6 would read far outside the storage
        forged_tensor(path, good.replace(b"J\x01\x00\x00\x00\x85", b"J\x40\x42\x0f\x00\x85", 1))
    elif case == "length":
        torch_format.save_tensor(str(path), np.zeros(63, np.int64))
    elif case == "negative":
        torch_format.save_tensor(str(path), -np.ones(64, np.int64))
    elif case == "nan":
        torch_format.save_tensor(str(path), np.full(64, np.nan, np.float32))
    elif case == "too many":  # refused before its storage is read
        torch_format.save_tensor(str(path), np.zeros(1 << 16, np.int64))
    with pytest.raises(JaxinferError) as error:
        activation_profile.read_profile(str(directory), model, 2, 64)
    assert "activation_1.pt" in str(error.value) and "\n" not in str(error.value)


def write_thresholds_document(model, document):
    path = sparsity.thresholds_path(model)
    with open(path, "w") as f:
        f.write(json.dumps({"model_fingerprint": sidecar.model_fingerprint(model), **document}))
    return path


@pytest.mark.parametrize("document, message", [
    ({"thresholds": [1, 2]}, "malformed"),
    ({"thresholds": {"hidden": [0.1, 0.2]}}, "malformed"),
    ({"thresholds": {"hidden": {"0.5": [0.1]}}}, "list of 2 numbers"),
    ({"thresholds": {"hidden": {"0.5": [0.1, "x"]}}}, "list of 2 numbers"),
    ({"thresholds": {"hidden": {"0.5": [0.1, float("nan")]}}}, "not a finite"),
    ({"thresholds": {"hidden": {"0.5": [0.1, 1e999]}}}, "not a finite"),
    ({"thresholds": {"hidden": {"0.5": [0.1, 10**400]}}}, "not a finite"),
    ({"thresholds": {"hidden": {"0.5": [0.1, -0.2]}}}, "negative"),
])
def test_bad_thresholds_files_are_one_line_errors(make_model, document, message):
    model = make_model()
    write_thresholds_document(model, document)
    with pytest.raises(JaxinferError, match=message):
        sparsity.load_thresholds(model, "hidden", 0.5, 2)
    sparsity.save_thresholds(model, "hidden", {0.5: np.ones(2)}, "test")  # a malformed file is replaced
    np.testing.assert_array_equal(sparsity.load_thresholds(model, "hidden", 0.5, 2), np.ones(2))


def test_a_thresholds_file_that_is_not_an_object_is_one_line(make_model):
    model = make_model()
    with open(sparsity.thresholds_path(model), "w") as f:
        f.write("[0.1, 0.2]")
    with pytest.raises(JaxinferError, match="not a jaxinfer sidecar"):
        sparsity.load_thresholds(model, "hidden", 0.5, 2)


def test_thresholds_go_to_the_file_asked_for(make_model, tmp_path):
    model = make_model()
    chosen = str(tmp_path / "elsewhere.json")
    assert sparsity.save_thresholds(model, "gate", {0.3: np.full(2, 0.5)}, "test", chosen) == chosen
    assert not os.path.exists(sparsity.thresholds_path(model))
    np.testing.assert_array_equal(sparsity.load_thresholds(model, "gate", 0.3, 2, chosen), np.full(2, 0.5))

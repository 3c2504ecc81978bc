import os
import subprocess
import sys

import pytest


def run(module, *args, **env_vars):
    env = dict(os.environ, JAX_PLATFORMS="cpu", **env_vars)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    return str(path)


@pytest.mark.parametrize("module,args,fragment", [
    ("jaxinfer.profile", ["-f", "/no/such.txt"], "not found"),
    ("jaxinfer.profile", ["--sparsity", "sometimes"], "--sparsity mode"),
    ("jaxinfer.calibrate", ["--method", "random"], "--method"),
    ("jaxinfer.calibrate", ["--levels", "0.5,1.5"], "--levels"),
    ("jaxinfer.train_predictor", ["--budget", "2"], "--budget"),
    ("jaxinfer.train_predictor", ["--sparsity", "predictor"], "labels"),
    ("jaxinfer.perplexity", ["--sparsity", "gate:0.5"], "calibrate"),
    ("jaxinfer.generate", ["--sparsity", "predictor"], "no activation predictors"),
    ("jaxinfer.generate", ["--down_t_type", "q6_k"], "--down_t_type"),
    ("jaxinfer.perplexity", ["--down-t-type", "f7"], "--down_t_type"),
])
def test_bad_input_is_one_line(make_model, text, module, args, fragment):
    text_args = [] if module == "jaxinfer.generate" else ["-f", text]
    result = run(module, "-m", make_model(n_ctx=64), *text_args, "-c", "32", *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and fragment in last, last


@pytest.mark.parametrize("module,args,fragment", [
    ("jaxinfer.profile", ["-o", "/no/such/folder/activation"], "does not exist"),
    ("jaxinfer.profile", ["-o", "{text}"], "a file is in its place"),
    ("jaxinfer.calibrate", ["-o", "{tmp}"], "is a folder"),
    ("jaxinfer.train_predictor", ["-o", "/no/such/folder/out.gguf"], "does not exist"),
])
def test_unwritable_outputs_fail_before_the_model_is_loaded(text, tmp_path, module, args, fragment):
    model = tmp_path / "not-a-model.gguf"
    model.write_text("not a model: the output is checked first")
    args = [a.format(text=text, tmp=tmp_path) for a in args]
    result = run(module, "-m", str(model), "-f", text, *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and fragment in last, last


def test_a_profile_folder_with_other_files_is_not_replaced(make_model, text, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = run("jaxinfer.profile", "-m", make_model(), "-f", text, "-o", str(tmp_path))
    assert result.returncode == 2 and "notes.txt" in result.stderr.strip().splitlines()[-1], result.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_profile_calibrate_and_train_end_to_end(make_model, text, tmp_path):
    sparse_model = make_model(n_ctx=64, n_embd=64, n_ff=128, sparsity=0.8)
    out = tmp_path / "tiny.gguf.activation"  # by default named after the model, beside it
    result = run("jaxinfer.profile", "-m", sparse_model, "-f", text, "-c", "32")
    assert result.returncode == 0 and f"the activation profile goes to {out}" in result.stderr, result.stderr
    assert sorted(os.listdir(out)) == ["activation.png", "activation_0.pt", "activation_1.pt", "profile.json"]
    # A model in an installed package (as the default model is): its thresholds go to the cache folder, not beside it.
    package = tmp_path / "site-packages" / "a_model"
    package.mkdir(parents=True)
    dense_model = make_model(name="site-packages/a_model/dense.gguf", n_ctx=64)
    cache = str(tmp_path / "cache")
    result = run("jaxinfer.calibrate", "-m", dense_model, "-f", text, "-c", "32", "--levels", "0.5",
                 JAXINFER_CACHE_DIR=cache)
    assert result.returncode == 0, result.stderr
    assert f"thresholds go to {cache}/models/dense.gguf-" in result.stderr and os.listdir(package) == ["dense.gguf"]
    result = run("jaxinfer.perplexity", "-m", dense_model, "-f", text, "-c", "32", "--sparsity", "hidden:0.5",
                 JAXINFER_CACHE_DIR=cache)
    assert result.returncode == 0 and "PPL =" in result.stdout, result.stderr
    assert f"thresholds from {cache}/models/dense.gguf-" in result.stderr, result.stderr
    # The README's sequence: predictors trained on calibrated hidden:S labels, exported, then generated from.
    trained = tmp_path / "trained.gguf"
    result = run("jaxinfer.train_predictor", "-m", dense_model, "-f", text, "-c", "32", "--sparsity", "hidden:0.5",
                 "--train_chunks", "4", "--heldout_chunks", "1", "--steps", "20", "-o", str(trained),
                 JAXINFER_CACHE_DIR=cache)
    assert result.returncode == 0 and "recall" in result.stdout, result.stderr
    result = run("jaxinfer.generate", "-m", str(trained), "--sparsity", "predictor", "-n", "4", "-c", "32")
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_thresholds_calibrated_to_another_file_are_used_with_thresholds(make_model, text, tmp_path):
    model, thresholds = make_model(n_ctx=64), str(tmp_path / "hidden.json")
    result = run("jaxinfer.calibrate", "-m", model, "-f", text, "-c", "32", "--levels", "0.5", "-o", thresholds)
    assert result.returncode == 0 and os.path.isfile(thresholds), result.stderr
    result = run("jaxinfer.generate", "-m", model, "--sparsity", "hidden:0.5", "--thresholds", thresholds, "-n", "2",
                 "-c", "32")
    assert result.returncode == 0 and f"thresholds from {thresholds}" in result.stderr, result.stderr

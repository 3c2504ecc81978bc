import os
import subprocess
import sys

import pytest


def run(module, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
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


def test_profile_calibrate_and_train_end_to_end(make_model, text, tmp_path):
    sparse_model = make_model(n_ctx=64, n_embd=64, n_ff=128, sparsity=0.8)
    out = tmp_path / "activation"
    assert run("jaxinfer.profile", "-m", sparse_model, "-f", text, "-c", "32", "-o", str(out)).returncode == 0
    assert sorted(os.listdir(out)) == ["activation.png", "activation_0.pt", "activation_1.pt", "profile.json"]
    dense_model = make_model(name="dense.gguf", n_ctx=64)
    assert run("jaxinfer.calibrate", "-m", dense_model, "-f", text, "-c", "32", "--levels", "0.5").returncode == 0
    result = run("jaxinfer.perplexity", "-m", dense_model, "-f", text, "-c", "32", "--sparsity", "hidden:0.5")
    assert result.returncode == 0 and "PPL =" in result.stdout, result.stderr
    # The README's sequence: predictors trained on calibrated hidden:S labels, exported, then generated from.
    trained = tmp_path / "trained.gguf"
    result = run("jaxinfer.train_predictor", "-m", dense_model, "-f", text, "-c", "32", "--sparsity", "hidden:0.5",
                 "--train_chunks", "4", "--heldout_chunks", "1", "--steps", "20", "-o", str(trained))
    assert result.returncode == 0 and "recall" in result.stdout, result.stderr
    result = run("jaxinfer.generate", "-m", str(trained), "--sparsity", "predictor", "-n", "4", "-c", "32")
    assert result.returncode == 0, result.stderr

"""The benchmark scripts run end to end on a tiny model (their numbers are not checked: speed lives in the scripts,
not in tests), and what they count is right."""

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import QuantError
from test_cli import assert_one_line_error, run_all

from jaxinfer import engine, quant, sparsity, synthetic, ternary
from jaxinfer.errors import JaxinferError, how_it_ended
from jaxinfer.gguf_io import load_matrix, open_gguf

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.parametrize("mode, skipped, weight_type", [("hidden", ("ffn_down",), "Q4_0"),
                                                     ("hidden", ("ffn_down",), "Q8_0"),
                                                     ("gate", ("ffn_up", "ffn_down"), "Q4_0")])
@pytest.mark.slow
def test_bench_generate_compares_sparse_with_dense_decoding(tmp_path, mode, skipped, weight_type):
    """A plain synthetic llama (make_sparse_model --sparsity 0), calibrated for MODE:0.5: --compare_dense reports
    both speeds and a share of weight bytes saved that is the skipped share of the matrices the mode skips by neuron
    (down for hidden; up and down for gate), of a down projection packed neuron-major its rows of q only, and the
    same counted in whole cache lines."""
    model = str(tmp_path / "plain.gguf")
    made = run("scripts/make_sparse_model.py", "-o", model, "--sparsity", "0", "--n_layer", "2", "--n_embd", "64",
               "--n_ff", "256", "--weight_type", weight_type)
    assert made.returncode == 0 and "plain llama" in made.stderr, made.stderr
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    calibrated = run("-m", "jaxinfer.calibrate", "-m", model, "-f", str(text), "-c", "32", "--method", mode,
                     "--levels", "0.5")
    assert calibrated.returncode == 0, calibrated.stderr
    result = run("scripts/bench_generate.py", "-m", model, "--pp", "16", "--tg", "8", "--repetitions", "1", "-c", "64",
                 "--sparsity", f"{mode}:0.5", "--compare_dense", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["dense_generation_tokens_per_s"] > 0 and report["sparse_generation_tokens_per_s"] > 0

    m = engine.load_model(model)
    layers = m.weights.layers
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    total = sum(getattr(layer, name).nbytes for layer in layers for name in names) + m.weights.output.nbytes
    # Packed neuron-major (where its kernel is fast), the down projection's scales (2 of a block's 18 or 34 bytes) are
    # read for every block; transposed in its own type, every byte belongs to one neuron.
    packed = sparsity.packs_neuron_major(sparsity.SparsitySpec(mode, 0.5), m.config.plan)
    own_share = {"ffn_down": (16 / 18 if weight_type == "Q4_0" else 32 / 34) if packed else 1.0, "ffn_up": 1.0}
    by_neuron = sum(getattr(layer, name).nbytes * own_share[name] for layer in layers for name in skipped)
    assert 0 < report["active_share"] < 1
    np.testing.assert_allclose(report["bytes_saved_share"], (1 - report["active_share"]) * by_neuron / total,
                               rtol=1e-3)
    # Counted in whole 64-byte lines, a neuron-major Q8_0 neuron owns its lines (a 64-byte piece per tile of 64
    # outputs); 32-byte Q4_0 pieces and 36-byte Q4_0 rows share lines with their neighbours, so fewer lines are skipped.
    if packed and weight_type == "Q8_0":
        np.testing.assert_allclose(report["lines_saved_share"], report["bytes_saved_share"], rtol=1e-6)
    else:
        assert 0 < report["lines_saved_share"] < report["bytes_saved_share"]


@pytest.mark.slow
def test_bench_generate_times_deep_in_the_context(tmp_path):
    """--depth D: pp and tg run with D tokens already in the cache (llama-bench's -d); bad values are one line."""
    model = str(tmp_path / "plain.gguf")
    made = run("scripts/make_sparse_model.py", "-o", model, "--sparsity", "0", "--n_layer", "2", "--n_embd", "64",
               "--n_ff", "128", "--weight_type", "Q8_0")
    assert made.returncode == 0, made.stderr
    result = run("scripts/bench_generate.py", "-m", model, "--pp", "8", "--tg", "4", "--depth", "40", "-c", "32",
                 "--repetitions", "1", "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["prompt_tokens_per_s"] > 0 and summary["generation_tokens_per_s"] > 0
    for args, fragment in [(("--depth", "-1"), "--depth"), (("--depth", "8", "--sparsity", "hidden:0.5",
                                                              "--compare_dense"), "without --depth"),
                            (("--rounds", "0"), "--rounds"), (("--rounds", "2"), "only with --llama_bench")]:
        bad = run("scripts/bench_generate.py", "-m", model, *args)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert bad.stderr.strip().splitlines()[-1].startswith("error: ") and fragment in bad.stderr, bad.stderr


@pytest.mark.slow
def test_bench_generate_without_a_prompt_test(make_model, tmp_path):
    """--pp 0 (or none) is no prompt test, as llama-bench's -p 0: tg alone is timed, the JSON's prompt_tokens_per_s is
    null, and llama-bench is given -p 0."""
    model = make_model(n_ctx=64)
    result = run("scripts/bench_generate.py", "-m", model, "--pp", "0", "--tg", "4", "--repetitions", "1", "-c", "32",
                 "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["prompt_tokens_per_s"] is None and summary["generation_tokens_per_s"] > 0
    assert not [key for key in summary if key.startswith("pp")]
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, fail=""))
    fake.chmod(0o755)
    result = run("scripts/bench_generate.py", "-m", model, "--pp=", "--tg", "4", "--repetitions", "1", "-c", "32",
                 "--llama_bench", str(fake), "--json")
    assert result.returncode == 0, result.stderr
    assert "llama.cpp pp0: " in result.stdout  # the fake answers each -p value; llama-bench itself skips a 0
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["prompt_tokens_per_s"] is None and summary["ratio_tg4"] > 0 and "ratio_pp0" not in summary


# Nonsense the scripts' flags refuse, each with the flag its one error line names. A model path that is not there and
# a port nothing listens on: a value let through fails differently, without naming the flag.
NO_MODEL = ["-m", "/no/such.gguf"]
NO_SERVER = ["--url", "http://127.0.0.1:9"]
SCRIPT_BAD_FLAGS = [
    ("bench_generate.py", [*NO_MODEL, "--pp", "abc"], "--pp"),
    ("bench_generate.py", [*NO_MODEL, "--pp", "-5"], "--pp"),
    ("bench_generate.py", [*NO_MODEL, "--pp", "128,0.5"], "--pp"),
    ("bench_generate.py", [*NO_MODEL, "--tg", "0"], "--tg"),
    ("bench_generate.py", [*NO_MODEL, "--tg", "-3"], "--tg"),
    ("bench_generate.py", [*NO_MODEL, "--repetitions", "0"], "--repetitions"),
    ("bench_generate.py", [*NO_MODEL, "-c", "0"], "--ctx_size"),
    ("bench_generate.py", [*NO_MODEL, "--threads", "0"], "--threads"),
    ("bench_generate.py", [*NO_MODEL, "--vram-budget", "nan"], "--vram_budget"),
    ("bench_sparse.py", ["--levels", "0.5,1"], "--levels"),
    ("bench_sparse.py", ["--levels="], "--levels"),
    ("bench_sparse.py", ["--threads", "2,x"], "--threads"),
    ("bench_sparse.py", ["--powerinfer_threads", "0"], "--powerinfer_threads"),
    ("bench_sparse.py", ["--n_layer", "0"], "--n_layer"),
    ("bench_sparse.py", [*NO_MODEL, "--specs", "hidden:0.5", "-c", "-1"], "--ctx_size"),
    ("bench_sparse_kernels.py", ["--tokens="], "--tokens"),
    ("bench_sparse_kernels.py", ["--sparsity", "nan"], "--sparsity"),
    ("bench_sparse_kernels.py", ["--repeats", "0"], "--repeats"),
    ("bench_sparse_kernels.py", ["--seed", "-1"], "--seed"),
    ("bench_repacked_kernels.py", ["--tokens", "0"], "--tokens"),
    ("bench_repacked_kernels.py", ["--tokens", "x"], "--tokens"),
    ("bench_repacked_kernels.py", ["--repeats", "0"], "--repeats"),
    ("bench_repacked_kernels.py", ["--shapes", "64by64"], "--shapes"),
    ("bench_repacked_kernels.py", ["--shapes", "-8x64"], "--shapes"),
    ("bench_attention_memory.py", ["--ubatches", "0"], "--ubatches"),
    ("bench_attention_memory.py", ["--ubatches", "9000"], "--ubatches"),
    ("bench_attention_memory.py", ["--limits", "-1"], "--limits"),
    ("bench_attention_memory.py", ["--limits", "none,inf"], "--limits"),
    ("bench_attention_memory.py", ["--repetitions", "0"], "--repetitions"),
    ("bench_attention_memory.py", ["--n_head_kv", "0"], "--n_head_kv"),
    ("bench_server.py", [*NO_SERVER, "--clients", "4,x"], "--clients"),
    ("bench_server.py", [*NO_SERVER, "--clients="], "--clients"),
    ("bench_server.py", [*NO_SERVER, "--clients", "0"], "--clients"),
    ("bench_hybrid.py", [*NO_MODEL, "--ffn_share", "nan"], "--ffn_share"),
    ("bench_hybrid.py", [*NO_MODEL, "--ffn_share", "-0.5"], "--ffn_share"),
    ("bench_hybrid.py", [*NO_MODEL, "-n", "0"], "--n_predict"),
    ("bench_hybrid.py", [*NO_MODEL, "-c", "1"], "--ctx_size"),
    ("bench_hybrid.py", [*NO_MODEL, "-f", "/no/such.txt"], "/no/such.txt"),
    ("bench_startup.py", [*NO_MODEL, "--warm_runs", "0"], "--warm_runs"),
    ("load_test_server.py", [*NO_SERVER, "--pid", "-3"], "--pid"),
    ("make_sparse_model.py", ["-o", "/dev/null/x.gguf", "--n_layer", "0"], "--n_layer"),
    ("make_sparse_model.py", ["-o", "/dev/null/x.gguf", "--n_ff", "-5"], "--n_ff"),
    ("make_sparse_model.py", ["-o", "/dev/null/x.gguf", "--n_vocab", "-5"], "--n_vocab"),
    ("make_sparse_model.py", ["-o", "/dev/null/x.gguf", "--seed", "-1"], "--seed"),
    ("make_sparse_model.py", ["-o", "/dev/null/x.gguf", "--power_law", "nan"], "--power_law"),
    ("make_sparse_model.py", ["-o", "/dev/null/x.gguf", "--sparsity", "1"], "--sparsity"),
    ("sparsity_table.py", [*NO_MODEL, "--levels", "0.5,abc"], "--levels"),
    ("sparsity_table.py", [*NO_MODEL, "--predictor_labels", "1.5"], "--predictor_labels"),
    ("sparsity_table.py", [*NO_MODEL, "--calibration_chunks", "0"], "--calibration_chunks"),
    ("sparsity_table.py", [*NO_MODEL, "--budget", "nan"], "--budget"),
    ("sparsity_table.py", [*NO_MODEL, "-f", str(ROOT / "tests" / "data" / "wiki.test.head.raw"), "--methods",
                           "gate,cats"], "--methods"),
]
# The scripts on argparse print their usage, then one error line naming the flag.
ARGPARSE_BAD_FLAGS = [
    ("fuzz_gguf.py", ["--workers", "0"], "--workers"),
    ("fuzz_gguf.py", ["--cases", "-5"], "--cases"),
    ("fuzz_gguf.py", ["--seed", "-1"], "--seed"),
    ("fuzz_gguf.py", ["--timeout", "nan"], "--timeout"),
    ("gpu_check.py", ["--out", "/dev/null/out", "--budget_s", "inf"], "--budget_s"),
    ("gpu_check.py", ["--out", "/dev/null/out", "--n_layer", "0"], "--n_layer"),
]


@pytest.mark.slow
def test_bad_flag_values_of_the_scripts_are_one_line_errors_before_anything_loads():
    results = run_all([(str(ROOT / "scripts" / script), args) for script, args, _ in
                       SCRIPT_BAD_FLAGS + ARGPARSE_BAD_FLAGS])
    for (script, args, fragment), result in zip(SCRIPT_BAD_FLAGS, results):
        assert_one_line_error(result, fragment)
    for (script, args, fragment), result in zip(ARGPARSE_BAD_FLAGS, results[len(SCRIPT_BAD_FLAGS):]):
        assert result["rc"] == 2 and "Traceback" not in result["stderr"], (script, args, result["stderr"])
        assert result["stderr"].strip().splitlines()[-1].startswith(f"{script}: error: {fragment}"), result["stderr"]


FAKE_LLAMA_BENCH = """#!{python}
import json, pathlib, sys
args = sys.argv[1:]
if "-d" in args:
    sys.exit("error: invalid parameter for argument: -d")  # an older llama-bench
if "{fail}" == "SIGILL":  # a build for instructions this CPU lacks
    import os, signal
    os.kill(os.getpid(), signal.SIGILL)
if "{fail}":
    print("loading model\\nllama_model_load: error loading model: {fail}", file=sys.stderr)
    sys.exit(1)
calls = pathlib.Path(sys.argv[0] + ".calls")  # each call of a run is faster, so that rounds differ
n = int(calls.read_text()) + 1 if calls.exists() else 1
calls.write_text(str(n))
pp = args[args.index("-p") + 1].split(",")
print(json.dumps([{{"n_prompt": int(p), "n_gen": 0, "samples_ts": [100.0 * n, 120.0 * n]}} for p in pp]
                 + [{{"n_prompt": 0, "n_gen": int(args[args.index("-n") + 1]), "samples_ts": [50.0 * n]}}]))
"""


@pytest.mark.slow
def test_bench_generate_runs_llama_bench_without_depth_and_shows_why_it_failed(tmp_path):
    """--llama_bench passes -d only with --depth (older builds reject "-d 0"), reads its JSON, and a failing
    llama-bench is one error line with the end of its stderr, or the signal that killed it."""
    model = str(tmp_path / "plain.gguf")
    assert run("scripts/make_sparse_model.py", "-o", model, "--sparsity", "0", "--n_layer", "1", "--n_embd", "64",
               "--n_ff", "128", "--weight_type", "Q8_0").returncode == 0
    for fail in ("", "unknown model architecture", "SIGILL"):
        fake = tmp_path / f"llama-bench{len(fail)}"
        fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, fail=fail))
        fake.chmod(0o755)
        result = run("scripts/bench_generate.py", "-m", model, "--pp", "8", "--tg", "4", "-c", "32", "--repetitions",
                     "1", "--llama_bench", str(fake), "--json")
        if not fail:
            assert result.returncode == 0, result.stderr
            assert "llama.cpp pp8: 120.0 tokens/s" in result.stdout + result.stderr
            summary = json.loads(result.stdout.strip().splitlines()[-1])
            assert summary["ratio_pp8"] == pytest.approx(summary["pp8"] / 120.0, rel=1e-3)
        else:
            assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
            last = result.stderr.strip().splitlines()[-1]
            ended = "was killed by SIGILL (Illegal instruction)" if fail == "SIGILL" else "exited with status 1"
            assert last.startswith(f"error: llama-bench {ended}") and fail in last, last


def test_a_peer_s_end_is_its_status_or_the_signal_that_killed_it():
    assert how_it_ended(1) == "exited with status 1"
    assert how_it_ended(-signal.SIGILL) == "was killed by SIGILL (Illegal instruction)"
    assert how_it_ended(-250) == "was killed by signal 250"  # no such signal here


@pytest.mark.slow
def test_bench_generate_alternates_rounds_with_llama_bench_and_takes_medians(tmp_path):
    """--rounds 3: ours then llama-bench three times; each test's ratio is the median of the rounds' ratios, with
    their range, and the speeds are the medians."""
    model = str(tmp_path / "plain.gguf")
    assert run("scripts/make_sparse_model.py", "-o", model, "--sparsity", "0", "--n_layer", "1", "--n_embd", "64",
               "--n_ff", "128", "--weight_type", "Q8_0").returncode == 0
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, fail=""))
    fake.chmod(0o755)
    result = run("scripts/bench_generate.py", "-m", model, "--pp", "8", "--tg", "4", "-c", "32", "--repetitions", "1",
                 "--llama_bench", str(fake), "--rounds", "3", "--json")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    ours = [float(line.split()[1]) for line in lines if line.startswith("pp8: ") and "jaxinfer" not in line]
    llama = [float(line.split()[2]) for line in lines if line.startswith("llama.cpp pp8: ")]
    assert llama == [120.0, 240.0, 360.0] and len(ours) == 3
    ratios = sorted(o / l for o, l in zip(ours, llama))
    summary = json.loads(lines[-1])
    assert summary["ratio_pp8"] == pytest.approx(ratios[1], rel=1e-3)
    assert summary["ratio_pp8_min"] == pytest.approx(ratios[0], rel=1e-3)
    assert summary["ratio_pp8_max"] == pytest.approx(ratios[2], rel=1e-3)
    assert summary["llama_cpp_pp8"] == 240.0 and summary["pp8"] == pytest.approx(sorted(ours)[1], rel=1e-3)
    assert "median of 3 alternating rounds" in result.stdout


@pytest.mark.slow
def test_bench_sparse_kernels_runs_and_rejects_what_the_kernels_do_not_take():
    result = run("scripts/bench_sparse_kernels.py", "--types", "Q5_K,Q4_1", "--shapes", "256x512", "--tokens", "1",
                 "--sparsity", "0.5", "--calls", "2", "--repeats", "1")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("Q5_K", "Q4_1"))]
    assert [row[0] for row in rows] == ["Q5_K", "Q4_1"]
    assert rows[0][-2:] == ["-", "-"] and rows[1][-1] != "-"  # neuron-major only for Q4_0/Q4_1/Q8_0
    for args, fragment in [(("--types", "Q4_K", "--shapes", "576x1536"), "multiples of 256"),
                           (("--types", "IQ2_XXS"), "--types"), (("--shapes", "576by1536"), "--shapes"),
                           (("--tokens", "0"), "--tokens"), (("--isa", "sse9"), "--isa")]:
        bad = run("scripts/bench_sparse_kernels.py", *args)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert bad.stderr.strip().splitlines()[-1].startswith("error: ") and fragment in bad.stderr, bad.stderr


@pytest.mark.slow
def test_bench_repacked_kernels_runs_and_rejects_types_without_repacked_kernels():
    result = run("scripts/bench_repacked_kernels.py", "--types", "Q4_0,IQ4_NL", "--shapes", "13x64", "--tokens", "1,5",
                 "--repeats", "1")
    assert result.returncode == 0, result.stderr
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith(("| Q4_0", "| IQ4_NL"))]
    assert [(row[0].strip(), row[2].strip()) for row in rows] == [("Q4_0", "1"), ("Q4_0", "5"), ("IQ4_NL", "1"),
                                                                  ("IQ4_NL", "5")]
    for args, message in ((("--types", "Q5_0"), "error: --types: the repacked types are"),
                          (("--types", "Q4_K", "--shapes", "1536x576"), "error: --shapes: a Q4_K row is whole blocks")):
        bad = run("scripts/bench_repacked_kernels.py", *args)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
        assert bad.stderr.strip().splitlines()[-1].startswith(message), bad.stderr


def test_make_sparse_model_rejects_a_bad_sparsity(tmp_path):
    result = run("scripts/make_sparse_model.py", "-o", str(tmp_path / "x.gguf"), "--sparsity", "1.5")
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.slow
def test_make_sparse_model_writes_a_ternary_bitnet_model(tmp_path):
    """--architecture bitnet-b1.58 with an I2_S weight type: a BitNet file with sub-norms and I2_S matrices of
    ternary values, the vocabulary asked for; a sparse BitNet and an unknown type are refused."""
    path = str(tmp_path / "b158.gguf")
    made = run("scripts/make_sparse_model.py", "-o", path, "--architecture", "bitnet-b1.58", "--sparsity", "0",
               "--n_layer", "1", "--n_embd", "128", "--n_ff", "256", "--n_vocab", "300", "--weight_type", "i2_s")
    assert made.returncode == 0, made.stderr
    g = open_gguf(path)
    assert g.metadata["general.architecture"] == "bitnet-b1.58" and "blk.0.ffn_sub_norm.weight" in g.tensors
    assert g.tensors["blk.0.ffn_up.weight"].tensor_type == ternary.I2_S
    assert g.tensors["token_embd.weight"].shape[-1] == 300
    up = np.asarray(quant.dequantize(load_matrix(g, "blk.0.ffn_up.weight")))
    assert set(np.unique(np.round(up / np.abs(up).max(), 6))) <= {-1.0, 0.0, 1.0}
    for args, fragment in ((("--architecture", "bitnet"), "give --sparsity 0"),
                           (("--sparsity", "0", "--weight_type", "TL1"), "unknown --weight_type")):
        bad = run("scripts/make_sparse_model.py", "-o", str(tmp_path / "x.gguf"), *args)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: ") and \
            fragment in bad.stderr, bad.stderr


@pytest.mark.slow
def test_bench_startup_times_a_cold_and_a_warm_run(make_model):
    result = run("scripts/bench_startup.py", "-m", make_model(), "--warm_runs", "1", "--json", "--", "-c", "64")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["generate_args"][-2:] == ["-c", "64"]
    for run_ in (summary["cold"], *summary["warm"]):
        assert 0 < run_["reported_first_token_s"] <= run_["first_token_s"] <= run_["exit_s"], run_
    bad = run("scripts/bench_startup.py", "-m", "/no/such/model.gguf", "--warm_runs", "1")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.strip().splitlines()[-1].startswith("error: generate failed"), bad.stderr
    assert "model file not found" in bad.stderr


@pytest.mark.slow
def test_make_sparse_model_refuses_a_shape_that_would_not_load(tmp_path):
    """12 heads do not divide 512: one error line naming it and the flags, nothing written; --n_head 8 writes a file
    that loads with 8 heads (and as many KV heads)."""
    path = tmp_path / "x.gguf"
    shape = ["--architecture", "bitnet-b1.58", "--shape", "small", "--n_embd", "512", "--n_ff", "1536", "--sparsity",
             "0", "--weight_type", "I2_S"]
    bad = run("scripts/make_sparse_model.py", *shape, "-o", str(path))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: a model of this shape would not load, so nothing was written: bitnet-b1.58.attention.head_count 12 "
        "does not divide bitnet-b1.58.embedding_length 512 (--n_layer, --n_embd, --n_ff, --n_head, --n_head_kv, "
        "--n_vocab, --weight_type set the shape)"]
    assert not path.exists()
    made = run("scripts/make_sparse_model.py", *shape, "--n_head", "8", "--n_layer", "1", "--n_vocab", "300", "-o",
               str(path))
    assert made.returncode == 0, made.stderr
    config = engine.load_model(str(path)).config
    assert (config.n_head, config.n_head_kv, config.head_dim) == (8, 8, 64)


@pytest.mark.parametrize("fields", [
    {"n_head": 4, "n_head_kv": 3},  # KV heads that do not divide the heads
    {"n_embd": 96, "n_head": 32, "n_head_kv": 32},  # a head size of 3: RoPE needs an even one
    {"n_embd": 200, "n_head": 4, "n_head_kv": 4, "weight_type": ternary.I2_S, "architecture": "bitnet"},  # 128-blocks
    {"n_ff": 100, "weight_type": Q.Q8_0},  # ffn_down's rows are not whole blocks of 32
    {"architecture": "gpt2"},
    {"weight_type": Q.IQ2_XXS},  # a type jaxinfer does not compute with
    {},
    {"sparsity": 0.8, "n_ff": 256},
])
def test_a_synthetic_spec_that_passes_check_loadable_loads(tmp_path, fields):
    """synthetic.check_loadable refuses exactly the specs whose file the loader refuses (or that cannot be written)."""
    spec = synthetic.SyntheticSpec(**fields)
    try:
        synthetic.check_loadable(spec)
        refused = None
    except JaxinferError as e:
        refused = str(e)
    if refused is None:
        engine.load_model(synthetic.write_model(str(tmp_path / "m.gguf"), spec))
    else:  # some cannot even be written (I2_S rows of 200 values, IQ2_XXS blocks, which gguf-py cannot make)
        with pytest.raises((JaxinferError, ValueError, QuantError)):
            engine.load_model(synthetic.write_model(str(tmp_path / "m.gguf"), spec))


def test_bench_generate_compare_dense_counts_no_predictor_in_the_dense_bytes(tmp_path):
    """A PowerInfer model (ReLU, with predictors), --sparsity predictor --compare_dense: the dense mode's bytes are
    every matrix but fc1/fc2 (which it never reads), its down rows only for its active neurons; the predictor mode's
    also gate and up rows only for active neurons, plus fc1/fc2. Counting fc1/fc2 in the dense bytes overstated the
    share saved."""
    model = synthetic.write_model(str(tmp_path / "sparse.gguf"), synthetic.SyntheticSpec(
        n_layer=1, n_embd=64, n_ff=256, sparsity=0.8, weight_type=Q.Q8_0, embedding_type=Q.Q8_0))
    result = run("scripts/bench_generate.py", "-m", model, "--pp", "8", "--tg", "8", "--repetitions", "1", "-c", "32",
                 "--sparsity", "predictor", "--compare_dense", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    tensors = open_gguf(model).tensors
    size = {name.removeprefix("blk.0.").removesuffix(".weight"): t.n_bytes for name, t in tensors.items()}
    fixed = sum(size[n] for n in ("attn_q", "attn_k", "attn_v", "attn_output", "output"))
    ffn = size["ffn_gate"] + size["ffn_up"]
    dense = fixed + ffn + report["dense_active_share"] * size["ffn_down_t"]
    sparse = fixed + report["active_share"] * (ffn + size["ffn_down_t"]) + size["fc1"] + size["fc2"]
    assert 0 < report["dense_active_share"] < 0.5
    assert report["bytes_saved_share"] == pytest.approx(1 - sparse / dense, abs=1e-4)


def test_make_sparse_model_writes_a_dense_twin_llama_cpp_can_load(tmp_path):
    """--dense_twin FILE: a plain GGUF (magic GGUF) of the PowerInfer FILE's weights: no predictors, ffn_down
    [d, n_ff] in the same type equal to ffn_down_t transposed (to Q4_0's rounding), every other tensor as stored;
    jaxinfer runs it as the same ReLU model. Model flags beside it, or a file that is not PowerInfer's, are one
    error line."""
    sparse = synthetic.write_model(str(tmp_path / "sparse.gguf"), synthetic.SyntheticSpec(
        n_layer=2, n_embd=64, n_ff=256, sparsity=0.8, weight_type=Q.Q4_0, embedding_type=Q.Q8_0))
    twin = str(tmp_path / "twin.gguf")
    made = run("scripts/make_sparse_model.py", "--dense_twin", sparse, "-o", twin)
    assert made.returncode == 0, made.stderr
    assert pathlib.Path(twin).read_bytes()[:4] == b"GGUF"
    g, t = open_gguf(sparse), open_gguf(twin)
    assert not t.powerinfer and not any(".fc1." in n or ".fc2." in n or "ffn_down_t" in n for n in t.tensors)
    assert set(t.tensors) == {n.replace("ffn_down_t", "ffn_down") for n in g.tensors if ".fc" not in n}
    for name, tensor in t.tensors.items():
        if "ffn_down" not in name:
            assert np.array_equal(np.asarray(tensor.data), np.asarray(g.tensors[name].data)), name
    for i in range(2):
        down = np.asarray(quant.dequantize(load_matrix(t, f"blk.{i}.ffn_down.weight")))
        down_t = np.asarray(quant.dequantize(load_matrix(g, f"blk.{i}.ffn_down_t.weight")))
        assert t.tensors[f"blk.{i}.ffn_down.weight"].tensor_type == Q.Q4_0 and down.shape == (64, 256)
        # Q4_0's step is a block's largest magnitude / 8: half a step off at most, or a step where +8 is clipped to +7
        steps = np.abs(down_t.T).reshape(64, 8, 32).max(axis=-1, keepdims=True) / 8
        error = np.abs(down - down_t.T).reshape(64, 8, 32)
        assert np.all(error <= steps * 1.001 + 1e-6) and np.mean(error <= steps / 2 + 1e-6) > 0.95
    assert engine.load_model(twin).config.gate_activation == "relu"
    with pytest.raises(JaxinferError, match="not a PowerInfer file"):
        synthetic.write_dense_twin(str(tmp_path / "x.gguf"), twin)
    bad = run("scripts/make_sparse_model.py", "--dense_twin", sparse, "--sparsity", "0.5", "-o", twin)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: --dense_twin takes the model from its file: drop --sparsity"], bad.stderr


FAKE_POWERINFER = """#!{python}
import sys
args = sys.argv[1:]
model, threads, n = args[args.index("-m") + 1], int(args[args.index("-t") + 1]), int(args[args.index("-n") + 1])
print("main: build = 1590 (d3ebd7c)", file=sys.stderr)
if "{fail_on}" in model:
    print("llama_model_loader: loaded meta data\\nllama_model_load: error loading model: unknown tensor",
          file=sys.stderr)
    sys.exit(1)
print(b"\\xb4 random bytes".decode("latin-1"))
print("llama_print_timings: prompt eval time =  10.00 ms /  1 tokens ( 10.00 ms per token, 100.00 tokens per second)",
      file=sys.stderr)
print(f"llama_print_timings:        eval time = 99.00 ms / {{n - 1}} runs   ( 1.57 ms per token, "
      f"{{10.0 * threads:.2f}} tokens per second)", file=sys.stderr)
"""
FAKE_LLAMA_BENCH_TG = """#!{python}
import json, sys
args = sys.argv[1:]
if "{fail_on}" in args[args.index("-m") + 1]:
    print("llama_model_load: error loading model: unknown tensor", file=sys.stderr)
    sys.exit(1)
assert args[args.index("-p") + 1] == "0"
samples = {{1: [40.0, 50.0, 70.0], 2: [60.0, 80.0, 90.0]}}
print(json.dumps([{{"n_prompt": 0, "n_gen": int(args[args.index("-n") + 1]), "n_threads": int(t), "samples_ts":
                   samples[int(t)], "build_commit": "0c1e570", "build_number": 1}}
                  for t in args[args.index("-t") + 1].split(",")]))
"""


def fake(path: pathlib.Path, text: str, fail_on: str) -> str:
    """An executable peer from `text` that fails on models whose path holds `fail_on`."""
    path.write_text(text.format(python=sys.executable, fail_on=fail_on))
    path.chmod(0o755)
    return str(path)


def test_bench_sparse_compares_sparse_dense_and_the_peers_on_each_level(tmp_path):
    """Two levels of tiny PowerInfer files in --models_dir, one there already, one made: per level the bytes each
    mode reads (the sums of the file's tensors), the speed-up against the one the bytes promise, PowerInfer's best
    -t on the file and llama.cpp's best -t on the dense twin (made beside it), jaxinfer's own speed on the twin, in
    each of two rounds. A peer that
    fails (here on the 0.95 file) is one line naming it and what it said, and null in the table."""
    models = tmp_path / "models"
    models.mkdir()
    given = synthetic.write_model(str(models / "sparse-tiny-1l-Q4_0-q8_0-0.8.gguf"), synthetic.SyntheticSpec(
        n_layer=1, n_embd=64, n_ff=256, sparsity=0.8, weight_type=Q.Q4_0, embedding_type=Q.Q8_0))
    powerinfer = fake(tmp_path / "main", FAKE_POWERINFER, "-0.95.")
    llama_bench = fake(tmp_path / "llama-bench", FAKE_LLAMA_BENCH_TG, "-0.95.")
    result = run("scripts/bench_sparse.py", "--models_dir", str(models), "--shape", "tiny", "--n_layer", "1",
                 "--levels", "0.8,0.95", "--tg", "4", "--pp", "16", "--pp_repetitions", "1", "--repetitions", "1",
                 "--rounds", "2", "-c", "32", "--powerinfer", powerinfer,
                 "--llama_bench", llama_bench, "--threads", "1,2", "--json")
    assert result.returncode == 0, result.stderr
    made = [line for line in result.stderr.splitlines() if line.startswith("making /")]
    assert len(made) == 1 and "-0.95.gguf: " in made[0], made  # 0.8's file was there
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    ok, failed = summary["levels"]
    assert ok["file"] == given and failed["file"] == str(models / "sparse-tiny-1l-Q4_0-q8_0-0.95.gguf")
    assert (models / "sparse-tiny-1l-Q4_0-q8_0-0.8.dense.gguf").is_file()

    size = {n.removeprefix("blk.0.").removesuffix(".weight"): t.n_bytes for n, t in open_gguf(given).tensors.items()}
    fixed = sum(size[n] for n in ("attn_q", "attn_k", "attn_v", "attn_output", "output"))
    ffn = size["ffn_gate"] + size["ffn_up"]
    mib = 2**20
    assert ok["dense_mib"] * mib == pytest.approx(fixed + ffn + ok["dense_active_share"] * size["ffn_down_t"])
    assert ok["sparse_mib"] * mib == pytest.approx(fixed + ok["active_share"] * (ffn + size["ffn_down_t"]) +
                                                   size["fc1"] + size["fc2"])
    assert ok["twin_mib"] * mib == pytest.approx(fixed + ffn + size["ffn_down_t"])
    assert ok["speedup"] == pytest.approx(ok["sparse_tg"] / ok["dense_tg"])
    assert ok["byte_ideal"] == pytest.approx(ok["dense_mib"] / ok["sparse_mib"])
    assert ok["fraction_of_ideal"] == pytest.approx(ok["speedup"] / ok["byte_ideal"])
    assert ok["twin_byte_ideal"] == pytest.approx(ok["twin_mib"] / ok["sparse_mib"])
    assert (ok["powerinfer_tg"], ok["powerinfer_threads"]) == (20.0, 2)  # -t 1: 10, -t 2: 20
    assert ok["powerinfer_build"] == "build 1590 (d3ebd7c)"
    assert (ok["llama_cpp_tg"], ok["llama_cpp_threads"]) == (80.0, 2)  # medians: -t 1 50, -t 2 80
    assert ok["sparse_over_powerinfer_tg"] == pytest.approx(ok["sparse_tg"] / 20.0)
    assert ok["sparse_over_llama_cpp_tg"] == pytest.approx(ok["sparse_tg"] / 80.0)
    assert ok["twin_tg"] > 0 and ok["sparse_over_twin_tg"] == pytest.approx(ok["sparse_tg"] / ok["twin_tg"])
    assert result.stdout.count("  twin: tg4 ") == 4 and failed["twin_tg"] > 0  # each round of each level
    order = [line.split(":")[0].strip() for line in result.stdout.splitlines() if ": tg4 " in line
             and line.split(":")[0].strip() in ("twin", "dense", "predictor")]
    assert order == ["twin", "dense", "predictor"] * 4  # the predictor last: its tokens' bytes are counted
    assert ok["ideal_over_powerinfer_tg"] == pytest.approx(ok["dense_tg"] * ok["byte_ideal"] / 20.0)
    assert ok["dense_pp"] > 0 and ok["sparse_pp"] > 0 and ok["pp_speedup"] == pytest.approx(ok["sparse_pp"] /
                                                                                               ok["dense_pp"])
    assert result.stdout.count(": pp16 ") == 4  # each mode once on each level
    assert failed["powerinfer_tg"] is None and failed["llama_cpp_tg"] is None and failed["sparse_tg"] > 0
    said = [line for line in result.stderr.splitlines() if "failed" in line]
    assert len(said) == 2 and "Traceback" not in result.stderr, result.stderr
    assert said[0] == (f"PowerInfer on {failed['file']} failed (-t 1, -t 2: exited with status 1: llama_model_loader: "
                       "loaded meta data | llama_model_load: error loading model: unknown tensor): reported as null")
    assert result.stdout.count("PowerInfer -t 2: tg4 20.00 tokens/s") == 2  # once a round, on the 0.8 file
    assert said[1].startswith("llama-bench on ") and "error loading model" in said[1], said[1]
    table = [line for line in result.stdout.splitlines() if line.startswith(("| 0.8 |", "| 0.95 |"))]
    assert len(table) == 4 and "| - | - | - | - | - |" in table[1] and "20.00 (2)" in table[0]
    assert table[2].startswith("| 0.8 | ") and table[2].endswith(f"| {ok['pp_speedup']:.3f}x |")  # prompts


def test_bench_sparse_compares_calibrated_specs_with_dense_on_a_model(make_model, tmp_path):
    """--specs on a plain model: thresholds missing from --thresholds are calibrated into it; each spec's row has the
    bytes it reads, its speed against dense's and against the bytes' promise, and its perplexity. Bad input is one
    error line."""
    model = make_model(n_layer=1, n_embd=64, n_ff=256, weight_type=Q.Q8_0, embedding_type=Q.Q8_0)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    thresholds = tmp_path / "thresholds.json"
    result = run("scripts/bench_sparse.py", "-m", model, "--specs", "hidden:0.5,gate:0.5", "-f", str(text),
                 "--chunks", "2", "--ppl_ctx_size", "32", "--tg", "4", "--repetitions", "1", "-c", "32",
                 "--thresholds", str(thresholds), "--json")
    assert result.returncode == 0, result.stderr
    assert set(json.loads(thresholds.read_text())["thresholds"]) == {"hidden", "gate"}
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    dense, *specs = summary["rows"]
    size = {n: t.n_bytes for n, t in open_gguf(model).tensors.items() if n.endswith(".weight") and "norm" not in n}
    assert dense["spec"] == "dense" and dense["active_share"] == 1.0 and dense["mib"] * 2**20 == sum(size.values())
    assert [s["spec"] for s in specs] == ["hidden:0.5", "gate:0.5"]
    for row in specs:
        assert 0 < row["active_share"] < 1 and row["mib"] < dense["mib"] and 1 < row["ppl"] < 1e4
        assert row["speedup"] == pytest.approx(row["tg"] / dense["tg"])
        assert row["byte_ideal"] == pytest.approx(dense["mib"] / row["mib"])
        assert row["fraction_of_ideal"] == pytest.approx(row["speedup"] / row["byte_ideal"])
    for args, message in ((("--specs", "hidden:0.5"), "error: -f/--file is required with --specs"),
                          (("--powerinfer", str(text)), f"error: --powerinfer {text}: not an executable file")):
        bad = run("scripts/bench_sparse.py", *args)
        assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(message), bad.stderr


@pytest.mark.slow
def test_gpu_check_dry_run_runs_every_step_on_the_cpu(tmp_path):
    """scripts/gpu_check.py, the command prepared for a GPU machine, runs its steps here with tiny models and the
    tests only collected, so that it cannot rot between the runs on a GPU; --only picks steps, bad flags exit 2."""
    out, work = tmp_path / "out", tmp_path / "work"
    done = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out), "--work",
                           str(work)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert list(steps) == ["wheels", "env", "nvidia-smi", "cpu_ext", "tests", "models", "moe_model", "default",
                           "sparse", "pp512", "hybrid", "moe", "xla_dump"]
    assert all(step["status"] in ("ok", "skipped") for step in steps.values()), steps
    assert steps["default"]["json"]["generation_tokens_per_s"] > 0
    assert steps["sparse"]["json"]["levels"][0]["sparse_tg"] > 0
    assert {"neurons", "layers", "host", "all"} <= set(steps["hybrid"]["json"])
    assert {"experts", "layers", "host", "all"} <= set(steps["moe"]["json"])  # a mixture: whole experts placed
    log = (out / "gpu_check.log").read_text()
    assert "tests/test_pallas_sparse_ffn.py::TestSparseFfnCompiled" in log  # collected, skipped without a GPU
    assert (out / "xla_dump.tar.gz").stat().st_size > 0
    bad = subprocess.run([sys.executable, "scripts/gpu_check.py", "--dry-run", "--out", str(out), "--only", "nope"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "--only: unknown steps nope" in bad.stderr

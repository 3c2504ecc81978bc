"""--receipt FILE.json on generate, perplexity and scripts/bench_generate.py: the file is strict JSON, holds every
section, and agrees with the model file, this machine and what the CLI printed; a path that cannot be written is a
one-line error before anything loads. The CLIs run in one batch (test_cli's driver)."""

import json
import math
import os
import pathlib
import re

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from test_cli import assert_one_line_error, run_all

from jaxinfer import receipt, sidecar
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_io import open_gguf

ROOT = pathlib.Path(__file__).resolve().parent.parent
SECTIONS = {"receipt_version", "created", "command", "model", "machine", "flags", "results", "versions"}
# The bench is a script, not a module: the driver runs it as `python -c` would.
RUN_BENCH = "import runpy, sys; sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"


def load(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f, parse_constant=lambda name: pytest.fail(f"{path} holds {name}, which is not JSON"))


def check_common(document: dict, model_path: str, given: dict):
    assert set(document) == SECTIONS
    model = document["model"]
    assert model["path"] == os.path.abspath(model_path) and model["size_bytes"] == os.path.getsize(model_path)
    assert model["fingerprint"] == sidecar.model_fingerprint(model_path)
    tensors = open_gguf(model_path).reader.tensors
    assert model["tensor_types"] == {
        name: {"tensors": sum(t.tensor_type.name == name for t in tensors),
               "bytes": sum(int(t.n_bytes) for t in tensors if t.tensor_type.name == name)}
        for name in {t.tensor_type.name for t in tensors}}
    machine = document["machine"]
    assert set(machine["kernels"]) == set(model["tensor_types"])
    assert machine["backend"] == jax.default_backend() and machine["plan"]["backend"] == machine["backend"]
    if machine["cpu_ext"]["available"]:
        import cpu_ext

        assert machine["cpu_ext"]["isa"] == cpu_ext.isa()
        assert machine["kernels"]["Q8_0"].startswith(f"cpu_ext {cpu_ext.isa()}")
    threads = machine["threads"]
    assert threads["os_cpu_count"] == os.cpu_count() and threads["schedulable_cpus"] == len(os.sched_getaffinity(0))
    if machine["backend"] == "cpu":  # XLA sizes its pool from the CPUs this process may run on, unless NPROC says
        assert threads["xla_intra_op_threads"] == int(os.environ.get("NPROC", threads["schedulable_cpus"]))
    for name, value in given.items():
        assert document["flags"]["given"][name] == value and document["flags"]["values"][name] == value
    assert document["versions"]["jax"] == jax.__version__ and document["versions"]["python"]


@pytest.mark.slow
def test_receipts_of_generate_perplexity_and_bench_agree_with_what_they_printed(make_model, tmp_path):
    path = make_model(weight_type=GGMLQuantizationType.Q8_0)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 60))
    r_generate, r_perplexity, r_bench = (str(tmp_path / f"{name}.json") for name in ("generate", "ppl", "bench"))
    unwritable = str(tmp_path / "no" / "such" / "folder" / "r.json")
    bench = str(ROOT / "scripts" / "bench_generate.py")
    results = run_all([
        ("jaxinfer.generate", ["-m", path, "-n", "6", "--temp", "0", "-c", "64", "--receipt", r_generate]),
        ("jaxinfer.perplexity", ["-m", path, "-f", str(text), "-c", "32", "--chunks", "3", "--receipt", r_perplexity]),
        ("-c", [RUN_BENCH, bench, "-m", path, "--pp", "16", "--tg", "4", "-c", "64", "--repetitions", "1",
                "--receipt", r_bench]),
        ("jaxinfer.generate", ["-m", path, "-n", "4", "--receipt", unwritable]),
        ("jaxinfer.perplexity", ["-m", path, "-f", str(text), "--receipt", unwritable]),
        ("-c", [RUN_BENCH, bench, "-m", path, "--receipt", unwritable]),
        ("jaxinfer.generate", ["-m", path, "-n", "4", "--receipt", str(tmp_path)]),
    ])
    generated, evaluated, benched, *failures = results
    for result in (generated, evaluated, benched):
        assert result["rc"] == 0, result["stderr"]

    document = load(r_generate)
    check_common(document, path, {"n_predict": 6, "temp": 0.0, "ctx_size": 64, "receipt": r_generate})
    r = document["results"]
    summary = re.search(r"load ([\d.]+) s \| compile ([\d.]+) s \| prompt (\d+) tokens, ([\d.]+) tok/s \| generated "
                        r"(\d+) tokens, ([\d.]+) tok/s \| stop: n_predict \| first token ([\d.]+) s after start \| "
                        r"seed (\d+)", generated["stderr"])
    assert summary, generated["stderr"]
    printed = summary.groups()
    assert (f"{r['load_seconds']:.2f}", f"{r['compile_seconds']:.2f}", str(r["prompt_tokens"]),
            f"{r['prompt_tokens_per_s']:.1f}", str(r["generated_tokens"]), f"{r['generation_tokens_per_s']:.2f}",
            f"{r['first_token_after_start_seconds']:.2f}", str(r["seed"])) == printed
    assert r["generated_tokens"] == 6 and r["stop_reason"] == "n_predict"
    assert math.isclose(r["prompt_tokens_per_s"], r["prompt_tokens"] / r["prompt_seconds"])
    assert math.isclose(r["generation_tokens_per_s"], 5 / r["generation_seconds"])  # the first token is the prefill's
    assert document["model"]["config"]["n_layer"] == 2 and document["machine"]["plan"]["ffn_sparsity"] == "dense"

    document = load(r_perplexity)
    check_common(document, path, {"ctx_size": 32, "chunks": 3})
    r = document["results"]
    summary = re.search(r"PPL = ([\d.]+) \+/- ([\d.]+) \| (\d+) tokens scored in (\d+) chunks of (\d+) \| [\d.]+ s, "
                        r"([\d.]+) tokens/s", evaluated["stdout"])
    assert summary, evaluated["stdout"]
    assert (f"{r['ppl']:.4f}", f"{r['ppl_error']:.5f}", str(r["scored_tokens"]), str(r["chunks"]), str(r["n_ctx"]),
            f"{r['tokens_per_s']:.1f}") == summary.groups()
    assert r["chunks"] == 3 and r["scored_tokens"] == 3 * (32 - 16 - 1) and r["kl_divergence"] is None

    document = load(r_bench)
    check_common(document, path, {"tg": 4, "repetitions": 1})
    r = document["results"]
    for test in ("pp16", "tg4"):
        assert f"{test}: " in benched["stdout"]
        printed = re.search(rf"{test}: ([\d.]+) tokens/s", benched["stdout"]).group(1)
        assert f"{r[f'{test}_tokens_per_s']:.{1 if test.startswith('pp') else 2}f}" == printed

    for result in failures[:3]:
        assert_one_line_error(result, f"cannot write {unwritable}: folder")
    assert_one_line_error(failures[3], "it is a folder")
    assert not os.path.exists(os.path.dirname(unwritable))


def test_values_strict_json_cannot_hold_are_written_as_text():
    value = {"nan": float("nan"), "inf": float("-inf"), "numpy": np.float32(1.5), "int": np.int64(3),
             "nested": [1, (2.0, float("inf"))], "object": pathlib.Path("/x"), 4: None}
    assert receipt.json_ready(value) == {"nan": "nan", "inf": "-inf", "numpy": 1.5, "int": 3,
                                         "nested": [1, [2.0, "inf"]], "object": "/x", "4": None}
    json.dumps(receipt.json_ready(value), allow_nan=False)


def test_check_path_refuses_what_cannot_be_written(tmp_path):
    receipt.check_path(None)  # no receipt asked for
    receipt.check_path(str(tmp_path / "fine.json"))
    assert os.listdir(tmp_path) == []  # the probe leaves nothing behind
    for bad, fragment in ((tmp_path, "it is a folder"), (tmp_path / "missing" / "r.json", "does not exist")):
        with pytest.raises(JaxinferError, match=fragment):
            receipt.check_path(str(bad))

"""scripts/bench_server.py and scripts/load_test_server.py against the real server process (python -m jaxinfer.server)
on a tiny synthetic model: the benchmark counts what was generated, and the issue's load test (200 requests from 16
concurrent clients, mixed lengths, some cancelled, two rounds) passes in full: every request completes or fails
cleanly, no slot is left busy, resident memory stays put; and, without a server, how the shared client
(scripts/server_client.py) judges what a server sends."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import httpx
import pytest
import server_process

from jaxinfer.synthetic import SyntheticSpec, write_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
SLOTS = 4
# Each of the slots gets -c / -np positions: the longest prompt of the scripts' mix is ~900 tokens of the synthetic
# tokenizer (characters), plus up to 64 generated.
CTX = 1024 * SLOTS


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


server_client = load_script("server_client")


def run(*args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(str(tmp_path_factory.mktemp("load") / "tiny.gguf"), SyntheticSpec(n_ctx=CTX))


@pytest.fixture(scope="module")
def start_server(model_path):
    """start_server(queue, ctx) -> (base URL, pid) of a server that answers /health with 200; all stopped at the
    end."""
    processes = []

    def start(queue: int, ctx: int = CTX):
        process, base = server_process.start(model_path, "-c", str(ctx), "--queue", str(queue), "-np", str(SLOTS))
        processes.append(process)
        server_process.wait_ready(process, base)
        return base, process.pid

    yield start
    for process in processes:
        server_process.stop(process)


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(32)


def last_json(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_bench_server_counts_every_generated_token(server):
    base, _ = server
    result = run("scripts/bench_server.py", "--url", base, "--clients", "1,2", "--requests", "2", "--max_tokens", "8",
                 "--warmup", "1", "--json")
    assert result.returncode == 0, result.stderr
    report = last_json(result)
    assert report["model"] == "tiny.gguf" and report["max_tokens"] == 8
    assert [r["clients"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert r["requests"] == r["clients"] * 2 and r["errors"] == 0
        assert r["tokens"] == r["requests"] * 8 and r["finish_reasons"] == {"length": r["requests"]}
        assert r["tokens"] / r["tokens_per_s"] == pytest.approx(r["wall_s"], abs=1e-3)  # wall_s is rounded to ms
        assert 0 < r["ttft_ms_p50"] <= r["ttft_ms_p95"] and 0 <= r["itl_ms_p50"] <= r["itl_ms_p95"]
        assert 0 < r["tpot_ms_p50"] <= r["tpot_ms_p95"]
    assert "tokens_per_s" in result.stdout.splitlines()[0]  # the table's header


@pytest.mark.slow
def test_load_test_200_requests_16_clients_two_rounds(server):
    base, pid = server
    result = run("scripts/load_test_server.py", "--url", base, "--requests", "200", "--clients", "16",
                 "--cancel_every", "7", "--pid", str(pid), "--json")
    assert result.returncode == 0, result.stderr
    report = last_json(result)
    assert report["ok"] and report["failures"] == []
    for r in report["rounds"]:
        assert r["completed"] + r["cancelled"] + r["refused_503"] + r["other_clean_errors"] == 200, r
        assert r["broken"] == 0 and r["cancelled"] > 0 and r["tokens"] > 0
        assert r["slots_reported"] and r["busy_slots"] == 0 and r["queue_length"] == 0
    assert report["memory"]["reported"] and report["memory"]["growth_bytes"] <= report["memory"]["bound_bytes"]


@pytest.mark.slow
def test_load_test_fails_on_errors_other_than_a_full_queue(start_server):
    """The mix's longer prompts do not fit a small context: 400s, clean, but not what valid requests may get."""
    base, _ = start_server(32, ctx=256)
    result = run("scripts/load_test_server.py", "--url", base, "--requests", "8", "--clients", "2", "--rounds", "1",
                 "--max_tokens", "8", "--cancel_every", "0", "--json")
    assert result.returncode == 1, result.stderr
    report = last_json(result)
    assert not report["ok"] and report["rounds"][0]["other_clean_errors"] > 0 and report["rounds"][0]["broken"] == 0
    assert re.match(r"round 1: request \d+ \((stream|plain)\) failed: 400: ", report["failures"][0]), report
    assert result.stderr.strip().splitlines()[-1].startswith("error: load test failed: round 1: request ")


@pytest.mark.slow
def test_load_test_counts_a_full_queue_as_clean_refusals(start_server):
    base, _ = start_server(1)
    result = run("scripts/load_test_server.py", "--url", base, "--requests", "48", "--clients", "16", "--rounds", "1",
                 "--max_tokens", "32", "--json")
    assert result.returncode == 0, result.stderr
    (r,) = last_json(result)["rounds"]
    assert r["refused_503"] > 0 and r["broken"] == 0 and r["busy_slots"] == 0, r


@pytest.mark.parametrize("script", ["bench_server.py", "load_test_server.py"])
def test_scripts_explain_an_unreachable_server_in_one_line(script):
    assert run(f"scripts/{script}", "--help").returncode == 0
    result = run(f"scripts/{script}", "--url", f"http://127.0.0.1:{server_process.free_port()}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: cannot reach the server at http://127.0.0.1:"), result.stderr


def sse(*chunks) -> bytes:
    return b"".join(b"data: " + (c if isinstance(c, bytes) else json.dumps(c).encode()) + b"\n\n" for c in chunks)


@pytest.mark.parametrize("status, body, expected", [
    # llama-server: one chunk per token, usage on the finish_reason chunk.
    (200, sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
              {"choices": [{"text": "", "finish_reason": "length"}], "usage": {"completion_tokens": 2}}, b"[DONE]"),
     {"completed": True, "tokens": 2, "content_chunks": 2, "finish_reason": "length"}),
    # ours: text held back and released in one chunk, usage in a last chunk without choices.
    (200, sse({"choices": [{"text": "ab"}]}, {"choices": [{"text": "", "finish_reason": "stop"}]},
              {"choices": [], "usage": {"completion_tokens": 3}}, b"[DONE]"),
     {"completed": True, "tokens": 3, "content_chunks": 1, "finish_reason": "stop"}),
    (200, sse({"choices": [{"text": "a"}]}, {"choices": [{"text": "", "finish_reason": "length"}]}),
     {"completed": False, "clean": False, "error": "the stream ended without data: [DONE]"}),
    (200, sse({"error": {"message": "boom"}}, b"[DONE]"),
     {"completed": False, "clean": True, "error": "error event: boom"}),
    (503, json.dumps({"error": {"message": "busy", "code": 503}}).encode(),
     {"completed": False, "clean": True, "status": 503, "error": "503: busy"}),
    (500, b"Internal Server Error", {"completed": False, "clean": False}),
    (200, sse(b"{not json"), {"completed": False, "clean": False}),
])
@pytest.mark.slow
def test_client_judges_what_a_server_sends(status, body, expected):
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
    with httpx.Client(transport=transport) as client:
        outcome = server_client.send(client, "http://server", server_client.RequestSpec("p", 2), read_timeout_s=5)
    for name, value in expected.items():
        assert getattr(outcome, name) == value, (name, outcome)

"""Runs over several processes (jax.distributed, distributed.py) against the one-process run of the same model: two
processes on localhost with two virtual CPU devices each, started by the test on a free port, write the same greedy
text and the same perplexity; a process whose peer never comes, or dies, fails with an error in bounded time."""

import contextlib
import mmap
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import server_process
from gguf import GGMLQuantizationType as Q
from server_process import free_port

from jaxinfer import cli, distributed, engine
from jaxinfer.sampling import SamplingParams
from test_sharding import SHAPE, env, perplexity, run_cli

BOUND_S = 60  # a process must give up within this when its peers are gone


def start(tmp_path, module: str, rank: int, port: int, *args, processes: int = 2) -> subprocess.Popen:
    """One process of a run; its output goes to files (a pipe nobody reads could fill and stall it)."""
    out, err = (tmp_path / f"{module}-{port}-{rank}.{name}" for name in ("out", "err"))
    with open(out, "w") as stdout, open(err, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", f"jaxinfer.{module}", *args, "--coordinator",
                                    f"localhost:{port}", "--num_processes", str(processes), "--process_id", str(rank)],
                                   stdout=stdout, stderr=stderr, text=True, env=env())
    process.logs = out, err
    return process


def finished(process: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    process.wait(timeout=timeout)
    out, err = (path.read_text() for path in process.logs)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run_processes(tmp_path, module: str, *args) -> list[subprocess.CompletedProcess]:
    port = free_port()
    processes = [start(tmp_path, module, rank, port, *args) for rank in range(2)]
    return [finished(p, 300) for p in processes]


def assert_quiet(result: subprocess.CompletedProcess):
    """A process other than 0 prints nothing: neither its own lines nor gloo's connection lines (from C++)."""
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "plan:" not in result.stderr and "loaded" not in result.stderr and "[Gloo]" not in result.stderr


@pytest.mark.slow
def test_generate_over_two_processes_writes_the_one_process_text(make_model, tmp_path):
    path = make_model(**SHAPE)
    args = ["-m", path, "-p", "the quick brown fox", "-n", "16", "--temp", "0", "-c", "64"]
    one = run_cli("generate", *args)
    assert one.returncode == 0, one.stderr
    assert len(one.stdout) > len("the quick brown fox") + 8  # text was generated (random weights: noise)
    first, second = run_processes(tmp_path, "generate", *args, "--tp", "4")
    assert first.returncode == 0, first.stderr
    assert "tensor-parallel over 4 devices" in first.stderr and "2 processes" in first.stderr
    assert first.stdout == one.stdout and "[Gloo]" not in first.stderr
    assert_quiet(second)


@pytest.mark.parametrize("shown", [True, False])
def test_native_standard_output_goes_to_stderr_only_when_asked(capfd, shown):
    """What leader_prints does with native writes to fd 1 (gloo's "Rank k is connected" lines): stderr with
    --verbosity, nowhere without; Python's own standard output still reaches the standard output."""
    with contextlib.ExitStack() as stack:
        python_stdout = cli._native_output_aside(stack, shown)
        os.write(1, b"[Gloo] native\n")
        python_stdout.write("text\n")
        python_stdout.flush()
    os.write(1, b"after\n")
    out, err = capfd.readouterr()
    assert out == "text\nafter\n"
    assert err == ("[Gloo] native\n" if shown else "")


@pytest.mark.slow
def test_perplexity_over_two_processes_is_the_one_process_perplexity(make_model, tmp_path):
    """Windows spread over the 4 devices of both processes (5 windows: a batch of 4 and one padded to 4), and the
    model cut over them. F32 weights: XLA's f32 products, whose partial sums added in another order differ by f32
    rounding (cpu_ext's 8-bit activations of a quantized model move a logit now and then by a step, test_sharding)."""
    path = make_model(**{**SHAPE, "weight_type": Q.F32})
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    args = ["-m", path, "-f", str(text), "-c", "32", "-b", "128", "--chunks", "5"]
    one = perplexity(run_cli("perplexity", *args))
    assert perplexity(run_cli("perplexity", *args, "--dp", "2")) == pytest.approx(one, rel=1e-4)  # one process
    for parallel in (["--dp", "4"], ["--tp", "4"]):
        first, second = run_processes(tmp_path, "perplexity", *args, *parallel)
        assert perplexity(first) == pytest.approx(one, rel=1e-4), parallel
        assert "5 chunks" in first.stdout and "2 processes" in first.stderr
        assert_quiet(second)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


@pytest.mark.slow
def test_the_server_over_two_processes_answers_as_one_process(make_model, tmp_path):
    """Process 0 serves HTTP and process 1 runs the same rounds, the model cut over both: three requests at once on
    two slots (one waits, slots are freed and compacted) get the greedy text of one process, a stop string cuts the
    text as it does there; SIGTERM to process 0 stops both, cleanly."""
    path = make_model(**SHAPE)
    port, http_port = free_port(), free_port()
    leader, follower = (start(tmp_path, "server", rank, port, "-m", path, "--port", str(http_port), "-c", "256", "-np",
                              "2") for rank in range(2))
    base = f"http://127.0.0.1:{http_port}"
    m = engine.load_model(path)

    def greedy(prompt: str, n: int) -> str:
        ids = list(engine.generate_tokens(m, m.tokenizer.encode(prompt), n, 128, SamplingParams(temperature=0),
                                          seed=0, stop_ids=frozenset()))
        return m.tokenizer.decode(ids)

    prompts = {"hello the": 12, "abc abc": 20, "x": 6}
    expected = {prompt: greedy(prompt, n) for prompt, n in prompts.items()}
    text = expected["abc abc"]  # random weights: partly bytes that decode to U+FFFD, which a stop string avoids
    stop = next(text[i:i + 2] for i in range(1, len(text)) if "\ufffd" not in text[i:i + 2])
    try:
        server_process.wait_ready(leader, base)
        replies = {}

        def ask(prompt: str, n: int, **fields):
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **fields}
            replies[prompt, bool(fields)] = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()

        threads = [threading.Thread(target=ask, args=item) for item in prompts.items()]
        threads.append(threading.Thread(target=ask, args=("abc abc", 20), kwargs={"stop": [stop]}))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for prompt in prompts:
            assert replies[prompt, False]["choices"][0]["text"] == expected[prompt], replies[prompt, False]
        cut = replies["abc abc", True]["choices"][0]
        assert (cut["text"], cut["finish_reason"]) == (text[:text.index(stop)], "stop")
    finally:
        leader.terminate()
    first, second = finished(leader, BOUND_S), finished(follower, BOUND_S)
    assert first.returncode == 0, first.stderr
    assert "tensor-parallel over 2 devices" in first.stderr and "serving " in first.stderr
    assert_quiet(second)


@pytest.mark.slow
def test_a_process_whose_coordinator_or_peer_never_comes_gives_up(make_model, tmp_path):
    """Process 1 with no coordinator to reach, and process 0 with no process 1 to wait for: each an error line
    within its join timeout."""
    path = make_model(**SHAPE)
    started = time.monotonic()
    alone = [start(tmp_path, "generate", rank, free_port(), "-m", path, "-n", "2", "--join_timeout", "5")
             for rank in (1, 0)]
    no_coordinator, no_peer = (finished(p, BOUND_S) for p in alone)
    assert time.monotonic() - started < BOUND_S
    assert no_coordinator.returncode == no_peer.returncode == 2
    assert "process 1 of 2: the coordinator at localhost:" in one_error_line(no_coordinator)
    assert "could not be reached within 5 s" in one_error_line(no_coordinator)
    assert "process 0 of 2: the other 1 processes did not all join within 5 s" in one_error_line(no_peer)


def killed_peer(tmp_path, module: str, args: list, shown: str) -> subprocess.CompletedProcess:
    """Process 0's result when process 1 is killed once process 0's stderr shows `shown`."""
    port = free_port()
    first, second = (start(tmp_path, module, rank, port, *args, "--tp", "2") for rank in range(2))
    deadline = time.monotonic() + 120
    while shown not in first.logs[1].read_text():
        assert first.poll() is None and time.monotonic() < deadline, first.logs[1].read_text()
        time.sleep(0.05)
    second.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    result = finished(first, BOUND_S)
    assert time.monotonic() - killed < BOUND_S
    finished(second, 5)
    return result


@pytest.mark.slow
def test_a_peer_killed_before_the_run_stops_the_other_process(make_model, tmp_path):
    """Killed once process 0 has loaded the model, before they compute together: JAX's runtime declares it dead
    (heartbeats) and ends process 0 with its own message."""
    args = ["-m", make_model(**SHAPE), "-n", "100", "--temp", "0", "-c", "128"]
    result = killed_peer(tmp_path, "generate", args, shown="loaded")
    assert result.returncode != 0
    assert "another task died" in result.stderr or "error: process 0 of 2: " in result.stderr, result.stderr


@pytest.mark.slow
def test_a_peer_killed_during_the_run_stops_the_other_process_with_an_error_line(make_model, tmp_path):
    """Killed once the first windows of a long evaluation are scored: process 0's next all-reduce fails, and it
    says so in one line (status 2)."""
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 2000)
    result = killed_peer(tmp_path, "perplexity", ["-m", make_model(**SHAPE), "-f", str(text), "-c", "32", "-b", "32"],
                         shown="ppl=")
    assert result.returncode == 2, result.stderr
    assert "error: process 0 of 2: the run failed, a process probably died (" in one_error_line(result)


@pytest.mark.slow
def test_a_server_process_killed_stops_the_one_serving_with_an_error_line(make_model, tmp_path):
    """Process 1 killed while process 0 serves and waits for requests: process 0's next round (shared at least every
    scheduler.IDLE_ROUND_S) fails, and it says so in one line (status 2)."""
    args = ["-m", make_model(**SHAPE), "--port", str(free_port()), "-c", "64", "-np", "2"]  # 2 prefill programs
    result = killed_peer(tmp_path, "server", args, shown="serving ")
    assert result.returncode == 2, result.stderr
    assert "error: process 0 of 2: the run failed, a process probably died (" in one_error_line(result)


@pytest.mark.parametrize("args, message", [
    (["--process_id", "1"], "--coordinator and --process_id are for a run over several processes"),
    (["--num_processes", "2"], "--num_processes 2 needs --coordinator HOST:PORT"),
    (["--num_processes", "2", "--process_id", "2", "--coordinator", "localhost:1"], "--process_id 2 is not below"),
    (["--num_processes", "2", "--tp", "3", "--coordinator", "localhost:1"], "--tp 3 devices cannot be shared"),
    (["--num_processes", "2", "--coordinator", "localhost"], "--coordinator must be HOST:PORT, got 'localhost'"),
])
def test_process_flags_that_cannot_work(args, message):
    result = run_cli("generate", "-n", "1", *args)
    assert result.returncode == 2
    assert message in one_error_line(result)


def rss_kib() -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", open("/proc/self/status").read()).group(1))


@pytest.mark.slow
def test_released_pages_of_a_mapped_file_leave_resident_memory(tmp_path):
    """What keeps a process of a run over several to its own shards: the pages a shard was copied out of are let
    go, and read back from the file unchanged when needed again; anonymous memory is never released."""
    data = np.random.default_rng(0).integers(0, 255, 64 * 2**20, np.uint8)
    data.tofile(tmp_path / "weights.bin")
    mapped = np.memmap(tmp_path / "weights.bin", np.uint8, "r")
    view = np.asarray(mapped[mmap.PAGESIZE // 2:])  # as the GGUF reader's views: not page-aligned, a plain ndarray
    assert int(view.sum(dtype=np.int64)) == int(data[mmap.PAGESIZE // 2:].sum(dtype=np.int64))  # every page read
    before = rss_kib()
    distributed.release_pages(view)
    assert before - rss_kib() > 60 * 1024
    np.testing.assert_array_equal(view, data[mmap.PAGESIZE // 2:])
    distributed.release_pages(data)  # not a file: nothing happens
    assert int(data.sum(dtype=np.int64)) == int(np.fromfile(tmp_path / "weights.bin", np.uint8).sum(dtype=np.int64))

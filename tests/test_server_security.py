"""The server (python -m jaxinfer.server) as a network service, probed as an attacker or a careless client would: API
keys, the Host header, CORS, JSON only, body and header limits and deadlines (with raw sockets), sizes checked before
tokenizing (peak resident memory bounded), a long stop string that must not stall the other clients, the -n cap, and
a SIGTERM that ends a busy server within --shutdown_timeout."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
import server_process

from jaxinfer.serving import MAX_STOP_CHARS, MAX_STOP_STRINGS
from jaxinfer.synthetic import SyntheticSpec, write_model

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC = SyntheticSpec(n_ctx=16384, n_embd=256, n_ff=1024, n_layer=4)  # test_server.py's: its programs are cached
KEYS = ("key-one", "key-two")  # the first given with --api-key, the second in --api-key-file
N_PREDICT = 64
BODY_MB = 16
CORS_ORIGIN = "http://ok.example"
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(str(tmp_path_factory.mktemp("security") / "tiny.gguf"), SPEC)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# the server's keys\n\n{KEYS[1]}\n")
    return str(path)


@pytest.fixture(scope="module")
def server(model_path, key_file):
    """(base URL, port, pid) of a server with keys, CORS for one origin, one-second header and body deadlines."""
    with server_process.running(model_path, "-c", str(SPEC.n_ctx), "-np", "4", "--api-key", KEYS[0],
                                "--api-key-file", key_file, "--cors-origin", CORS_ORIGIN, "--max_body_mb",
                                str(BODY_MB), "--header_timeout", "1", "--body_timeout", "1", "-n",
                                str(N_PREDICT)) as (base, _, process):
        yield base, int(base.rsplit(":", 1)[1]), process.pid


def assert_error(response, status, *fragments):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"], error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]
    return error


def test_api_keys_guard_every_route_but_health_and_the_chat_page(server):
    base = server[0]
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/").status_code == 200  # a browser sends no key for it: the page sends the one it is given
    body = {"prompt": "abc", "max_tokens": 2, "ignore_eos": True}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEYS[0]}):
        for method, route in (("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions")):
            response = httpx.request(method, f"{base}{route}", headers=headers, json=body)
            error = assert_error(response, 401, "Authorization: Bearer KEY")
            assert error["type"] == "authentication_error" and response.headers["www-authenticate"] == "Bearer"
    for key in KEYS:  # --api-key's and --api-key-file's
        reply = httpx.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    assert "jaxinfer_busy_slots" in httpx.get(f"{base}/metrics", headers=AUTH).text


def test_only_json_bodies_and_this_servers_host_names(server):
    base, port, _ = server
    for headers in ({"Content-Type": "text/plain"}, {}, {"Content-Type": "application/x-www-form-urlencoded"}):
        response = httpx.post(f"{base}/v1/completions", content=b'{"prompt": "abc"}', headers={**AUTH, **headers})
        assert_error(response, 415, "Content-Type: application/json")
    # DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1.
    for host in (f"evil.example:{port}", "evil.example", f"127.0.0.2:{port}"):
        assert_error(httpx.get(f"{base}/v1/models", headers={**AUTH, "Host": host}), 400, "Host header")
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(f"{base}/v1/models", headers={**AUTH, "Host": host}).status_code == 200


def test_cors_only_for_the_origin_given(server):
    base = server[0]
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{base}/v1/completions", headers={"Origin": CORS_ORIGIN, **preflight})
    assert allowed.status_code == 204 and allowed.headers["access-control-allow-origin"] == CORS_ORIGIN
    assert "Authorization" in allowed.headers["access-control-allow-headers"]
    reply = httpx.post(f"{base}/v1/completions", headers={"Origin": CORS_ORIGIN, **AUTH},
                       json={"prompt": "abc", "max_tokens": 1})
    assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == CORS_ORIGIN
    refused = httpx.post(f"{base}/v1/completions", headers={"Origin": CORS_ORIGIN}, json={"prompt": "abc"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == CORS_ORIGIN
    for response in (httpx.options(f"{base}/v1/completions", headers={"Origin": "http://evil.example", **preflight}),
                     httpx.post(f"{base}/v1/completions", headers={"Origin": "http://evil.example", **AUTH},
                                json={"prompt": "abc", "max_tokens": 1})):
        assert "access-control-allow-origin" not in response.headers


def raw_exchange(port: int, data: bytes, wait_s: float) -> tuple[bytes, float]:
    """Send `data` on a new connection and read until the server closes it -> (what it sent, seconds it took);
    the test fails if the connection is still open after `wait_s`."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(wait_s)
        start = time.monotonic()
        s.sendall(data)
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except TimeoutError:
            pytest.fail(f"the server kept the connection open for {wait_s} s after {data[:60]!r}")
        return received, time.monotonic() - start


@pytest.mark.slow
def test_slow_or_idle_connections_are_closed(server):
    """--header_timeout 1 and --body_timeout 1: an idle connection, half-sent headers and a half-sent body are closed
    within a few seconds (they were held for ten minutes and more, and then kept SIGTERM from ending the server)."""
    port = server[1]
    received, took = raw_exchange(port, b"", 10)
    assert took < 5 and received.startswith(b"HTTP/1.1 408"), received
    received, took = raw_exchange(port, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le", 10)
    assert took < 5 and received.startswith(b"HTTP/1.1 408"), received
    headers = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
               f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    received, took = raw_exchange(port, headers + b'{"prompt": ', 10)
    assert took < 5 and received.startswith(b"HTTP/1.1 408") and b"--body_timeout" in received, received


def peak_growth(pid: int, action) -> int:
    """How far the resident memory of process `pid` rose above its level before `action()` ran (bytes)."""
    status = pathlib.Path(f"/proc/{pid}/status")
    pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) starts again from the current size

    def kib(name):
        return int(next(line.split()[1] for line in status.read_text().splitlines() if line.startswith(name)))

    before = kib("VmRSS:")
    action()
    return (kib("VmHWM:") - before) * 1024


def test_bodies_past_the_limit_are_refused_unread(server):
    """413 from Content-Length before the body is read, and counted for a chunked one; four uploads of 64 MiB at
    once raise the server's peak resident memory by little (each was buffered whole, twice)."""
    base, port, pid = server
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS[0]}\r\n"
            f"Content-Type: application/json\r\n").encode()
    received, took = raw_exchange(port, head + b"Content-Length: 50000000\r\n\r\n{", 10)
    assert took < 3 and received.startswith(b"HTTP/1.1 413") and b"--max_body_mb" in received, received

    def chunks():
        for _ in range(BODY_MB + 1):
            yield b" " * 2**20

    assert_error(httpx.post(f"{base}/v1/completions", content=chunks(), headers={**AUTH, "Content-Type":
                                                                                 "application/json"}), 413)

    def upload():
        try:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(head + f"Content-Length: {64 * 2**20}\r\n\r\n".encode())
                for _ in range(64):
                    s.sendall(b" " * 2**20)
        except OSError:  # refused before it was all sent: what should happen
            pass

    def uploads():
        threads = [threading.Thread(target=upload) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)

    assert peak_growth(pid, uploads) < 64 * 2**20


def test_long_prompts_are_refused_before_tokenizing(server):
    """A 10 MB prompt is refused from its length in characters: fast, without the tokenizer's memory, and the
    other clients (here /health) are answered meanwhile."""
    base, _, pid = server
    latencies, done = [], threading.Event()

    def probe():
        while not done.is_set():
            start = time.monotonic()
            httpx.get(f"{base}/health")
            latencies.append(time.monotonic() - start)
            time.sleep(0.02)

    prober = threading.Thread(target=probe)
    prober.start()
    responses = []

    def send():
        responses.append(httpx.post(f"{base}/v1/completions", headers=AUTH, json={"prompt": "ab " * 3_300_000},
                                    timeout=60))
        responses.append(httpx.post(f"{base}/tokenize", headers=AUTH, json={"content": "ab " * 3_300_000},
                                    timeout=60))
        responses.append(httpx.post(f"{base}/v1/chat/completions", headers=AUTH, timeout=60,
                                    json={"messages": [{"role": "user", "content": "ab " * 3_300_000}]}))

    try:
        growth = peak_growth(pid, send)
    finally:
        done.set()
        prober.join()
    for response in responses:
        assert_error(response, 400, "9900000 characters, more than a slot's context")
    assert growth < 160 * 2**20 and max(latencies) < 1.0, (growth, max(latencies))


def test_a_long_stop_string_stalls_no_other_client(server):
    """A 400,000-character stop string is refused; stop strings at the limits (MAX_STOP_STRINGS of MAX_STOP_CHARS)
    are matched in linear time: meanwhile another client's short request is answered as fast as ever."""
    base = server[0]
    huge = httpx.post(f"{base}/v1/completions", headers=AUTH, timeout=30,
                      json={"prompt": "abc", "stop": ["x" * 400_000], "max_tokens": N_PREDICT, "ignore_eos": True})
    assert_error(huge, 400, f"at most {MAX_STOP_CHARS} characters")
    short = {"prompt": "hello the", "max_tokens": 8, "temperature": 0}

    def timed():
        start = time.monotonic()
        assert httpx.post(f"{base}/v1/completions", headers=AUTH, json=short, timeout=60).status_code == 200
        return time.monotonic() - start

    alone = min(timed() for _ in range(3))
    stops = [chr(0x4e00 + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)]  # never in the text: never match
    long_body = {"prompt": "abc", "stop": stops, "max_tokens": N_PREDICT, "ignore_eos": True, "temperature": 0,
                 "stream": True}
    with httpx.Client(base_url=base, headers=AUTH, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=long_body) as long_request:
            assert long_request.status_code == 200
            beside = [timed() for _ in range(3)]
            assert "[DONE]" in long_request.read().decode()
    assert min(beside) < max(0.5, 5 * alone), (alone, beside)


def test_n_predict_caps_every_request(server):
    reply = httpx.post(f"{server[0]}/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": "abc", "max_tokens": 1_000_000, "ignore_eos": True})
    assert reply.json()["usage"]["completion_tokens"] == N_PREDICT
    assert reply.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_sigterm_ends_a_busy_server_within_the_shutdown_timeout(model_path):
    """Four streams generating for a long while, an idle connection, half-sent headers and a client gone during its
    upload: SIGTERM ends the server within --shutdown_timeout and a few seconds (8 streams took 52 s, an idle
    connection for ever), status 0, no traceback."""
    process, base = server_process.start(model_path, "-c", str(SPEC.n_ctx), "-np", "4", "--shutdown_timeout", "1")
    port = int(base.rsplit(":", 1)[1])
    sockets = []
    try:
        server_process.wait_ready(process, base)
        http = httpx.Client(base_url=base, timeout=60)
        body = {"prompt": "abc", "max_tokens": SPEC.n_ctx // 4 - 8, "ignore_eos": True, "stream": True}
        streams = [http.send(http.build_request("POST", "/v1/completions", json=body), stream=True)
                   for _ in range(4)]
        lines = [stream.iter_lines() for stream in streams]
        for generating in lines:
            assert next(line for line in generating if line.startswith("data: {"))
        for data in (b"", b"GET /health HTTP/1.1\r\nHo",
                     b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\""):
            sockets.append(socket.create_connection(("127.0.0.1", port)))
            sockets[-1].sendall(data)
        sockets.pop().close()  # gone during its upload
        start = time.monotonic()
        process.send_signal(signal.SIGTERM)
        status = process.wait(timeout=30)
        took = time.monotonic() - start
    finally:
        for s in sockets:
            s.close()
        if process.poll() is None:
            process.kill()
    stderr = process.stderr.read()
    assert status == 0 and took < 10, (status, took, stderr)
    assert "Traceback" not in stderr, stderr


def test_bad_json_values_are_refused_in_one_line(server):
    """Each of these was a 500, a traceback in the log, float32 overflow warnings, or a reply echoing a megabyte."""
    base = server[0]
    headers = {**AUTH, "Content-Type": "application/json"}
    for content, fragment in ((b'{"prompt": "\\ud800"}', "lone surrogate"),
                              (b'{"messages": [{"role": "user", "content": "a\\udfff"}]}', "lone surrogate"),
                              (json.dumps({"prompt": "a", "temperature": 1e308}).encode(), "'temperature'"),
                              (json.dumps({"prompt": "a", "model": "m" * 1_000_000}).encode(), "'model'")):
        route = "/v1/chat/completions" if b"messages" in content else "/v1/completions"
        error = assert_error(httpx.post(f"{base}{route}", content=content, headers=headers), 400, fragment)
        assert len(error["message"]) < 300


@pytest.mark.slow
def test_load_test_abuse_mode_passes_and_probes_only_loopback(server):
    """scripts/load_test_server.py --abuse: the load round held while the probes ran, every bad input refused
    cleanly, every fault survived, nothing left busy; a server elsewhere is not probed."""
    def run(*args):
        return subprocess.run([sys.executable, "scripts/load_test_server.py", *args], capture_output=True, text=True,
                              timeout=300, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))

    result = run("--url", server[0], "--abuse", "--api_key", KEYS[1], "--requests", "24", "--clients", "4",
                 "--rounds", "2", "--max_tokens", "16", "--abuse_wait_s", "10", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    abuse = report["abuse"]
    assert report["ok"] and abuse["ok"] and abuse["load_held"], abuse
    assert abuse["bad_inputs"] >= 14 and abuse["bad_inputs_refused"] == abuse["bad_inputs"]
    assert abuse["faults"] >= 5 and abuse["faults_survived"] == abuse["faults"]
    assert all(r["busy_slots"] == 0 for r in report["rounds"])
    line = next(line for line in result.stderr.splitlines() if line.startswith("abuse: "))
    assert "load held" in line and "nothing lost" in line, line
    elsewhere = run("--url", "http://192.0.2.1:8080", "--abuse")
    assert elsewhere.returncode == 2 and elsewhere.stderr.strip().splitlines() == [
        "error: --abuse probes only a server on this machine (127.0.0.1, ::1 or localhost), not 192.0.2.1"]

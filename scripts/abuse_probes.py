"""load_test_server.py --abuse: a server on this machine probed as an attacker or a careless client would, a bounded
number of times, each probe within a deadline. A probe is a bad input, which must get its clean JSON refusal, or a
fault (a stalled or dropped connection), which the server must survive and clean up after."""

import ipaddress
import json
import socket
import threading
import time
import urllib.parse

import httpx

LONG_STOP = 400_000  # characters: matched naively, a stop string this long cost every client seconds a token
STOPS_ALLOWED = (16, 512)  # jaxinfer's bounds on stop strings (count, characters): the longest a request may send
MID_STREAM_DROPS = 8


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def result(probe: str, kind: str, expected: str, got: str, ok: bool) -> dict:
    return {"probe": probe, "kind": kind, "expected": expected, "got": got, "ok": ok}


def json_refusal(response: httpx.Response, status: int) -> tuple[str, bool]:
    """(what came back, whether it is a one-line JSON error with `status`)."""
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"{response.status_code} {response.text[:80]!r}", False
    one_line = "\n" not in message and len(message) < 1000 and "Traceback" not in message
    return f"{response.status_code} {message[:80]!r}", response.status_code == status and one_line


def raw(base: str, data: bytes, wait_s: float, close_after_send: bool = False) -> tuple[bytes, float | None]:
    """Send `data` on a new connection -> (what the server sent, seconds until it closed the connection; None when
    it was still open after `wait_s`, or when we closed it ourselves)."""
    url = urllib.parse.urlsplit(base)
    with socket.create_connection((url.hostname, url.port or 80), timeout=wait_s) as s:
        start = time.monotonic()
        try:
            s.sendall(data)
        except OSError:  # the server refused before all was sent
            pass
        if close_after_send:
            return b"", None
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except TimeoutError:
            return received, None
        except OSError:
            pass
        return received, time.monotonic() - start


def bad_inputs(base: str, key: str | None, wait_s: float) -> list[dict]:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    as_json = {**auth, "Content-Type": "application/json"}
    url = urllib.parse.urlsplit(base)
    results = []
    posts = [  # probe, body bytes, headers, expected status
        ("malformed JSON", b"{not json", as_json, 400),
        ("NaN temperature", b'{"prompt": "a", "temperature": NaN}', as_json, 400),
        ("a number for the prompt", b'{"prompt": 7}', as_json, 400),
        ("max_tokens 1e30", b'{"prompt": "a", "max_tokens": 1000000000000000000000000000000}', as_json, 400),
        ("temperature 1e308", b'{"prompt": "a", "temperature": 1e308}', as_json, 400),
        ("a lone surrogate", b'{"prompt": "\\ud800"}', as_json, 400),
        ("100,000 nested lists", b"[" * 100_000, as_json, 400),
        ("a 1 MB model name", json.dumps({"prompt": "a", "model": "m" * 2**20}).encode(), as_json, 400),
        (f"a {LONG_STOP:,}-character stop string", json.dumps({"prompt": "a", "stop": ["x" * LONG_STOP]}).encode(),
         as_json, 400),
        ("logit_bias, not implemented", b'{"prompt": "a", "logit_bias": {"1": 5}}', as_json, 400),
        ("a text/plain body (a cross-origin form)", b'{"prompt": "a"}', {**auth, "Content-Type": "text/plain"}, 415),
        ("a foreign Host header (DNS rebinding)", b'{"prompt": "a"}', {**as_json, "Host": "evil.example"}, 400),
    ]
    if key:
        posts.append(("no API key", b'{"prompt": "a", "max_tokens": 1}', {"Content-Type": "application/json"}, 401))
    with httpx.Client(timeout=wait_s) as client:
        for probe, content, headers, status in posts:
            try:
                got, ok = json_refusal(client.post(f"{base}/v1/completions", content=content, headers=headers), status)
            except httpx.HTTPError as e:
                got, ok = f"{type(e).__name__}: {e}", False
            results.append(result(probe, "bad input", f"{status} JSON error", got, ok))
    fields = "".join(f"{k}: {v}\r\n" for k, v in auth.items())
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n{fields}"
    for probe, data, status in (
            ("a 1 TB Content-Length", (head + "Content-Length: 1099511627776\r\n\r\n{").encode(), b"413"),
            ("a path outside the routes", f"GET /../../etc/passwd HTTP/1.1\r\nHost: {url.hostname}\r\n{fields}"
                                          f"Connection: close\r\n\r\n".encode(), b"404")):
        received, _ = raw(base, data, wait_s)
        line = received.split(b"\r\n", 1)[0].decode(errors="replace")
        results.append(result(probe, "bad input", status.decode(), line or "no answer",
                              line.split(" ")[1:2] == [status.decode()]))
    return results


def faults(base: str, key: str | None, wait_s: float) -> list[dict]:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    url = urllib.parse.urlsplit(base)
    fields = "".join(f"{k}: {v}\r\n" for k, v in auth.items())
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nContent-Type: application/json\r\n{fields}"
    results = []
    for probe, data in (("an idle connection", b""),
                        ("half-sent headers", f"GET /health HTTP/1.1\r\nHost: {url.hostname}\r\nAcc".encode()),
                        ("a half-sent body", (head + "Content-Length: 1000\r\n\r\n{\"prompt\": ").encode())):
        _, closed_after = raw(base, data, wait_s)
        results.append(result(probe, "fault", f"closed within {wait_s:g} s",
                              "still open" if closed_after is None else f"closed after {closed_after:.1f} s",
                              closed_after is not None))
    raw(base, (head + "Content-Length: 100000\r\n\r\n{\"prompt\": \"").encode() + b"a" * 5000, wait_s,
        close_after_send=True)
    results.append(result("a client gone during its upload", "fault", "survived", "sent half, closed", True))
    body = {"prompt": "a", "max_tokens": 10**6, "ignore_eos": True, "stream": True}
    dropped = 0
    with httpx.Client(headers=auth, timeout=wait_s) as client:
        for _ in range(MID_STREAM_DROPS):
            try:
                with client.stream("POST", f"{base}/v1/completions", json=body) as response:
                    dropped += response.status_code == 200 and any(line.startswith("data: {")
                                                                   for line in response.iter_lines())
            except httpx.HTTPError:
                pass
    results.append(result(f"{MID_STREAM_DROPS} clients gone mid-stream (max_tokens 1e6)", "fault",
                          f"{MID_STREAM_DROPS} streams started and dropped", f"{dropped}", dropped == MID_STREAM_DROPS))
    results.append(stall(base, auth, wait_s))
    return results


def stall(base: str, auth: dict, wait_s: float) -> dict:
    """Another client's latency beside a request with the longest stop strings allowed (reported; a stalled server
    is one whose short requests do not come back within wait_s)."""
    short = {"prompt": "a", "max_tokens": 4, "temperature": 0}
    count, length = STOPS_ALLOWED
    stops = [chr(0x4e00 + i) * length for i in range(count)]
    long_body = {"prompt": "a", "max_tokens": 256, "ignore_eos": True, "stream": True, "stop": stops}
    latencies = []
    with httpx.Client(headers=auth, timeout=wait_s) as client:
        def timed():
            start = time.monotonic()
            client.post(f"{base}/v1/completions", json=short)
            return time.monotonic() - start

        try:
            alone = timed()
            streaming = threading.Thread(target=lambda: httpx.post(f"{base}/v1/completions", json=long_body,
                                                                   headers=auth, timeout=wait_s))
            streaming.start()
            latencies = [timed() for _ in range(3)]
            streaming.join()
        except httpx.HTTPError as e:
            return result("latency beside the longest stop strings", "fault", f"answered within {wait_s:g} s",
                          f"{type(e).__name__}", False)
    return result("latency beside the longest stop strings", "fault", f"answered within {wait_s:g} s",
                  f"{max(latencies) * 1000:.0f} ms (alone {alone * 1000:.0f} ms)", True)


def run_all(base: str, key: str | None, wait_s: float) -> list[dict]:
    return bad_inputs(base, key, wait_s) + faults(base, key, wait_s)


def summary(probes: list[dict], first_round: dict) -> dict:
    """The abuse part of the report, and its one line: load held, faults survived, bad inputs tried, nothing lost."""
    bad = [p for p in probes if p["kind"] == "bad input"]
    fault = [p for p in probes if p["kind"] == "fault"]
    held = first_round["broken"] == 0 and first_round["other_clean_errors"] == 0
    lost = first_round.get("busy_slots", 0) or first_round.get("queue_length", 0)
    line = (f"load {'held' if held else 'NOT held'} ({first_round['completed']} completed, "
            f"{first_round['refused_503']} refused with 503, {first_round['broken']} broken), "
            f"faults survived {sum(p['ok'] for p in fault)}/{len(fault)}, bad inputs refused cleanly "
            f"{sum(p['ok'] for p in bad)}/{len(bad)}, {'nothing lost' if not lost else 'slots left busy'}")
    return {"line": line, "load_held": held, "faults": len(fault), "faults_survived": sum(p["ok"] for p in fault),
            "bad_inputs": len(bad), "bad_inputs_refused": sum(p["ok"] for p in bad), "probes": probes,
            "ok": held and not lost and all(p["ok"] for p in probes)}

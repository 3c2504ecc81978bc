"""The real server process (python -m jaxinfer.server) for the tests that drive it: started on a free port, waited
for until /health answers 200, stopped at the end."""

import contextlib
import os
import socket
import subprocess
import sys
import time

import httpx

READY_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu")


def wait_ready(process: subprocess.Popen, base: str) -> bool:
    """Wait until the server at `base` answers /health with 200 -> whether it answered 503 (loading) before; the test
    fails if the process ends or READY_TIMEOUT_S pass first."""
    saw_loading, deadline = False, time.monotonic() + READY_TIMEOUT_S
    while True:
        assert process.poll() is None, process.stderr.read() if process.stderr else process.returncode
        assert time.monotonic() < deadline, f"the server did not report ready in {READY_TIMEOUT_S} s"
        try:
            status = httpx.get(f"{base}/health").status_code
        except httpx.TransportError:
            status = None
        saw_loading |= status == 503
        if status == 200:
            return saw_loading
        time.sleep(0.1)


def start(model_path: str, *args: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A server process for `model_path` with the flags `args` (its stderr piped) -> (process, base URL)."""
    port = port or free_port()
    process = subprocess.Popen([sys.executable, "-m", "jaxinfer.server", "-m", model_path, "--port", str(port), *args],
                               env=env(), stderr=subprocess.PIPE, text=True)
    return process, f"http://127.0.0.1:{port}"


def stop(process: subprocess.Popen) -> int:
    """SIGTERM, as a service manager stops it -> its exit status."""
    process.terminate()
    return process.wait(timeout=30)


@contextlib.contextmanager
def running(model_path: str, *args: str):
    """Within: a ready server -> (base URL, whether /health answered 503 while it loaded, the process)."""
    process, base = start(model_path, *args)
    try:
        saw_loading = wait_ready(process, base)
        yield base, saw_loading, process
    finally:
        stop(process)

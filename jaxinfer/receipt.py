"""Run receipts: what ran, on what, how, and how fast, as one JSON file (`--receipt FILE.json` on generate, perplexity
and the benchmark scripts), so that a number can be traced to the model file, machine, kernels, threads, flags and
versions that produced it.

A receipt holds: `model` (path, size, the fingerprint sidecar files are stamped with, architecture and shapes,
tensor types with counts and bytes, the down projection's layout), `machine` (backend, devices, processes, the plan,
cpu_ext's ISA, the kernel of each weight type under the run's plan, threads, CPU), `flags` (the program's flags with
their values, and which were given), `results` (what the CLI measured and printed, in the same units), `versions`
(python, platform, jax, jaxlib, jaxinfer and its git commit, gguf, numpy) and when and how it was started. The path is
checked before the run (`check_path`) and the file written atomically at its end.
"""

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys

import jax
from absl import flags

from jaxinfer import inspection, quant, sidecar

RECEIPT_VERSION = 1
THREAD_ENVIRONMENT = ("XLA_FLAGS", "NPROC", "OMP_NUM_THREADS", "JAX_PLATFORMS")  # what sets or bounds thread counts
PACKAGES = ("jax", "jaxlib", "jaxinfer", "gguf", "numpy")
# The name XLA's CPU client gives the threads of its intra-op pool, which cpu_ext's kernels split their work over
# (ffi_common.h). The pool is sized from the schedulable CPUs, or $NPROC (measured: 2 threads on 2 CPUs, 1 under
# `taskset -c 0`, 5 with NPROC=5).
XLA_POOL_THREAD = "tf_XLAEigen"


def check_path(path: str | None) -> None:
    """Fail now, with one line, when the receipt could not be written at the end of the run."""
    if path:
        sidecar.check_writable_file(path)


def model_section(m) -> dict:
    """The model file and what was made of it (`m`: engine.LoadedModel)."""
    types = {}
    for t in m.gguf.reader.tensors:
        row = types.setdefault(t.tensor_type.name, {"tensors": 0, "bytes": 0})
        row["tensors"] += 1
        row["bytes"] += int(t.n_bytes)
    shapes = dataclasses.asdict(m.config)
    del shapes["plan"]  # under machine
    down_t = m.weights.layers[0].ffn_down_t if m.weights.layers else None
    return {"path": os.path.abspath(m.path), "size_bytes": os.path.getsize(m.path),
            "fingerprint": sidecar.model_fingerprint(m.path), "powerinfer": m.gguf.powerinfer, "config": shapes,
            "tensor_types": types, "weight_bytes_loaded": quant.tree_nbytes(m.weights),
            "down_projection": None if down_t is None else quant.layout_name(down_t),
            "thresholds_file": m.thresholds_path, "split": None if m.split is None else m.split.summary}


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def xla_pool_threads() -> int | None:
    """The threads of XLA's CPU intra-op pool, counted by name in /proc/self/task; None where threads cannot be
    listed or no CPU client has made its pool."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8", errors="replace") as f:
                count += f.read().strip() == XLA_POOL_THREAD
        except OSError:  # the thread ended meanwhile
            continue
    return count or None


def machine_section(m) -> dict:
    devices = jax.devices()
    types = {t.tensor_type for t in m.gguf.reader.tensors}
    return {
        "backend": m.config.plan.backend, "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind, "process_count": jax.process_count(),
        "plan": dataclasses.asdict(m.config.plan),
        "cpu_ext": inspection.cpu_ext_status(), "kernels": inspection.kernel_routes(types, m.config.plan),
        "threads": {"os_cpu_count": os.cpu_count(), "schedulable_cpus": len(os.sched_getaffinity(0)),
                    "xla_intra_op_threads": xla_pool_threads(), "cpu_ext_threads": "XLA's intra-op pool",
                    "environment": {name: os.environ.get(name) for name in THREAD_ENVIRONMENT}},
        "cpu": _cpu_model(), "machine": platform.machine(),
    }


def json_ready(value):
    """`value` as strict JSON holds it: non-finite floats as their names (json.dumps would write NaN, which is not
    JSON), numpy scalars as numbers, other objects as their text."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy and JAX scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def flags_section() -> dict:
    """The program's own flags (those its --help lists) with their values, and the names of all flags given."""
    f = flags.FLAGS
    own = {flag.name: json_ready(flag.value) for flag in f.get_key_flags_for_module(sys.argv[0])}
    given = sorted({f[name].name for name in f if f[name].present})  # a flag is listed under its short name too
    return {"values": own, "given": {name: json_ready(f[name].value) for name in given}}


def _git_commit(directory: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", directory, "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def versions_section() -> dict:
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    source = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    versions["jaxinfer_source"] = source
    versions["jaxinfer_commit"] = _git_commit(source)
    return versions


def build(m, results: dict) -> dict:
    """The receipt of a run of model `m` (engine.LoadedModel) that measured `results` (JSON-ready)."""
    return json_ready({
        "receipt_version": RECEIPT_VERSION,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": [sys.executable, *sys.argv],
        "model": model_section(m),
        "machine": machine_section(m),
        "flags": flags_section(),
        "results": results,
        "versions": versions_section(),
    })


def write(path: str | None, m, results: dict) -> None:
    """Write the receipt of this run to `path` (nothing when None), atomically; only process 0 of several writes."""
    if not path or jax.process_index() != 0:
        return
    text = json.dumps(build(m, results), indent=1, allow_nan=False).encode()

    def write_text(tmp):
        with open(tmp, "wb") as f:
            f.write(text)

    sidecar.atomic_write(path, write_text)

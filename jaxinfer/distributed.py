"""Several processes, on one host or several, running one model together (`jax.distributed`): joining the run,
the global device order, and arrays that span the processes.

Every process runs the same program on the same inputs (JAX's multi-controller model): each loads the model, reads
the prompt or text, and issues the same compiled calls in the same order; the devices of all processes form one mesh
(sharding.py) and the collectives between processes go through gloo on a CPU. What only process 0 knows (a server's
requests) it gives the others through those collectives too (`share`). Process 0 hosts the coordinator that
the others join. A process that cannot join, or whose peer stops answering, fails within bounded times rather than
waiting: JOIN within the caller's timeout, a silent peer declared dead after HEARTBEAT_TIMEOUT_S, and a shutdown that
waits at most SHUTDOWN_TIMEOUT_S for the others at exit.
"""

import json
import mmap

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxinfer.errors import JaxinferError

HEARTBEAT_TIMEOUT_S = 10  # a process not heard from for this long is dead, and the run fails in every process
SHUTDOWN_TIMEOUT_S = 10  # at exit, how long a process waits for the others to reach their exit too
SMALLEST_MESSAGE = 1024  # bytes: shared messages are padded to a power of two from here (each size one program)


def initialize(coordinator: str, num_processes: int, process_id: int, timeout_s: int) -> None:
    """Join the run of `num_processes` processes as `process_id`, process 0 serving the coordinator at `coordinator`
    (HOST:PORT) and the others connecting to it: before JAX starts its backends (the CLIs call this first). A
    coordinator that cannot be reached, or a process that does not come, within `timeout_s` seconds ends the
    process: JAX 0.10's runtime aborts it (its join fails in C++, not as a Python error; the CLIs print their own
    error line first, cli.join_processes). A failure that does come back to Python is a JaxinferError."""
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit():
        raise JaxinferError(f"--coordinator must be HOST:PORT, got {coordinator!r}")
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id, initialization_timeout=timeout_s,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S,
                                   shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
                                   cluster_detection_method="deactivate")  # every value is given: probe nothing
    except (RuntimeError, ValueError) as e:
        raise JaxinferError(f"process {process_id} of {num_processes} could not join the run at {coordinator}: "
                            f"{one_line(e)}") from None


def one_line(error: Exception, limit: int = 300) -> str:
    """The first line of an error's message (the distributed runtime's are many lines of status and context)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return lines[0] if len(lines[0]) <= limit else lines[0][:limit] + " ..."


def is_leader() -> bool:
    """Whether this process is the one that prints (process 0; the only one without jax.distributed)."""
    return jax.process_index() == 0


class ProcessLost(JaxinferError):
    """A collective between the processes failed: one of them died, or cannot be reached."""


def share(message: dict | None) -> dict:
    """Process 0's `message` (a JSON object; the others give None) -> that message, in every process: how process 0
    hands the others the inputs only it has (the server's requests), through JAX's own collectives
    (multihost_utils.broadcast_one_to_all: a psum over every process's devices), as two broadcasts: the length,
    then the bytes padded to a power of two. ProcessLost if a process is gone."""
    leader = is_leader()
    if leader:
        data = np.frombuffer(json.dumps(message, separators=(",", ":")).encode(), np.uint8)
    try:
        size = int(multihost_utils.broadcast_one_to_all(np.array([data.size if leader else 0], np.int32))[0])
        padded = np.zeros(max(SMALLEST_MESSAGE, 1 << (size - 1).bit_length()), np.uint8)
        if leader:
            padded[:size] = data
        received = multihost_utils.broadcast_one_to_all(padded)
    except (ValueError, jax.errors.JaxRuntimeError) as e:  # gloo's failures come as either
        raise ProcessLost(one_line(e)) from None
    return json.loads(received[:size].tobytes())


def devices() -> list:
    """Every process's devices, process by process (the order of a mesh's devices, so that each process holds one
    run of consecutive shards)."""
    return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def global_array(value, sharding: jax.sharding.Sharding) -> jax.Array:
    """`value` (a numpy array, or a jax.Array this process holds whole), which every process has the same of, as an
    array placed by `sharding`, which may span processes: this process's devices get their shards of it
    (jax.make_array_from_callback). The shards of a memory-mapped array (a GGUF tensor) are copied out of the file,
    and the file's pages then let go: a process keeps only the rows of its own shards."""
    if not isinstance(value, (jax.Array, np.ndarray)):  # a Python or numpy scalar
        value = np.asarray(value)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:  # already spans the processes
        return value if value.sharding.is_equivalent_to(sharding, value.ndim) else jax.device_put(value, sharding)
    if isinstance(value, jax.Array) and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        value = np.asarray(value)
    mapped = isinstance(value, np.ndarray) and _file_mapping(value) is not None

    def shard(index):
        if isinstance(value, np.ndarray):
            return np.array(value[index])  # a copy: the mapping's pages are let go below
        return value[index]  # PRNG keys: JAX places key arrays itself

    placed = jax.make_array_from_callback(value.shape, sharding, shard)
    if mapped:
        release_pages(value)
    return placed


def _file_mapping(array: np.ndarray) -> mmap.mmap | None:
    """The memory map of a file that `array` is a view of (np.memmap's base), if any."""
    base = array
    while base is not None:
        if isinstance(base, mmap.mmap):
            return base
        base = getattr(base, "base", None)
    return None


def release_pages(array: np.ndarray) -> None:
    """Let go of the pages of a read-only file mapping under `array` (MADV_DONTNEED): they leave the process's
    resident memory, and a later read maps them again from the file. Only for views of a file: the pages of
    anonymous memory would be zeroed."""
    mapping = _file_mapping(array)
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED") or array.nbytes == 0:
        return
    start = array.ctypes.data - np.frombuffer(mapping, np.uint8).ctypes.data
    first_page = start - start % mmap.PAGESIZE
    mapping.madvise(mmap.MADV_DONTNEED, first_page, start + array.nbytes - first_page)

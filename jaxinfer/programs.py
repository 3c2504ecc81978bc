"""Step programs built once per key and reused across runs.

A warm run of `generate` found its compiled prefill and decode programs in XLA's persistent cache, yet spent 1.2-2.9 s
tracing and lowering them again to compute that cache's key. Here a program is exported (`jax.export`) the first
time and its serialized StableHLO stored under CACHE_DIR/programs/, keyed on everything its lowering depends on: the
step function, the structure, shapes, types, shardings and static values of its arguments (the model's Config, the
weights' formats), the source of the packages it runs (jaxinfer, cpu_ext with its kernel library, pallas_kernels),
the JAX version, the backend and the JAX settings that change lowering. A later run with the same key loads the
file, skips tracing and lowering of the step, and its compile hits the persistent cache. The weights' values are no
part of a program: models of one shape and format share it.

Files are written atomically and checked on read (format, checksum, the full key); one that is unreadable, stale or
fails to load is rebuilt and replaced. Programs are stored only while the persistent compilation cache is on
(runtime.enable_compilation_cache): without it compiling dominates and a stored program saves nothing.
"""

import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import os
import pickle
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import jax
from absl import logging

from jaxinfer import quant, runtime, sidecar

FORMAT = b"jaxinfer step program 1\n"
DIGEST_BYTES = 32  # sha256 of the body, after FORMAT
SOURCE_PACKAGES = ("jaxinfer", "cpu_ext", "pallas_kernels")
# JAX settings that change what a function lowers to (not just how it compiles, which the XLA cache keys itself).
LOWERING_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_numpy_rank_promotion",
                     "jax_numpy_dtype_promotion", "jax_num_cpu_devices", "jax_use_shardy_partitioner")
_built: dict = {}  # (folder or None, key) -> Program: what this process built or loaded


@dataclasses.dataclass
class Program:
    """A compiled step: call it with arguments of the structure, shapes and types it was built for (static keyword
    arguments excluded) -> the step's result. `origin` says how it was obtained: "loaded" (a stored program),
    "exported" (traced and stored now), or "compiled" (traced and not stored, with the reason)."""

    call: Callable
    origin: str

    def __call__(self, *args):
        return self.call(*args)


def directory() -> str:
    """Where programs are stored."""
    return os.path.join(runtime.CACHE_DIR, "programs")


def compile_step(step, *args, donate: tuple[str, ...] = (), **static) -> Program:
    """`step` (a jax.jit function) compiled for `args` and the static keyword arguments `static`, with the arguments
    named in `donate` donated (as its jit donates them); loaded from a stored program when one matches, and built once
    per process for each key."""
    leaves, in_tree = jax.tree.flatten(args)
    key = program_key(step, leaves, in_tree, static)
    folder = directory() if jax.config.jax_compilation_cache_dir else None
    if (folder, key) not in _built:
        _built[folder, key] = _build(step, args, leaves, in_tree, static, donate, key, folder)
    return _built[folder, key]


def build_at_once(builds: list[Callable[[], object]]) -> list:
    """Call each of `builds` (functions that obtain programs through compile_step) on threads, up to one per CPU, ->
    their results in order (the first failure raised). XLA compiles outside the interpreter's lock, and one compile
    keeps about 1.3 cores busy, so programs compiled together are ready sooner than one by one: the default model's
    server, 5 prefill and 3 decode programs on 2 cores, 35.7 s instead of 40.2 s (tracing and lowering, 7.6 s of
    them, hold the lock)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(builds), os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda build: build(), builds))


def stored(step, *args, **static) -> bool:
    """Whether compile_step(step, *args, **static) finds its program built in this process or stored by an earlier
    run, rather than tracing and compiling it anew (what takes seconds): a CLI says so before it compiles."""
    leaves, in_tree = jax.tree.flatten(args)
    key = program_key(step, leaves, in_tree, static)
    folder = directory() if jax.config.jax_compilation_cache_dir else None
    return (folder, key) in _built or (folder is not None and _read(_path(step, key, folder), key) is not None)


def _path(step, key: str, folder: str) -> str:
    return os.path.join(folder, f"{step.__qualname__}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.program")


def _build(step, args: tuple, leaves: list, in_tree, static: dict, donate: tuple[str, ...], key: str,
           folder: str | None) -> Program:
    if folder is None:
        return _compiled(step, args, static, "compiled (the persistent compilation cache is off)")
    path = _path(step, key, folder)
    donated = _donated_leaves(step, args, donate)
    stored = _read(path, key)
    if stored is not None:
        try:
            return _program(*stored, in_tree, leaves, donated, "loaded")
        except Exception as e:  # a program that no longer loads (it passed its checks) is rebuilt like a stale one
            logging.warning("rebuilding the stored step program %s: %s", path, _one_line(e))
    try:
        exported, out_tree = _export(step, leaves, in_tree, static)
    except Exception as e:  # what jax.export cannot serialize still runs, only without reuse across runs
        logging.warning("%s is not stored for later runs (jax.export: %s)", step.__qualname__, _one_line(e))
        return _compiled(step, args, static, f"compiled (not exported: {_one_line(e)})")
    _write(path, key, exported.serialize(), out_tree)
    return _program(exported, out_tree, in_tree, leaves, donated, "exported")


def program_key(step, leaves: list, in_tree, static: dict) -> str:
    """Everything the lowered program depends on, as text."""
    arguments = [f"{jax.typeof(leaf)} {getattr(leaf, 'sharding', 'default')}" for leaf in leaves]
    device = jax.devices()[0]
    settings = [f"{name}={getattr(jax.config, name, None)}" for name in LOWERING_SETTINGS]
    return "\n".join([FORMAT.decode().strip(), f"{step.__module__}.{step.__qualname__}",
                      f"static {sorted(static.items())}", f"tree {in_tree}", *arguments,
                      f"jax {jax.__version__} jaxlib {jax.lib.__version__}",
                      f"backend {device.platform} {device.device_kind} {device.client.platform_version}",
                      *settings, f"sources {_source_digest()}"])


@functools.cache
def _source_digest() -> str:
    """A hash of the packages' Python sources and of the cpu_ext kernel library in use."""
    return _digest(_source_files())


def _source_files() -> list[tuple[str, str]]:
    """(name inside its package, path) of each file the digest covers: by those names, not their paths, so that the
    same sources in another checkout or environment give the same digest."""
    files = []
    for package in SOURCE_PACKAGES:
        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            files += sorted((os.path.join(package, os.path.relpath(os.path.join(root, name), folder)),
                             os.path.join(root, name)) for root, _, names in os.walk(folder) for name in names
                            if name.endswith(".py"))
    kernels = quant.cpu_kernels()
    if kernels is not None:
        files.append((os.path.join("cpu_ext", os.path.basename(kernels.LIBRARY_PATH)), str(kernels.LIBRARY_PATH)))
    return files


def _digest(files: list[tuple[str, str]]) -> str:
    digest = hashlib.sha256()
    for name, path in files:
        digest.update(name.encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()


def _custom_call_checks() -> list:
    """cpu_ext's FFI targets are ours, not in jax.export's list of stable custom calls: allowed by name."""
    kernels = quant.cpu_kernels()
    names = kernels.FFI_TARGETS if kernels is not None else ()
    return [jax.export.DisabledSafetyCheck.custom_call(name) for name in names]


def _export(step, leaves: list, in_tree, static: dict):
    """The step as a function of its argument leaves returning its result leaves, exported; and the result's tree."""
    out_trees = []

    def flat(*flat_args):
        out_leaves, out_tree = jax.tree.flatten(step(*jax.tree.unflatten(in_tree, flat_args), **static))
        out_trees.append(out_tree)
        return out_leaves

    exported = jax.export.export(jax.jit(flat), disabled_checks=_custom_call_checks())(*leaves)
    return exported, out_trees[0]


def _program(exported, out_tree, in_tree, leaves: list, donated: tuple[int, ...], origin: str) -> Program:
    """Compile an exported step (a persistent-cache hit once it ran before) into a Program taking the step's args."""
    if isinstance(exported, (bytes, bytearray)):
        exported = jax.export.deserialize(bytearray(exported))
    compiled = jax.jit(exported.call, donate_argnums=donated).lower(*leaves).compile()

    def call(*args):
        args_leaves, tree = jax.tree.flatten(args)
        if tree != in_tree:
            raise ValueError(f"a step program built for {in_tree} was called with {tree}")
        return jax.tree.unflatten(out_tree, compiled(*args_leaves))

    return Program(call, origin)


def _compiled(step, args: tuple, static: dict, origin: str) -> Program:
    compiled = step.lower(*args, **static).compile()
    return Program(compiled, origin)


def _donated_leaves(step, args: tuple, donate: tuple[str, ...]) -> tuple[int, ...]:
    """Indices among the flattened `args` of the leaves of the arguments named in `donate`."""
    names = list(inspect.signature(step).parameters)
    if unknown := set(donate) - set(names[:len(args)]):
        raise ValueError(f"{step.__qualname__} takes no positional argument {', '.join(sorted(unknown))} to donate")
    donated, start = [], 0
    for position, arg in enumerate(args):
        count = len(jax.tree.leaves(arg))
        if names[position] in donate:
            donated += range(start, start + count)
        start += count
    return tuple(donated)


def _read(path: str, key: str):
    """(serialized program, result tree) stored at `path` for `key`, or None when there is none or it is unusable
    (a partial write, another format, a hash collision: rebuilt by the caller)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    body = data[len(FORMAT) + DIGEST_BYTES:]
    if not data.startswith(FORMAT) or data[len(FORMAT):len(FORMAT) + DIGEST_BYTES] != hashlib.sha256(body).digest():
        logging.warning("rebuilding the step program %s: not a complete program file", path)
        return None
    try:
        stored = pickle.loads(body)  # a file of this user's cache, checksummed: as trusted as XLA's cache entries
        if stored["key"] != key:
            return None
        return stored["program"], stored["out_tree"]
    except Exception as e:
        logging.warning("rebuilding the step program %s: %s", path, _one_line(e))
        return None


def _write(path: str, key: str, serialized: bytes, out_tree) -> None:
    """Store a program; a cache that cannot be written costs the next run its time, not this run its result."""
    body = pickle.dumps({"key": key, "program": bytes(serialized), "out_tree": out_tree})
    data = FORMAT + hashlib.sha256(body).digest() + body
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with sidecar.atomic_output(path) as tmp, open(tmp, "wb") as f:
            f.write(data)
    except OSError as e:
        logging.warning("cannot store the step program %s: %s", path, e.strerror or e)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())[:300] or type(error).__name__

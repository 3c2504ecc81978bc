"""Files derived from a model (calibrated thresholds, activation profiles, GPU indices, logits bases): where they live,
written atomically with the usual permissions, and stamped with a fingerprint of the model, so that a stale or
foreign file is detected instead of silently used.

Temporary files and folders are named `<target>.<host>-<pid>-<random>.tmp` beside their target: concurrent writers
never share one, and a leftover of a killed run can be told from a live writer's. After each successful replace of a
target, its leftovers are removed: those made on this host by a process that is gone, and any not modified for
STALE_TEMP_SECONDS (a writer on another host sharing the folder, or temps of older versions). A live writer's temp
is never removed: its process still runs, or it was modified recently.
"""

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import time

import numpy as np

from jaxinfer import runtime
from jaxinfer.errors import JaxinferError, not_a_model_file

FINGERPRINT_BYTES = 1 << 20
STALE_TEMP_SECONDS = 24 * 3600
PACKAGE_FOLDERS = ("site-packages", "dist-packages")  # installed packages' data is never written to


def model_fingerprint(path: str) -> str:
    """Size plus a hash of the first MiB (header, metadata, tensor table) and of the last MiB (weights)."""
    try:
        size = os.path.getsize(path)
        digest = hashlib.sha256(str(size).encode())
        with open(path, "rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            f.seek(max(0, size - FINGERPRINT_BYTES))
            digest.update(f.read(FINGERPRINT_BYTES))
    except FileNotFoundError:
        raise JaxinferError(f"model file not found: {path}") from None
    except OSError as e:
        raise JaxinferError(f"cannot read {path}: {e.strerror}") from None
    return digest.hexdigest()[:32]


def derived_path(model_path: str, name: str, create: bool = False) -> str:
    """Where the file or folder `name` derived from a model lives: beside the model, unless the model sits in an
    installed package or in a folder this user cannot write; then in CACHE_DIR/models/<model file>-<fingerprint>/
    (created when `create`), so that writers and readers agree and no package folder is ever written to."""
    if not os.path.isfile(model_path):  # before its folder is judged: a mistyped model is what to report
        raise not_a_model_file(model_path)
    model_path = os.path.abspath(model_path)
    directory = os.path.dirname(model_path)
    if set(directory.split(os.sep)) & set(PACKAGE_FOLDERS) or not os.access(directory, os.W_OK | os.X_OK):
        directory = os.path.join(runtime.CACHE_DIR, "models",
                                 f"{os.path.basename(model_path)}-{model_fingerprint(model_path)[:16]}")
        if create:
            try:
                os.makedirs(directory, exist_ok=True)
            except OSError as e:
                raise JaxinferError(f"cannot create the cache folder {directory}: {e.strerror}") from None
    return os.path.join(directory, name)


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())


def _temp_path(path: str) -> str:
    return f"{os.path.abspath(path)}.{_host()}-{os.getpid()}-{secrets.token_hex(4)}.tmp"


def _process_is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # exists, owned by another user
        return False
    return False


def _is_stale(entry: os.DirEntry, target: str, now: float) -> bool:
    ours = re.fullmatch(re.escape(target) + r"\.([A-Za-z0-9_]+)-(\d+)-[0-9a-f]{8}\.tmp", entry.name)
    # Older versions named temps `<target>.tmp` and `<target>.XXXXXXXX.tmp` (tempfile): only their age tells.
    older = re.fullmatch(re.escape(target) + r"(\.[a-z0-9_]{8})?\.tmp", entry.name)
    if not ours and not older:
        return False
    try:
        if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TEMP_SECONDS:
            return True
    except FileNotFoundError:
        return False
    return bool(ours) and ours[1] == _host() and int(ours[2]) > 0 and _process_is_gone(int(ours[2]))


def remove_stale_temps(path: str) -> None:
    """Remove leftovers of killed writes of `path` (see the module docstring for which)."""
    directory, target = os.path.split(os.path.abspath(path))
    now = time.time()
    with os.scandir(directory) as entries:
        stale = [entry for entry in entries if _is_stale(entry, target, now)]
    for entry in stale:
        with contextlib.suppress(FileNotFoundError):
            _remove(entry.path)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


@contextlib.contextmanager
def atomic_output(path: str):
    """Yield a temporary path beside `path`, unique to this call, created empty with the permissions a new file gets
    (0666 less the umask, not tempfile's 0600); when the block succeeds it is renamed over `path`, so readers never
    see half a file, and stale temps of `path` are removed. On failure the temp is removed and `path` untouched."""
    tmp = _temp_path(path)
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    remove_stale_temps(path)


def atomic_write(path: str, write) -> None:
    """`write(temporary_path)` beside `path`, then rename it over `path` (see atomic_output)."""
    with atomic_output(path) as tmp:
        write(tmp)


@contextlib.contextmanager
def atomic_directory(path: str):
    """Yield a new empty folder beside `path`; when the block succeeds it takes `path`'s place as one unit: the old
    folder is moved aside, the new one renamed in and only then the old one deleted, so its contents are not lost
    before the new set is complete, and a reader never finds a mix of the two. On failure `path` is untouched."""
    tmp = _temp_path(path)
    os.mkdir(tmp)  # 0777 less the umask
    try:
        yield tmp
        if os.path.lexists(path):
            aside = _temp_path(path)
            os.rename(path, aside)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(aside, path)
                raise
            _remove(aside)  # a folder, or a file that stood in the folder's place
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    remove_stale_temps(path)


def _probe(path: str) -> None:
    """Create and remove a temp beside `path`: the one sure test that a file can be made there."""
    try:
        tmp = _temp_path(path)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        os.unlink(tmp)
    except OSError as e:
        raise JaxinferError(f"cannot write {path}: {e.strerror}") from None


def check_writable_file(path: str) -> None:
    """Fail now, before a long run, when the output file `path` could not be written at its end."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise JaxinferError(f"cannot write {path}: folder {directory} does not exist")
    if os.path.isdir(path):
        raise JaxinferError(f"cannot write {path}: it is a folder")
    _probe(path)


def check_writable_folder(path: str) -> None:
    """Fail now, before a long run, when the output folder `path` could not be written (as atomic_directory does)."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise JaxinferError(f"cannot write {path}: folder {directory} does not exist")
    if os.path.lexists(path) and not os.path.isdir(path):
        raise JaxinferError(f"cannot write the folder {path}: a file is in its place")
    _probe(path)


def checked_numbers(values, length: int, what: str) -> np.ndarray:
    """`values` read from a derived file as float64 [length]; a JaxinferError naming `what` unless it is a list of
    `length` finite numbers."""
    if (not isinstance(values, list) or len(values) != length
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)):
        raise JaxinferError(f"{what} must be a list of {length} numbers")
    try:
        array = np.array(values, np.float64)
    except OverflowError:
        array = np.array([np.inf])
    if not np.all(np.isfinite(array)):
        raise JaxinferError(f"{what} holds a value that is not a finite number")
    return array


def _write_bytes(data: bytes):
    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)

    return write


def write_json(path: str, model_path: str, payload: dict) -> None:
    document = {"model_fingerprint": model_fingerprint(model_path), **payload}
    atomic_write(path, _write_bytes(json.dumps(document, indent=1).encode()))


def read_json(path: str, model_path: str) -> dict:
    """The sidecar's payload (a JSON object); a JaxinferError if it is unreadable, not an object, or belongs to
    another version of the model."""
    try:
        with open(path, encoding="utf-8") as f:
            document = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise JaxinferError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(document, dict):
        raise JaxinferError(f"{path} is not a jaxinfer sidecar (a JSON object)")
    if document.get("model_fingerprint") != model_fingerprint(model_path):
        raise JaxinferError(f"{path} was made for a different model file than {model_path}; recreate it")
    return document

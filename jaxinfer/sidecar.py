"""Files derived from a model (calibrated thresholds, activation profiles, GPU indices): written atomically and
stamped with a fingerprint of the model, so a stale or foreign file is detected instead of silently used."""

import hashlib
import json
import os
import tempfile

from jaxinfer.errors import JaxinferError

FINGERPRINT_BYTES = 1 << 20


def model_fingerprint(path: str) -> str:
    """Size plus a hash of the first MiB (header, metadata, tensor table) and of the last MiB (weights)."""
    size = os.path.getsize(path)
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(FINGERPRINT_BYTES))
        f.seek(max(0, size - FINGERPRINT_BYTES))
        digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()[:32]


def atomic_write(path: str, write) -> None:
    """`write(temporary_path)` beside `path`, then rename it over `path`: readers never see half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _write_bytes(data: bytes):
    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)

    return write


def write_json(path: str, model_path: str, payload: dict) -> None:
    document = {"model_fingerprint": model_fingerprint(model_path), **payload}
    atomic_write(path, _write_bytes(json.dumps(document, indent=1).encode()))


def read_json(path: str, model_path: str) -> dict:
    """The sidecar's payload; a JaxinferError if it is unreadable or belongs to another version of the model."""
    try:
        with open(path) as f:
            document = json.load(f)
    except (OSError, ValueError) as e:
        raise JaxinferError(f"cannot read {path}: {e}") from None
    if document.get("model_fingerprint") != model_fingerprint(model_path):
        raise JaxinferError(f"{path} was made for a different model file than {model_path}; recreate it")
    return document

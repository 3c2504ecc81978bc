"""1-D tensors in PyTorch's `torch.save` file format, without torch: PowerInfer's solver reads neuron activation
counts with `torch.load("activation/activation_{i}.pt")`.

A torch.save file is an uncompressed zip under one top-level folder `<name>/`:
    <name>/data.pkl     pickle (protocol 2) of torch._utils._rebuild_tensor_v2(storage, 0, size, stride, False,
                        OrderedDict()), where `storage` is a persistent id ("storage", torch.<Type>Storage, "0",
                        "cpu", numel) resolved by the loader to the raw bytes below
    <name>/data/0       the storage bytes, little-endian
    <name>/byteorder    "little"
    <name>/version      "3"
The pickle is spelled out opcode by opcode (below) because torch's classes cannot be pickled without torch.
"""

import collections
import os
import pickle
import struct
import zipfile
import zlib

import numpy as np

from jaxinfer.errors import JaxinferError

STORAGE_TYPES = {np.dtype(np.int64): "LongStorage", np.dtype(np.float32): "FloatStorage",
                 np.dtype(np.int32): "IntStorage", np.dtype(np.float64): "DoubleStorage"}
MAX_PICKLE_BYTES = 1 << 16  # a 1-D tensor's pickle is ~200 bytes; a larger one is not a tensor file


def _unicode(text: str) -> bytes:
    data = text.encode()
    return b"X" + struct.pack("<I", len(data)) + data  # BINUNICODE


def _int(value: int) -> bytes:
    return b"J" + struct.pack("<i", value)  # BININT


def _tensor_pickle(storage_type: str, numel: int) -> bytes:
    return b"".join([
        b"\x80\x02",  # PROTO 2
        b"ctorch._utils\n_rebuild_tensor_v2\n",  # GLOBAL: the function to call
        b"(",  # MARK: its argument tuple
        b"(", _unicode("storage"), f"ctorch\n{storage_type}\n".encode(), _unicode("0"), _unicode("cpu"),
        _int(numel), b"t",  # TUPLE: the persistent id
        b"Q",  # BINPERSID: storage
        _int(0),  # storage offset
        _int(numel), b"\x85",  # TUPLE1: size
        _int(1), b"\x85",  # TUPLE1: stride
        b"\x89",  # NEWFALSE: requires_grad
        b"ccollections\nOrderedDict\n)R",  # OrderedDict(): backward hooks
        b"t",  # TUPLE
        b"R",  # REDUCE: call
        b".",  # STOP
    ])


def save_tensor(path: str, values: np.ndarray) -> None:
    """Write a 1-D int64/int32/float32/float64 array as a torch tensor file (atomically)."""
    from jaxinfer.sidecar import atomic_write

    values = np.ascontiguousarray(values)
    if values.ndim != 1 or values.dtype not in STORAGE_TYPES:
        raise ValueError(f"only 1-D {sorted(str(t) for t in STORAGE_TYPES)} arrays, got {values.dtype}{values.shape}")
    folder = os.path.splitext(os.path.basename(path))[0]

    def write(tmp):
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:
            z.writestr(f"{folder}/data.pkl", _tensor_pickle(STORAGE_TYPES[values.dtype], values.size))
            z.writestr(f"{folder}/byteorder", "little")
            z.writestr(f"{folder}/data/0", values.astype(values.dtype.newbyteorder("<")).tobytes())
            z.writestr(f"{folder}/version", "3\n")

    atomic_write(path, write)


class _TensorUnpickler(pickle.Unpickler):
    """Resolves exactly the globals a saved 1-D tensor uses; anything else is refused."""

    def __init__(self, file, archive: zipfile.ZipFile, folder: str, max_elements: int | None):
        super().__init__(file)
        self.archive, self.folder, self.max_elements = archive, folder, max_elements

    def find_class(self, module, name):
        dtypes = {v: k for k, v in STORAGE_TYPES.items()}
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in dtypes:
            return dtypes[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"unexpected global {module}.{name} in a tensor file")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], np.dtype)
                and isinstance(pid[2], str) and _is_count(pid[4])):
            raise pickle.UnpicklingError(f"unexpected storage reference {pid!r:.80}")
        _, dtype, key, _, numel = pid
        if self.max_elements is not None and numel > self.max_elements:  # before a (compressed) storage is inflated
            raise pickle.UnpicklingError(f"{numel} values, expected at most {self.max_elements}")
        info = self.archive.getinfo(f"{self.folder}/data/{key}")
        if info.file_size != numel * dtype.itemsize:
            raise pickle.UnpicklingError(f"storage of {numel} {dtype} values holds {info.file_size} bytes")
        return np.frombuffer(self.archive.read(info), dtype=dtype.newbyteorder("<"), count=numel)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _rebuild_tensor(storage, offset, size, stride, requires_grad, hooks):
    """A 1-D contiguous tensor: what save_tensor and torch.save of a 1-D CPU tensor write; anything else (whose
    strides could reach outside the storage) is refused."""
    if not (isinstance(storage, np.ndarray) and _is_count(offset) and isinstance(size, tuple) and len(size) == 1
            and _is_count(size[0]) and (stride in ((1,), ()) or size[0] <= 1) and offset + size[0] <= len(storage)):
        raise pickle.UnpicklingError(f"not a 1-D tensor within its storage (size {size!r:.40}, stride {stride!r:.40})")
    return storage[offset:offset + size[0]].copy()


def load_tensor(path: str, max_elements: int | None = None) -> np.ndarray:
    """Read a tensor file written by `save_tensor` or by `torch.save` of a 1-D CPU tensor of at most `max_elements`
    values; a JaxinferError naming `path` if it is anything else."""
    try:
        with zipfile.ZipFile(path) as archive:
            pickles = [i for i in archive.infolist() if i.filename.endswith("/data.pkl")]
            if len(pickles) != 1 or pickles[0].file_size > MAX_PICKLE_BYTES:
                raise pickle.UnpicklingError("expected one small <name>/data.pkl")
            with archive.open(pickles[0]) as f:
                tensor = _TensorUnpickler(f, archive, pickles[0].filename.rsplit("/", 1)[0], max_elements).load()
    except FileNotFoundError:
        raise JaxinferError(f"tensor file not found: {path}") from None
    except OSError as e:
        raise JaxinferError(f"cannot read {path}: {e.strerror or e}") from None
    except (zipfile.BadZipFile, pickle.UnpicklingError, KeyError, ValueError, TypeError, EOFError, OverflowError,
            IndexError, AttributeError, RecursionError, NotImplementedError, zlib.error) as e:
        raise JaxinferError(f"{path} is not a 1-D torch tensor file ({type(e).__name__}: {e})") from None
    if not isinstance(tensor, np.ndarray):
        raise JaxinferError(f"{path} is not a 1-D torch tensor file (it holds a {type(tensor).__name__})")
    return tensor

"""Writing GGUF and PowerInfer (PWRI) files with gguf-py's GGUFWriter.

A PowerInfer file is a GGUF v3 file with `PWRI` in place of the magic, per-layer predictor tensors
`blk.N.fc1.weight` [rank, d] and `blk.N.fc2.weight` [n_ff, rank] (rank may differ per layer), the down projection
stored transposed as `blk.N.ffn_down_t.weight` [n_ff, d] (one row per neuron, for row-wise axpy), and optionally the
predictor threshold `powerinfer.sparse_threshold` (f32). PowerInfer writes a plain GGUF and patches the magic; so
do we, before the atomic rename.
"""

import dataclasses
import math
from collections.abc import Callable, Iterable

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from tqdm import tqdm

from jaxinfer.gguf_io import POWERINFER_MAGIC, GGUFFile
from jaxinfer.sidecar import atomic_write
from jaxinfer.ternary import I2_S, QUANT_SIZES, i2_s_nbytes, quant_type

VIRTUAL_FIELDS = ("GGUF.", "general.architecture")  # written by GGUFWriter itself
PLAIN_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
               GGMLQuantizationType.I32: np.int32}  # stored as numpy arrays of that type, not as block bytes


def metadata_fields(gguf: GGUFFile):
    """(key, value, type, array element type) of every stored metadata field, to copy into a new file."""
    for key, field in gguf.reader.fields.items():
        if key.startswith(VIRTUAL_FIELDS):
            continue
        vtype = GGUFValueType(field.types[0])
        sub_type = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
        yield key, field.contents(), vtype, sub_type


@dataclasses.dataclass(frozen=True)
class PendingTensor:
    """A tensor to write, made only when its turn comes, so multi-GiB models stream through memory."""

    name: str
    shape: tuple[int, ...]  # logical (numpy order) shape, e.g. (rows, cols)
    qtype: GGMLQuantizationType
    make: Callable[[], np.ndarray]  # the stored form: a PLAIN_TYPES array, raw block bytes otherwise

    def stored_layout(self) -> tuple[tuple[int, ...], np.dtype, int]:
        if self.qtype in PLAIN_TYPES:
            dtype = np.dtype(PLAIN_TYPES[self.qtype])
            return self.shape, dtype, dtype.itemsize * math.prod(self.shape)
        if self.qtype == I2_S:  # the groups and the tail, one run of bytes
            return (i2_s_nbytes(math.prod(self.shape)),), np.dtype(np.uint8), i2_s_nbytes(math.prod(self.shape))
        block_size, type_size = QUANT_SIZES[self.qtype]
        byte_shape = (*self.shape[:-1], self.shape[-1] // block_size * type_size)
        return byte_shape, np.dtype(np.uint8), math.prod(byte_shape)

    def info(self) -> tuple[tuple[int, ...], np.dtype, int]:
        """The shape, dtype and size that GGUFWriter.add_tensor_info takes: for bytes, the shape in bytes, which it
        converts to values with gguf-py's table; I2_S is missing there, so its shape is given in values with a dtype
        that is not bytes (gguf-py then takes it as it is)."""
        shape, dtype, nbytes = self.stored_layout()
        return (self.shape, np.dtype(np.int8), nbytes) if self.qtype == I2_S else (shape, dtype, nbytes)


def write_gguf(path: str, arch: str, fields: Iterable, tensors: list[PendingTensor], powerinfer: bool = False,
               progress: bool = False) -> str:
    """Write `tensors` with metadata `fields` (key, value, type, sub_type) to `path`, atomically; as a PowerInfer
    file when `powerinfer`."""

    def write(tmp):
        writer = GGUFWriter(tmp, arch)
        for key, value, vtype, sub_type in fields:
            writer.add_key_value(key, value, vtype, sub_type)
        for t in tensors:
            shape, dtype, nbytes = t.info()
            writer.add_tensor_info(t.name, shape, dtype, nbytes, raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tqdm(tensors, desc="writing", unit="tensor", disable=not progress):
            data = t.make()
            expected, dtype, _ = t.stored_layout()
            if data.shape != expected or data.dtype != dtype:
                raise ValueError(f"{t.name}: made {data.dtype}{data.shape}, expected {dtype}{expected}")
            writer.write_tensor_data(data)
        writer.close()
        if powerinfer:
            with open(tmp, "r+b") as patch:
                patch.write(POWERINFER_MAGIC)

    atomic_write(path, write)
    return path


def stored_tensors(gguf: GGUFFile, skip=()) -> list[PendingTensor]:
    """The file's tensors as they are stored, ready for write_gguf."""
    return [
        PendingTensor(name, tuple(int(n) for n in reversed(t.shape.tolist())), quant_type(t.tensor_type),
                      lambda t=t: np.asarray(t.data))
        for name, t in gguf.tensors.items() if name not in skip
    ]

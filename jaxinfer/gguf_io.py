"""GGUF files -> `Config` + `Weights`, through gguf-py's memory-mapped `GGUFReader`.

Tensors go to JAX in their stored format (quantized blocks stay blocks). On the CPU backend `jax.device_put` of a
64-byte-aligned read-only numpy view is zero-copy, so most weights are served straight from the file mapping, as
llama.cpp's mmap does; the rest are copied once.
"""

import dataclasses
import os

import jax
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from jaxinfer.config import Config
from jaxinfer.errors import JaxinferError
from jaxinfer.model import Layer, Weights
from jaxinfer.quant import SUPPORTED_TYPES, QuantArray, from_gguf_data

GGUF_MAGIC = b"GGUF"
POWERINFER_MAGIC = b"PWRI"  # PowerInfer: a GGUF v3 file whose first 4 bytes say it carries sparse-inference tensors
LAYER_TENSORS = {  # Layer field -> GGUF tensor name within blk.N
    "attn_norm": "attn_norm",
    "attn_q": "attn_q",
    "attn_k": "attn_k",
    "attn_v": "attn_v",
    "attn_output": "attn_output",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "ffn_gate",
    "ffn_up": "ffn_up",
    "ffn_down": "ffn_down",
}
SMALL_ARRAY = 64  # metadata arrays longer than this (vocabularies, merges) are read on demand, not into `metadata`


class Reader(GGUFReader):
    """GGUFReader that also reads PowerInfer files, and slices plain ndarray views of the mapping.

    PowerInfer writes `PWRI` where GGUF has its magic and leaves the rest of the file GGUF v3, so the magic read at
    offset 0 answers GGUF for it. The reader slices the file once per metadata item (twice per vocabulary string);
    an np.memmap slice carries its own attribute dict, which for a 49k-token vocabulary with 49k merges costs
    ~90 MiB, so slices come from a plain view. Overrides the private `_get`: gguf is pinned to a minor release."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        if offset == 0 and plain[:4].tobytes() == POWERINFER_MAGIC:
            return np.frombuffer(GGUF_MAGIC, dtype=np.uint32)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = plain[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


@dataclasses.dataclass
class GGUFFile:
    """An open GGUF file: its reader, scalar metadata and tensors by name."""

    path: str
    reader: GGUFReader
    metadata: dict
    tensors: dict
    powerinfer: bool  # PWRI magic: PowerInfer's sparse-model format

    def array(self, key: str) -> list | None:
        """A metadata array (e.g. `tokenizer.ggml.tokens`) as a Python list, or None when absent."""
        field = self.reader.get_field(key)
        return None if field is None else field.contents()


def open_gguf(path: str) -> GGUFFile:
    """Open and validate a GGUF file; every way it can be unusable is a one-line JaxinferError."""
    if not os.path.isfile(path):
        raise JaxinferError(f"model file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic not in (GGUF_MAGIC, POWERINFER_MAGIC):
        raise JaxinferError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r} or "
                            f"{POWERINFER_MAGIC!r})")
    try:
        reader = Reader(path)
    except (ValueError, IndexError, KeyError, OSError, EOFError) as e:
        raise JaxinferError(f"{path} is truncated or corrupt ({type(e).__name__}: {e})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise JaxinferError(f"{path} is truncated: tensor {t.name} ends past the end of the file")
    metadata = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > SMALL_ARRAY:
            continue
        metadata[key] = field.contents()
    return GGUFFile(path, reader, metadata, {t.name: t for t in reader.tensors}, magic == POWERINFER_MAGIC)


def _tensor(gguf: GGUFFile, name: str):
    t = gguf.tensors.get(name)
    if t is None:
        raise JaxinferError(f"{gguf.path} lacks tensor {name}")
    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        supported = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
        raise JaxinferError(f"tensor {name} has quant type {qtype.name}, which jaxinfer does not support "
                            f"(supported: {supported})")
    return t, qtype


def load_vector(gguf: GGUFFile, name: str):
    t, qtype = _tensor(gguf, name)
    if qtype != GGMLQuantizationType.F32:
        raise JaxinferError(f"tensor {name} must be F32, found {qtype.name}")
    return jax.device_put(t.data.reshape(-1))


def load_matrix(gguf: GGUFFile, name: str, exact: bool = False) -> QuantArray:
    t, qtype = _tensor(gguf, name)
    shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # ReaderTensor.shape is in GGML (innermost-first) order
    w = from_gguf_data(np.asarray(t.data), qtype, shape)
    return QuantArray(jax.device_put(w.data), w.qtype, w.shape, exact)


def _load_layer(gguf: GGUFFile, i: int, exact: bool) -> Layer:
    def name(tensor):
        return f"blk.{i}.{tensor}.weight"

    def matrix(tensor):
        return load_matrix(gguf, name(tensor), exact)

    def optional(tensor):
        return matrix(tensor) if name(tensor) in gguf.tensors else None

    tensors = {field: load_vector(gguf, name(tensor)) if field.endswith("_norm") else matrix(tensor)
               for field, tensor in LAYER_TENSORS.items() if field != "ffn_down"}
    down_t = optional("ffn_down_t")  # PowerInfer stores the down projection transposed, one row per neuron
    down = None if down_t is not None else matrix("ffn_down")
    return Layer(**tensors, ffn_down=down, ffn_down_t=down_t, fc1=optional("fc1"), fc2=optional("fc2"))


def load_weights(gguf: GGUFFile, cfg: Config, exact: bool = False) -> Weights:
    """`exact`: every matmul multiplies by the dequantized weight, never through 8-bit-activation kernels."""
    token_embd = load_matrix(gguf, "token_embd.weight", exact)
    layers = [_load_layer(gguf, i, exact) for i in range(cfg.n_layer)]
    output = load_matrix(gguf, "output.weight", exact) if "output.weight" in gguf.tensors else token_embd
    return Weights(token_embd, layers, load_vector(gguf, "output_norm.weight"), output)


def load_config(gguf: GGUFFile) -> Config:
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise JaxinferError(f"{gguf.path} lacks tensor token_embd.weight")
    return Config.from_metadata(gguf.metadata, n_vocab=int(embd.shape[-1]), powerinfer=gguf.powerinfer)

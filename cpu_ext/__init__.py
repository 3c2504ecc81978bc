"""XLA FFI CPU kernels for y = x · Wᵀ with W stored as GGUF blocks (C++ in this directory, see qmatmul.h).

The activations are quantized to 8 bits per 32-value block (an f32 scale and two 16-value sums per block) and dotted
with the weight blocks in integers, as llama.cpp's CPU backend does; K-quants use the same 32-value activation blocks
(their sub-blocks). F16/F32 weights are dotted in f32 without quantizing the activations. That 8-bit rounding makes
results differ from `quantized_matmul_reference` by about 1e-2 relative on random data.

The shared library is loaded with ctypes and its handler registered with XLA once, at import. It is looked for in
this package (editable or wheel install) and in cpu_ext/build (`cmake -S cpu_ext -B cpu_ext/build && cmake --build
cpu_ext/build`, for machines without network access).
"""

import ctypes
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from jaxinfer import quant

_LIBRARY = "libjaxinfer_cpu.so"
_TARGET = "jaxinfer_quantized_matmul"
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name] for name in ("F32", "F16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
)


def _find_library() -> pathlib.Path:
    here = pathlib.Path(__file__).resolve().parent
    # An editable install leaves __file__ in the source tree and installs the library into site-packages/cpu_ext.
    candidates = [here / _LIBRARY, here / "build" / _LIBRARY]
    candidates += [pathlib.Path(p) / "cpu_ext" / _LIBRARY for p in sys.path if p]
    for path in candidates:
        if path.is_file():
            return path
    raise ImportError(
        f"{_LIBRARY} not found (looked in {here}, {here / 'build'} and cpu_ext/ on sys.path): run "
        '`pip install -e .` or `cmake -S cpu_ext -B cpu_ext/build && cmake --build cpu_ext/build`'
    )


_lib = ctypes.cdll.LoadLibrary(str(_find_library()))
_lib.jaxinfer_cpu_isa.restype = ctypes.c_char_p
_lib.jaxinfer_cpu_select_isa.argtypes = [ctypes.c_char_p]
jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(_lib.QuantizedMatmul), platform="cpu")


def isa() -> str:
    """The kernels in use: "avx512" (AVX-512 VNNI), "avx2" or "scalar", chosen from the CPU at first use."""
    return _lib.jaxinfer_cpu_isa().decode()


def select_isa(name: str) -> None:
    """Force "avx512", "avx2" or "scalar" kernels (tests, benchmarks), or "best" to re-detect."""
    if not _lib.jaxinfer_cpu_select_isa(name.encode()):
        raise ValueError(f"this CPU cannot run the {name!r} kernels")


@functools.cache
def _batched_call(qtype: GGMLQuantizationType, rows: int, cols: int):
    """The FFI call for one weight shape and type, with a batching rule. The handler takes any leading dims on x, so
    vmap over x only folds the batch axis into them; vmap over the weights too (rare) maps the call over it."""

    def call(x, data):
        out = jax.ShapeDtypeStruct(x.shape[:-1] + (rows,), jnp.float32)
        attrs = dict(qtype=np.int64(int(qtype)), rows=np.int64(rows), cols=np.int64(cols))
        return jax.ffi.ffi_call(_TARGET, out)(x, data, **attrs)

    @jax.custom_batching.custom_vmap
    def batched(x, data):
        return call(x, data)

    @batched.def_vmap
    def _(axis_size, in_batched, x, data):
        x_batched, data_batched = in_batched
        if not x_batched:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        if data_batched:
            return jax.lax.map(lambda args: batched(*args), (x, data)), True
        return batched(x, data), True

    return batched


def quantized_matmul(x: jax.Array, data: jax.Array, *, qtype: GGMLQuantizationType, rows: int, cols: int) -> jax.Array:
    """x [..., cols] · Wᵀ -> f32 [..., rows], W given as `QuantArray.data`: uint8 blocks [rows, cols / block_size *
    type_size], or f16/f32 [rows, cols]. Raises on shapes, byte counts or types the kernels do not take."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"cpu_ext.quantized_matmul: unsupported type {qtype.name}")
    return _batched_call(qtype, int(rows), int(cols))(jnp.asarray(x, jnp.float32), data)


def quantized_matmul_reference(x: jax.Array, data: jax.Array, *, qtype, rows: int, cols: int) -> jax.Array:
    """The same product in plain jnp: dequantize W to f32 with jaxinfer.quant, then x @ W.T."""
    w = quant.QuantArray(data, GGMLQuantizationType(qtype), (rows, cols))
    return jnp.asarray(x, jnp.float32) @ quant.dequantize(w).T

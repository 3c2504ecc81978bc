"""XLA FFI CPU kernels for y = x · Wᵀ with W stored as GGUF blocks (C++ in this directory, see qmatmul.h).

The activations are quantized to 8 bits per 32-value block (an f32 scale and the block sums that fold weight offsets
in) and dotted with the weight blocks in integers, as llama.cpp's CPU backend does; K-quants and the ternary TQ1_0 and
TQ2_0 use 256-value activation blocks (llama.cpp's Q8_K), I2_S BitNet's per-token int8 (one scale a row, see
cpu_ext/ternary.h). F16/F32 weights are dotted in f32 without quantizing the activations. That 8-bit rounding makes
results differ from `quantized_matmul_reference` by about 1e-2 relative on random data.

Weights repacked eight rows to a group (`jaxinfer.quant.pack_rows_x8`, Q4_0/Q4_1/Q8_0/IQ4_NL and, per 256-value
super-block with their scales unpacked, Q4_K/Q5_K/Q6_K/IQ4_XS: REPACKED_TYPES) take `quantized_matmul(...,
interleave=8)`: kernels tiled over rows x tokens (one vpdpbusd adds eight or sixteen rows' partial dots), for prompts
of any length and decode, with the portable row kernels' bits (K-quants and IQ4_XS: the row kernels' integer sums,
floats applied once per row and super-block, so within f32 rounding of the row kernels).

Row-sparse kernels for a sparse FFN (PowerInfer-style) read only the weight rows of active neurons: `masked_matmul`
and `gather_matmul` (up/gate projections, the same 8-bit activation path) and `masked_axpy` and `gather_axpy` (the
down projection stored transposed, one row per neuron; h stays f32, so these match their references to f32
rounding), `neuron_major_axpy` (a Q4_0/Q4_1/Q8_0 down projection repacked neuron-major without rounding; h in 8
bits and integer dots, as the dense kernels) and `down_rows_axpy` / `down_rows_gather_axpy` (a transposed Q4_0/Q8_0
down projection with each row's scales in front, over a mask or the rows an index names; each group of 32 active
neurons' coefficients rounded to 8 bits per block and dotted in integers).

Each kernel has a plain-jnp `*_reference` beside it, the semantics it is tested against. The references take the
weight already dequantized to f32 (jaxinfer.quant.dequantize reads every format): this package is a leaf that imports
nothing from jaxinfer, so that jaxinfer can import it.

The shared library is loaded with ctypes and its handler registered with XLA once, at import. It is looked for in
this package (editable or wheel install) and in cpu_ext/build (`cmake -S cpu_ext -B cpu_ext/build && cmake --build
cpu_ext/build`, for machines without network access).
"""

import ctypes
import enum
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

_LIBRARY = "libjaxinfer_cpu.so"
# Microsoft BitNet's I2_S, a type id gguf-py does not know (jaxinfer.ternary.I2_S): rows a multiple of 256 values, its
# activations rounded to int8 with one scale per token (BitNet's absmax), its per-tensor scale left to the caller.
I2_S = enum.IntEnum("BitNetType", {"I2_S": 36}).I2_S  # named, and equal to jaxinfer.ternary.I2_S
SUPPORTED_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
                 "IQ4_XS", "TQ1_0", "TQ2_0")
) | {I2_S}
# The types the repacked kernels read (quantized_matmul's interleave 8; jaxinfer.quant.pack_rows_x8 lays them out,
# qmatmul.h draws the layout).
REPACKED_TYPES = frozenset(GGMLQuantizationType[name]
                           for name in ("Q4_0", "Q4_1", "Q8_0", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"))
# The types neuron_major_axpy reads, packed as jaxinfer.quant.pack_neuron_major lays them out (qmatmul.h,
# NeuronLayout).
NEURON_MAJOR_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q8_0"))
# The types down_rows_axpy reads, as jaxinfer.quant.pack_down_rows lays them out (down_rows.h).
DOWN_ROWS_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_0", "Q8_0"))
DOWN_GROUP = 32  # neurons whose coefficients down_rows_axpy rounds with one scale per block


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


LIBRARY_PATH = _find_library()  # the kernels in use: what caches of programs that call them are keyed on
_lib = ctypes.cdll.LoadLibrary(str(LIBRARY_PATH))
_lib.jaxinfer_cpu_isa.restype = ctypes.c_char_p
_lib.jaxinfer_cpu_select_isa.argtypes = [ctypes.c_char_p]
# op -> (handler symbol, which args carry the tokens' leading dims, last output dim from (rows, cols, *args)).
_OPS = {
    "quantized_matmul": ("QuantizedMatmul", (True, False), lambda rows, cols, x, data: rows),
    "masked_matmul": ("MaskedMatmul", (True, False, True), lambda rows, cols, x, data, mask: rows),
    "gather_matmul": ("GatherMatmul", (True, False, False), lambda rows, cols, x, data, index: index.shape[0]),
    "masked_axpy": ("MaskedAxpy", (True, False, True), lambda rows, cols, h, data_t, mask: cols),
    "gather_axpy": ("GatherAxpy", (True, False, False), lambda rows, cols, h, data_t, index: cols),
    "neuron_major_axpy": ("NeuronMajorAxpy", (True, False, True), lambda rows, cols, h, packed, mask: cols),
    "down_rows_axpy": ("DownRowsAxpy", (True, False, True), lambda rows, cols, h, rows_data, mask: cols),
    "down_rows_gather_axpy": ("DownRowsGatherAxpy", (True, False, False), lambda rows, cols, h, rows_data, index: cols),
}


def handlers() -> dict[str, int]:
    """{FFI target name: address of its handler}: what a PJRT plugin needs to run these kernels in its own host
    programs (jaxinfer.jax_compat.register_host_handlers, for the host part of a GPU program)."""
    symbols = {f"jaxinfer_{op}": symbol for op, (symbol, _, _) in _OPS.items()}
    symbols |= {"jaxinfer_quantized_matmul_group": "QuantizedMatmulGroup", "jaxinfer_masked_matmul_group":
                "MaskedMatmulGroup", "jaxinfer_cached_attention": "CachedAttention"}
    return {name: ctypes.cast(getattr(_lib, symbol), ctypes.c_void_p).value for name, symbol in symbols.items()}


for _name, _address in handlers().items():
    jax.ffi.register_ffi_target(_name, jax.ffi.pycapsule(ctypes.cast(_address, ctypes.c_void_p)), platform="cpu")
# Every custom-call target registered above: a program exported with them names them (jax.export's stability check).
FFI_TARGETS = tuple(handlers())


def isa() -> str:
    """The kernels in use: "avx512" (AVX-512 VNNI), "avx2" or "scalar", chosen from the CPU at first use."""
    return _lib.jaxinfer_cpu_isa().decode()


def fast_neuron_major() -> bool:
    """Whether neuron_major_axpy runs a SIMD kernel (AVX-512 VBMI byte permutes, or AVX2 unpacks) with the kernels in
    use; the portable one is correct but takes several times the dense kernel's time (6-14x measured)."""
    return bool(_lib.jaxinfer_cpu_fast_neuron_major())


def select_isa(name: str) -> None:
    """Force "avx512", "avx2" or "scalar" kernels (tests, benchmarks), or "best" to re-detect."""
    if not _lib.jaxinfer_cpu_select_isa(name.encode()):
        raise ValueError(f"this CPU cannot run the {name!r} kernels")


def _token_batched(call, token_args: tuple[bool, ...], out_batched):
    """`call` with a batching rule. The handlers take any leading dims on the token args (x or h, and mask), so vmap
    over those only folds the batch axis into them, broadcasting the unbatched ones; vmap over a weight or the index
    too (rare) maps the call over the batch. `out_batched` is True, or a tuple of them for several outputs."""

    @jax.custom_batching.custom_vmap
    def batched(*args):
        return call(*args)

    @batched.def_vmap
    def _(axis_size, in_batched, *args):
        if any(b and not token for b, token in zip(in_batched, token_args)):

            def one(mapped):
                mapped = iter(mapped)
                return batched(*(next(mapped) if b else a for a, b in zip(args, in_batched)))

            return jax.lax.map(one, tuple(a for a, b in zip(args, in_batched) if b)), out_batched
        args = (a if b or not token else jnp.broadcast_to(a, (axis_size, *a.shape))
                for a, b, token in zip(args, in_batched, token_args))
        return batched(*args), out_batched

    return batched


@functools.cache
def _batched_call(op: str, qtype: GGMLQuantizationType, rows: int, cols: int, **extra_attrs: int):
    """The FFI call of `op` for one weight shape and type (and the op's own int attributes), batched by
    _token_batched."""
    _, token_args, out_last = _OPS[op]

    def call(*args):
        out = jax.ShapeDtypeStruct(args[0].shape[:-1] + (out_last(rows, cols, *args),), jnp.float32)
        attrs = dict(qtype=np.int64(int(qtype)), rows=np.int64(rows), cols=np.int64(cols))
        attrs.update({name: np.int64(value) for name, value in extra_attrs.items()})
        return jax.ffi.ffi_call(f"jaxinfer_{op}", out)(*args, **attrs)

    return _token_batched(call, token_args, True)


def _check_type(op: str, qtype) -> GGMLQuantizationType:
    if int(qtype) == I2_S:
        return qtype
    qtype = GGMLQuantizationType(qtype)
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"cpu_ext.{op}: unsupported type {qtype.name}")
    return qtype


def _mask(op: str, mask) -> jax.Array:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise ValueError(f"cpu_ext.{op}: mask must be bool, got {mask.dtype}")
    return mask


_INT32 = np.iinfo(np.int32)


def _index(op: str, index) -> jax.Array:
    """index as the handlers take it: int32, or a wider JAX integer array, which they check entry by entry (a cast to
    int32 would wrap an entry such as 2**32 + 3 into range, to row 3, where it is meant as out of range)."""
    if not isinstance(index, jax.Array):
        # jnp.asarray would do that cast to a NumPy int64 array with x64 off, silently: check the values first.
        index = np.asarray(index)
        if np.issubdtype(index.dtype, np.integer) and index.size and (index.min() < _INT32.min or
                                                                      index.max() > _INT32.max):
            raise ValueError(f"cpu_ext.{op}: index entries must fit in int32, got {index.min()}..{index.max()}")
    index = jnp.asarray(index)
    if not jnp.issubdtype(index.dtype, jnp.integer) or index.ndim != 1:
        raise ValueError(f"cpu_ext.{op}: index must be a 1-D integer array, got {index.dtype}{list(index.shape)}")
    return index if index.dtype.itemsize >= 4 else index.astype(jnp.int32)


def quantized_matmul(x: jax.Array, data: jax.Array, *, qtype: GGMLQuantizationType, rows: int, cols: int,
                     interleave: int = 1) -> jax.Array:
    """x [..., cols] · Wᵀ -> f32 [..., rows], W given as `QuantArray.data`: uint8 blocks [rows, cols / block_size *
    type_size], or f16/f32 [rows, cols]; with `interleave` 8, a W of REPACKED_TYPES repacked eight rows to a group
    (`jaxinfer.quant.pack_rows_x8`): uint8 [ceil(rows / 8), 8 * cols / 32 * type_size] (Q4_K/Q5_K/Q6_K/IQ4_XS:
    cols / 256 * 1184/1440/1680/1104), dotted by the repacked kernels for any number of tokens. Raises on shapes,
    byte counts or types the kernels do not take."""
    qtype = _check_type("quantized_matmul", qtype)
    call = _batched_call("quantized_matmul", qtype, int(rows), int(cols), interleave=int(interleave))
    return call(jnp.asarray(x, jnp.float32), data)


def quantized_matmul_reference(x: jax.Array, w: jax.Array) -> jax.Array:
    """The same product in plain jnp, W given dequantized (f32 [rows, cols]): x @ W.T."""
    return jnp.asarray(x, jnp.float32) @ jnp.asarray(w, jnp.float32).T


@functools.cache
def _group_call(qtype: GGMLQuantizationType, rows: tuple[int, ...], cols: int, interleave: int):
    """The FFI call of quantized_matmul_group for one tuple of weight shapes, batched by _token_batched (x is the
    one token arg)."""

    def call(x, *datas):
        outs = tuple(jax.ShapeDtypeStruct(x.shape[:-1] + (r,), jnp.float32) for r in rows)
        attrs = dict(qtype=np.int64(int(qtype)), rows=np.array(rows, np.int64), cols=np.int64(cols),
                     interleave=np.int64(interleave))
        return tuple(jax.ffi.ffi_call("jaxinfer_quantized_matmul_group", outs)(x, *datas, **attrs))

    return _token_batched(call, (True,) + (False,) * len(rows), (True,) * len(rows))


def quantized_matmul_group(x: jax.Array, datas, *, qtype: GGMLQuantizationType, rows, cols: int,
                           interleave: int = 1) -> list[jax.Array]:
    """[quantized_matmul(x, datas[i], rows=rows[i], interleave=interleave) ...] in one call, for weights of one type,
    input size and layout (a layer's q/k/v, or gate/up): x is quantized once and the rows of all the weights are
    split over the threads together. Gives the same bits as the separate calls."""
    qtype = _check_type("quantized_matmul_group", qtype)
    if len(datas) != len(rows):
        raise ValueError(f"cpu_ext.quantized_matmul_group: {len(datas)} weights but {len(rows)} row counts")
    call = _group_call(qtype, tuple(int(r) for r in rows), int(cols), int(interleave))
    return list(call(jnp.asarray(x, jnp.float32), *datas))


def masked_matmul(x: jax.Array, data: jax.Array, mask: jax.Array, *, qtype: GGMLQuantizationType, rows: int,
                  cols: int) -> jax.Array:
    """x [..., cols] · Wᵀ where mask, else 0 -> f32 [..., rows]; mask bool [..., rows] with the leading dims of x, W
    as in quantized_matmul. Weight rows masked off for every token are not read (up/gate projections of a sparse
    FFN)."""
    qtype = _check_type("masked_matmul", qtype)
    call = _batched_call("masked_matmul", qtype, int(rows), int(cols))
    return call(jnp.asarray(x, jnp.float32), data, _mask("masked_matmul", mask))


@functools.cache
def _masked_group_call(qtype: GGMLQuantizationType, n: int, rows: int, cols: int):
    """The FFI call of masked_matmul_group for n weights, batched by _token_batched (x and mask carry the tokens)."""

    def call(x, mask, *datas):
        outs = tuple(jax.ShapeDtypeStruct(x.shape[:-1] + (rows,), jnp.float32) for _ in range(n))
        attrs = dict(qtype=np.int64(int(qtype)), rows=np.int64(rows), cols=np.int64(cols))
        return tuple(jax.ffi.ffi_call("jaxinfer_masked_matmul_group", outs)(x, mask, *datas, **attrs))

    return _token_batched(call, (True, True) + (False,) * n, (True,) * n)


def masked_matmul_group(x: jax.Array, datas, mask: jax.Array, *, qtype: GGMLQuantizationType, rows: int,
                        cols: int) -> list[jax.Array]:
    """[masked_matmul(x, data, mask) for data in datas] in one call, for weights of one type and shape (a sparse
    FFN's gate and up): x is quantized and the active rows found once, and the rows of all the weights are split
    over the threads together. Gives the same bits as the separate calls."""
    qtype = _check_type("masked_matmul_group", qtype)
    call = _masked_group_call(qtype, len(datas), int(rows), int(cols))
    return list(call(jnp.asarray(x, jnp.float32), _mask("masked_matmul_group", mask), *datas))


def masked_matmul_reference(x, w, mask) -> jax.Array:
    """where(mask, x @ W.T, 0) in plain jnp, W dequantized."""
    return jnp.where(mask, quantized_matmul_reference(x, w), 0.0)


def gather_matmul(x: jax.Array, data: jax.Array, index: jax.Array, *, qtype: GGMLQuantizationType, rows: int,
                  cols: int, segment: int = 0, interleave: int = 1) -> jax.Array:
    """x [..., cols] · W[index]ᵀ -> f32 [..., k] for index int [k] (any order, repeats allowed; entries outside
    [0, rows) give 0, for padding; entries outside int32 raise). Only the indexed rows of W are read. With `segment`
    s > 0, x is [m, cols] with k = m s and token t takes only the entries t s .. (t + 1) s - 1 (0 elsewhere): one
    call for several row sets, each with its own activations. With `interleave` 8, W is repacked eight rows to a
    group as for quantized_matmul and the index lists whole groups (entries 8j .. 8j + 7: rows 8g .. 8g + 7, or all
    out of range; k and s multiples of 8), dotted by the repacked kernels."""
    qtype = _check_type("gather_matmul", qtype)
    call = _batched_call("gather_matmul", qtype, int(rows), int(cols), segment=int(segment),
                         interleave=int(interleave))
    return call(jnp.asarray(x, jnp.float32), data, _index("gather_matmul", index))


def gather_matmul_reference(x, w, index, segment: int = 0) -> jax.Array:
    """x @ W[index].T in plain jnp, W dequantized, 0 where index is out of range (and outside a token's segment)."""
    valid = (index >= 0) & (index < w.shape[0])
    y = jnp.where(valid, quantized_matmul_reference(x, jnp.asarray(w)[jnp.where(valid, index, 0)]), 0.0)
    if segment:
        y = jnp.where(jnp.arange(index.shape[0]) // segment == jnp.arange(x.shape[-2])[:, None], y, 0.0)
    return y


def masked_axpy(h: jax.Array, data_t: jax.Array, mask: jax.Array, *, qtype: GGMLQuantizationType, rows: int,
                cols: int) -> jax.Array:
    """sum over j with mask[..., j] of h[..., j] W_t[j] -> f32 [..., cols]: h f32 [..., rows], mask bool of h's shape,
    W_t [rows, cols] as in quantized_matmul (the down projection stored transposed: one row per neuron). Rows masked
    off for every token are not read. h is not quantized: the result matches the reference to f32 rounding."""
    qtype = _check_type("masked_axpy", qtype)
    call = _batched_call("masked_axpy", qtype, int(rows), int(cols))
    return call(jnp.asarray(h, jnp.float32), data_t, _mask("masked_axpy", mask))


def masked_axpy_reference(h, w_t, mask) -> jax.Array:
    """where(mask, h, 0) @ W_t in plain jnp, W_t dequantized (also neuron_major_axpy's reference)."""
    return jnp.where(mask, jnp.asarray(h, jnp.float32), 0.0) @ jnp.asarray(w_t, jnp.float32)


def gather_axpy(h: jax.Array, data_t: jax.Array, index: jax.Array, *, qtype: GGMLQuantizationType, rows: int,
                cols: int) -> jax.Array:
    """sum over i of h[..., i] W_t[index[i]] -> f32 [..., cols] for h f32 [..., k], index int [k] (entries outside
    [0, rows) are skipped, entries outside int32 raise). Only the indexed rows of W_t are read."""
    qtype = _check_type("gather_axpy", qtype)
    call = _batched_call("gather_axpy", qtype, int(rows), int(cols))
    return call(jnp.asarray(h, jnp.float32), data_t, _index("gather_axpy", index))


def gather_axpy_reference(h, w_t, index) -> jax.Array:
    """h @ W_t[index] in plain jnp, W_t dequantized, out-of-range entries of index left out."""
    valid = (index >= 0) & (index < w_t.shape[0])
    return masked_axpy_reference(h, jnp.asarray(w_t)[jnp.where(valid, index, 0)], valid)


def neuron_major_axpy(h: jax.Array, packed: jax.Array, mask: jax.Array, *, qtype: GGMLQuantizationType, rows: int,
                      cols: int, span: int) -> jax.Array:
    """masked_axpy for a Q4_0/Q4_1/Q8_0 W_t [rows = n_ff, cols = d] given as
    `jaxinfer.quant.pack_neuron_major(W, span).data` (W = W_tᵀ in GGUF's layout, repacked without rounding, in spans
    of `span` outputs): the q of neurons masked off, or whose h rounds to 0, are not read. h is quantized to 8 bits per
    32 neurons and dotted in integers, as `quantized_matmul(where(mask, h, 0), W)` would (about 1e-2 relative
    difference from masked_axpy_reference on random data)."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in NEURON_MAJOR_TYPES:
        raise ValueError(f"cpu_ext.neuron_major_axpy: unsupported type {qtype.name} (Q4_0, Q4_1 or Q8_0)")
    call = _batched_call("neuron_major_axpy", qtype, int(rows), int(cols), span=int(span))
    return call(jnp.asarray(h, jnp.float32), packed, _mask("neuron_major_axpy", mask))



def down_rows_axpy(h: jax.Array, rows_data: jax.Array, mask: jax.Array, *, qtype: GGMLQuantizationType, rows: int,
                   cols: int) -> jax.Array:
    """masked_axpy for a Q4_0/Q8_0 W_t [rows = n_ff, cols = d] given as `jaxinfer.quant.pack_down_rows(W_t).data`
    (each row's scales, then its quants): the rows of neurons masked off, or whose h is 0, are not read. A token's
    active neurons are taken in groups of DOWN_GROUP; each group's coefficients h_i d_ib are rounded to 8 bits with
    one scale per block and dotted in integers (cpu_ext/down_rows.h), as `down_rows_axpy_reference` computes."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in DOWN_ROWS_TYPES:
        raise ValueError(f"cpu_ext.down_rows_axpy: unsupported type {qtype.name} (Q4_0 or Q8_0)")
    call = _batched_call("down_rows_axpy", qtype, int(rows), int(cols))
    return call(jnp.asarray(h, jnp.float32), rows_data, _mask("down_rows_axpy", mask))


def down_rows_gather_axpy(h: jax.Array, rows_data: jax.Array, index: jax.Array, *, qtype: GGMLQuantizationType,
                          rows: int, cols: int, segment: int = 0) -> jax.Array:
    """gather_axpy for a Q4_0/Q8_0 W_t given as `jaxinfer.quant.pack_down_rows(W_t).data`: sum over i of h[..., i]
    W_t[index[i]] for h f32 [..., k], index int [k] (entries outside [0, rows) are skipped, entries outside int32
    raise), with down_rows_axpy's arithmetic over the named rows in the index's order: only the rows of entries whose
    h is nonzero are read (a mixture's routed experts' neurons, expert_products.ranges_axpy). With `segment`, the
    entries are taken `segment` at a time, a group of neurons never spanning two (an expert's rounding its own)."""
    qtype = GGMLQuantizationType(qtype)
    if qtype not in DOWN_ROWS_TYPES:
        raise ValueError(f"cpu_ext.down_rows_gather_axpy: unsupported type {qtype.name} (Q4_0 or Q8_0)")
    call = _batched_call("down_rows_gather_axpy", qtype, int(rows), int(cols), segment=int(segment))
    return call(jnp.asarray(h, jnp.float32), rows_data, _index("down_rows_gather_axpy", index))


def down_rows_axpy_reference(h, scales, values, mask) -> jax.Array:
    """down_rows_axpy's arithmetic in plain jnp, for one token h [rows]: W_t given as its block scales f32 [rows,
    cols / 32] and its values q - offset, int32 [rows, cols]. The nonzero active neurons in order, in groups of
    DOWN_GROUP; per group and block the coefficients g = h d rounded to 8 bits over the group (scale max |g| / 127),
    dotted with q in integers, times the scale, the groups added in order. Equal to the kernel up to the f32
    rounding of its sums over threads."""
    h, mask = np.asarray(h, np.float32), np.asarray(mask)
    scales, values = jnp.asarray(scales, jnp.float32), jnp.asarray(values, jnp.int32)
    active = np.flatnonzero(mask & (h != 0))
    y = jnp.zeros(values.shape[1], jnp.float32)
    for begin in range(0, len(active), DOWN_GROUP):
        group = active[begin:begin + DOWN_GROUP]
        g = jnp.asarray(h[group])[:, None] * scales[group]  # [n, blocks]
        amax = jnp.max(jnp.abs(g), axis=0)
        inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0).astype(jnp.float32)
        g8 = jnp.round(g * inv).astype(jnp.int32)
        isum = jnp.einsum("nb,nbj->bj", g8, values[group].reshape(len(group), -1, 32))
        y = y + ((amax / 127.0).astype(jnp.float32)[:, None] * isum.astype(jnp.float32)).reshape(-1)
    return y


def down_rows_gather_axpy_reference(h, scales, values, index, segment: int = 0) -> jax.Array:
    """down_rows_gather_axpy's arithmetic in plain jnp, for one token h [k]: down_rows_axpy_reference over the rows
    `index` names (scales and values as there), in the index's order, its out-of-range entries left out, segment by
    segment."""
    index, h = np.asarray(index), np.asarray(h)
    valid = (index >= 0) & (index < np.shape(scales)[0])
    rows = np.where(valid, index, 0)
    segment = segment or len(index)
    parts = [down_rows_axpy_reference(h[s:s + segment], jnp.asarray(scales)[rows[s:s + segment]],
                                      jnp.asarray(values)[rows[s:s + segment]], valid[s:s + segment])
             for s in range(0, len(index), segment)]
    return sum(parts[1:], parts[0])


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, layer, start, row=0,
                     window: int = 0, softcap: float = 0.0) -> jax.Array:
    """Causal GQA attention of q [B, T, H, hd], row b at positions start[b] .. start[b]+T-1 (start int32 [B], or
    one scalar for every row), against layer `layer` of the KV caches [n_layer, R, S, H_kv, hd] (query row b reads
    cache row row + b), row b filled up to start[b]+T-1 -> f32 [B, T, H, hd]. With `window` > 0 (static) a query at
    position p sees positions p - window + 1 .. p only (a sliding-window layer); with `softcap` > 0 (static) the
    scores are soft-capped, softcap * tanh(score / softcap) (Gemma 2). Reads only the keys each row's queries see,
    in place. A layer, rows or positions outside the cache raise, as does a start that is neither a scalar nor one
    per row."""
    out = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    start = jnp.asarray(start, jnp.int32)
    if start.ndim == 0:
        start = jnp.broadcast_to(start, q.shape[:1])
    return jax.ffi.ffi_call("jaxinfer_cached_attention", out)(
        jnp.asarray(q, jnp.float32), k_cache, v_cache, jnp.asarray(layer, jnp.int32), start,
        jnp.asarray(row, jnp.int32), window=np.int64(window), softcap=np.float32(softcap))


def cached_attention_reference(q, k_cache, v_cache, layer, start, row=0, window: int = 0,
                               softcap: float = 0.0) -> jax.Array:
    """Causal GQA softmax attention in plain jnp, one piece (as jaxinfer.model.attend), over that layer's keys (query
    row b against cache row row + b) at positions <= each query's (row b's queries at start[b] .. start[b]+T-1;
    start [B] or a scalar), and with `window` > 0 more than window - 1 before it, the scores soft-capped where
    `softcap` > 0; query head j uses KV head j // (H / H_kv)."""
    b, t, h, hd = q.shape
    k, v = jnp.asarray(k_cache)[layer, row:row + b], jnp.asarray(v_cache)[layer, row:row + b]
    n_kv = k.shape[2]
    scores = jnp.einsum("btkgd,bskd->bkgts", jnp.asarray(q, jnp.float32).reshape(b, t, n_kv, h // n_kv, hd), k)
    q_pos = jnp.broadcast_to(jnp.asarray(start), (b,))[:, None] + jnp.arange(t)  # [B, T]
    k_pos = jnp.arange(k.shape[1])
    causal = k_pos <= q_pos[..., None]  # [B, T, S]
    if window > 0:
        causal &= k_pos > q_pos[..., None] - window
    causal = causal[:, None, None]  # [B, 1, 1, T, S]
    scores = scores / jnp.sqrt(jnp.float32(hd))
    if softcap > 0:
        scores = softcap * jnp.tanh(scores / softcap)
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, hd)

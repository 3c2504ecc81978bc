"""cpu_ext.neuron_major_axpy (the sparse down projection of a Q4_0/Q4_1/Q8_0 weight packed by quant.pack_neuron_major)
against its plain-jnp reference and against the dense kernel on the masked h, on every instruction set this CPU
runs, under jit and vmap; bad inputs raise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import cpu_ext
from jaxinfer import quant
from jaxinfer.synthetic import encode_tensor

from test_cpu_ext import REL_ERROR, rel_error

# (d outputs, n_ff neurons): one tile and one block, several of each, SmolLM2's FFN.
SHAPES = [(64, 32), (192, 96), (576, 1536)]
# The dense kernel on where(mask, h, 0) quantizes h the same way and adds the same integer block sums: only the
# order of the float additions differs (measured <= 4e-7 relative to the largest output).
DENSE_AGREEMENT = 1e-5


def packed_weight(qtype, d, n_ff, rng, span=None) -> tuple[quant.QuantArray, quant.QuantArray]:
    """(W [d, n_ff] in GGUF's layout, its neuron-major packing in spans of `span` outputs)."""
    w = quant.QuantArray(jnp.asarray(encode_tensor(rng.normal(size=(d, n_ff)).astype(np.float32), qtype, rng)),
                         qtype, (d, n_ff))
    return w, quant.pack_neuron_major(w, span)


def run(h, packed: quant.QuantArray, mask, span=None):
    n_ff, d = packed.shape
    return cpu_ext.neuron_major_axpy(h, packed.data, mask, qtype=packed.qtype, rows=n_ff, cols=d,
                                     span=span or quant.neuron_span(d, packed.qtype))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_matches_reference_and_dense_kernel(qtype, isa):
    """Spans of one tile, of several, and of all the outputs (each neuron's q one run)."""
    rng = np.random.default_rng(int(qtype))
    for (d, n_ff), span in [(shape, span) for shape in SHAPES for span in (64, shape[0])] + [((576, 1536), 192)]:
        w, packed = packed_weight(qtype, d, n_ff, rng, span)
        for batch in (1, 3):
            h = rng.normal(size=(batch, n_ff)).astype(np.float32)
            mask = rng.random((batch, n_ff)) < 0.5
            y = run(h, packed, mask, span)
            y_ref = cpu_ext.masked_axpy_reference(h, quant.dequantize_neuron_major(packed, span), mask)
            assert y.shape == (batch, d) and y.dtype == jnp.float32
            masked = np.where(mask, h, 0).astype(np.float32)
            assert rel_error(y, y_ref, masked, quant.dequantize(w)) < REL_ERROR[qtype], (d, n_ff, span, batch)
            dense = cpu_ext.quantized_matmul(masked, w.data, qtype=qtype, rows=d, cols=n_ff)
            np.testing.assert_allclose(y, dense, rtol=0, atol=DENSE_AGREEMENT * float(jnp.abs(dense).max()))


def test_edge_masks_and_token_independence(isa):
    """No active neuron: exact zeros. Every neuron: the dense kernel's product. A token gets the same bits alone
    as in a batch."""
    rng = np.random.default_rng(3)
    d, n_ff = 192, 96
    w, packed = packed_weight(Q.Q4_1, d, n_ff, rng)
    h = rng.normal(size=(4, n_ff)).astype(np.float32)
    np.testing.assert_array_equal(run(h, packed, np.zeros((4, n_ff), bool)), 0.0)
    every = run(h, packed, np.ones((4, n_ff), bool))
    dense = cpu_ext.quantized_matmul(h, w.data, qtype=Q.Q4_1, rows=d, cols=n_ff)
    np.testing.assert_allclose(every, dense, rtol=0, atol=DENSE_AGREEMENT * float(jnp.abs(dense).max()))
    mask = rng.random((4, n_ff)) < 0.3
    batched = np.asarray(run(h, packed, mask))
    for t in range(4):
        np.testing.assert_array_equal(np.asarray(run(h[t], packed, mask[t])), batched[t])


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_isas_agree(qtype):
    """The VBMI kernel and the portable one compute the same integer sums; their floats differ in rounding only."""
    rng = np.random.default_rng(4)
    _, packed = packed_weight(qtype, 576, 1536, rng)
    h = rng.normal(size=(2, 1536)).astype(np.float32)
    mask = rng.random((2, 1536)) < 0.5
    cpu_ext.select_isa("scalar")
    try:
        portable = np.asarray(run(h, packed, mask))
    finally:
        cpu_ext.select_isa("best")
    np.testing.assert_allclose(run(h, packed, mask), portable, rtol=0, atol=1e-6 * np.abs(portable).max())


def test_jit_vmap_and_leading_dims():
    rng = np.random.default_rng(5)
    d, n_ff = 64, 64
    packs = [packed_weight(Q.Q4_1, d, n_ff, rng)[1] for _ in range(2)]
    data = jnp.stack([p.data for p in packs])
    kw = dict(qtype=Q.Q4_1, rows=n_ff, cols=d, span=quant.neuron_span(d, Q.Q4_1))
    h = rng.normal(size=(2, 3, n_ff)).astype(np.float32)
    mask = rng.random((2, 3, n_ff)) < 0.5

    def f(h, data, mask):
        return cpu_ext.neuron_major_axpy(h, data, mask, **kw)

    for in_axes in [(0, None, 0), (0, None, None), (None, None, 0), (0, 0, 0), (None, 0, None)]:
        args = [v if axis == 0 else v[0] for v, axis in zip((h, data, mask), in_axes)]
        y = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
        for i in range(2):
            h_i, data_i, mask_i = (v[i] if axis == 0 else v for v, axis in zip(args, in_axes))
            np.testing.assert_allclose(y[i], f(h_i, data_i, mask_i), rtol=1e-6, atol=1e-6)
    y = jax.jit(f)(h, data[0], mask)  # two leading dims
    assert y.shape == (2, 3, d)
    np.testing.assert_allclose(y, f(h.reshape(6, n_ff), data[0], mask.reshape(6, n_ff)).reshape(2, 3, d), rtol=1e-6)


@pytest.mark.parametrize(
    "case, match",
    [
        ("packed_shape", r"packed weight must be uint8 \[2, 1280\]"),
        ("cols", "a positive multiple of 64"),
        ("h_rows", r"h must be \[\.\.\., 64\]"),
        ("mask_rows", "mask must have the shape of h"),
        ("type", "unsupported GGML type 12"),
        ("span", "span=96 must be a positive multiple of 64 dividing cols=128"),
    ],
)
def test_bad_input_raises(case, match):
    _, packed = packed_weight(Q.Q4_1, 64, 64, np.random.default_rng(6))
    data, h, mask, rows, cols, qtype = packed.data, np.ones((2, 64), np.float32), np.ones((2, 64), bool), 64, 64, Q.Q4_1
    span = 64  # quant.neuron_span's for these rows
    if case == "packed_shape":
        data = data[:, :-1]
    elif case == "cols":
        cols = 32
    elif case == "h_rows":
        h = np.ones((2, 63), np.float32)
    elif case == "mask_rows":
        mask = np.ones((2, 65), bool)
    elif case == "span":
        data, cols, span = packed_weight(Q.Q4_1, 128, 64, np.random.default_rng(6))[1].data, 128, 96
    if case == "type":  # past the Python check: the handler's own
        attrs = dict(qtype=np.int64(int(Q.Q4_K)), rows=np.int64(rows), cols=np.int64(cols), span=np.int64(64))
        call = jax.ffi.ffi_call("jaxinfer_neuron_major_axpy", jax.ShapeDtypeStruct((2, cols), jnp.float32))
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(call(h, data, mask, **attrs))
        return
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(cpu_ext.neuron_major_axpy(h, data, mask, qtype=qtype, rows=rows, cols=cols, span=span))


def test_python_checks_raise():
    with pytest.raises(ValueError, match="unsupported type Q4_K"):
        cpu_ext.neuron_major_axpy(np.ones((1, 32), np.float32), np.zeros((1, 64), np.uint8), np.ones((1, 32), bool),
                                  qtype=Q.Q4_K, rows=32, cols=64, span=64)
    with pytest.raises(ValueError, match="mask must be bool"):
        cpu_ext.neuron_major_axpy(np.ones((1, 32), np.float32), np.zeros((1, 1280), np.uint8),
                                  np.ones((1, 32), np.int8), qtype=Q.Q4_1, rows=32, cols=64, span=64)


def test_fast_kernel_is_reported(isa):
    """AVX2 and AVX-512 (with VBMI or not) have a SIMD kernel for it; only the portable kernels are slow."""
    assert cpu_ext.fast_neuron_major() == (isa != "scalar")

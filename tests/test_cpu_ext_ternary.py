"""cpu_ext's ternary kernels (cpu_ext/ternary.h): TQ1_0, TQ2_0 and I2_S against the jnp reference on every instruction
set this CPU runs, every set giving the portable kernels' bits; the row-sparse kernels skip the rows they do not
need; quant.matmul routes ternary weights to them; the exact I2_S transpose of a down projection."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import cpu_ext
from jaxinfer import quant, ternary
from jaxinfer.synthetic import encode_tensor
from test_cpu_ext import poisoned

TYPES = [Q.TQ1_0, Q.TQ2_0, ternary.I2_S]
# Relative error against x · Wᵀ with the reference's activations (f32 for TQ1_0/TQ2_0, absmax_int8's for I2_S),
# measured over the cases below: TQ1_0/TQ2_0 against Q8_K activations 2.3e-3 .. 8.5e-3 (the K-quants' 8-bit
# rounding), up to 2.3e-2 on a single-value output; I2_S, the same int8 values in integers, <= 5.7e-7.
REL_ERROR = {Q.TQ1_0: 4e-2, Q.TQ2_0: 4e-2, ternary.I2_S: 2e-6}
# The axpys over rows (transposed down projections): TQ1_0/TQ2_0 in f32 as the reference, measured <= 3e-7; I2_S
# rounds each panel's h to int8 (cpu_ext/ternary.h, quantize_coefs), measured <= 4e-3.
AXPY_REL_ERROR = {Q.TQ1_0: 1e-5, Q.TQ2_0: 1e-5, ternary.I2_S: 1e-2}
SHAPES = [(1, 256), (5, 512), (67, 1536)]  # one row, odd row counts, more 16-row bands than threads
BATCHES = [1, 3, 9]  # single dots, the four-token kernels and the rest


def ternary_weight(qtype, rows, cols, rng, random_bytes=False) -> quant.QuantArray:
    """Ternary values times a scale per row (TQ: a block scale each; I2_S: one scale), or for TQ1_0/TQ2_0 random
    bytes with sane scales (TQ2_0's code 3, value 2, included)."""
    if random_bytes:
        type_size = {Q.TQ1_0: 54, Q.TQ2_0: 66}[qtype]
        blocks = rng.integers(0, 256, (rows, cols // 256, type_size), np.uint8)
        blocks[..., -2:] = np.full(blocks.shape[:-1], 0.25, np.float16)[..., None].view(np.uint8)
        return quant.from_gguf_data(blocks.reshape(rows, -1), qtype, (rows, cols))
    values = (rng.integers(-1, 2, (rows, cols)) * rng.uniform(0.5, 1.5, (rows, 1))).astype(np.float32)
    if qtype == ternary.I2_S:
        values = (rng.integers(-1, 2, (rows, cols)) * 0.3).astype(np.float32)
    data = encode_tensor(values, qtype, rng)
    return quant.from_gguf_data(data.reshape(-1) if qtype == ternary.I2_S else data, qtype, (rows, cols))


def reference(x, w):
    x = ternary.absmax_int8(jnp.asarray(x)) if w.qtype == ternary.I2_S else jnp.asarray(x)
    return np.asarray(x @ quant.dequantize(w).T)


def product(x, w):
    return np.asarray(cpu_ext.quantized_matmul(x, w.data, qtype=w.qtype, rows=w.shape[0], cols=w.shape[1])) * w.scale


def rel_error(y, y_ref, x, w):
    """||y - y_ref|| over the typical size of an output, ||x|| ||W|| / sqrt(cols), as test_cpu_ext's."""
    values = np.asarray(quant.dequantize(w))
    return float(np.linalg.norm(y - y_ref) / (np.linalg.norm(x) * np.linalg.norm(values) / np.sqrt(x.shape[-1])))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_matches_reference_with_the_portable_kernels_bits(qtype, isa):
    rng = np.random.default_rng(int(qtype))
    cases = [(w, False) for w in (ternary_weight(qtype, r, c, rng) for r, c in SHAPES)]
    if qtype != ternary.I2_S:
        cases.append((ternary_weight(qtype, 19, 768, rng, random_bytes=True), True))
    for w, _ in cases:
        for batch in BATCHES:
            x = rng.normal(size=(batch, w.shape[1])).astype(np.float32)
            y = product(x, w)
            error = rel_error(y, reference(x, w), x, w)
            assert error < REL_ERROR[qtype], (qtype.name, w.shape, batch, error)
            cpu_ext.select_isa("scalar")
            np.testing.assert_array_equal(y, product(x, w))
            cpu_ext.select_isa(isa)
            alone = product(x[-1:], w)  # a token's bits do not depend on its batch (four-token kernels)
            np.testing.assert_array_equal(y[-1:], alone)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_row_sparse_kernels_read_only_the_rows_they_need(qtype, isa):
    """masked_matmul (and its group form) on a weight whose other rows are garbage: the dense kernel's bits where
    the mask is set, exact zeros elsewhere; masked_axpy over rows (transposed down projections) matches the f32
    reference (I2_S: to its int8 coefficients' rounding, the portable kernel's bits)."""
    rng = np.random.default_rng(50 + int(qtype))
    rows, cols = 37, 512
    w = ternary_weight(qtype, rows, cols, rng)
    x = rng.normal(size=(3, cols)).astype(np.float32)
    mask = rng.random((3, rows)) < 0.5
    garbage = poisoned(np.asarray(w.data), np.flatnonzero(mask.any(0)))
    kw = dict(qtype=qtype, rows=rows, cols=cols)
    dense = np.asarray(cpu_ext.quantized_matmul(x, w.data, **kw))
    masked = np.asarray(cpu_ext.masked_matmul(x, garbage, mask, **kw))
    np.testing.assert_array_equal(masked, np.where(mask, dense, 0.0))
    group = cpu_ext.masked_matmul_group(x, [garbage, garbage], mask, **kw)
    for y in group:
        np.testing.assert_array_equal(np.asarray(y), masked)
    h = rng.normal(size=(3, rows)).astype(np.float32)
    axpy = np.asarray(cpu_ext.masked_axpy(h, garbage, mask, **kw))
    expected = np.where(mask, h, 0.0) @ np.asarray(quant.dequantize(dataclasses.replace(w, scale=1.0)))
    assert rel_error(axpy, expected, np.where(mask, h, 0.0), dataclasses.replace(w, scale=1.0)) < AXPY_REL_ERROR[qtype]
    if qtype == ternary.I2_S:
        cpu_ext.select_isa("scalar")
        np.testing.assert_array_equal(axpy, np.asarray(cpu_ext.masked_axpy(h, garbage, mask, **kw)))


@pytest.mark.slow
def test_quant_routes_ternary_weights_to_the_kernels_at_any_token_count():
    """products("cpu_ext"): the kernels, beyond CPU_KERNEL_MAX_TOKENS too, times the tensor's scale; exact weights
    and I2_S rows that are not a multiple of 256 values go to XLA (with BitNet's int8 activations for I2_S)."""
    rng = np.random.default_rng(3)
    for qtype in TYPES:
        w = ternary_weight(qtype, 8, 512, rng)
        w = dataclasses.replace(w, scale=w.scale * 0.5)
        x = jnp.asarray(rng.normal(size=(quant.CPU_KERNEL_MAX_TOKENS + 3, 512)).astype(np.float32))
        with quant.products("cpu_ext"):
            fast = np.asarray(quant.matmul(x, w))
            exact = np.asarray(quant.matmul(x, dataclasses.replace(w, exact=True)))
        np.testing.assert_array_equal(fast, product(x, dataclasses.replace(w, scale=1.0)) * np.float32(w.scale))
        np.testing.assert_allclose(exact, np.asarray(x @ quant.dequantize(w).T), rtol=1e-5, atol=1e-5)
    odd = ternary_weight(ternary.I2_S, 8, 384, rng)
    x = jnp.asarray(rng.normal(size=(2, 384)).astype(np.float32))
    with quant.products("cpu_ext"):
        assert quant._kernels(x, odd) is None
        np.testing.assert_allclose(np.asarray(quant.matmul(x, odd)), reference(x, odd), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_a_ternary_down_projection_transposes_exactly_to_i2_s(qtype):
    rng = np.random.default_rng(9)
    values = (rng.integers(-1, 2, (256, 512)) * 0.75).astype(np.float32)
    data = encode_tensor(values, qtype, rng)
    w = quant.from_gguf_data(data.reshape(-1) if qtype == ternary.I2_S else data, qtype, (256, 512))
    w_t = quant.transpose_ternary(dataclasses.replace(w, scale=w.scale * 2.0))
    assert (w_t.qtype, w_t.shape) == (ternary.I2_S, (512, 256))
    np.testing.assert_array_equal(np.asarray(quant.dequantize(w_t)), 2.0 * np.asarray(quant.dequantize(w)).T)
    if qtype != ternary.I2_S:  # block scales that differ are no I2_S tensor
        assert quant.transpose_ternary(ternary_weight(qtype, 256, 512, rng)) is None
    assert quant.transpose_ternary(quant.from_gguf_data(data[:128] if qtype != ternary.I2_S else
                                                        encode_tensor(values[:128], qtype, rng), qtype,
                                                        (128, 512))) is None  # 128 outputs: no I2_S kernel rows

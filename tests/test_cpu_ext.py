"""cpu_ext kernels against the plain-jnp reference (dequantize, then x @ W.T), for every weight type, every
instruction set this CPU runs, several shapes and batch sizes, under jit and vmap; bad inputs raise."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

import cpu_ext
from jaxinfer import quant
from jaxinfer.synthetic import encode_tensor

# Bounds on the relative error (see rel_error), with x and W random normal (K-quants: random blocks). Block types
# quantize x to 8 bits per 32 values: measured over 3 seeds, 5.8e-3 .. 6.7e-3 on outputs of >= 64 values for every
# type, up to 1.3e-2 (Q4_0) on single-value outputs. F16/F32 weights multiply x unquantized, in f32 in another
# summation order: measured <= 5.1e-7.
REL_ERROR = {Q.Q4_0: 2e-2, Q.Q4_1: 2e-2, Q.Q8_0: 2e-2, Q.Q4_K: 2e-2, Q.Q6_K: 2e-2, Q.F16: 1e-6, Q.F32: 1e-6}
# (rows, cols): one row, odd row counts, more 16-row bands than threads; cols like SmolLM2's 576 and 1536.
SHAPES = {32: [(1, 256), (5, 576), (67, 1536)], 256: [(1, 256), (5, 512), (67, 1536)], 1: [(3, 40), (67, 576)]}
BATCHES = [1, 2, 7, 64]


def available_isas():
    isas = []
    for isa in ("scalar", "avx2", "avx512"):
        try:
            cpu_ext.select_isa(isa)
            isas.append(isa)
        except ValueError:
            pass
    cpu_ext.select_isa("best")
    return isas


@pytest.fixture(params=available_isas())
def isa(request):
    cpu_ext.select_isa(request.param)
    yield request.param
    cpu_ext.select_isa("best")


def random_weight(qtype, rows, cols, rng):
    return encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), qtype, rng)


def rel_error(y, y_ref, x, w):
    """||y - y_ref|| over the typical size of an output, ||x|| ||W|| / sqrt(cols) (= ||y_ref|| for random x and W;
    unlike ||y_ref|| itself it does not shrink when a one-element output happens to be near zero)."""
    scale = jnp.linalg.norm(x) * jnp.linalg.norm(w) / np.sqrt(x.shape[-1])
    return float(jnp.linalg.norm(y - y_ref) / scale)


def check(x, data, qtype, rows, cols, y):
    """Compare y with the reference product; returns the relative error."""
    w = quant.dequantize(quant.QuantArray(jnp.asarray(data), qtype, (rows, cols)))
    y_ref = cpu_ext.quantized_matmul_reference(x, data, qtype=qtype, rows=rows, cols=cols)
    assert y.shape == y_ref.shape and y.dtype == jnp.float32
    error = rel_error(y, y_ref, x, w)
    assert error < REL_ERROR[qtype], (qtype.name, x.shape, rows, cols, error)
    return error


@pytest.mark.parametrize("qtype", sorted(REL_ERROR, key=int), ids=lambda q: q.name)
def test_matches_reference(qtype, isa):
    rng = np.random.default_rng(int(qtype))
    for rows, cols in SHAPES[GGML_QUANT_SIZES[qtype][0]]:
        data = random_weight(qtype, rows, cols, rng)
        for batch in BATCHES:
            x = rng.normal(size=(batch, cols)).astype(np.float32)
            check(x, data, qtype, rows, cols, cpu_ext.quantized_matmul(x, data, qtype=qtype, rows=rows, cols=cols))


def test_jit_and_leading_dims():
    rng = np.random.default_rng(0)
    data = random_weight(Q.Q4_1, 48, 576, rng)
    x = rng.normal(size=(2, 3, 576)).astype(np.float32)
    f = jax.jit(lambda x, data: cpu_ext.quantized_matmul(x, data, qtype=Q.Q4_1, rows=48, cols=576))
    check(x, data, Q.Q4_1, 48, 576, f(x, data))


def test_vmap_over_x_weights_and_both():
    rng = np.random.default_rng(1)
    rows, cols = 40, 256
    data = np.stack([random_weight(Q.Q8_0, rows, cols, rng) for _ in range(3)])
    x = rng.normal(size=(3, 5, cols)).astype(np.float32)

    def f(x, data):
        return cpu_ext.quantized_matmul(x, data, qtype=Q.Q8_0, rows=rows, cols=cols)

    for in_axes in [(0, None), (None, 0), (0, 0)]:
        y = jax.jit(jax.vmap(f, in_axes=in_axes))(x if in_axes[0] == 0 else x[0], data if in_axes[1] == 0 else data[0])
        assert y.shape == (3, 5, rows)
        for i in range(3):
            check(x[i if in_axes[0] == 0 else 0], data[i if in_axes[1] == 0 else 0], Q.Q8_0, rows, cols, y[i])
    nested = jax.vmap(jax.vmap(f, in_axes=(0, None)), in_axes=(0, None))(x[:, :, None], data[0])
    check(x[:, :, None], data[0], Q.Q8_0, rows, cols, nested)


def test_quant_matmul_uses_kernels_on_cpu_unless_exact():
    rng = np.random.default_rng(2)
    w = quant.from_gguf_data(random_weight(Q.Q4_1, 8, 64, rng), Q.Q4_1, (8, 64))
    x = jnp.asarray(rng.normal(size=(2, 64)).astype(np.float32))
    exact = x @ quant.dequantize(w).T
    fast = quant.matmul(x, w)
    assert not np.allclose(fast, exact, rtol=1e-5, atol=1e-5)  # the 8-bit activation path ran
    check(x, w.data, Q.Q4_1, 8, 64, fast)
    exact_w = dataclasses.replace(w, exact=True)
    np.testing.assert_allclose(jax.jit(quant.matmul)(x, exact_w), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "case, match",
    [
        ("byte_count", "weight must be"),
        ("rows", "weight must be"),
        ("cols", "must be a positive multiple"),
        ("x_cols", r"x must be \[\.\.\., 64\]"),
        ("dtype", "weight must be"),
    ],
)
def test_bad_input_raises(case, match):
    rng = np.random.default_rng(3)
    data, x, rows, cols = random_weight(Q.Q4_1, 4, 64, rng), np.ones((1, 64), np.float32), 4, 64
    if case == "byte_count":
        data = data[:, :-1]
    elif case == "rows":
        rows = 5
    elif case == "cols":
        x, cols = np.ones((1, 48), np.float32), 48
    elif case == "x_cols":
        x = np.ones((1, 32), np.float32)
    elif case == "dtype":
        data = data.view(np.int8)
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(cpu_ext.quantized_matmul(x, data, qtype=Q.Q4_1, rows=rows, cols=cols))


def test_unsupported_type_raises():
    with pytest.raises(ValueError, match="unsupported type Q5_0"):
        cpu_ext.quantized_matmul(np.ones((1, 32), np.float32), np.zeros((1, 22), np.uint8), qtype=Q.Q5_0, rows=1,
                                 cols=32)

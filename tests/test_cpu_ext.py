"""cpu_ext kernels against the plain-jnp reference (dequantize, then x @ W.T), for every weight type, every
instruction set this CPU runs, several shapes and batch sizes, under jit and vmap; bad inputs raise."""

import dataclasses
import functools

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
REL_ERROR = {Q.Q4_0: 2e-2, Q.Q4_1: 2e-2, Q.Q5_0: 2e-2, Q.Q5_1: 2e-2, Q.Q8_0: 2e-2, Q.Q2_K: 2e-2, Q.Q3_K: 2e-2,
             Q.Q4_K: 2e-2, Q.Q5_K: 2e-2, Q.Q6_K: 2e-2, Q.IQ4_NL: 2e-2, Q.IQ4_XS: 2e-2, Q.F16: 1e-6, Q.F32: 1e-6}
# (rows, cols): one row, odd row counts, more 16-row bands than threads; cols like SmolLM2's 576 and 1536.
SHAPES = {32: [(1, 256), (5, 576), (67, 1536)], 256: [(1, 256), (5, 512), (67, 1536)], 1: [(3, 40), (67, 576)]}
BATCHES = [1, 2, 7, 64]


def random_weight(qtype, rows, cols, rng):
    return encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), qtype, rng)


@functools.partial(jax.jit, static_argnames=("qtype", "rows", "cols"))
def dequantized(data, qtype, rows, cols):
    """Jitted: one program per shape, not dozens of operations compiled one by one (and kept: memory)."""
    return quant.dequantize(quant.QuantArray(data, qtype, (rows, cols)))


def rel_error(y, y_ref, x, w):
    """||y - y_ref|| over the typical size of an output, ||x|| ||W|| / sqrt(cols) (= ||y_ref|| for random x and W;
    unlike ||y_ref|| itself it does not shrink when a one-element output happens to be near zero)."""
    y, y_ref, x, w = (np.asarray(a, np.float64) for a in (y, y_ref, x, w))
    scale = np.linalg.norm(x) * np.linalg.norm(w) / np.sqrt(x.shape[-1])
    return float(np.linalg.norm(y - y_ref) / scale)


def check(x, data, qtype, rows, cols, y):
    """Compare y with the reference product; returns the relative error."""
    w = dequantized(data, qtype, rows, cols)
    y_ref = jax.jit(cpu_ext.quantized_matmul_reference)(x, w)
    assert y.shape == y_ref.shape and y.dtype == jnp.float32
    error = rel_error(y, y_ref, x, w)
    assert error < REL_ERROR[qtype], (qtype.name, x.shape, rows, cols, error)
    return error


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS], ids=lambda q: q.name)
def test_k_quant_kernels_give_the_portable_kernels_bits(qtype, isa):
    """K-quant dots sum each super-block in integers and then apply the same float formula in every kernel set."""
    rng = np.random.default_rng(11)
    rows, cols = SHAPES[256][-1]
    data = random_weight(qtype, rows, cols, rng)
    x = rng.normal(size=(6, cols)).astype(np.float32)
    y = np.asarray(cpu_ext.quantized_matmul(x, data, qtype=qtype, rows=rows, cols=cols))
    cpu_ext.select_isa("scalar")
    portable = np.asarray(cpu_ext.quantized_matmul(x, data, qtype=qtype, rows=rows, cols=cols))
    np.testing.assert_array_equal(y, portable)


@pytest.mark.parametrize("qtype", sorted(REL_ERROR, key=int), ids=lambda q: q.name)
def test_a_token_gets_the_same_bits_in_any_batch(qtype, isa):
    """Tokens in a batch are dotted four at a time (QuantDot4) and the rest one at a time: a token's output must not
    depend on which path or batch it went through."""
    rng = np.random.default_rng(7)
    rows, cols = SHAPES[GGML_QUANT_SIZES[qtype][0]][-1]
    data = random_weight(qtype, rows, cols, rng)
    x = rng.normal(size=(11, cols)).astype(np.float32)
    batched = np.asarray(cpu_ext.quantized_matmul(x, data, qtype=qtype, rows=rows, cols=cols))
    for i in range(len(x)):
        alone = np.asarray(cpu_ext.quantized_matmul(x[i:i + 1], data, qtype=qtype, rows=rows, cols=cols))
        np.testing.assert_array_equal(batched[i], alone[0])


@pytest.mark.slow
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


def test_quant_matmul_uses_kernels_where_the_plan_says_unless_exact():
    """Under products("cpu_ext") (a CPU plan's), quant.matmul runs the kernel; exact weights and the default
    products ("xla") multiply with the dequantized weight."""
    rng = np.random.default_rng(2)
    w = quant.from_gguf_data(random_weight(Q.Q4_1, 8, 64, rng), Q.Q4_1, (8, 64))
    x = jnp.asarray(rng.normal(size=(2, 64)).astype(np.float32))
    exact = x @ quant.dequantize(w).T
    with quant.products("cpu_ext"):
        fast = quant.matmul(x, w)
        exact_w = jax.jit(quant.matmul)(x, dataclasses.replace(w, exact=True))
    assert not np.allclose(fast, exact, rtol=1e-5, atol=1e-5)  # the 8-bit activation path ran
    check(x, w.data, Q.Q4_1, 8, 64, fast)
    np.testing.assert_allclose(exact_w, exact, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(quant.matmul(x, w), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", sorted(REL_ERROR, key=int), ids=lambda q: q.name)
def test_group_gives_the_bits_of_separate_calls(qtype, isa):
    """quantized_matmul_group (one call for q/k/v or gate/up) equals the separate products bit for bit, for weights
    of different row counts and for batches that take the four-token path and the single one."""
    rng = np.random.default_rng(8)
    cols = SHAPES[GGML_QUANT_SIZES[qtype][0]][-1][1]
    rows = [67, 5, 1]
    datas = [random_weight(qtype, r, cols, rng) for r in rows]
    for batch in (1, 6):
        x = rng.normal(size=(batch, cols)).astype(np.float32)
        grouped = jax.jit(lambda x, *d: cpu_ext.quantized_matmul_group(x, list(d), qtype=qtype, rows=rows,
                                                                         cols=cols))(x, *datas)
        for y, data, r in zip(grouped, datas, rows):
            assert y.shape == (batch, r)
            separate = cpu_ext.quantized_matmul(x, data, qtype=qtype, rows=r, cols=cols)
            np.testing.assert_array_equal(np.asarray(y), np.asarray(separate))


def test_group_under_vmap_and_bad_input():
    rng = np.random.default_rng(9)
    rows, cols = [40, 8], 256
    datas = [random_weight(Q.Q8_0, r, cols, rng) for r in rows]
    x = rng.normal(size=(3, 5, cols)).astype(np.float32)

    def f(x, first):
        return cpu_ext.quantized_matmul_group(x, [first, datas[1]], qtype=Q.Q8_0, rows=rows, cols=cols)

    over_x = jax.jit(jax.vmap(f, in_axes=(0, None)))(x, datas[0])
    over_both = jax.jit(jax.vmap(f, in_axes=(0, 0)))(x, np.stack([datas[0]] * 3))
    for i in range(3):
        for y in (over_x, over_both):
            check(x[i], datas[0], Q.Q8_0, rows[0], cols, y[0][i])
            check(x[i], datas[1], Q.Q8_0, rows[1], cols, y[1][i])
    with pytest.raises(Exception, match="weight must be"):  # row counts swapped
        jax.block_until_ready(cpu_ext.quantized_matmul_group(x[0], datas, qtype=Q.Q8_0, rows=rows[::-1], cols=cols))
    with pytest.raises(ValueError, match="2 weights but 1 row counts"):
        cpu_ext.quantized_matmul_group(x[0], datas, qtype=Q.Q8_0, rows=rows[:1], cols=cols)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_masked_group_gives_the_bits_of_separate_masked_calls(qtype, isa):
    """masked_matmul_group (a part's gate and up in one call) equals masked_matmul on each weight bit for bit, for a
    mask per token, none active and every row active, one token and the four-token path, and under vmap."""
    rng = np.random.default_rng(11)
    rows, cols = 70, SHAPES[GGML_QUANT_SIZES[qtype][0]][-1][1]
    datas = [random_weight(qtype, rows, cols, rng) for _ in range(2)]
    kw = dict(qtype=qtype, rows=rows, cols=cols)
    group = jax.jit(lambda x, mask, *d: cpu_ext.masked_matmul_group(x, list(d), mask, **kw))
    for batch in (1, 6):
        x = rng.normal(size=(batch, cols)).astype(np.float32)
        for mask in (rng.random((batch, rows)) < 0.3, np.zeros((batch, rows), bool), np.ones((batch, rows), bool)):
            for y, data in zip(group(x, mask, *datas), datas):
                np.testing.assert_array_equal(np.asarray(y), np.asarray(cpu_ext.masked_matmul(x, data, mask, **kw)))
    x = rng.normal(size=(3, 2, cols)).astype(np.float32)
    mask = rng.random((3, 2, rows)) < 0.5
    over_tokens = jax.jit(jax.vmap(lambda x, mask: cpu_ext.masked_matmul_group(x, datas, mask, **kw)))(x, mask)
    for i in range(3):
        for y, data in zip(over_tokens, datas):
            separate = cpu_ext.masked_matmul(x[i], data, mask[i], **kw)
            np.testing.assert_array_equal(np.asarray(y[i]), np.asarray(separate))
    with pytest.raises(Exception, match="weight must be"):  # a weight of another shape
        jax.block_until_ready(cpu_ext.masked_matmul_group(x[0], [datas[0], datas[1][:5]], mask[0], **kw))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL], ids=lambda q: q.name)
def test_one_token_over_scattered_rows_gives_the_dense_bits(qtype, isa):
    """A decode step's row-sparse products dot their active rows two at a time (RowDot::pair, where the kernels have
    it) while asking for the next ones' lines (where the CPU takes it): the bits of the dense product on every row
    taken, for masks over scattered rows, runs of them (left to the hardware) and every row, with an odd and an even
    count of active rows, on one weight and on gate and up in one call, and for an index and a segmented index."""
    rng = np.random.default_rng(12)
    rows, cols = 300, 576
    kw = dict(qtype=qtype, rows=rows, cols=cols)
    data, other = random_weight(qtype, rows, cols, rng), random_weight(qtype, rows, cols, rng)
    x = rng.normal(size=(1, cols)).astype(np.float32)
    dense = np.asarray(cpu_ext.quantized_matmul(x, data, **kw))
    dense_other = np.asarray(cpu_ext.quantized_matmul(x, other, **kw))
    runs = np.zeros((1, rows), bool)
    runs[0, 10:17] = runs[0, 40:44] = runs[0, 299] = True
    odd = rng.random((1, rows)) < 0.3
    odd[0, np.flatnonzero(odd[0])[0]] ^= odd[0].sum() % 2 == 0  # one row fewer where the count is even
    for mask in (odd, ~odd, runs, np.ones((1, rows), bool)):
        masked = np.asarray(cpu_ext.masked_matmul(x, data, mask, **kw))
        np.testing.assert_array_equal(masked[mask], dense[mask])
        np.testing.assert_array_equal(masked[~mask], 0.0)
        gate, up = (np.asarray(y) for y in cpu_ext.masked_matmul_group(x, [data, other], mask, **kw))
        np.testing.assert_array_equal(gate, masked)
        np.testing.assert_array_equal(up[mask], dense_other[mask])
        np.testing.assert_array_equal(up[~mask], 0.0)
    index = rng.permutation(rows)[:90].astype(np.int32)
    np.testing.assert_array_equal(np.asarray(cpu_ext.gather_matmul(x, data, index, **kw)), dense[:, index])
    tokens = rng.normal(size=(2, cols)).astype(np.float32)
    both = np.asarray(cpu_ext.quantized_matmul(tokens, data, **kw))
    segmented = np.asarray(cpu_ext.gather_matmul(tokens, data, index, segment=45, **kw))
    np.testing.assert_array_equal(segmented[0, :45], both[0, index[:45]])
    np.testing.assert_array_equal(segmented[1, 45:], both[1, index[45:]])


def test_quant_masked_matmuls_groups_only_what_the_kernels_take():
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.normal(size=(2, 64)).astype(np.float32))
    mask = jnp.asarray(rng.random((2, 8)) < 0.5)
    q4 = [quant.from_gguf_data(random_weight(Q.Q4_1, 8, 64, rng), Q.Q4_1, (8, 64)) for _ in range(2)]
    q8 = quant.from_gguf_data(random_weight(Q.Q8_0, 8, 64, rng), Q.Q8_0, (8, 64))
    with quant.products("cpu_ext"):
        for ws in (q4, [q4[0], q8], [dataclasses.replace(w, exact=True) for w in q4]):
            got = jax.jit(quant.masked_matmuls)(x, ws, mask)
            for y, w in zip(got, ws):
                np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(quant.masked_matmul)(x, w, mask)))
        assert not np.allclose(got[0], quant.masked_matmuls(x, q4, mask)[0], rtol=1e-6)  # exact vs the kernel


def test_quant_matmuls_groups_only_what_the_kernels_take():
    """quant.matmuls is [quant.matmul(x, w) ...] whether it groups (same type and cols), mixes types (separate
    calls) or multiplies exactly."""
    rng = np.random.default_rng(10)
    x = jnp.asarray(rng.normal(size=(2, 64)).astype(np.float32))
    q4 = [quant.from_gguf_data(random_weight(Q.Q4_1, r, 64, rng), Q.Q4_1, (r, 64)) for r in (8, 4)]
    q8 = quant.from_gguf_data(random_weight(Q.Q8_0, 6, 64, rng), Q.Q8_0, (6, 64))
    with quant.products("cpu_ext"):
        for ws in (q4, [q4[0], q8], [dataclasses.replace(w, exact=True) for w in q4]):
            got = jax.jit(quant.matmuls)(x, ws)
            for y, w in zip(got, ws):
                np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(quant.matmul)(x, w)))


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


def test_every_type_the_model_sends_to_the_kernels_has_them():
    assert quant.CPU_KERNEL_TYPES <= cpu_ext.SUPPORTED_TYPES
    assert quant.NEURON_MAJOR_TYPES == cpu_ext.NEURON_MAJOR_TYPES  # what quant packs is what the kernel reads


def test_unsupported_type_raises():
    with pytest.raises(ValueError, match="unsupported type IQ2_XXS"):
        cpu_ext.quantized_matmul(np.ones((1, 256), np.float32), np.zeros((1, 66), np.uint8), qtype=Q.IQ2_XXS, rows=1,
                                 cols=256)


# ---- Row-sparse kernels (masked_matmul, gather_matmul, masked_axpy, gather_axpy)

# masked_matmul and gather_matmul use the dense kernel's 8-bit activation path: REL_ERROR (measured over 3 seeds and
# every instruction set on the cases below: <= 9.6e-3, F16/F32 <= 5.2e-7). The axpys keep h in f32 and dequantize each
# row to f32 as the reference does, so only the rounding of the sums differs: measured <= 3.0e-7 for every type.
AXPY_REL_ERROR = 1e-5
# (rows, cols, batch): a one-row weight, odd row counts, more 16-row tasks than threads; batch sizes 1, 3 and 8.
SPARSE_CASES = {
    32: [(1, 64, 3), (37, 576, 1), (67, 256, 8)],
    256: [(1, 256, 3), (37, 512, 1), (67, 256, 8)],
    1: [(1, 40, 3), (37, 72, 1), (67, 576, 8)],
}
SPARSE_STATIC = ("qtype", "rows", "cols")


def sparse_ops(x, h, data, data_masked, data_gathered, mask, index, h_index, *, qtype, rows, cols):
    """All four kernels in one jitted call (one compile per case), each on a weight whose rows it must not read are
    NaN."""
    kw = dict(qtype=qtype, rows=rows, cols=cols)
    return (
        cpu_ext.masked_matmul(x, data_masked, mask, **kw),
        cpu_ext.gather_matmul(x, data_gathered, index, **kw),
        cpu_ext.masked_axpy(h, data_masked, mask, **kw),
        cpu_ext.gather_axpy(h_index, data_gathered, index, **kw),
    )


def sparse_references(x, h, data, data_masked, data_gathered, mask, index, h_index, *, qtype, rows, cols):
    w = dequantized(data, qtype, rows, cols)
    return (
        jax.jit(cpu_ext.masked_matmul_reference)(x, w, mask),
        jax.jit(cpu_ext.gather_matmul_reference)(x, w, index),
        jax.jit(cpu_ext.masked_axpy_reference)(h, w, mask),
        jax.jit(cpu_ext.gather_axpy_reference)(h_index, w, index),
    )


sparse_ops_jit = jax.jit(sparse_ops, static_argnames=SPARSE_STATIC)
sparse_references_jit = jax.jit(sparse_references, static_argnames=SPARSE_STATIC)


def random_index(rows, rng):
    """Unsorted rows with repeats and out-of-range padding (-1, rows, rows + 5)."""
    picked = rng.choice(rows, size=max(1, rows // 2), replace=False)
    index = np.concatenate([picked, picked[: max(1, len(picked) // 3)], [-1, rows, rows + 5]])
    return rng.permutation(index).astype(np.int32)


def poisoned(data, keep_rows):
    """The weight with every row not in keep_rows set to all-ones bytes: NaN scales (block types) or NaN values."""
    out = np.array(data)
    drop = np.setdiff1d(np.arange(out.shape[0]), keep_rows)
    out.view(np.uint8).reshape(out.shape[0], -1)[drop] = 0xFF
    return out


def sparse_case(qtype, rows, cols, batch, rng):
    data = random_weight(qtype, rows, cols, rng)
    mask = rng.random((batch, rows)) < 0.5
    index = random_index(rows, rng)
    return dict(
        x=rng.normal(size=(batch, cols)).astype(np.float32),
        h=rng.normal(size=(batch, rows)).astype(np.float32),
        data=data,
        data_masked=poisoned(data, np.flatnonzero(mask.any(0))),
        data_gathered=poisoned(data, index[(index >= 0) & (index < rows)]),
        mask=mask,
        index=index,
        h_index=rng.normal(size=(batch, len(index))).astype(np.float32),
    )


def check_sparse(case, outputs, references, qtype, rows, cols):
    """Compare the four kernels' outputs with their references; returns the relative errors."""
    index_valid = (case["index"] >= 0) & (case["index"] < rows)
    w = dequantized(case["data"], qtype, rows, cols)
    scales = [  # the typical size of an output, as in rel_error
        (case["x"], w),
        (case["x"], w[np.clip(case["index"], 0, rows - 1)[index_valid]]),
        (np.where(case["mask"], case["h"], 0), w),
        (np.where(index_valid, case["h_index"], 0), w[np.clip(case["index"], 0, rows - 1)]),
    ]
    bounds = [REL_ERROR[qtype]] * 2 + [AXPY_REL_ERROR] * 2
    errors = []
    for name, y, y_ref, (a, b), bound in zip(("masked_matmul", "gather_matmul", "masked_axpy", "gather_axpy"),
                                              outputs, references, scales, bounds):
        assert y.shape == y_ref.shape and y.dtype == jnp.float32, name
        assert np.isfinite(y).all(), f"{name} read a row it had no use for"
        scale = np.linalg.norm(a) * np.linalg.norm(b) / np.sqrt(a.shape[-1])
        errors.append(float(np.linalg.norm(y - y_ref) / scale) if scale > 0 else float(np.abs(y).max(initial=0)))
        assert errors[-1] < bound, (name, qtype.name, rows, cols, case["x"].shape, errors[-1])
    # Outputs outside the mask or the index range are exactly zero.
    np.testing.assert_array_equal(np.asarray(outputs[0])[~case["mask"]], 0.0)
    np.testing.assert_array_equal(np.asarray(outputs[1])[:, ~index_valid], 0.0)
    return errors


@functools.cache
def sparse_cases(qtype):
    """Inputs and reference outputs of every case of `qtype`, computed once for all instruction sets."""
    rng = np.random.default_rng(100 + int(qtype))
    cases = []
    for rows, cols, batch in SPARSE_CASES[GGML_QUANT_SIZES[qtype][0]]:
        case = sparse_case(qtype, rows, cols, batch, rng)
        cases.append((rows, cols, case, sparse_references_jit(**case, qtype=qtype, rows=rows, cols=cols)))
    return cases


@pytest.mark.slow
@pytest.mark.parametrize("qtype", sorted(REL_ERROR, key=int), ids=lambda q: q.name)
def test_sparse_kernels_match_reference(qtype, isa):
    for rows, cols, case, references in sparse_cases(qtype):
        outputs = sparse_ops_jit(**case, qtype=qtype, rows=rows, cols=cols)
        check_sparse(case, outputs, references, qtype, rows, cols)


def test_sparse_edge_sets(isa):
    """Empty and full index sets and masks: exact zeros, and exactly the dense kernel's results."""
    rng = np.random.default_rng(4)
    rows, cols = 40, 256
    kw = dict(qtype=Q.Q4_1, rows=rows, cols=cols)
    data = random_weight(Q.Q4_1, rows, cols, rng)
    x = rng.normal(size=(3, cols)).astype(np.float32)
    h = rng.normal(size=(3, rows)).astype(np.float32)
    none, every = np.zeros((3, rows), bool), np.ones((3, rows), bool)
    empty, all_rows, outside = np.zeros(0, np.int32), np.arange(rows, dtype=np.int32), np.array([-3, rows], np.int32)

    @jax.jit
    def run(x, h, data):
        return dict(
            mm_none=cpu_ext.masked_matmul(x, data, none, **kw),
            mm_every=cpu_ext.masked_matmul(x, data, every, **kw),
            gm_empty=cpu_ext.gather_matmul(x, data, empty, **kw),
            gm_all=cpu_ext.gather_matmul(x, data, all_rows, **kw),
            gm_outside=cpu_ext.gather_matmul(x, data, outside, **kw),
            dense=cpu_ext.quantized_matmul(x, data, **kw),
            ax_none=cpu_ext.masked_axpy(h, data, none, **kw),
            ax_every=cpu_ext.masked_axpy(h, data, every, **kw),
            ga_empty=cpu_ext.gather_axpy(h[:, :0], data, empty, **kw),
            ga_all=cpu_ext.gather_axpy(h, data, all_rows, **kw),
            ga_outside=cpu_ext.gather_axpy(h[:, :2], data, outside, **kw),
        )

    y = jax.tree.map(np.asarray, run(x, h, data))
    for name in ("mm_none", "gm_outside", "ax_none", "ga_empty", "ga_outside"):
        np.testing.assert_array_equal(y[name], np.zeros_like(y[name]), err_msg=name)
    assert y["gm_empty"].shape == (3, 0) and y["ga_empty"].shape == (3, cols)
    np.testing.assert_array_equal(y["mm_every"], y["dense"])
    np.testing.assert_array_equal(y["gm_all"], y["dense"])
    np.testing.assert_array_equal(y["ax_every"], y["ga_all"])  # same rows in the same order
    w = dequantized(data, Q.Q4_1, rows, cols)
    assert rel_error(y["ax_every"], cpu_ext.masked_axpy_reference(h, w, every), h, w) < AXPY_REL_ERROR


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.F16], ids=lambda q: q.name)
def test_segmented_gather_gives_each_token_its_own_rows(qtype, isa):
    """gather_matmul with `segment`: token t takes only its segment's entries (a mixture's down projections, each
    expert with its own hidden values: 3 tokens x 2 row ranges of 40, a padded entry and a repeated row among them),
    to the bit what each token's own gather gives, 0 elsewhere, and the reference's values."""
    rng = np.random.default_rng(12)
    block = 256 if qtype == Q.Q4_K else 32
    rows, cols, segment = 120, 2 * block, 80
    kw = dict(qtype=qtype, rows=rows, cols=cols)
    data = random_weight(qtype, rows, cols, rng)
    x = rng.normal(size=(3, cols)).astype(np.float32)
    index = np.concatenate([np.arange(40, 120), np.arange(0, 80), np.arange(40, 120)]).astype(np.int32)
    index[5], index[200] = -1, index[199]
    got = np.asarray(jax.jit(lambda x, d, i: cpu_ext.gather_matmul(x, d, i, segment=segment, **kw))(x, data, index))
    for t in range(3):
        own = index[t * segment:(t + 1) * segment]
        alone = np.asarray(cpu_ext.gather_matmul(x[t:t + 1], data, own, **kw))[0]
        np.testing.assert_array_equal(got[t, t * segment:(t + 1) * segment], alone)
        np.testing.assert_array_equal(np.delete(got[t], np.s_[t * segment:(t + 1) * segment]), 0.0)
    w = dequantized(data, qtype, rows, cols)
    reference = cpu_ext.gather_matmul_reference(jnp.asarray(x), w, jnp.asarray(index), segment)
    assert rel_error(got, reference, x, w) < REL_ERROR[qtype]
    with pytest.raises(Exception, match="segment must be 0, or the index's entries per token"):
        cpu_ext.gather_matmul(x, data, index[:100], segment=segment, **kw)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.F16], ids=lambda q: q.name)
def test_gather_of_many_tokens_gives_each_token_s_own_bits(qtype, isa):
    """gather_matmul of 4 tokens or more dots them four at a time (two consecutive rows at once where the index runs
    on): to the bit what each token alone gives, for runs of rows, scattered rows, repeats and padding, and 7 tokens
    (a remainder of three)."""
    rng = np.random.default_rng(13)
    block = 256 if qtype == Q.Q4_K else 32
    rows, cols = 150, 2 * block
    kw = dict(qtype=qtype, rows=rows, cols=cols)
    data = random_weight(qtype, rows, cols, rng)
    x = rng.normal(size=(7, cols)).astype(np.float32)
    index = np.concatenate([np.arange(10, 75), rng.permutation(rows)[:40], [3, 3, -1, rows, 149]]).astype(np.int32)
    got = np.asarray(jax.jit(lambda x, d, i: cpu_ext.gather_matmul(x, d, i, **kw))(x, data, index))
    for t in range(7):
        alone = np.asarray(cpu_ext.gather_matmul(x[t:t + 1], data, index, **kw))[0]
        np.testing.assert_array_equal(got[t], alone, err_msg=f"token {t}")


def test_axpy_results_do_not_depend_on_thread_timing():
    """The axpys sum per-task partial results in a fixed order: repeated calls agree to the bit."""
    rng = np.random.default_rng(8)
    rows, cols = 600, 64  # 38 panels of 16 rows, split over the threads
    kw = dict(qtype=Q.Q8_0, rows=rows, cols=cols)
    data = random_weight(Q.Q8_0, rows, cols, rng)
    h = rng.normal(size=(2, rows)).astype(np.float32)
    mask = rng.random((2, rows)) < 0.5
    index = rng.permutation(rows).astype(np.int32)
    f = jax.jit(lambda h, data, mask, index: (cpu_ext.masked_axpy(h, data, mask, **kw),
                                              cpu_ext.gather_axpy(h, data, index, **kw)))
    first = jax.tree.map(np.asarray, f(h, data, mask, index))
    for _ in range(20):
        again = f(h, data, mask, index)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_sparse_jit_vmap_and_leading_dims():
    """vmap over the token args folds into the leading dims (batched or not, mask and x alike); vmap over the index or
    the weights maps the call; leading dims beyond one are taken as they are."""
    rng = np.random.default_rng(5)
    rows, cols, qtype = 24, 64, Q.Q8_0
    kw = dict(qtype=qtype, rows=rows, cols=cols)
    data = np.stack([random_weight(qtype, rows, cols, rng) for _ in range(2)])
    x = rng.normal(size=(2, 3, cols)).astype(np.float32)
    h = rng.normal(size=(2, 3, rows)).astype(np.float32)
    mask = rng.random((2, 3, rows)) < 0.5
    index = np.stack([random_index(rows, rng)[:10] for _ in range(2)])
    hk = rng.normal(size=(2, 3, 10)).astype(np.float32)
    ops = dict(
        masked_matmul=(cpu_ext.masked_matmul, cpu_ext.masked_matmul_reference, x, mask, REL_ERROR[qtype]),
        gather_matmul=(cpu_ext.gather_matmul, cpu_ext.gather_matmul_reference, x, index, REL_ERROR[qtype]),
        masked_axpy=(cpu_ext.masked_axpy, cpu_ext.masked_axpy_reference, h, mask, AXPY_REL_ERROR),
        gather_axpy=(cpu_ext.gather_axpy, cpu_ext.gather_axpy_reference, hk, index, AXPY_REL_ERROR),
    )
    for name, (op, reference, a, b, bound) in ops.items():
        def f(a, data, b):
            return op(a, data, b, **kw)

        # (a, data, b) batched or not; the first slice of an unbatched arg is used for every element.
        for in_axes in [(0, None, 0), (0, None, None), (None, None, 0), (0, 0, 0), (None, 0, None)]:
            args = [v if axis == 0 else v[0] for v, axis in zip((a, data, b), in_axes)]
            y = jax.jit(jax.vmap(f, in_axes=in_axes))(*args)
            for i in range(2):
                a_i, data_i, b_i = (v[i] if axis == 0 else v for v, axis in zip(args, in_axes))
                y_ref = reference(a_i, dequantized(data_i, **kw), b_i)
                assert y[i].shape == y_ref.shape, (name, in_axes)
                scale = float(jnp.linalg.norm(y_ref)) or 1.0
                assert float(jnp.linalg.norm(y[i] - y_ref)) / scale < 5 * bound, (name, in_axes)
        # Two leading dims at once, under jit.
        b = b if name.startswith("masked") else b[0]
        y, y_ref = jax.jit(f)(a, data[0], b), reference(a, dequantized(data[0], **kw), b)
        assert y.shape == y_ref.shape and float(jnp.linalg.norm(y - y_ref) / jnp.linalg.norm(y_ref)) < 5 * bound, name


@pytest.mark.parametrize(
    "op, case, match",
    [
        ("masked_matmul", "byte_count", "weight must be"),
        ("masked_matmul", "x_cols", r"x must be \[\.\.\., 64\]"),
        ("masked_matmul", "mask_rows", "mask must be"),
        ("masked_matmul", "mask_lead", "mask must be"),
        ("gather_matmul", "byte_count", "weight must be"),
        ("gather_matmul", "x_cols", r"x must be \[\.\.\., 64\]"),
        ("masked_axpy", "byte_count", "weight must be"),
        ("masked_axpy", "h_rows", r"h must be \[\.\.\., 4\]"),
        ("masked_axpy", "mask_rows", "mask must have the shape of h"),
        ("gather_axpy", "h_rows", r"h must be \[\.\.\., 2\]"),
        ("gather_axpy", "cols", "must be a positive multiple"),
    ],
)
def test_sparse_bad_input_raises(op, case, match):
    rng = np.random.default_rng(6)
    rows, cols = 4, 64
    data = random_weight(Q.Q4_1, rows, cols, rng)
    x, h, mask, index = np.ones((2, cols), np.float32), np.ones((2, rows), np.float32), np.ones((2, rows), bool), \
        np.array([0, 3], np.int32)
    if case == "byte_count":
        data = data[:, :-1]
    elif case == "x_cols":
        x = np.ones((2, 32), np.float32)
    elif case == "mask_rows":
        mask = np.ones((2, rows + 1), bool)
    elif case == "mask_lead":
        mask = np.ones((3, rows), bool)
    elif case == "h_rows":
        h = np.ones((2, 3), np.float32)
    elif case == "cols":
        cols = 48
    first = x if op.endswith("matmul") else h
    if op == "gather_axpy" and case != "h_rows":
        first = first[:, :2]
    last = mask if op.startswith("masked") else index
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(getattr(cpu_ext, op)(first, data, last, qtype=Q.Q4_1, rows=rows, cols=cols))


@pytest.mark.parametrize("op", ["masked_matmul", "gather_matmul", "masked_axpy", "gather_axpy"])
def test_sparse_python_checks_raise(op):
    x = np.ones((1, 32), np.float32)
    last = np.ones((1, 1), bool) if op.startswith("masked") else np.zeros(1, np.int32)
    with pytest.raises(ValueError, match="unsupported type IQ2_XXS"):
        getattr(cpu_ext, op)(x, np.zeros((1, 66), np.uint8), last, qtype=Q.IQ2_XXS, rows=1, cols=256)
    data = random_weight(Q.Q8_0, 1, 32, np.random.default_rng(7))
    bad = np.ones((1, 1), np.int8) if op.startswith("masked") else np.zeros((1, 1), np.int32)
    with pytest.raises(ValueError, match="mask must be bool" if op.startswith("masked") else "1-D integer array"):
        getattr(cpu_ext, op)(x if op.endswith("matmul") else np.ones((1, 1), np.float32), data, bad,
                             qtype=Q.Q8_0, rows=1, cols=32)


def test_sparse_handler_checks_dtypes():
    """Called past the Python checks, the handlers reject wrong dtypes themselves (an error, not a crash)."""
    data = random_weight(Q.Q8_0, 2, 32, np.random.default_rng(9))
    attrs = dict(qtype=np.int64(int(Q.Q8_0)), rows=np.int64(2), cols=np.int64(32))
    out = jax.ShapeDtypeStruct((1, 2), jnp.float32)
    with pytest.raises(Exception, match="Wrong buffer dtype"):
        jax.block_until_ready(jax.ffi.ffi_call("jaxinfer_masked_matmul", out)(
            np.ones((1, 32), np.float32), data, np.ones((1, 2), np.int8), **attrs))
    with pytest.raises(Exception, match="index must be int32, int64, uint32 or uint64"):
        jax.block_until_ready(jax.ffi.ffi_call("jaxinfer_gather_axpy", jax.ShapeDtypeStruct((1, 32), jnp.float32))(
            np.ones((1, 2), np.float32), data, np.zeros(2, np.float32), **attrs))

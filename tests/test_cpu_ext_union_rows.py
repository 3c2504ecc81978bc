"""Row-sparse products of many tokens (cpu_ext/union_rows.cc): from 16 tokens a call packs the union of its tokens'
active rows eight to a group, in order of how many tokens take them, and runs the repacked kernels where a token
takes a group's row; the same products as the row kernels' (the portable kernels' bits, so bit for bit with the
portable set, to f32 rounding with the SIMD row kernels). Rows few of the tokens take are dotted by the row kernels."""

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import cpu_ext
from jaxinfer import quant
from jaxinfer.synthetic import encode_tensor

PACKED = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.IQ4_NL]
MIN_TOKENS = 16  # cpu_ext's kUnionPackMinTokens


def row_path(x, data, mask, qtype, rows, cols):
    """The same products through the row kernels: calls of fewer tokens than the packed path takes."""
    return np.concatenate([np.asarray(cpu_ext.masked_matmul(x[i:i + 4], data, mask[i:i + 4], qtype=qtype, rows=rows,
                                                            cols=cols)) for i in range(0, len(x), 4)])


@pytest.mark.parametrize("qtype", PACKED, ids=lambda q: q.name)
@pytest.mark.parametrize("rows, m, active", [(203, MIN_TOKENS, 0.3), (64, 37, 0.05), (9, 130, 0.6)])
def test_the_packed_path_gives_the_row_kernels_products(qtype, rows, m, active, isa):
    rng = np.random.default_rng(rows + m)
    cols = 512
    data = encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), qtype, rng)
    x = rng.normal(size=(m, cols)).astype(np.float32)
    mask = rng.random((m, rows)) < active
    mask[:, 3] = False  # a row no token takes: never read
    poisoned = data.copy()
    poisoned[3] = 0xFF  # NaN scales if it were read
    packed = np.asarray(cpu_ext.masked_matmul(x, poisoned, mask, qtype=qtype, rows=rows, cols=cols))
    rows_only = row_path(x, data, mask, qtype, rows, cols)
    if isa == "scalar":  # the repacked kernels give the portable row kernels' bits
        np.testing.assert_array_equal(packed, rows_only)
    else:
        np.testing.assert_allclose(packed, rows_only, rtol=1e-5, atol=1e-5 * np.abs(rows_only).max())
    assert np.all(packed[~mask] == 0)
    gate, up = cpu_ext.masked_matmul_group(x, [poisoned, data], mask, qtype=qtype, rows=rows, cols=cols)
    np.testing.assert_array_equal(np.asarray(gate), packed)
    np.testing.assert_array_equal(np.asarray(up), packed)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda q: q.name)
def test_rows_few_tokens_take_are_skipped_where_no_token_takes_them(qtype, isa):
    """Rows taken by 90% of the tokens down to 0.5% (a ReLU model's hot and cold neurons): the packed path groups rows
    by how many tokens take them and skips a group's dots for four tokens that take none of its rows; over 101 tokens
    (chunks of 80 at 4096 columns, a last token alone) the products are still the row kernels'."""
    rng = np.random.default_rng(7)
    rows, m, cols = 203, 101, 4096
    data = encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), qtype, rng)
    x = rng.normal(size=(m, cols)).astype(np.float32)
    mask = rng.random((m, rows)) < np.geomspace(0.9, 0.005, rows)[rng.permutation(rows)]
    packed = np.asarray(cpu_ext.masked_matmul(x, data, mask, qtype=qtype, rows=rows, cols=cols))
    rows_only = row_path(x, data, mask, qtype, rows, cols)
    if isa == "scalar":
        np.testing.assert_array_equal(packed, rows_only)
    else:
        np.testing.assert_allclose(packed, rows_only, rtol=1e-5, atol=1e-5 * np.abs(rows_only).max())
    assert np.all(packed[~mask] == 0) and np.all(packed[mask] != 0)


@pytest.mark.parametrize("qtype", PACKED, ids=lambda q: q.name)
def test_rows_few_tokens_take_are_dotted_by_the_row_kernels(qtype, isa):
    """A row fewer than an eighth of the call's tokens take is not packed but dotted token by token, four of its
    tokens at a time where the kernel set has that kernel: its products are the row kernels' bits on every kernel
    set, and a row that just makes the cut (an eighth of the tokens) is packed. All rows cold (nothing packed) too."""
    rng = np.random.default_rng(11)
    rows, m, cols = 96, 64, 256
    data = encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), qtype, rng)
    x = rng.normal(size=(m, cols)).astype(np.float32)
    takers = np.concatenate([np.arange(1, 12), np.full(rows - 11, 40)])[rng.permutation(rows)]  # 1..7 cold, 8.. not
    mask = np.zeros((m, rows), bool)
    for row, k in enumerate(takers):
        mask[rng.choice(m, k, replace=False), row] = True
    cold = takers * 8 < m
    assert cold.sum() == 7
    packed = np.asarray(cpu_ext.masked_matmul(x, data, mask, qtype=qtype, rows=rows, cols=cols))
    rows_only = row_path(x, data, mask, qtype, rows, cols)
    np.testing.assert_array_equal(packed[:, cold], rows_only[:, cold])
    np.testing.assert_allclose(packed, rows_only, rtol=1e-5, atol=1e-5 * np.abs(rows_only).max())
    assert np.all(packed[~mask] == 0) and np.all(packed[mask] != 0)
    only_cold = mask & cold
    np.testing.assert_array_equal(
        np.asarray(cpu_ext.masked_matmul(x, data, only_cold, qtype=qtype, rows=rows, cols=cols)),
        np.where(only_cold, rows_only, 0))


def test_masked_products_of_long_chunks_stay_with_the_kernels():
    """Beyond the row kernels' 128 tokens a masked product of a packed type still runs cpu_ext (the union, packed),
    where a dense one in GGUF's rows goes to XLA's GEMM; a K-quant's masked product too."""
    rng = np.random.default_rng(1)
    w = quant.from_gguf_data(encode_tensor(rng.normal(size=(32, 256)).astype(np.float32), Q.Q8_0, rng), Q.Q8_0,
                             (32, 256))
    x = rng.normal(size=(300, 256)).astype(np.float32)
    mask = rng.random((300, 32)) < 0.5
    with quant.products("cpu_ext"):
        text = jax.jit(quant.masked_matmul).lower(x, w, mask).as_text()
        dense = jax.jit(quant.matmul).lower(x, w).as_text()
    assert "jaxinfer_masked_matmul" in text and "jaxinfer_quantized_matmul" not in dense
    assert quant.kernel_token_limit(w, masked=True) is None and quant.kernel_token_limit(w) == 128
    k = quant.QuantArray(w.data, Q.Q4_K, (32, 256))
    assert quant.kernel_token_limit(k, masked=True) == 128


def test_a_sparse_ffn_over_a_prompts_chunk_equals_it_over_small_pieces(make_model):
    """The prefill's choice: a predictor model's FFN over a chunk of 32 tokens (the union of their rows, packed) and
    over pieces of 8 (row by row) are the same products, to f32 rounding."""
    from jaxinfer import engine, sparse_ffn, sparsity

    m = sparsity.apply(engine.load_model(make_model(n_embd=128, n_ff=512, sparsity=0.8, weight_type=Q.Q8_0)),
                       sparsity.SparsitySpec("predictor"))
    layer = m.weights.layers[0]
    rng = np.random.default_rng(3)
    x, ffn_inp = (rng.normal(size=(1, 32, 128)).astype(np.float32) for _ in range(2))

    def ffn(x, ffn_inp):
        with quant.products("cpu_ext"):
            return sparse_ffn.ffn(x, ffn_inp, layer, m.config, trace=False)[0]

    whole = np.asarray(jax.jit(ffn)(x, ffn_inp))
    pieces = np.concatenate([np.asarray(jax.jit(ffn)(x[:, i:i + 8], ffn_inp[:, i:i + 8])) for i in range(0, 32, 8)],
                            axis=1)
    np.testing.assert_allclose(whole, pieces, rtol=1e-5, atol=1e-5 * np.abs(pieces).max())

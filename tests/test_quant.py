import dataclasses

import gguf
import jax
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from jaxinfer import quant, x8_kquants
from jaxinfer.synthetic import encode_tensor

# Scale fields of each block type, as (byte offset, number of fp16 values): random bytes there could be inf/NaN.
F16_FIELDS = {Q.Q8_0: (0, 1), Q.Q4_0: (0, 1), Q.Q4_1: (0, 2), Q.Q5_0: (0, 1), Q.Q5_1: (0, 2), Q.Q2_K: (80, 2),
              Q.Q3_K: (108, 1), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208, 1), Q.IQ4_NL: (0, 1), Q.IQ4_XS: (0, 1)}


def random_blocks(qtype, rows, cols, rng):
    """Arbitrary bytes for every quant field (so every bit pattern of nibbles, high bits and packed scales occurs),
    with finite fp16 scales."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    offset, count = F16_FIELDS[qtype]
    blocks[:, offset:offset + 2 * count] = rng.normal(size=(len(blocks), count)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16], ids=lambda q: q.name)
def test_float_types_match_gguf(qtype):
    rng = np.random.default_rng(0)
    values = rng.normal(size=(4, 64)).astype(np.float32)
    stored = gguf.quants.quantize(values, qtype) if qtype == Q.BF16 else encode_tensor(values, qtype, rng)
    expected = gguf.quants.dequantize(stored, qtype)
    got = quant.dequantize(quant.from_gguf_data(stored, qtype, (4, 64)))
    np.testing.assert_array_equal(np.asarray(got), expected.astype(np.float32))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.F16], ids=lambda q: q.name)
def test_matmul_and_take_rows_match_dequantized_numpy(qtype):
    rng = np.random.default_rng(1)
    rows, cols = 24, 512
    stored = encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), qtype, rng)
    dense = gguf.quants.dequantize(stored, qtype).astype(np.float32)
    w = dataclasses.replace(quant.from_gguf_data(stored, qtype, (rows, cols)), exact=True)  # cpu_ext: test_cpu_ext
    x = rng.normal(size=(3, 2, cols)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jax.jit(quant.matmul)(x, w)), x @ dense.T, rtol=1e-4, atol=1e-4)
    ids = np.array([[3, 0], [23, 3]])
    np.testing.assert_array_equal(np.asarray(quant.take_rows(w, ids)), dense[ids])


@pytest.mark.parametrize("tokens", [1, 4, 5])
def test_fused_products_match_the_dot_with_the_dequantized_weight(tokens):
    """The GPU plan's "xla_fused" products (a decode's multiply-and-reduce, up to FUSED_MAX_TOKENS tokens; a dot
    beyond) give the dequantized numpy products, for matmul, masked_matmul and masked_axpy."""
    rng = np.random.default_rng(7)
    rows, cols = 64, 256
    stored = encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), Q.Q4_0, rng)
    dense = gguf.quants.dequantize(stored, Q.Q4_0).astype(np.float32)
    w = quant.from_gguf_data(stored, Q.Q4_0, (rows, cols))
    w_t = quant.from_gguf_data(encode_tensor(dense.T.copy(), Q.Q8_0, rng), Q.Q8_0, (cols, rows))
    x = rng.normal(size=(tokens, cols)).astype(np.float32)
    mask = rng.random((tokens, rows)) < 0.3
    h = rng.normal(size=(tokens, cols)).astype(np.float32)
    mask_t = rng.random((tokens, cols)) < 0.3

    def products(x, mask, h, mask_t):
        with quant.products("xla_fused"):
            return quant.matmul(x, w), quant.masked_matmul(x, w, mask), quant.masked_axpy(h, w_t, mask_t)

    if tokens <= quant.FUSED_MAX_TOKENS:
        text = jax.jit(products).lower(x, mask, h, mask_t).as_text()
        assert "dot_general" not in text and "reduce" in text
    y, masked, axpy = jax.jit(products)(x, mask, h, mask_t)
    dense_t = gguf.quants.dequantize(np.asarray(w_t.data), Q.Q8_0).astype(np.float32)
    np.testing.assert_allclose(np.asarray(y), x @ dense.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(masked), np.where(mask, x @ dense.T, 0), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(axpy), np.where(mask_t, h, 0) @ dense_t, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("rows,cols,span", [(64, 32, None), (192, 96, 64), (192, 96, 192), (2048, 32, None)])
def test_neuron_major_packing_keeps_every_value(qtype, rows, cols, span):
    """pack_neuron_major regroups the blocks without rounding: decoded, it is gguf-py's dequantization, transposed;
    the scale bytes are W's own, rearranged."""
    data = random_blocks(qtype, rows, cols, np.random.default_rng(int(qtype)))
    w = quant.QuantArray(data, qtype, (rows, cols))
    packed = quant.pack_neuron_major(w, span)
    assert packed.layout == quant.NEURON_MAJOR and packed.shape == (cols, rows) and packed.nbytes == w.nbytes
    expected = gguf.quants.dequantize(data, qtype).reshape(rows, cols).T
    np.testing.assert_array_equal(np.asarray(quant.dequantize_neuron_major(packed, span)), expected)
    span = span or quant.neuron_span(rows, qtype)
    spans = np.asarray(packed.data).reshape(cols // 32, rows // span, -1)  # scales first in each span
    np.testing.assert_array_equal(np.sort(spans[:, :, :2 * span].ravel()),
                                  np.sort(data.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])[:, :, :2].ravel()))
    if span == quant.neuron_span(rows, qtype):  # the span the model's dispatch assumes
        x = np.random.default_rng(1).normal(size=(2, cols)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(quant.masked_axpy(x, dataclasses.replace(packed, exact=True), x > 0)),
                                   np.where(x > 0, x, 0) @ expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", sorted(quant.REPACKED_TYPES, key=int), ids=lambda q: q.name)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (8, 2), (13, 3), (2049, 1)])
def test_rows_x8_packing_keeps_every_byte(qtype, rows, blocks):
    """pack_rows_x8 rearranges the rows' bytes (the last group padded with zero blocks; K-quants' and IQ4_XS's
    packed scales unpacked to a byte each, 1-3% more) into one 64-byte-aligned buffer; unpacked, they are the rows
    again; dequantized and looked up (through their groups), gguf-py's values. 2049 rows: groups are packed in
    several batches."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    cols = blocks * block_size
    data = random_blocks(qtype, rows, cols, np.random.default_rng(int(qtype)))
    w = quant.QuantArray(data, qtype, (rows, cols))
    packed = quant.pack_rows_x8(w)
    groups = -(-rows // 8)
    group_block = x8_kquants.GROUP_BYTES.get(qtype, 8 * type_size)
    assert group_block <= 1.03 * 8 * type_size
    assert packed.layout == quant.ROWS_X8 and packed.shape == (rows, cols)
    assert packed.data.shape == (groups, blocks * group_block) and packed.data.unsafe_buffer_pointer() % 64 == 0
    # Jitted: one program each instead of dozens of operations compiled one by one for each shape.
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.unpack_rows_x8)(packed).data), data)
    expected = gguf.quants.dequantize(data, qtype).reshape(rows, cols)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.dequantize)(packed)), expected)
    ids = np.array([[rows - 1, 0, rows // 2], [1 % rows, rows - 1, 8 % rows]])  # any shape and lane, repeats
    np.testing.assert_array_equal(np.asarray(jax.jit(quant.take_rows)(packed, jax.numpy.array(ids))), expected[ids])


def test_rows_x8_dispatch_runs_the_repacked_kernel_for_any_number_of_tokens():
    """Under products("cpu_ext") a repacked weight goes to the repacked kernels past the row kernels' 128 tokens;
    exact weights are never repacked; without cpu_ext products XLA multiplies the unpacked weight."""
    import cpu_ext

    rng = np.random.default_rng(3)
    rows, cols = 13, 64
    w = quant.QuantArray(encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), Q.Q4_0, rng), Q.Q4_0,
                         (rows, cols))
    packed = quant.pack_rows_x8(w)
    x = rng.normal(size=(200, cols)).astype(np.float32)
    kernel = cpu_ext.quantized_matmul(x, packed.data, qtype=Q.Q4_0, rows=rows, cols=cols, interleave=8)
    with quant.products("cpu_ext"):
        np.testing.assert_array_equal(np.asarray(jax.jit(quant.matmul)(x, packed)), np.asarray(kernel))
        grouped = quant.matmuls(x, [packed, packed])
        rows_out = quant.matmul(x, w)  # 200 tokens of GGUF's rows: XLA
    np.testing.assert_array_equal(np.asarray(grouped[1]), np.asarray(kernel))
    np.testing.assert_allclose(np.asarray(rows_out), x @ np.asarray(quant.dequantize(w)).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(quant.matmul(x, packed)), np.asarray(rows_out), rtol=1e-5, atol=1e-5)
    assert not quant.can_pack_rows_x8(dataclasses.replace(w, exact=True))
    assert not quant.can_pack_rows_x8(packed)
    with pytest.raises(ValueError, match="cannot repack"):
        quant.pack_rows_x8(dataclasses.replace(w, exact=True))


def test_neuron_span_keeps_long_rows_whole():
    assert quant.neuron_span(576, Q.Q4_1) == 64 and quant.neuron_span(4096, Q.Q4_0) == 4096
    assert quant.neuron_span(1024, Q.Q4_0) == 64 and quant.neuron_span(1024, Q.Q8_0) == 1024


def test_neuron_major_packing_takes_q4_q8_weights_of_64_rows():
    rng = np.random.default_rng(2)
    assert not quant.can_pack_neuron_major(quant.QuantArray(random_blocks(Q.Q5_0, 64, 32, rng), Q.Q5_0, (64, 32)))
    assert not quant.can_pack_neuron_major(quant.QuantArray(random_blocks(Q.Q4_1, 96, 32, rng), Q.Q4_1, (96, 32)))
    exact = quant.QuantArray(random_blocks(Q.Q4_1, 64, 32, rng), Q.Q4_1, (64, 32), exact=True)
    assert not quant.can_pack_neuron_major(exact)
    with pytest.raises(ValueError, match="cannot pack"):
        quant.pack_neuron_major(exact)

"""cpu_ext.down_rows_axpy and down_rows_gather_axpy, the integer sparse down projection (cpu_ext/down_rows.h), against
their plain-jnp references on every instruction set this CPU runs, and the DOWN_ROWS layout (quant.pack_down_rows)
against GGUF's rows."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import cpu_ext
from jaxinfer import quant
from jaxinfer.synthetic import encode_tensor

TYPES = [Q.Q4_0, Q.Q8_0]
OFFSET = {Q.Q4_0: 8, Q.Q8_0: 0}  # GGUF's q of the stored value, as the kernel dots it (Q8_0's + 128 is taken back)


def weight(qtype, rows, cols, rng):
    data = encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), qtype, rng)
    return quant.from_gguf_data(data, qtype, (rows, cols))


def scales_and_values(w: quant.QuantArray):
    """The reference's view of a GGUF-rows weight: block scales f32 [rows, blocks] and values q - offset int32."""
    rows, cols = w.shape
    blocks = np.asarray(w.data).reshape(rows, cols // 32, -1)
    scales = blocks[:, :, :2].copy().view(np.float16).reshape(rows, -1).astype(np.float32)
    if w.qtype == Q.Q4_0:
        q = blocks[:, :, 2:]
        values = np.concatenate([q & 0x0F, q >> 4], axis=-1).astype(np.int32) - OFFSET[w.qtype]
    else:
        values = blocks[:, :, 2:].view(np.int8).astype(np.int32)
    return scales, values.reshape(rows, cols)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows, cols, active, tokens", [(1, 32, 1.0, 3), (37, 64, 0.5, 3), (100, 512, 0.3, 3),
                                                        (300, 4096, 0.15, 3), (300, 512, 0.3, 40)])
def test_matches_reference_on_every_isa(qtype, rows, cols, active, tokens, isa):
    """A decode step's few tokens split their groups over the threads; a prompt's (40 tokens: tiles of 16, 16 and 8)
    is taken a tile of tokens at a time, each token's groups added by one thread."""
    rng = np.random.default_rng(rows)
    w = weight(qtype, rows, cols, rng)
    packed = quant.pack_down_rows(w)
    h = rng.normal(size=(tokens, rows)).astype(np.float32)
    h[:, ::7] = 0.0  # active neurons whose h is 0 add nothing (and are not read)
    mask = rng.random((tokens, rows)) < active
    y = np.asarray(cpu_ext.down_rows_axpy(h, packed.data, mask, qtype=qtype, rows=rows, cols=cols))
    scales, values = scales_and_values(w)
    for t in sorted({0, tokens // 2, tokens - 1}):  # a prompt's first, middle and last tiles
        reference = np.asarray(cpu_ext.down_rows_axpy_reference(h[t], scales, values, mask[t]))
        np.testing.assert_allclose(y[t], reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max(initial=1.0))
        exact = np.where(mask[t], h[t], 0) @ np.asarray(quant.dequantize(w))
        scale = np.linalg.norm(exact) or 1.0
        assert np.linalg.norm(y[t] - exact) / scale < 2e-2  # the coefficients' 8-bit rounding


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows, cols, k, segment", [(1, 32, 1, 0), (64, 64, 40, 0), (300, 1024, 96, 0),
                                                   (300, 1024, 96, 24)])
def test_gather_matches_reference_on_every_isa(qtype, rows, cols, k, segment, isa):
    """The rows an index names, in its order (repeats and out-of-range padding included), segment by segment: the
    reference over those rows, and, gathered by hand (one segment), down_rows_axpy's bits."""
    rng = np.random.default_rng(rows + k)
    w = weight(qtype, rows, cols, rng)
    packed = quant.pack_down_rows(w)
    index = rng.integers(-3, rows + 3, size=k).astype(np.int32)
    h = rng.normal(size=(2, k)).astype(np.float32)
    h[:, ::5] = 0.0
    y = np.asarray(cpu_ext.down_rows_gather_axpy(h, packed.data, index, qtype=qtype, rows=rows, cols=cols,
                                                 segment=segment))
    scales, values = scales_and_values(w)
    valid = (index >= 0) & (index < rows)
    taken = quant.QuantArray(np.asarray(packed.data)[np.where(valid, index, 0)], qtype, (k, cols),
                             layout=quant.DOWN_ROWS)
    for t in range(2):
        reference = np.asarray(cpu_ext.down_rows_gather_axpy_reference(h[t], scales, values, index, segment))
        np.testing.assert_allclose(y[t], reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max(initial=1.0))
    if segment:
        return
    by_mask = cpu_ext.down_rows_axpy(h, taken.data, np.broadcast_to(valid, h.shape), qtype=qtype, rows=k, cols=cols)
    np.testing.assert_array_equal(y, np.asarray(by_mask))


def test_gather_reads_only_the_named_rows_and_checks_its_index():
    rng = np.random.default_rng(8)
    rows, cols = 64, 128
    w = weight(Q.Q4_0, rows, cols, rng)
    index = np.array([5, 9, 70, -1, 33], np.int32)
    h = rng.normal(size=5).astype(np.float32)
    h[1] = 0.0  # row 9 is named but its h is 0: not read
    poisoned = np.asarray(quant.pack_down_rows(w).data).copy()
    for j in set(range(rows)) - {5, 33}:
        poisoned[j, :2 * cols // 32] = np.frombuffer(np.full(cols // 32, np.nan, np.float16).tobytes(), np.uint8)
    clean = cpu_ext.down_rows_gather_axpy(h, quant.pack_down_rows(w).data, index, qtype=Q.Q4_0, rows=rows, cols=cols)
    dirty = cpu_ext.down_rows_gather_axpy(h, poisoned, index, qtype=Q.Q4_0, rows=rows, cols=cols)
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(dirty))
    assert np.isfinite(np.asarray(clean)).all()
    with pytest.raises(ValueError, match="index entries must fit in int32"):
        cpu_ext.down_rows_gather_axpy(h, poisoned, np.array([2**32 + 3] * 5), qtype=Q.Q4_0, rows=rows, cols=cols)
    with pytest.raises(Exception, match=r"h must be \[\.\.\., 4\]"):
        jax.block_until_ready(cpu_ext.down_rows_gather_axpy(h, poisoned, index[:4], qtype=Q.Q4_0, rows=rows,
                                                            cols=cols))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("cols", [1024, 640, 96])  # rows of whole 512-value chunks, and with 4 or 3 blocks beyond
def test_every_isa_gives_the_portable_bits(qtype, cols):
    rng = np.random.default_rng(5)
    rows = 211
    packed = quant.pack_down_rows(weight(qtype, rows, cols, rng))
    h = rng.normal(size=(40, rows)).astype(np.float32)  # a prompt's tiles, as a decode step's split (first 2)
    mask = rng.random((40, rows)) < 0.4
    outs = []
    for isa in ("scalar", "avx2", "avx512"):
        try:
            cpu_ext.select_isa(isa)
        except ValueError:
            continue
        outs.append(np.asarray(cpu_ext.down_rows_axpy(h, packed.data, mask, qtype=qtype, rows=rows, cols=cols)))
        outs.append(np.asarray(cpu_ext.down_rows_axpy(h[:2], packed.data, mask[:2], qtype=qtype, rows=rows,
                                                      cols=cols)))
    cpu_ext.select_isa("best")
    for prompt, step in zip(outs[2::2], outs[3::2]):
        np.testing.assert_array_equal(prompt, outs[0])
        np.testing.assert_array_equal(step, outs[1])


def test_rows_never_read_may_hold_anything():
    """Masked-off rows and rows of neurons whose h is 0 are not read: NaN there changes nothing."""
    rng = np.random.default_rng(2)
    rows, cols = 64, 256
    w = weight(Q.Q8_0, rows, cols, rng)
    h = rng.normal(size=rows).astype(np.float32)
    mask = np.arange(rows) % 3 == 0
    h[3] = 0.0
    poisoned = np.asarray(quant.pack_down_rows(w).data).copy()
    for j in np.flatnonzero(~mask | (h == 0)):
        poisoned[j, :2 * cols // 32] = np.frombuffer(np.full(cols // 32, np.nan, np.float16).tobytes(), np.uint8)
    clean = cpu_ext.down_rows_axpy(h, quant.pack_down_rows(w).data, mask, qtype=Q.Q8_0, rows=rows, cols=cols)
    dirty = cpu_ext.down_rows_axpy(h, poisoned, mask, qtype=Q.Q8_0, rows=rows, cols=cols)
    np.testing.assert_array_equal(np.asarray(clean), np.asarray(dirty))


def test_jit_vmap_and_quant_dispatch():
    rng = np.random.default_rng(3)
    rows, cols = 96, 512
    w = weight(Q.Q4_0, rows, cols, rng)
    packed = quant.pack_down_rows(w)
    h = jnp.asarray(rng.normal(size=(2, 5, rows)).astype(np.float32))
    mask = jnp.asarray(rng.random((2, 5, rows)) < 0.5)
    direct = cpu_ext.down_rows_axpy(h, packed.data, mask, qtype=Q.Q4_0, rows=rows, cols=cols)
    mapped = jax.jit(jax.vmap(lambda h, m: cpu_ext.down_rows_axpy(h, packed.data, m, qtype=Q.Q4_0, rows=rows,
                                                                  cols=cols)))(h, mask)
    np.testing.assert_array_equal(np.asarray(direct), np.asarray(mapped))
    with quant.products("cpu_ext"):
        through_quant = jax.jit(quant.masked_axpy)(h, packed, mask)
    np.testing.assert_array_equal(np.asarray(through_quant), np.asarray(direct))
    # Off the kernels (XLA), the layout reads as GGUF's rows.
    np.testing.assert_allclose(np.asarray(quant.masked_axpy(h, packed, mask)), np.asarray(quant.masked_axpy(h, w, mask)),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_the_layout_keeps_every_byte(qtype):
    w = weight(qtype, 13, 96, np.random.default_rng(4))
    packed = quant.pack_down_rows(w)
    assert packed.layout == quant.DOWN_ROWS and packed.nbytes == w.nbytes
    np.testing.assert_array_equal(np.asarray(quant.unpack_down_rows(packed).data), np.asarray(w.data))
    np.testing.assert_array_equal(np.asarray(quant.dequantize(packed)), np.asarray(quant.dequantize(w)))
    rows = np.array([7, 2, 11])  # taking rows (a split's parts) commutes with the layout
    taken = quant.QuantArray(np.asarray(packed.data)[rows], qtype, (3, 96), layout=quant.DOWN_ROWS)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(taken)), np.asarray(quant.dequantize(w))[rows])


def test_bad_input_raises():
    rng = np.random.default_rng(6)
    packed = quant.pack_down_rows(weight(Q.Q4_0, 8, 64, rng))
    h, mask = np.ones((1, 8), np.float32), np.ones((1, 8), bool)
    with pytest.raises(ValueError, match="unsupported type Q4_1"):
        cpu_ext.down_rows_axpy(h, packed.data, mask, qtype=Q.Q4_1, rows=8, cols=64)
    with pytest.raises(Exception, match="weight must be uint8"):
        jax.block_until_ready(cpu_ext.down_rows_axpy(h, packed.data[:, :-1], mask, qtype=Q.Q4_0, rows=8, cols=64))
    with pytest.raises(Exception, match="mask must have the shape of h"):
        jax.block_until_ready(cpu_ext.down_rows_axpy(h, packed.data, mask[:, :4], qtype=Q.Q4_0, rows=8, cols=64))

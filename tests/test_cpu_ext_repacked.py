"""cpu_ext's repacked kernels (quantized_matmul with interleave 8: weights repacked eight rows to a group by
quant.pack_rows_x8): the portable row kernels' bits on every instruction set this CPU runs, for one token, four-token
tiles, two-group tiles and tails (K-quants and IQ4_XS: the portable repacked kernels' bits, and the row kernels' where
floats are exact); the jnp reference within 8-bit activations' error; jit, vmap, groups; gathers of whole groups;
bad input."""

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_cpu_ext import REL_ERROR, check, random_weight, rel_error

import cpu_ext
from jaxinfer import quant, x8_kquants

K_TYPES = sorted(x8_kquants.GROUP_BYTES, key=int)  # 256-value super-blocks
TYPES = sorted(cpu_ext.REPACKED_TYPES - set(K_TYPES), key=int)  # 32-value blocks
# (rows, cols): rows below, at and past one group, an odd count past several (a padded last group, an odd group out
# of the two-group tiles); cols of one block and SmolLM2's 576 (K-quants: one and six super-blocks).
SHAPES = [(1, 32), (8, 576), (13, 256), (67, 576)]
K_SHAPES = [(1, 256), (8, 512), (13, 256), (67, 1536)]
TOKENS = [1, 4, 7, 130]  # one, a four-token tile, tiles and a tail, past the row kernels' 128
K_TOKENS = [1, 4, 5, 13, 130]  # 13: an eight-token tile, a four-token one and a tail


def repacked(data, qtype, rows, cols):
    return quant.pack_rows_x8(quant.QuantArray(jnp.asarray(data), qtype, (rows, cols))).data


def x8_matmul(x, packed, qtype, rows, cols):
    return cpu_ext.quantized_matmul(x, packed, qtype=qtype, rows=rows, cols=cols, interleave=8)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_repacked_kernels_give_the_portable_row_kernels_bits(qtype, isa):
    """Same integer dots and the same float steps per row and block as the portable row kernels: the same bits, on
    every ISA, for any number of tokens; and the reference product within the 8-bit activations' error."""
    rng = np.random.default_rng(int(qtype))
    for rows, cols in SHAPES:
        data = random_weight(qtype, rows, cols, rng)
        packed = repacked(data, qtype, rows, cols)
        for tokens in TOKENS:
            x = rng.normal(size=(tokens, cols)).astype(np.float32)
            cpu_ext.select_isa("scalar")
            row_bits = np.asarray(cpu_ext.quantized_matmul(x, data, qtype=qtype, rows=rows, cols=cols))
            cpu_ext.select_isa(isa)
            y = x8_matmul(x, packed, qtype, rows, cols)
            np.testing.assert_array_equal(np.asarray(y), row_bits, err_msg=f"{rows}x{cols}, {tokens} tokens")
            check(x, data, qtype, rows, cols, y)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_k_quant_repacked_kernels_give_the_portable_repacked_bits(qtype, isa):
    """K-quants and IQ4_XS: every ISA gives the portable repacked kernels' bits for any number of tokens; those are
    the row kernels' integer sums with their own float steps (one per row and super-block, not the rows' eight
    lanes), so within float rounding of the row kernels; and the reference product within the 8-bit activations'
    error."""
    rng = np.random.default_rng(int(qtype))
    for rows, cols in K_SHAPES:
        data = random_weight(qtype, rows, cols, rng)
        packed = repacked(data, qtype, rows, cols)
        for tokens in K_TOKENS:
            x = rng.normal(size=(tokens, cols)).astype(np.float32)
            cpu_ext.select_isa("scalar")
            portable = np.asarray(x8_matmul(x, packed, qtype, rows, cols))
            rows_y = np.asarray(cpu_ext.quantized_matmul(x, data, qtype=qtype, rows=rows, cols=cols))
            cpu_ext.select_isa(isa)
            y = x8_matmul(x, packed, qtype, rows, cols)
            np.testing.assert_array_equal(np.asarray(y), portable, err_msg=f"{rows}x{cols}, {tokens} tokens")
            np.testing.assert_allclose(portable, rows_y, rtol=0, atol=1e-5 * np.abs(rows_y).max())
            check(x, data, qtype, rows, cols, y)


def exact_k_weight(qtype, rows, cols, rng):
    """Random blocks whose products with integer activations are exact in f32 all the way (d, dmin in {0.5, 1},
    small integer scales: every partial sum below 2^24 halves), so kernels that compute the same integers must give
    the same bits whatever their float steps."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    halves = rng.choice(np.array([0.5, 1.0], np.float16), size=blocks.shape[:2] + (2,)).view(np.uint8)

    def small(high):  # eight integers in [0, high) per block
        return rng.integers(0, high, size=blocks.shape[:2] + (8,), dtype=np.uint8)

    if qtype in (Q.Q4_K, Q.Q5_K):
        blocks[..., 0:4] = halves.reshape(*blocks.shape[:2], 4)
        blocks[..., 4:16] = x8_kquants.q4_k_pack_scales(np, small(4), small(4))
    elif qtype == Q.Q6_K:
        blocks[..., 208:210] = halves[..., :2]
        blocks[..., 192:208] = rng.integers(-3, 4, size=blocks.shape[:2] + (16,)).astype(np.int8).view(np.uint8)
    else:  # IQ4_XS: scales 31..33 stored, -1..1
        ls = small(3) + np.uint8(31)
        blocks[..., 0:2] = halves[..., :2]
        blocks[..., 4:8] = (ls[..., 0::2] & 0x0F) | ((ls[..., 1::2] & 0x0F) << 4)
        scales_h = (((ls >> 4) & 3).astype(np.uint16) << (2 * np.arange(8, dtype=np.uint16))).sum(-1, dtype=np.uint16)
        blocks[..., 2:4] = scales_h[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", K_TYPES, ids=lambda q: q.name)
def test_k_quant_repacked_kernels_give_the_row_kernels_bits_where_floats_are_exact(qtype, isa):
    """With integer activations (max |x| = 127 in every super-block: scale 1, q = x) and the weights above, every
    float step is exact, so the repacked kernels and the row kernels agree to the bit exactly when their integer
    sums do: this checks the repacked integer arithmetic (unpacking, scales, offsets) against the row kernels'."""
    rng = np.random.default_rng(int(qtype) + 100)
    rows, cols = 13, 512
    data = exact_k_weight(qtype, rows, cols, rng)
    packed = repacked(data, qtype, rows, cols)
    for tokens in (1, 5):
        x = rng.integers(-127, 128, size=(tokens, cols)).astype(np.float32)
        x[:, ::256] = 127.0
        y = np.asarray(x8_matmul(x, packed, qtype, rows, cols))
        np.testing.assert_array_equal(y, np.asarray(cpu_ext.quantized_matmul(x, data, qtype=qtype, rows=rows,
                                                                             cols=cols)))
        np.testing.assert_array_equal(y, np.asarray(cpu_ext.quantized_matmul_reference(
            x, quant.dequantize(quant.QuantArray(jnp.asarray(data), qtype, (rows, cols))))))


def test_q8_0_extremes_and_zero_activations(isa):
    """Q8_0's q of -128 and 127 (stored + 128: 0 and 255, the sign trick's widest case without VNNI), and blocks
    of activations that are all zero, give the row kernels' bits."""
    rng = np.random.default_rng(3)
    rows, cols = 16, 64
    data = random_weight(Q.Q8_0, rows, cols, rng).reshape(rows, 2, 34)
    data[:8, :, 2:] = np.uint8(0x80)  # q = -128
    data[8:, :, 2:] = np.uint8(0x7F)  # q = 127
    data = data.reshape(rows, -1)
    x = rng.normal(size=(5, cols)).astype(np.float32)
    x[:, :32] = 0.0
    cpu_ext.select_isa("scalar")
    row_bits = np.asarray(cpu_ext.quantized_matmul(x, data, qtype=Q.Q8_0, rows=rows, cols=cols))
    cpu_ext.select_isa(isa)
    y = x8_matmul(x, repacked(data, Q.Q8_0, rows, cols), Q.Q8_0, rows, cols)
    np.testing.assert_array_equal(np.asarray(y), row_bits)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K], ids=lambda q: q.name)
def test_jit_vmap_and_leading_dims(qtype):
    rng = np.random.default_rng(4)
    rows, cols = 21, 256
    datas = [random_weight(qtype, rows, cols, rng) for _ in range(3)]
    packed = np.stack([repacked(d, qtype, rows, cols) for d in datas])
    x = rng.normal(size=(3, 5, cols)).astype(np.float32)

    def f(x, packed):
        return x8_matmul(x, packed, qtype, rows, cols)

    for in_axes in [(0, None), (None, 0), (0, 0)]:
        y = jax.jit(jax.vmap(f, in_axes=in_axes))(x if in_axes[0] == 0 else x[0],
                                                  packed if in_axes[1] == 0 else packed[0])
        assert y.shape == (3, 5, rows)
        for i in range(3):
            check(x[i if in_axes[0] == 0 else 0], datas[i if in_axes[1] == 0 else 0], qtype, rows, cols, y[i])
    leading = jax.jit(f)(x, packed[0])
    np.testing.assert_array_equal(np.asarray(leading), np.asarray(jax.vmap(f, in_axes=(0, None))(x, packed[0])))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.IQ4_NL, Q.Q6_K], ids=lambda q: q.name)
def test_group_gives_the_bits_of_separate_calls(qtype):
    rng = np.random.default_rng(5)
    rows, cols = [67, 16, 3], 512 if qtype in K_TYPES else 576
    datas = [repacked(random_weight(qtype, r, cols, rng), qtype, r, cols) for r in rows]
    for tokens in (1, 9):
        x = rng.normal(size=(tokens, cols)).astype(np.float32)
        grouped = jax.jit(lambda x, *d: cpu_ext.quantized_matmul_group(x, list(d), qtype=qtype, rows=rows, cols=cols,
                                                                         interleave=8))(x, *datas)
        for y, packed, r in zip(grouped, datas, rows):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x8_matmul(x, packed, qtype, r, cols)))


def x8_gather(x, packed, index, qtype, rows, cols, segment=0):
    return cpu_ext.gather_matmul(x, packed, index, qtype=qtype, rows=rows, cols=cols, segment=segment, interleave=8)


def groups_index(groups, rows):
    """The rows of whole groups of eight (None: a group of padding, all out of range)."""
    return np.concatenate([np.arange(8 * g, 8 * g + 8) if g is not None else np.full(8, rows)
                           for g in groups]).astype(np.int32)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_gather_of_repacked_groups_gives_the_dense_products_bits(qtype, isa):
    """gather_matmul of a repacked weight (a mixture's experts held repacked) reads whole groups through the dense
    product's kernels: its outputs are, to the bit, the same rows of the repacked dense product, for runs of groups,
    a repeat, a padded last group (rows past the weight: 0), a group of padding (0), and 1, 5 and 13 tokens; with a
    segment each token gets its own groups' outputs and 0 elsewhere; and the reference within 8-bit rounding."""
    rng = np.random.default_rng(int(qtype) + 7)
    rows, cols = 67, 512 if qtype in K_TYPES else 576
    data = random_weight(qtype, rows, cols, rng)
    packed = repacked(data, qtype, rows, cols)
    index = groups_index([3, 4, 5, 1, 8, None, 0, 0], rows)
    w = quant.dequantize(quant.QuantArray(jnp.asarray(data), qtype, (rows, cols)))
    for tokens in (1, 5, 13):
        x = rng.normal(size=(tokens, cols)).astype(np.float32)
        got = np.asarray(jax.jit(lambda x, p, i: x8_gather(x, p, i, qtype, rows, cols))(x, packed, index))
        dense = np.asarray(x8_matmul(x, packed, qtype, rows, cols))
        inside = index < rows
        np.testing.assert_array_equal(got[:, inside], dense[:, index[inside]], err_msg=f"{tokens} tokens")
        np.testing.assert_array_equal(got[:, ~inside], 0.0)
        reference = cpu_ext.gather_matmul_reference(jnp.asarray(x), w, jnp.asarray(index))
        assert rel_error(got, reference, x, w) < REL_ERROR[qtype]
    x = rng.normal(size=(4, cols)).astype(np.float32)
    got = np.asarray(x8_gather(x, packed, index, qtype, rows, cols, segment=16))
    dense = np.asarray(x8_matmul(x, packed, qtype, rows, cols))
    for t in range(4):
        own = np.zeros(len(index), bool)
        own[16 * t:16 * t + 16] = True
        keep = own & (index < rows)
        np.testing.assert_array_equal(got[t, keep], dense[t, index[keep]])
        np.testing.assert_array_equal(got[t, ~keep], 0.0)


def test_a_gather_of_repacked_groups_refuses_a_broken_group():
    rng = np.random.default_rng(8)
    rows, cols = 24, 64
    packed = repacked(random_weight(Q.Q4_0, rows, cols, rng), Q.Q4_0, rows, cols)
    x = rng.normal(size=(2, cols)).astype(np.float32)
    for index, what in ((np.arange(4, 12), "not one group"), (np.array([0, 1, 2, 3, 4, 5, 7, 6]), "not one group"),
                        (np.array([99] * 7 + [3]), "not one group"), (np.arange(4), "multiples of 8")):
        with pytest.raises(Exception, match=what):
            jax.block_until_ready(x8_gather(x, packed, index.astype(np.int32), Q.Q4_0, rows, cols))
    with pytest.raises(Exception, match="multiples of 8"):
        jax.block_until_ready(x8_gather(x, packed, np.arange(24, dtype=np.int32), Q.Q4_0, rows, cols, segment=12))


def test_bad_input_raises():
    rng = np.random.default_rng(6)
    rows, cols = 13, 64
    data = random_weight(Q.Q4_0, rows, cols, rng)
    packed = repacked(data, Q.Q4_0, rows, cols)
    x = rng.normal(size=(2, cols)).astype(np.float32)
    with pytest.raises(Exception, match=r"repacked in groups of eight rows must be u8 \[2, 288\]"):
        jax.block_until_ready(x8_matmul(x, data, Q.Q4_0, rows, cols))  # GGUF's rows passed as groups
    with pytest.raises(Exception, match="weight must be"):
        jax.block_until_ready(cpu_ext.quantized_matmul(x, packed, qtype=Q.Q4_0, rows=rows, cols=cols))
    q5 = random_weight(Q.Q5_0, 8, cols, rng)
    with pytest.raises(Exception, match="interleave must be 1, or 8 for Q4_0/Q4_1/Q8_0/IQ4_NL"):
        jax.block_until_ready(x8_matmul(x, q5, Q.Q5_0, 8, cols))
    with pytest.raises(Exception, match="interleave must be 1, or 8"):
        jax.block_until_ready(cpu_ext.quantized_matmul(x, packed, qtype=Q.Q4_0, rows=rows, cols=cols, interleave=4))
    # A Q4_K group's rows are 1152 bytes per super-block, its repacked group 1184 (the scales unpacked).
    with pytest.raises(Exception, match=r"repacked in groups of eight rows must be u8 \[2, 1184\]"):
        jax.block_until_ready(x8_matmul(np.tile(x, 4), np.zeros((2, 1152), np.uint8), Q.Q4_K, rows, 256))


def test_repacked_types_are_what_quant_packs():
    assert quant.REPACKED_TYPES == cpu_ext.REPACKED_TYPES == set(TYPES) | set(K_TYPES)
    assert set(REL_ERROR) >= cpu_ext.REPACKED_TYPES

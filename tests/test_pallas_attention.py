import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.model import attend
from pallas_kernels.attention import (BlockSizes, attention, attention_reference, combine_splits, decode_attention,
                                      decode_attention_reference)

# 16 is the smallest tile Triton's dot takes, so the compiled class can run the same cases on a GPU.
BLOCKS = BlockSizes(block_q=16, block_k=16, num_splits=4, block_h=16)


def random_qkv(seed, batch, n_query, n_key, n_head, n_head_kv, head_dim):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, n_query, n_head, head_dim)).astype(np.float32)
    k = rng.normal(size=(batch, n_key, n_head_kv, head_dim)).astype(np.float32)
    v = rng.normal(size=(batch, n_key, n_head_kv, head_dim)).astype(np.float32)
    return q, k, v


class AttentionTest:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("compiled Pallas kernels need a GPU; the interpret subclass runs them on CPU")

    # (batch, T, S, H, H_kv, start): GQA ratios 1 and 3; a cache-less prefill, chunks at offsets into a longer cache,
    # and lengths that are not multiples of the tiles (padded by the wrapper).
    @pytest.mark.parametrize("batch, n_query, n_key, n_head, n_head_kv, start", [
        (1, 32, 32, 2, 2, 0),
        (2, 16, 64, 3, 3, 40),
        (1, 32, 96, 6, 2, 17),
        (1, 10, 37, 3, 1, 27),
        (2, 16, 48, 6, 2, 0),
    ])
    @pytest.mark.slow
    def test_prefill_matches_references(self, batch, n_query, n_key, n_head, n_head_kv, start):
        q, k, v = random_qkv(start, batch, n_query, n_key, n_head, n_head_kv, 64)
        got = attention(q, k, v, start, block_sizes=BLOCKS, interpret=self.INTERPRET)
        np.testing.assert_allclose(np.asarray(got), np.asarray(attention_reference(q, k, v, start)), atol=1e-5)
        q_pos = start + np.arange(n_query, dtype=np.int32)
        model = attend(q, k, v, q_pos, np.arange(n_key, dtype=np.int32))
        np.testing.assert_allclose(np.asarray(got), np.asarray(model), atol=1e-5)

    @pytest.mark.slow
    def test_prefill_with_a_traced_start(self):
        q, k, v = random_qkv(5, 1, 16, 64, 6, 2, 64)
        run = jax.jit(lambda q, k, v, start: attention(q, k, v, start, block_sizes=BLOCKS, interpret=self.INTERPRET))
        for start in (0, 13, 48):
            np.testing.assert_allclose(np.asarray(run(q, k, v, jnp.int32(start))),
                                       np.asarray(attention_reference(q, k, v, start)), atol=1e-5)

    # Positions at the start, inside, on split boundaries (S=128 in 4 splits of 32) and at the end of the cache.
    @pytest.mark.slow
    @pytest.mark.parametrize("n_head, n_head_kv, head_dim", [(4, 4, 64), (9, 3, 64), (6, 2, 128)])
    def test_decode_matches_references(self, n_head, n_head_kv, head_dim):
        q, k, v = random_qkv(n_head, 2, 1, 128, n_head, n_head_kv, head_dim)
        for position in (0, 5, 31, 32, 77, 127):
            got = decode_attention(q[:, 0], k, v, position, block_sizes=BLOCKS, interpret=self.INTERPRET)
            reference = decode_attention_reference(q[:, 0], k, v, position)
            np.testing.assert_allclose(np.asarray(got), np.asarray(reference), atol=1e-5, err_msg=f"{position=}")
            model = attend(q, k, v, np.array([position], np.int32), np.arange(128, dtype=np.int32))[:, 0]
            np.testing.assert_allclose(np.asarray(got), np.asarray(model), atol=1e-5, err_msg=f"{position=}")

    @pytest.mark.slow
    def test_decode_pads_a_cache_that_does_not_fit_the_splits(self):
        q, k, v = random_qkv(9, 1, 1, 50, 6, 2, 64)  # 50 keys, padded to 4 splits x 16
        for position in (0, 20, 49):
            got = decode_attention(q[:, 0], k, v, position, block_sizes=BLOCKS, interpret=self.INTERPRET)
            np.testing.assert_allclose(np.asarray(got), np.asarray(decode_attention_reference(q[:, 0], k, v, position)),
                                       atol=1e-5)


    @pytest.mark.slow
    def test_prefill_with_a_start_per_row(self):
        """Rows at different depths: each row's queries attend up to their own positions, as that row alone."""
        q, k, v = random_qkv(6, 3, 16, 96, 6, 2, 64)
        starts = np.array([0, 71, 30], np.int32)
        got = np.asarray(attention(q, k, v, jnp.asarray(starts), block_sizes=BLOCKS, interpret=self.INTERPRET))
        np.testing.assert_allclose(got, np.asarray(attention_reference(q, k, v, starts)), atol=1e-5)
        for row, start in enumerate(starts):
            q_pos = start + np.arange(16, dtype=np.int32)
            alone = attend(q[row:row + 1], k[row:row + 1], v[row:row + 1], q_pos, np.arange(96, dtype=np.int32))
            np.testing.assert_allclose(got[row:row + 1], np.asarray(alone), atol=1e-5, err_msg=f"{row=}")

    @pytest.mark.slow
    def test_decode_with_a_position_per_row(self):
        q, k, v = random_qkv(7, 4, 1, 128, 9, 3, 64)
        positions = np.array([0, 127, 32, 77], np.int32)
        got = np.asarray(decode_attention(q[:, 0], k, v, jnp.asarray(positions), block_sizes=BLOCKS,
                                          interpret=self.INTERPRET))
        np.testing.assert_allclose(got, np.asarray(decode_attention_reference(q[:, 0], k, v, positions)), atol=1e-5)
        for row, position in enumerate(positions):
            alone = attend(q[row:row + 1], k[row:row + 1], v[row:row + 1], np.array([position], np.int32),
                           np.arange(128, dtype=np.int32))[:, 0]
            np.testing.assert_allclose(got[row:row + 1], np.asarray(alone), atol=1e-5, err_msg=f"{row=}")


class TestAttentionInterpret(AttentionTest):
    INTERPRET = True


class TestAttentionCompiled(AttentionTest):
    INTERPRET = False


def test_combine_splits_equals_one_softmax_over_all_keys():
    """Independent of the kernel: per-split (acc, l, m) computed in numpy merge to the full softmax average."""
    rng = np.random.default_rng(0)
    scores, values = rng.normal(size=(3, 40)) * 4, rng.normal(size=(40, 8))
    parts = []
    for chunk in np.split(np.arange(40), 4):
        m = scores[:, chunk].max(axis=1)
        p = np.exp(scores[:, chunk] - m[:, None])
        parts.append((p @ values[chunk], p.sum(axis=1), m))
    o, l, m = (np.stack(x).astype(np.float32) for x in zip(*parts))
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    expected = probs / probs.sum(axis=1, keepdims=True) @ values
    np.testing.assert_allclose(np.asarray(combine_splits(o, l, m)), expected, rtol=1e-5, atol=1e-5)


def test_kernels_lower_for_an_nvidia_gpu():
    """Without a GPU, check that both kernels lower for CUDA through Triton, which is how JAX 0.11 compiles a
    generic pallas_call on the GPU machine (JAX 0.10 defaults to Mosaic GPU: switch it off for the check)."""
    previous = getattr(jax.config, "jax_pallas_use_mosaic_gpu", None)
    if previous is not None:
        jax.config.update("jax_pallas_use_mosaic_gpu", False)
    try:
        for head_dim in (64, 128):
            q, k = jnp.zeros((1, 128, 9, head_dim)), jnp.zeros((1, 512, 3, head_dim))
            prefill = jax.jit(lambda q, k, v, start: attention(q, k, v, start)).trace(
                q, k, k, jnp.int32(0)).lower(lowering_platforms=("cuda",))
            decode = jax.jit(lambda q, k, v, position: decode_attention(q, k, v, position)).trace(
                q[:, 0], k, k, jnp.int32(0)).lower(lowering_platforms=("cuda",))
            assert "flash_attention_prefill" in prefill.as_text() and "triton" in prefill.as_text()
            assert "flash_decoding" in decode.as_text() and "triton" in decode.as_text()
    finally:
        if previous is not None:
            jax.config.update("jax_pallas_use_mosaic_gpu", previous)

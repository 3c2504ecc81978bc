import jax
import jax.numpy as jnp
import numpy as np
import pytest

cpu_ext = pytest.importorskip("cpu_ext")


def caches(seed, n_layer, batch, max_len, n_head_kv, head_dim, filled):
    rng = np.random.default_rng(seed)
    k = rng.normal(size=(n_layer, batch, max_len, n_head_kv, head_dim)).astype(np.float32)
    v = rng.normal(size=(n_layer, batch, max_len, n_head_kv, head_dim)).astype(np.float32)
    k[:, :, filled:] = v[:, :, filled:] = np.nan  # never read
    return k, v


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("batch, n_query, n_head, n_head_kv, head_dim, start", [
    (1, 1, 9, 3, 64, 0),      # the default model's first decode step
    (1, 1, 9, 3, 64, 700),
    (2, 4, 4, 4, 16, 5),      # batch, no GQA, a micro-batch
    (1, 3, 8, 1, 40, 30),     # multi-query, a head size that is not a multiple of 16
    (1, 12, 9, 3, 64, 60),    # queries on both sides of a 64-key chunk boundary: partials merged per query
    (2, 2, 4, 2, 128, 130),   # the other unrolled head size, three chunks
    (1, 1, 2, 1, 80, 5),      # a head size with a 16-lane body and no tail
    # more than 8 queries: the tiled kernel (attention_prefill.cc)
    (1, 300, 9, 3, 64, 0),    # a prompt: blocks of 21 queries x 3 heads (63 rows, one of padding), keys in 5 blocks
    (2, 70, 4, 4, 128, 130),  # a micro-batch after a context, blocks of 64 queries, key blocks crossing the queries
    (1, 40, 2, 1, 80, 5),     # a head size with no unrolled tile: the loops of any size
    (1, 20, 6, 2, 40, 100),   # ... one that is not a multiple of 16
    (1, 33, 2, 1, 256, 10),   # the largest unrolled head size
])
@pytest.mark.slow
def test_cached_attention_kernel_equals_the_reference(batch, n_query, n_head, n_head_kv, head_dim, start,
                                                      cache_dtype):
    """An f16 cache is widened to f32 as it is read: the reference gets the same f16 values in f32."""
    max_len, layer = 768, 2
    k, v = (c.astype(cache_dtype) for c in caches(0, 3, batch, max_len, n_head_kv, head_dim, start + n_query))
    q = np.random.default_rng(1).normal(size=(batch, n_query, n_head, head_dim)).astype(np.float32)
    got = jax.jit(cpu_ext.cached_attention)(q, k, v, jnp.int32(layer), jnp.int32(start))
    k_ref, v_ref = (np.nan_to_num(c).astype(np.float32) for c in (k, v))  # the reference reads every position
    expected = cpu_ext.cached_attention_reference(q, k_ref, v_ref, layer, start)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_the_queries_may_be_the_first_rows_of_a_larger_cache():
    """A server's decode step over its first 2 busy slots of 4: query row b reads cache row b, and the other rows
    (NaN here) are never read."""
    k, v = caches(3, 2, 4, 96, 3, 64, 70)
    k[:, 2:] = v[:, 2:] = np.nan
    q = np.random.default_rng(4).normal(size=(2, 1, 9, 64)).astype(np.float32)
    starts = jnp.array([69, 12], jnp.int32)
    got = jax.jit(cpu_ext.cached_attention)(q, k, v, jnp.int32(1), starts)
    expected = cpu_ext.cached_attention_reference(q, np.nan_to_num(k[:, :2]), np.nan_to_num(v[:, :2]), 1, starts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    assert not np.isnan(np.asarray(got)).any()


@pytest.mark.parametrize("n_query", [1, 40], ids=["decode", "tiled"])
def test_the_queries_may_be_later_rows_of_the_cache(n_query):
    """A server's slot 2 of 4 prefilling alone (row 2): query row 0 reads cache row 2, the others (NaN) are never
    read."""
    k, v = caches(5, 2, 4, 96, 3, 64, 30 + n_query)
    k[:, [0, 1, 3]] = v[:, [0, 1, 3]] = np.nan
    q = np.random.default_rng(6).normal(size=(1, n_query, 9, 64)).astype(np.float32)
    got = jax.jit(cpu_ext.cached_attention)(q, k, v, jnp.int32(1), jnp.int32(30), jnp.int32(2))
    expected = cpu_ext.cached_attention_reference(q, np.nan_to_num(k), np.nan_to_num(v), 1, 30, row=2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    for row in (-1, 4):
        with pytest.raises(Exception, match="outside the cache's 4"):
            jax.block_until_ready(cpu_ext.cached_attention(q, k, v, 1, 30, row))


def test_cached_attention_kernel_rejects_positions_outside_the_cache():
    k, v = caches(0, 2, 1, 8, 1, 16, 8)
    q = np.zeros((1, 2, 2, 16), np.float32)
    with pytest.raises(Exception, match="outside the cache"):
        jax.block_until_ready(cpu_ext.cached_attention(q, k, v, 0, 7))
    with pytest.raises(Exception, match="outside the cache"):
        jax.block_until_ready(cpu_ext.cached_attention(q, k, v, 2, 0))
    with pytest.raises(Exception, match="disagree"):
        jax.block_until_ready(cpu_ext.cached_attention(np.zeros((1, 2, 2, 8), np.float32), k, v, 0, 0))
    with pytest.raises(Exception, match="disagree"):  # more query rows than cache rows
        jax.block_until_ready(cpu_ext.cached_attention(np.zeros((2, 2, 2, 16), np.float32), k, v, 0, 0))
    with pytest.raises(Exception, match="both be f32 or both f16"):
        jax.block_until_ready(cpu_ext.cached_attention(q, k, v.astype(np.float16), 0, 0))


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("n_query, starts", [
    (1, [0, 700, 63]),     # decode of three sequences at different depths: 1, 12 and 1 chunks
    (4, [130, 0, 60]),     # a micro-batch; the last row's queries straddle a chunk boundary
    (3, [5, 5]),           # equal depths, given per row
    (100, [0, 37, 64]),    # prompts at different depths, through the tiled kernel
])
@pytest.mark.slow
def test_cached_attention_kernel_with_a_start_per_row_equals_the_reference(n_query, starts, cache_dtype):
    """Each row reads its own filled positions only: past them a row's cache holds NaN, which would show."""
    batch, max_len, layer, n_head, n_head_kv, head_dim = len(starts), 768, 1, 9, 3, 64
    k, v = caches(2, 2, batch, max_len, n_head_kv, head_dim, max_len)
    for row, start in enumerate(starts):
        k[:, row, start + n_query:] = v[:, row, start + n_query:] = np.nan
    k, v = k.astype(cache_dtype), v.astype(cache_dtype)
    q = np.random.default_rng(3).normal(size=(batch, n_query, n_head, head_dim)).astype(np.float32)
    got = jax.jit(cpu_ext.cached_attention)(q, k, v, jnp.int32(layer), jnp.array(starts, jnp.int32))
    k_ref, v_ref = (np.nan_to_num(c).astype(np.float32) for c in (k, v))
    expected = cpu_ext.cached_attention_reference(q, k_ref, v_ref, layer, jnp.array(starts))
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
    for row, start in enumerate(starts):  # the reference too, row by row against a one-row call
        alone = cpu_ext.cached_attention_reference(q[row:row + 1], k_ref[:, row:row + 1], v_ref[:, row:row + 1],
                                                   layer, start)
        np.testing.assert_allclose(np.asarray(expected)[row:row + 1], np.asarray(alone), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cache_dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("n_query, starts, window, head_dim", [
    (1, [700, 5, 63], 512, 64),   # decode: Gemma 3's window deep in a context, one shorter than it, one at its edge
    (1, [300, 0], 1, 128),        # a window of one position: each query sees itself only
    (1, [200], 20, 256),          # a window inside one chunk, Gemma 3's head size
    (4, [130, 60], 100, 64),      # a micro-batch whose windows cross chunk boundaries
    (300, [0], 48, 64),           # a prompt through the tiled kernel: key blocks before each query block's window
    (70, [500, 10], 100, 128),    # a micro-batch deep in a context and one near its start
    (20, [100], 7, 40),           # a window shorter than the queries, a head size with no unrolled tile
    (40, [30], 1000, 64),         # a window longer than the context: every position, as without one
])
@pytest.mark.slow
def test_a_sliding_window_sees_its_last_positions_only(n_query, starts, window, head_dim, cache_dtype):
    """A query at position p sees p - window + 1 .. p: the positions before the first query's window and after each
    row's last hold NaN, never read; the rest equals the reference with the window's mask."""
    batch, max_len, layer, n_head, n_head_kv = len(starts), 1024, 1, 4, 2
    k, v = caches(7, 2, batch, max_len, n_head_kv, head_dim, max_len)
    for row, start in enumerate(starts):
        k[:, row, start + n_query:] = v[:, row, start + n_query:] = np.nan
        k[:, row, :max(0, start - window + 1)] = v[:, row, :max(0, start - window + 1)] = np.nan
    k, v = k.astype(cache_dtype), v.astype(cache_dtype)
    q = np.random.default_rng(8).normal(size=(batch, n_query, n_head, head_dim)).astype(np.float32)
    run = jax.jit(cpu_ext.cached_attention, static_argnames="window")
    got = np.asarray(run(q, k, v, jnp.int32(layer), jnp.array(starts, jnp.int32), window=window))
    k_ref, v_ref = (np.nan_to_num(c).astype(np.float32) for c in (k, v))
    expected = cpu_ext.cached_attention_reference(q, k_ref, v_ref, layer, jnp.array(starts), window=window)
    np.testing.assert_allclose(got, np.asarray(expected), rtol=1e-5, atol=1e-5)
    if window < max(starts) + n_query:  # the window is visible: without it the reference differs
        unwindowed = cpu_ext.cached_attention_reference(q, k_ref, v_ref, layer, jnp.array(starts))
        assert np.abs(np.asarray(unwindowed) - got).max() > 1e-3
    with pytest.raises(Exception, match="window must be >= 0"):
        jax.block_until_ready(cpu_ext.cached_attention(q, k, v, layer, jnp.array(starts, jnp.int32), window=-1))


@pytest.mark.parametrize("n_query, starts, window, softcap, head_dim", [
    (1, [300, 7], 0, 50.0, 128),   # decode, Gemma 2's default cap, a long context over chunks
    (1, [40], 16, 0.5, 64),        # a cap below the scores' spread: many scores saturate
    (3, [70, 0], 32, 4.0, 256),    # a micro-batch through a sliding window
    (100, [0, 30], 0, 4.0, 64),    # prompts through the tiled kernel
    (40, [200], 48, 0.5, 128),     # ... through a sliding window
])
def test_soft_capped_scores_equal_the_reference(n_query, starts, window, softcap, head_dim):
    """Gemma 2's scores softcap * tanh(score / softcap) before the softmax, in both kernels; an invalid cap is an
    error."""
    batch, max_len, layer, n_head, n_head_kv = len(starts), 512, 0, 4, 2
    k, v = caches(9, 1, batch, max_len, n_head_kv, head_dim, max_len)
    q = 3 * np.random.default_rng(10).normal(size=(batch, n_query, n_head, head_dim)).astype(np.float32)
    run = jax.jit(cpu_ext.cached_attention, static_argnames=("window", "softcap"))
    got = np.asarray(run(q, k, v, jnp.int32(layer), jnp.array(starts, jnp.int32), window=window, softcap=softcap))
    expected = cpu_ext.cached_attention_reference(q, k, v, layer, jnp.array(starts), window=window, softcap=softcap)
    np.testing.assert_allclose(got, np.asarray(expected), rtol=1e-5, atol=1e-5)
    uncapped = cpu_ext.cached_attention_reference(q, k, v, layer, jnp.array(starts), window=window)
    assert np.abs(np.asarray(uncapped) - got).max() > 1e-3  # the cap is visible at these scores
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(Exception, match="softcap must be a finite number >= 0"):
            jax.block_until_ready(cpu_ext.cached_attention(q, k, v, layer, jnp.array(starts, jnp.int32),
                                                           softcap=bad))


def test_cached_attention_kernel_rejects_a_row_whose_start_is_outside_the_cache():
    k, v = caches(0, 1, 3, 8, 1, 16, 8)
    q = np.zeros((3, 2, 2, 16), np.float32)
    for starts, row in (([0, 7, 0], 1), ([0, 3, -1], 2), ([2**31 - 1, 0, 0], 0)):
        with pytest.raises(Exception, match=f"row {row}'s positions .* outside the cache"):
            jax.block_until_ready(cpu_ext.cached_attention(q, k, v, 0, np.array(starts, np.int32)))
    with pytest.raises(Exception, match="start one int32 per batch row"):
        jax.block_until_ready(cpu_ext.cached_attention(q, k, v, 0, np.array([0, 1], np.int32)))

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.attention import (MIB, MIN_KEY_STEP, attention, cached_attention, default_max_batch_mib, key_step,
                                plan_attention, scores_bytes)
from jaxinfer.blocks import sliding_attention
from jaxinfer.model import attend

HEAD_DIM = 16


def numpy_attention(q, k, v, q_pos, k_pos, softcap=0.0):
    """One query head at a time, in float64: head j reads KV head j // (H / H_kv); scores soft-capped (softcap *
    tanh(s / softcap)) where `softcap`."""
    b, t, h, hd = q.shape
    group = h // k.shape[2]
    out = np.zeros(q.shape)
    for bi in range(b):
        for j in range(h):
            scores = q[bi, :, j].astype(np.float64) @ k[bi, :, j // group].T / math.sqrt(hd)
            scores = softcap * np.tanh(scores / softcap) if softcap else scores
            scores = np.where(k_pos[None, :] <= q_pos[:, None], scores, -np.inf)
            probs = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[bi, :, j] = (probs / probs.sum(axis=1, keepdims=True)) @ v[bi, :, j // group]
    return out


def inputs(seed, batch, n_query, n_key, n_head, n_head_kv, start):
    """Queries at positions start..start+T-1 against a cache of n_key positions (those after the queries are
    masked, as in model.attention_block's cache path)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, n_query, n_head, HEAD_DIM)).astype(np.float32)
    k = rng.normal(size=(batch, n_key, n_head_kv, HEAD_DIM)).astype(np.float32)
    v = rng.normal(size=(batch, n_key, n_head_kv, HEAD_DIM)).astype(np.float32)
    return q, k, v, start + np.arange(n_query, dtype=np.int32), np.arange(n_key, dtype=np.int32)


def limits(batch, n_query, n_key, n_head, n_head_kv):
    """MiB limits that exercise each kind of plan for this call."""
    group_mib = scores_bytes(batch, n_head // n_head_kv, n_query, n_key) / MIB
    return {
        "none": None,
        "large": 2 * n_head_kv * group_mib,
        "one_kv_group_per_step": group_mib,
        "two_kv_groups_per_step": 2.5 * group_mib,
        "query_chunks": 0.3 * group_mib,
        "one_query_per_step": 1e-9,
    }


# (batch, T, S, H, H_kv, start): GQA ratios 1, 3 and 4; causal offsets into a longer cache, and a cache-less call.
CASES = [
    (1, 7, 7, 4, 4, 0),
    (2, 5, 19, 4, 4, 9),
    (1, 6, 24, 9, 3, 11),
    (2, 8, 8, 6, 2, 0),
    (1, 5, 21, 8, 2, 16),
]


@pytest.mark.slow
@pytest.mark.parametrize("batch, n_query, n_key, n_head, n_head_kv, start", CASES)
def test_equals_model_attend_and_a_per_head_loop_for_every_limit(batch, n_query, n_key, n_head, n_head_kv, start):
    q, k, v, q_pos, k_pos = inputs(start + n_head, batch, n_query, n_key, n_head, n_head_kv, start)
    plain = np.asarray(attend(q, k, v, q_pos, k_pos))
    looped = numpy_attention(q, k, v, q_pos, k_pos)
    np.testing.assert_allclose(plain, looped, rtol=1e-5, atol=1e-5)
    kinds_seen = set()
    for name, limit in limits(batch, n_query, n_key, n_head, n_head_kv).items():
        plan = plan_attention(batch, n_query, n_key, n_head, n_head_kv, limit)
        kinds_seen.add((plan.head_steps > 1, plan.query_steps > 1))
        got = jax.jit(attention, static_argnames="max_batch_mib")(q, k, v, q_pos, k_pos, max_batch_mib=limit)
        np.testing.assert_allclose(np.asarray(got), plain, rtol=1e-6, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.asarray(got), looped, rtol=1e-5, atol=1e-5, err_msg=name)
    assert kinds_seen >= {(False, False), (True, True)} | ({(True, False)} if n_head_kv > 1 else set())


@pytest.mark.parametrize("batch, n_query, n_key, n_head, n_head_kv, start", CASES)
def test_plan_respects_the_bound_with_the_fewest_steps(batch, n_query, n_key, n_head, n_head_kv, start):
    group = n_head // n_head_kv
    for name, limit in limits(batch, n_query, n_key, n_head, n_head_kv).items():
        plan = plan_attention(batch, n_query, n_key, n_head, n_head_kv, limit)
        assert plan.total_bytes == scores_bytes(batch, n_head, n_query, n_key)
        assert plan.step_bytes == scores_bytes(batch, plan.kv_heads_per_step * group, plan.queries_per_step, n_key)
        # Steps cover every head and query.
        assert plan.kv_heads_per_step * plan.head_steps >= n_head_kv
        assert plan.queries_per_step * plan.query_steps >= n_query
        floor = scores_bytes(batch, group, 1, n_key)  # one query of one KV group: the smallest step there is
        if limit is None or plan.total_bytes <= limit * MIB:
            assert plan.steps == 1, name
            continue
        assert plan.step_bytes <= max(limit * MIB, floor), name
        per_group = scores_bytes(batch, group, n_query, n_key)
        if per_group <= limit * MIB:  # whole KV groups fit: no query chunks, and no fewer head steps would fit
            assert plan.query_steps == 1, name
            assert plan.head_steps == math.ceil(n_head_kv / (limit * MIB // per_group)), name
        else:
            assert plan.kv_heads_per_step == 1, name
            assert plan.query_steps == math.ceil(n_query / max(1, limit * MIB // floor)), name


def test_the_limit_bounds_what_xla_allocates():
    """XLA's temporary memory follows the plan: well under the unsplit scores when split, at least them when not."""
    batch, n_query, n_key, n_head, n_head_kv = 1, 256, 1024, 8, 2
    q, k, v, q_pos, k_pos = inputs(0, batch, n_query, n_key, n_head, n_head_kv, n_key - n_query)
    total = scores_bytes(batch, n_head, n_query, n_key)

    def temp_bytes(limit):
        compiled = jax.jit(attention, static_argnames="max_batch_mib").lower(
            q, k, v, q_pos, k_pos, max_batch_mib=limit).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temp_bytes(None) >= total
    for limit_mib in (total / 4 / MIB, total / 16 / MIB):
        plan = plan_attention(batch, n_query, n_key, n_head, n_head_kv, limit_mib)
        assert plan.step_bytes <= limit_mib * MIB
        assert temp_bytes(limit_mib) <= 3 * plan.step_bytes + q.nbytes + 2 * k.nbytes


def test_default_limit_leaves_the_default_model_unsplit_and_splits_by_heads_only():
    # SmolLM2-135M: 9 heads, 3 KV heads, context 8192, 512-token micro-batches.
    limit = default_max_batch_mib(9, 3, 8192, 512)
    assert limit == 256.0
    assert plan_attention(1, 512, 8192, 9, 3, limit).steps == 1
    # A 64-head, 8-KV-head model at 32k: split, but by whole KV groups only.
    big = default_max_batch_mib(64, 8, 32768, 512)
    plan = plan_attention(1, 512, 32768, 64, 8, big)
    assert plan.head_steps > 1 and plan.query_steps == 1 and plan.step_bytes <= big * MIB


def test_decode_shapes_are_not_split():
    """One query against a long cache is small (ik_llama.cpp: TG at 163k is 79 MiB): no steps."""
    plan = plan_attention(1, 1, 8192, 9, 3, default_max_batch_mib(9, 3, 8192, 512))
    assert plan.steps == 1 and plan.step_bytes == 9 * 8192 * 4


def test_traced_positions_work_under_jit():
    q, k, v, q_pos, k_pos = inputs(3, 1, 4, 12, 6, 2, 8)
    limit = scores_bytes(1, 3, 4, 12) / MIB / 2  # forces query chunks

    @jax.jit
    def run(q, k, v, start):
        return attention(q, k, v, start + jnp.arange(4), jnp.arange(12), max_batch_mib=limit)

    np.testing.assert_allclose(np.asarray(run(q, k, v, 8)), numpy_attention(q, k, v, q_pos, k_pos), rtol=1e-5,
                               atol=1e-5)


def cache_inputs(seed, n_layer, batch, max_len, n_head, n_head_kv, n_query, start):
    """Queries at start..start+T-1 and KV caches [L, B, max_len, H_kv, hd] holding large values past the filled
    positions (stale padding, in the model), which must not count."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, n_query, n_head, HEAD_DIM)).astype(np.float32)
    k = rng.normal(size=(n_layer, batch, max_len, n_head_kv, HEAD_DIM)).astype(np.float32)
    v = rng.normal(size=(n_layer, batch, max_len, n_head_kv, HEAD_DIM)).astype(np.float32)
    k[:, :, start + n_query:] = v[:, :, start + n_query:] = 1e6
    return q, k, v, start + np.arange(n_query, dtype=np.int32)


@pytest.mark.parametrize("max_len, n_head, n_head_kv, n_query, start", [
    (40, 4, 2, 1, 0),     # the first decode step: one key
    (40, 4, 2, 1, 33),    # the last, partial step of a cache that 16-key steps do not divide
    (300, 6, 2, 5, 290),  # 256-key steps, the second pulled back to the cache's end
    (64, 8, 8, 16, 17),   # no GQA, a micro-batch starting mid-step
    (48, 6, 1, 3, 10),    # multi-query
])
@pytest.mark.parametrize("limit_mib", [None, 1e-6], ids=["default_steps", "smallest_steps"])
def test_cached_attention_equals_a_per_head_loop_over_the_filled_positions(max_len, n_head, n_head_kv, n_query,
                                                                           start, limit_mib):
    q, k, v, q_pos = cache_inputs(0, 2, 1, max_len, n_head, n_head_kv, n_query, start)
    layer = 1
    filled = start + n_query
    expected = numpy_attention(q, k[layer][:, :filled], v[layer][:, :filled], q_pos, np.arange(filled))
    run = jax.jit(cached_attention, static_argnames="max_batch_mib")
    got = run(q, k, v, jnp.int32(layer), jnp.asarray(q_pos), max_batch_mib=limit_mib)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


def test_key_steps_follow_the_limit():
    assert key_step(1, 1, 9, 8192, None) == 256  # decode: one step per 256 positions of context
    assert key_step(1, 1, 9, 100, None) == 100  # never more than the cache
    assert key_step(1, 512, 64, 8192, 1.0) == MIN_KEY_STEP  # 16 keys would be 2 MiB: the floor wins
    steps = key_step(1, 512, 9, 8192, 2.0)
    assert scores_bytes(1, 9, 512, steps) <= 2 * MIB < scores_bytes(1, 9, 512, 2 * steps)


@pytest.mark.parametrize("n_query, starts", [(1, [0, 33, 17]), (5, [290, 0, 100])])
@pytest.mark.parametrize("limit_mib", [None, 1e-6], ids=["default_steps", "smallest_steps"])
def test_cached_attention_with_rows_at_different_depths(n_query, starts, limit_mib):
    """q_pos [B, T]: each row attends to its own filled positions only (past them its cache holds 1e6), as the same
    row alone does; steps run to the deepest row."""
    max_len, layer, n_head, n_head_kv = 300, 1, 6, 2
    q, k, v, _ = cache_inputs(4, 2, len(starts), max_len, n_head, n_head_kv, n_query, max_len - n_query)
    for row, start in enumerate(starts):
        k[:, row, start + n_query:] = v[:, row, start + n_query:] = 1e6
    q_pos = np.array(starts, np.int32)[:, None] + np.arange(n_query, dtype=np.int32)
    run = jax.jit(cached_attention, static_argnames="max_batch_mib")
    got = np.asarray(run(q, k, v, jnp.int32(layer), jnp.asarray(q_pos), max_batch_mib=limit_mib))
    for row, start in enumerate(starts):
        filled = start + n_query
        expected = numpy_attention(q[row:row + 1], k[layer][row:row + 1, :filled], v[layer][row:row + 1, :filled],
                                   q_pos[row], np.arange(filled))
        np.testing.assert_allclose(got[row:row + 1], expected, rtol=1e-5, atol=1e-5, err_msg=f"{row=}")


def test_soft_capped_attention_in_every_path_equals_a_per_head_loop():
    """Gemma 2's attention logit soft-capping, computed by each XLA attention path: unsplit and in steps, against a
    cache in key steps (online softmax), and the sliding-window one (its window covering every key here); the cap
    changes the result (scores of unit-normal q and k reach ~4, the cap is 1.5)."""
    cap, n_query, start, max_len = 1.5, 5, 19, 40
    q, k, v, q_pos = cache_inputs(7, 2, 1, max_len, 6, 2, n_query, start)
    filled = start + n_query
    keys, values = k[1][:, :filled], v[1][:, :filled]
    expected = numpy_attention(q, keys, values, q_pos, np.arange(filled), softcap=cap)
    assert np.abs(expected - numpy_attention(q, keys, values, q_pos, np.arange(filled))).max() > 0.05
    for limit in (None, 1e-9):
        got = attention(q, keys, values, q_pos, np.arange(filled), max_batch_mib=limit, softcap=cap)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5, err_msg=str(limit))
        got = cached_attention(q, k, v, jnp.int32(1), jnp.asarray(q_pos), max_batch_mib=limit, softcap=cap)
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5, err_msg=str(limit))
    got = sliding_attention(q, k, v, jnp.asarray(q_pos)[None], max_len, layer=1, softcap=cap)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)

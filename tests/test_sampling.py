import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import SamplingParams, apply_penalties, first_argmax, sample

NO_RECENT = jnp.full((1, 4), -1, jnp.int32)


def draw(logits, params, n=400):
    keys = jax.random.split(jax.random.key(0), n)
    logits = jnp.asarray(logits, jnp.float32)[None]
    return np.asarray(jax.vmap(lambda k: sample(logits, NO_RECENT, k[None], params)[0])(keys))


@pytest.mark.slow
def test_greedy_is_argmax():
    logits = np.array([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]], np.float32)
    got = sample(jnp.asarray(logits), jnp.full((2, 4), -1), jax.random.split(jax.random.key(0), 2),
                 SamplingParams(temperature=0))
    assert got.tolist() == [1, 0]


def test_first_argmax_is_jnp_argmax():
    """Random rows, ties (the first wins), a NaN (the first NaN wins, as argmax takes NaN as the largest), -inf rows,
    +inf: the index jnp.argmax gives, in int32."""
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(8, 1000)).astype(np.float32)
    rows[1, [7, 300, 999]] = 50.0
    rows[2, [40, 41]] = np.nan
    rows[3] = -np.inf
    rows[4, [5, 6]] = np.inf
    rows[5, 998:] = 9.0
    got = jax.jit(first_argmax)(jnp.asarray(rows))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.argmax(rows, axis=-1))
    assert np.asarray(got)[1:6].tolist() == [7, 40, 0, 5, 998]


@pytest.mark.slow
def test_top_k_one_is_argmax_at_any_temperature():
    assert set(draw([0.0, 1.0, 0.5, 0.9], SamplingParams(temperature=5.0, top_k=1, min_p=0.0))) == {1}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 needs the first two.
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    drawn = draw(logits, SamplingParams(temperature=1.0, top_k=0, top_p=0.75, min_p=0.0))
    assert set(drawn) == {0, 1}


def test_min_p_drops_unlikely_tokens():
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    drawn = draw(logits, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2))
    assert set(drawn) == {0, 1, 2}  # 0.05 < 0.2 * 0.5


@pytest.mark.slow
def test_temperature_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    drawn = draw(np.log(probs), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), n=4000)
    np.testing.assert_allclose(np.bincount(drawn, minlength=3) / len(drawn), probs, atol=0.03)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = jnp.array([[2.0, -2.0, 2.0, -2.0]])
    got = apply_penalties(logits, jnp.array([[0, 1, -1]]), 2.0)
    np.testing.assert_allclose(np.asarray(got), [[1.0, -4.0, 2.0, -2.0]])


def test_frequency_and_presence_penalties_subtract_per_count_and_once_as_llama_cpp():
    """Token 0 seen twice, token 1 once, token 2 not: llama.cpp's penalties sampler (repeat first, then
    count * frequency + presence subtracted), per row with its own values."""
    logits = jnp.array([[2.0, -2.0, 2.0, 1.0], [2.0, -2.0, 2.0, 1.0]])
    recent = jnp.array([[0, 1, 0, -1], [0, 1, 0, -1]])
    got = apply_penalties(logits, recent, jnp.array([[2.0], [1.0]]), jnp.array([[0.5], [0.0]]),
                          jnp.array([[0.25], [1.0]]))
    np.testing.assert_allclose(np.asarray(got), [[1.0 - 1.0 - 0.25, -4.0 - 0.5 - 0.25, 2.0, 1.0],
                                                 [2.0 - 1.0, -2.0 - 1.0, 2.0, 1.0]])
    neutral = apply_penalties(logits, recent, 1.0, 0.0, 0.0)
    np.testing.assert_array_equal(np.asarray(neutral), np.asarray(logits))


def test_penalties_equal_counting_over_the_whole_vocabulary():
    """Only the recent tokens' logits are touched: the values of counting every token of the vocabulary in the window
    (numpy), with repeated tokens, empty slots, zero and negative logits, per-row values; the others left as they
    were."""
    rng = np.random.default_rng(0)
    batch, vocab, window = 3, 50, 24
    logits = rng.standard_normal((batch, vocab)).astype(np.float32)
    logits[:, :5] = 0.0
    recent = rng.integers(0, 12, (batch, window)).astype(np.int32)  # a few tokens, many repeats
    recent[rng.random((batch, window)) < 0.3] = -1
    repeat, frequency, presence = (rng.uniform(0.5, 2.0, (batch, 1)).astype(np.float32) for _ in range(3))
    want = logits.copy()
    for row in range(batch):
        counts = np.bincount(recent[row][recent[row] >= 0], minlength=vocab).astype(np.float32)
        seen = counts > 0
        x = logits[row, seen]
        want[row, seen] = (np.where(x > 0, x / repeat[row], x * repeat[row]) - counts[seen] * frequency[row]
                           - presence[row])
    got = apply_penalties(jnp.asarray(logits), jnp.asarray(recent), jnp.asarray(repeat), jnp.asarray(frequency),
                          jnp.asarray(presence))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)  # XLA may fuse count * frequency into its subtraction
    untouched = np.ones_like(want, bool)
    for row in range(batch):
        untouched[row, recent[row][recent[row] >= 0]] = False
    np.testing.assert_array_equal(np.asarray(got)[untouched], logits[untouched])


@pytest.mark.parametrize("field,value,flag", [
    ("temperature", -1.0, "--temp "), ("top_k", -1, "--top_k"), ("top_p", 0.0, "--top_p"), ("top_p", 1.5, "--top_p"),
    ("min_p", 2.0, "--min_p"), ("repeat_penalty", 0.0, "--repeat_penalty"), ("repeat_last_n", -2, "--repeat_last_n"),
    ("frequency_penalty", 2.5, "--frequency_penalty"), ("presence_penalty", -3.0, "--presence_penalty")])
def test_bad_values_are_rejected_naming_the_flag(field, value, flag):
    with pytest.raises(JaxinferError, match=flag):
        SamplingParams(**{field: value}).validate()


def reference_sample(logits, recent, key, params: SamplingParams):
    """The sampler before its values were traced (static values, lax.top_k of exactly top_k): the traced one must
    draw the same tokens from the same keys."""
    logits = logits.astype(jnp.float32)
    if params.repeat_last_n > 0:
        logits = apply_penalties(logits, recent, params.repeat_penalty, params.frequency_penalty,
                                 params.presence_penalty)
    if params.temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    k = params.top_k if 0 < params.top_k < logits.shape[-1] else logits.shape[-1]
    values, ids = jax.lax.top_k(logits, k)
    probs = jax.nn.softmax(values, axis=-1)
    keep = jnp.cumsum(probs, axis=-1) - probs < params.top_p
    keep &= probs >= params.min_p * probs[..., :1]
    values = jnp.where(keep, values / params.temperature, -jnp.inf)
    choice = jax.random.categorical(key, values, axis=-1)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0), SamplingParams(temperature=0, repeat_penalty=1.5),
    SamplingParams(), SamplingParams(temperature=1.3, top_k=1), SamplingParams(temperature=2.0, top_k=128),
    SamplingParams(temperature=2.0, top_k=129, top_p=1.0, min_p=0.0), SamplingParams(top_k=0, top_p=0.9),
    SamplingParams(temperature=3.0, top_k=300, top_p=1.0, min_p=0.01, repeat_penalty=1.3),
    SamplingParams(temperature=1.0, top_k=5000, top_p=0.5, min_p=0.0, repeat_penalty=0.7),
    SamplingParams(temperature=0.9, top_k=50, frequency_penalty=0.8, presence_penalty=-0.5),
    SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=2.0)])
@pytest.mark.slow
def test_traced_sampler_draws_what_the_static_one_drew(params):
    """Same tokens for the same keys, on both sides of FAST_TOP_K (300 > 128 tokens) and with top_k beyond it."""
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 2, (1, 300)), jnp.float32)
    recent = jnp.asarray(rng.integers(-1, 300, (1, 8)), jnp.int32)
    params = dataclasses.replace(params, repeat_last_n=8)
    keys = jax.random.split(jax.random.key(5), 300)
    traced = jax.jit(jax.vmap(lambda k, p: sample(logits, recent, k[None], p), in_axes=(0, None)))
    expected = jax.vmap(lambda k: reference_sample(logits, recent, k, params))(keys)
    np.testing.assert_array_equal(np.asarray(traced(keys, params.as_arrays())), np.asarray(expected))


def test_new_sampling_values_reuse_the_compiled_sampler():
    step = jax.jit(sample)
    logits, recent = jnp.zeros((1, 300)), jnp.full((1, 64), -1, jnp.int32)
    for params in (SamplingParams(), SamplingParams(temperature=0), SamplingParams(temperature=1, top_k=7, top_p=0.5),
                   SamplingParams(top_k=0, min_p=0.2, repeat_penalty=1.1), SamplingParams(top_k=2**31 - 1)):
        step(logits, recent, jax.random.key(0)[None], params.as_arrays())
    assert step._cache_size() == 1
    step(logits, recent, jax.random.key(0)[None], SamplingParams(repeat_last_n=8).as_arrays())
    assert step._cache_size() == 2  # the window size is static: it sizes the recent-token array


def test_non_finite_values_are_rejected():
    for field in ("temperature", "top_p", "min_p", "repeat_penalty"):
        for value in (float("nan"), float("inf")):
            with pytest.raises(JaxinferError, match="must be"):
                SamplingParams(**{field: value}).validate()
    with pytest.raises(JaxinferError, match="--top_k"):
        SamplingParams(top_k=2**40).validate()
    with pytest.raises(JaxinferError, match="--repeat_last_n"):
        SamplingParams(repeat_last_n=2**40).validate()

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import SamplingParams, apply_repeat_penalty, sample

NO_RECENT = jnp.full((1, 4), -1, jnp.int32)


def draw(logits, params, n=400):
    keys = jax.random.split(jax.random.key(0), n)
    logits = jnp.asarray(logits, jnp.float32)[None]
    return np.asarray(jax.vmap(lambda k: sample(logits, NO_RECENT, k, params)[0])(keys))


def test_greedy_is_argmax():
    logits = np.array([[0.1, 3.0, -1.0, 2.9], [5.0, 0.0, 0.0, 0.0]], np.float32)
    got = sample(jnp.asarray(logits), jnp.full((2, 4), -1), jax.random.key(0), SamplingParams(temperature=0))
    assert got.tolist() == [1, 0]


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


def test_temperature_sampling_follows_the_distribution():
    probs = np.array([0.6, 0.3, 0.1])
    drawn = draw(np.log(probs), SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0), n=4000)
    np.testing.assert_allclose(np.bincount(drawn, minlength=3) / len(drawn), probs, atol=0.03)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = jnp.array([[2.0, -2.0, 2.0, -2.0]])
    got = apply_repeat_penalty(logits, jnp.array([[0, 1, -1]]), 2.0)
    np.testing.assert_allclose(np.asarray(got), [[1.0, -4.0, 2.0, -2.0]])


@pytest.mark.parametrize("field,value,flag", [
    ("temperature", -1.0, "--temp "), ("top_k", -1, "--top_k"), ("top_p", 0.0, "--top_p"), ("top_p", 1.5, "--top_p"),
    ("min_p", 2.0, "--min_p"), ("repeat_penalty", 0.0, "--repeat_penalty"), ("repeat_last_n", -2, "--repeat_last_n")])
def test_bad_values_are_rejected_naming_the_flag(field, value, flag):
    with pytest.raises(JaxinferError, match=flag):
        SamplingParams(**{field: value}).validate()

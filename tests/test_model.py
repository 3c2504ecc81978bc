import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine, model
from jaxinfer.config import Config


def test_rope_rotates_adjacent_pairs_as_complex_numbers():
    """Independent formulation: pair (x[2i], x[2i+1]) is the complex number x[2i] + j x[2i+1], multiplied by
    exp(j * pos * theta^(-2i/rope_dim)); dims past rope_dim pass through."""
    rng = np.random.default_rng(0)
    cfg = Config(
        arch="llama", n_layer=1, n_embd=16, n_ff=16, n_head=2, n_head_kv=1, head_dim=8, n_vocab=8,
        n_ctx_train=64, rms_eps=1e-5, rope_theta=500.0, rope_dim=6, gate_activation="silu",
        up_activation="identity")
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    positions = np.array([0, 1, 7, 20, 33], np.int32)
    z = x[..., 0:6:2] + 1j * x[..., 1:6:2]
    angle = positions[:, None] * 500.0 ** (-np.arange(0, 6, 2) / 6)
    z = z * np.exp(1j * angle)[None, :, None, :]
    expected = x.copy()
    expected[..., 0:6:2], expected[..., 1:6:2] = z.real, z.imag
    np.testing.assert_allclose(np.asarray(model.rope(jnp.asarray(x), jnp.asarray(positions), cfg)), expected,
                               rtol=1e-5, atol=1e-5)


def test_attend_matches_per_head_loop_with_gqa():
    rng = np.random.default_rng(1)
    b, t, s, h, n_kv, hd = 2, 3, 7, 6, 2, 4
    q = rng.normal(size=(b, t, h, hd)).astype(np.float32)
    k = rng.normal(size=(b, s, n_kv, hd)).astype(np.float32)
    v = rng.normal(size=(b, s, n_kv, hd)).astype(np.float32)
    q_pos, k_pos = np.array([2, 3, 4]), np.arange(s)
    expected = np.zeros_like(q)
    for bi in range(b):
        for head in range(h):
            kv = head // (h // n_kv)
            for ti in range(t):
                visible = k_pos <= q_pos[ti]
                scores = k[bi, visible, kv] @ q[bi, ti, head] / np.sqrt(hd)
                p = np.exp(scores - scores.max())
                expected[bi, ti, head] = (p / p.sum()) @ v[bi, visible, kv]
    got = model.attend(*map(jnp.asarray, (q, k, v, q_pos, k_pos)))
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_type", [Q.F32, Q.Q4_K, Q.IQ4_XS], ids=lambda q: q.name)
def test_incremental_decode_matches_full_forward(make_model, weight_type):
    m = engine.load_model(make_model(n_embd=256, n_ff=256, weight_type=weight_type, embedding_type=Q.Q8_0))
    tokens = np.random.default_rng(2).integers(0, m.config.n_vocab, size=(1, 11)).astype(np.int32)
    full, _, _ = jax.jit(model.forward, static_argnums=2)(tokens, m.weights, m.config)
    expected = np.asarray(model.logits(full, m.weights, m.config))[0]

    n_prompt = 6
    padded = np.zeros((1, 16), np.int32)
    padded[0, :n_prompt] = tokens[0, :n_prompt]
    cache = model.init_cache(m.config, 1, 32)
    step_logits, cache = model.prefill(padded, jnp.int32(n_prompt), m.weights, cache, m.config)
    got = [np.asarray(step_logits)[0]]
    for position in range(n_prompt, tokens.shape[1]):
        step_logits, cache = model.decode_step(tokens[:, position], m.weights, cache, m.config)
        got.append(np.asarray(step_logits)[0])
    assert cache.length.tolist() == [tokens.shape[1]]
    scale = np.abs(expected).max()
    np.testing.assert_allclose(np.stack(got), expected[n_prompt - 1:], rtol=0, atol=1e-5 * scale)


def test_batched_forward_equals_one_sequence_at_a_time(make_model):
    m = engine.load_model(make_model(n_head=4, n_head_kv=1))
    tokens = np.random.default_rng(3).integers(0, m.config.n_vocab, size=(3, 9)).astype(np.int32)
    forward = jax.jit(model.forward, static_argnums=2)
    batched, _, _ = forward(tokens, m.weights, m.config)
    for row in range(3):
        single, _, _ = forward(tokens[row:row + 1], m.weights, m.config)
        np.testing.assert_allclose(np.asarray(batched[row]), np.asarray(single[0]), rtol=1e-5, atol=1e-5)


def prefill_and_decode(weights, tokens, config):
    """Logits after an 8-token prefill (padded to 16) and two decode steps, into a 40-position cache (not a multiple
    of the bounded attention's 16-key steps)."""
    padded = np.zeros((1, 16), np.int32)
    padded[0, :8] = tokens[0, :8]
    cache = model.init_cache(config, 1, 40)
    logits, cache = model.prefill(padded, jnp.int32(8), weights, cache, config)
    out = [np.asarray(logits)]
    for position in (8, 9):
        logits, cache = model.decode_step(tokens[:, position], weights, cache, config)
        out.append(np.asarray(logits))
    return np.concatenate(out)


@pytest.mark.parametrize("variant", [{"attn_max_batch_mib": 1e-4}, {"attention": "cpu_ext"},
                                     {"attention": "pallas_interpret"}],
                         ids=["bounded", "cpu_ext", "pallas_interpret"])
def test_attention_kernels_give_the_model_the_same_logits(make_model, variant):
    """Through the whole model, prefill and decode: bounded attention (head groups without a cache, 16-key steps
    against it), cpu_ext's cache kernel and the Pallas flash kernels (interpreted on CPU) equal one-piece XLA
    attention."""
    m = engine.load_model(make_model(n_head=4, n_head_kv=2), exact=True)
    xla = m.config.replan(attention="xla", attn_max_batch_mib=None)
    tokens = np.random.default_rng(4).integers(0, m.config.n_vocab, size=(1, 10)).astype(np.int32)
    run = functools.partial(prefill_and_decode, m.weights, tokens)
    reference = run(xla)
    np.testing.assert_allclose(run(xla.replan(**variant)), reference, rtol=1e-5,
                               atol=1e-5 * np.abs(reference).max())


@pytest.mark.parametrize("kernel", ["xla", "cpu_ext", "pallas_interpret"])
def test_an_f16_cache_stores_f16_and_changes_logits_by_its_rounding_only(make_model, kernel):
    """Each attention kernel reads an f16 cache: the logits move by about f16's rounding of K and V (2^-11
    relative), against the f32 cache through the same kernel."""
    m = engine.load_model(make_model(n_head=4, n_head_kv=2), exact=True)
    f32 = m.config.replan(attention=kernel)
    f16 = dataclasses.replace(f32, cache_type="f16")
    assert model.init_cache(f16, 1, 8).k.dtype == jnp.float16
    tokens = np.random.default_rng(5).integers(0, m.config.n_vocab, size=(1, 10)).astype(np.int32)
    reference, got = (prefill_and_decode(m.weights, tokens, config) for config in (f32, f16))
    scale = np.abs(reference).max()
    error = np.abs(got - reference).max() / scale
    assert 0 < error < 3e-3, error

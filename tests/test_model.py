import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine, model
from jaxinfer.config import Config

# cpu_ext's attention kernels are CPU FFI handlers: a GPU plan never picks them (scripts/gpu_check.py runs these
# tests on a GPU).
HOST_KERNELS = ["cpu_ext"] if jax.default_backend() == "cpu" else []


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
    rotated = model.rope(jnp.asarray(x), model.rope_rotation(jnp.asarray(positions), cfg), cfg)
    np.testing.assert_allclose(np.asarray(rotated), expected, rtol=1e-5, atol=1e-5)


def test_neox_rope_rotates_the_halves_as_complex_numbers():
    """llama.cpp's NEOX RoPE (BitNet): pair (x[i], x[i + rope_dim/2]) is x[i] + j x[i + rope_dim/2], multiplied by
    exp(j * pos * theta^(-2i/rope_dim)); dims past rope_dim pass through."""
    rng = np.random.default_rng(1)
    cfg = Config(
        arch="bitnet", n_layer=1, n_embd=16, n_ff=16, n_head=2, n_head_kv=1, head_dim=8, n_vocab=8,
        n_ctx_train=64, rms_eps=1e-5, rope_theta=500.0, rope_dim=6, gate_activation="silu",
        up_activation="identity", rope_type="neox")
    x = rng.normal(size=(2, 5, 3, 8)).astype(np.float32)
    positions = np.array([[0, 1, 7, 20, 33], [2, 3, 4, 5, 6]], np.int32)
    z = x[..., 0:3] + 1j * x[..., 3:6]
    angle = positions[..., None] * 500.0 ** (-np.arange(0, 6, 2) / 6)
    z = z * np.exp(1j * angle)[:, :, None, :]
    expected = x.copy()
    expected[..., 0:3], expected[..., 3:6] = z.real, z.imag
    rotated = model.rope(jnp.asarray(x), model.rope_rotation(jnp.asarray(positions), cfg), cfg)
    np.testing.assert_allclose(np.asarray(rotated), expected, rtol=1e-5, atol=1e-5)


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


@pytest.mark.slow
@pytest.mark.parametrize("weight_type", [Q.F32, Q.Q4_K, Q.IQ4_XS], ids=lambda q: q.name)
def test_incremental_decode_matches_full_forward(make_model, weight_type):
    m = engine.load_model(make_model(n_embd=256, n_ff=256, weight_type=weight_type, embedding_type=Q.Q8_0))
    assert_incremental_decode_matches_full_forward(m, n_prompt=6)


def test_the_gpu_plans_fused_decode_products_give_the_full_forwards_logits(make_model):
    """products "xla_fused" (the GPU plan): decode steps multiply as fused multiply-and-reduces, the full forward's
    11 tokens as dots, and they agree to f32 rounding."""
    m = engine.load_model(make_model(n_embd=256, n_ff=256, weight_type=Q.Q4_0), repack=False)
    fused = dataclasses.replace(m, config=m.config.replan(products="xla_fused", attention="xla"))
    assert_incremental_decode_matches_full_forward(fused, n_prompt=6)


def assert_incremental_decode_matches_full_forward(m, n_prompt: int, atol: float = 1e-5):
    """A prefill of n_prompt of 11 random tokens, then decode steps of the rest, give the full forward's logits (to
    `atol` times the largest)."""
    tokens = np.random.default_rng(2).integers(0, m.config.n_vocab, size=(1, 11)).astype(np.int32)
    full, _, _ = jax.jit(model.forward, static_argnums=2)(tokens, m.weights, m.config)
    expected = np.asarray(model.logits(full, m.weights, m.config))[0]

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
    np.testing.assert_allclose(np.stack(got), expected[n_prompt - 1:], rtol=0, atol=atol * scale)


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


@pytest.mark.parametrize("variant", [{"attn_max_batch_mib": 1e-4}, *({"attention": k} for k in HOST_KERNELS),
                                     {"attention": "pallas_interpret"}],
                         ids=["bounded", *HOST_KERNELS, "pallas_interpret"])
@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["xla", *HOST_KERNELS, "pallas_interpret"])
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


def prefill_and_decode_alone(weights, config, prompt, steps):
    """One sequence: its logits after its prompt (one chunk of 16) and after each token of `steps`."""
    padded = np.zeros((1, 16), np.int32)
    padded[0, :len(prompt)] = prompt
    cache = model.init_cache(config, 1, 40)
    logits, cache = model.prefill(padded, jnp.int32(len(prompt)), weights, cache, config)
    out = [np.asarray(logits)[0]]
    for token in steps:
        logits, cache = model.decode_step(np.array([token], np.int32), weights, cache, config)
        out.append(np.asarray(logits)[0])
    return np.stack(out)


def chunks_of(prompts, chunk):
    """Prompts of different lengths prefilled together in chunks of `chunk`: (tokens [B, chunk], n_valid [B]) per
    chunk; a prompt already done has n_valid 0 in the later chunks."""
    n_chunks = -(-max(map(len, prompts)) // chunk)
    for c in range(n_chunks):
        tokens = np.zeros((len(prompts), chunk), np.int32)
        pieces = [p[c * chunk:(c + 1) * chunk] for p in prompts]
        for row, piece in enumerate(pieces):
            tokens[row, :len(piece)] = piece
        yield tokens, np.array([len(piece) for piece in pieces], np.int32)


@pytest.mark.slow
@pytest.mark.parametrize("cache_type", ["f32", "f16"])
@pytest.mark.parametrize("kernel", ["xla", *HOST_KERNELS, "pallas_interpret"])
def test_sequences_at_different_depths_give_the_logits_each_gives_alone(make_model, kernel, cache_type):
    """Three prompts of 3, 8 and 13 tokens prefill together in chunks of 8 (the two short ones sit out the second
    chunk) and then decode together, each step at three different depths: row by row, the logits are those of each
    sequence run alone in a one-row cache. The sitting-out rows' caches stay bit for bit as they were."""
    m = engine.load_model(make_model(n_head=4, n_head_kv=2), exact=True)
    config = dataclasses.replace(m.config.replan(attention=kernel), cache_type=cache_type)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, config.n_vocab, size=n).astype(np.int32) for n in (3, 8, 13)]
    steps = rng.integers(0, config.n_vocab, size=(3, 3)).astype(np.int32)

    cache = model.init_cache(config, 3, 40)
    last = [None] * 3
    for tokens, n_valid in chunks_of(prompts, 8):
        before = jax.tree.map(np.asarray, cache)
        logits, cache = model.prefill(tokens, n_valid, m.weights, cache, config)
        for row in range(3):
            if n_valid[row]:
                last[row] = np.asarray(logits)[row]
            else:
                np.testing.assert_array_equal(np.asarray(cache.k)[:, row], before.k[:, row])
                np.testing.assert_array_equal(np.asarray(cache.v)[:, row], before.v[:, row])
                assert int(cache.length[row]) == before.length[row]
    assert cache.length.tolist() == [3, 8, 13]
    batched = [np.stack(last)]
    for step in steps.T:
        logits, cache = model.decode_step(step, m.weights, cache, config)
        batched.append(np.asarray(logits))
    assert cache.length.tolist() == [6, 11, 16]
    batched = np.stack(batched, axis=1)  # [row, step, n_vocab]

    for row in range(3):
        alone = prefill_and_decode_alone(m.weights, config, prompts[row], steps[row])
        np.testing.assert_allclose(batched[row], alone, rtol=0, atol=1e-5 * np.abs(alone).max(), err_msg=f"{row=}")


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["xla", *HOST_KERNELS, "pallas_interpret"])
def test_slots_of_a_larger_cache_prefill_and_decode_as_each_does_alone(make_model, kernel):
    """A server's slots: two prompts prefill one at a time into rows 2 and 0 of a 4-row cache (prefill's row), then
    decode steps advance the cache's first 3 rows with row 1 not active: each sequence's logits are those it gives
    alone, and rows 1 and 3 stay as they were (empty)."""
    m = engine.load_model(make_model(n_head=4, n_head_kv=2), exact=True)
    config = m.config.replan(attention=kernel)
    rng = np.random.default_rng(8)
    prompts = {2: rng.integers(0, config.n_vocab, size=5), 0: rng.integers(0, config.n_vocab, size=11)}
    steps = rng.integers(0, config.n_vocab, size=(3, 3)).astype(np.int32)
    cache = model.init_cache(config, 4, 40)
    got = {}
    for row, prompt in prompts.items():
        padded = np.zeros((1, 16), np.int32)
        padded[0, :len(prompt)] = prompt
        logits, cache = model.prefill(padded, jnp.int32(len(prompt)), m.weights, cache, config, jnp.int32(row))
        got[row] = [np.asarray(logits)[0]]
    assert cache.length.tolist() == [11, 0, 5, 0]
    for step in steps.T:
        logits, cache = model.decode_step(step, m.weights, cache, config, jnp.array([True, False, True]))
        for row in prompts:
            got[row].append(np.asarray(logits)[row])
    assert cache.length.tolist() == [14, 0, 8, 0]
    assert not np.asarray(cache.k)[:, 1::2].any() and not np.asarray(cache.v)[:, 1::2].any()
    for row, prompt in prompts.items():
        alone = prefill_and_decode_alone(m.weights, config, prompt, steps[row])
        np.testing.assert_allclose(np.stack(got[row]), alone, rtol=0, atol=1e-5 * np.abs(alone).max(),
                                   err_msg=f"{row=}")


def test_prefill_takes_one_count_for_every_row_or_one_per_row(make_model):
    """A scalar n_valid applies to every row (the single-sequence callers pass one); [B] counts advance each row by
    its own."""
    m = engine.load_model(make_model())
    tokens = np.random.default_rng(7).integers(0, m.config.n_vocab, size=(2, 8)).astype(np.int32)
    _, cache = model.prefill(tokens, jnp.int32(5), m.weights, model.init_cache(m.config, 2, 16), m.config)
    assert cache.length.tolist() == [5, 5]
    _, cache = model.prefill(tokens, np.array([0, 2], np.int32), m.weights, cache, m.config)
    assert cache.length.tolist() == [5, 7]


def cache_copies(compiled_text: str, cache: model.KVCache) -> list[str]:
    """The instructions of a compiled program that copy a whole KV cache."""
    shape = f"[{','.join(map(str, cache.k.shape))}]"
    return [line for line in compiled_text.splitlines() if re.search(r"= \S+ copy(-start)?\(", line) and shape in line]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["xla", *HOST_KERNELS])
def test_a_batched_decode_step_writes_the_donated_cache_in_place(make_model, kernel):
    """Per-row positions make the K/V write a scatter: XLA must still update the donated cache in place, with no
    copy of it per step, for one row and for several."""
    m = engine.load_model(make_model(n_head=4, n_head_kv=2))
    config = m.config.replan(attention=kernel)
    for batch in (1, 3):
        cache = model.init_cache(config, batch, 64)
        step = model.decode_step.lower(jnp.zeros(batch, jnp.int32), m.weights, cache, config).compile()
        assert cache_copies(step.as_text(), cache) == [], batch
        prefill = model.prefill.lower(jnp.zeros((batch, 8), jnp.int32), jnp.zeros(batch, jnp.int32), m.weights,
                                      cache, config).compile()
        assert cache_copies(prefill.as_text(), cache) == [], batch

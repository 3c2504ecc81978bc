"""BitNet's block (config `bitnet` and `bitnet-b1.58`, model.py's sub-norms, QuantArray.scale): the model against a
plain numpy forward of the same equations, incremental decode against the full forward, and the squared-ReLU FFN's
natural zeros skipped by the dense mode."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine, evaluation, model, quant, sharding, sparse_ffn, sparsity, ternary
from jaxinfer.config import ARCHITECTURES
from jaxinfer.errors import JaxinferError
from jaxinfer.synthetic import SyntheticSpec, write_model
from test_model import assert_incremental_decode_matches_full_forward

SPEC = dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2)
LLAMA_CPP_LOGITS = pathlib.Path(__file__).parent / "data" / "llama_cpp_bitnet_tq2_0.kld"  # see data/README.md


def bitnet_model(tmp_path, arch: str, qtype, **fields):
    spec = SyntheticSpec(architecture=arch, weight_type=qtype, projection_scales=True, **{**SPEC, **fields})
    return engine.load_model(write_model(str(tmp_path / f"{arch}-{qtype.name}.gguf"), spec))


def rms(x, gamma, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def reference_logits(m, tokens: np.ndarray) -> np.ndarray:
    """llama.cpp's build_bitnet in numpy (f64) for one sequence, from each weight's values: norm, q/k/v (each
    times its scale, which its values carry), RoPE, causal attention, attn_sub_norm, attn_output; norm, gate and
    up, gate activation (SiLU or squared ReLU) times up, ffn_sub_norm, ffn_down; final norm, output. I2_S inputs are
    rounded to int8 per token first, as BitNet's BitLinear does."""
    cfg, w = m.config, m.weights
    act = {"silu": lambda v: v / (1 + np.exp(-v)), "relu_sqr": lambda v: np.maximum(v, 0) ** 2}[cfg.gate_activation]

    def product(x, weight):
        if weight.qtype == ternary.I2_S:
            x = np.asarray(ternary.absmax_int8(jnp.asarray(x, jnp.float32)), np.float64)
        return x @ np.asarray(quant.dequantize(weight), np.float64).T

    positions = np.arange(len(tokens))
    x = np.asarray(quant.take_rows(w.token_embd, jnp.asarray(tokens)), np.float64)
    for layer in w.layers:
        h = rms(x, np.asarray(layer.attn_norm), cfg.rms_eps)
        q, k, v = (product(h, p).reshape(len(tokens), -1, cfg.head_dim)
                   for p in (layer.attn_q, layer.attn_k, layer.attn_v))
        rotation = model.rope_rotation(jnp.asarray(positions), cfg)
        q, k = (np.asarray(model.rope(jnp.asarray(t[None], jnp.float32), rotation, cfg))[0] for t in (q, k))
        group = cfg.n_head // cfg.n_head_kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(cfg.head_dim)
        scores = np.where(positions[None, None, :] <= positions[None, :, None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", probs, v).reshape(len(tokens), -1)
        x = x + product(rms(attn, np.asarray(layer.attn_sub_norm), cfg.rms_eps), layer.attn_output)
        h = rms(x, np.asarray(layer.ffn_norm), cfg.rms_eps)
        hidden = act(product(h, layer.ffn_gate)) * product(h, layer.ffn_up)
        x = x + product(rms(hidden, np.asarray(layer.ffn_sub_norm), cfg.rms_eps), layer.ffn_down)
    return product(rms(x, np.asarray(w.output_norm), cfg.rms_eps), w.output)


def test_the_architectures_are_registered_with_their_block():
    assert ARCHITECTURES["bitnet"].gate_activation == "silu" and ARCHITECTURES["bitnet"].sub_norms
    assert ARCHITECTURES["bitnet-b1.58"].gate_activation == "relu_sqr" and ARCHITECTURES["bitnet-b1.58"].sub_norms
    assert ARCHITECTURES["bitnet"].rope_type == ARCHITECTURES["bitnet-b1.58"].rope_type == "neox"  # llama.cpp's
    assert not ARCHITECTURES["llama"].sub_norms and ARCHITECTURES["llama"].rope_type == "norm"


@pytest.mark.parametrize("arch, qtype", [("bitnet", Q.TQ2_0), ("bitnet-b1.58", Q.TQ1_0),
                                         ("bitnet-b1.58", ternary.I2_S), ("bitnet", Q.F32)],
                         ids=lambda v: getattr(v, "name", v))
@pytest.mark.slow
def test_forward_is_the_block_s_equations(tmp_path, arch, qtype):
    """With XLA's products to f32 rounding; with cpu_ext's ternary kernels to their 8-bit activations' rounding
    (TQ1_0/TQ2_0: llama.cpp's Q8_K, a scale per 256 values, measured 2.9e-2 and 3.3e-2 of the largest logit after two
    layers; I2_S: the reference's own int8 activations, measured 3e-7; F32 weights stay with XLA)."""
    m = bitnet_model(tmp_path, arch, qtype)
    assert all(layer.attn_q.scale != 1.0 for layer in m.weights.layers)  # the projections' scales were read
    tokens = np.random.default_rng(0).integers(0, m.config.n_vocab, 9).astype(np.int32)
    expected = reference_logits(m, tokens)
    for products, tolerance in (("xla", 2e-4), ("cpu_ext", 1e-5 if qtype in (ternary.I2_S, Q.F32) else 5e-2)):
        cfg = m.config.replan(products=products)
        hidden, _, _ = jax.jit(model.forward, static_argnums=2)(tokens[None], m.weights, cfg)
        got = np.asarray(model.logits(hidden, m.weights, cfg))[0]
        np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance * np.abs(expected).max(), err_msg=products)


def test_a_bitnet_file_gives_llama_cpp_s_logits(tmp_path):
    """llama.cpp's logits for the same synthetic file (its bitnet graph: NEOX RoPE, sub-norms, scales; TQ2_0 dots
    against 8-bit activations): KL divergence 2.3e-4 and the same top token for 96% (NORM RoPE: 0.14 and 41%)."""
    m = bitnet_model(tmp_path, "bitnet", Q.TQ2_0)
    base = evaluation.read_logits_file(str(LLAMA_CPP_LOGITS))
    windows = base.tokens.reshape(base.n_chunk, base.n_ctx)
    result = evaluation.evaluate_windows(m.weights, m.config, windows, n_seq=4, base=base, progress=False)
    assert result.kl.mean < 1e-3 and result.kl.same_top > 0.9
    assert result.kl.base_ppl == pytest.approx(600.3050, rel=1e-4)
    assert result.ppl == pytest.approx(600.3050, rel=1e-2)


def test_incremental_decode_matches_the_full_forward(tmp_path):
    assert_incremental_decode_matches_full_forward(bitnet_model(tmp_path, "bitnet-b1.58", ternary.I2_S), n_prompt=5)


@pytest.mark.slow
def test_the_squared_relu_ffn_has_natural_zeros_that_the_dense_mode_skips(tmp_path):
    """b1.58's FFN: relu(gate)² is zero for about half the neurons, and the dense mode's `active` is exactly the
    nonzero hidden values (their down rows alone are read); SiLU's bitnet has next to none (an integer dot of a
    ternary row with 8-bit activations is exactly 0 now and then: 0.15% of the hidden values here)."""
    for arch, zeros in (("bitnet-b1.58", True), ("bitnet", False)):
        m = bitnet_model(tmp_path, arch, Q.TQ2_0)
        tokens = np.random.default_rng(4).integers(0, m.config.n_vocab, (1, 16)).astype(np.int32)
        _, _, traces = model.forward(tokens, m.weights, m.config, observe=lambda i, trace: trace)
        for trace in traces:
            active = np.asarray(trace.active)
            np.testing.assert_array_equal(active, np.asarray(trace.hidden) != 0)
            assert (0.3 < 1 - active.mean() < 0.7) if zeros else active.mean() > 0.97, active.mean()


def test_hidden_norm_keeps_the_sparse_modes_zeros():
    hidden = jnp.asarray([[0.0, 2.0, 0.0, -1.0]])
    normed = sparse_ffn._normed(hidden, lambda h: model.rms_norm(h, jnp.ones(4), 1e-5))
    np.testing.assert_array_equal(np.asarray(normed) == 0, np.asarray(hidden) == 0)


def test_what_does_not_apply_to_bitnet_yet_says_so(tmp_path):
    path = write_model(str(tmp_path / "b.gguf"), SyntheticSpec(architecture="bitnet", weight_type=Q.TQ2_0, **SPEC))
    m = engine.load_model(path)
    with pytest.raises(JaxinferError, match="sub-norms normalize over all heads"):
        sharding.check_model(m.config, 2)
    with pytest.raises(JaxinferError, match="hot/cold split .* does not apply to BitNet"):
        engine.split_model(m, 1.0, 64, None, False)


def greedy(m, cfg, prompt, n_new):
    """Greedy tokens after `prompt` through prefill and decode steps, and the logits of every step."""
    padded = np.zeros((1, 16), np.int32)
    padded[0, :len(prompt)] = prompt
    cache = model.init_cache(cfg, 1, 32)
    logits, cache = model.prefill(padded, jnp.int32(len(prompt)), m.weights, cache, cfg)
    tokens, steps = [], [np.asarray(logits)[0]]
    for _ in range(n_new):
        tokens.append(int(np.argmax(steps[-1])))
        logits, cache = model.decode_step(jnp.asarray([tokens[-1]], jnp.int32), m.weights, cache, cfg)
        steps.append(np.asarray(logits)[0])
    return tokens, np.stack(steps)


@pytest.mark.parametrize("qtype", [Q.TQ2_0, ternary.I2_S], ids=lambda q: q.name)
def test_sparse_modes_skip_b1_58_s_zeros_and_give_the_unsparsified_tokens(tmp_path, qtype):
    """--sparsity dense stores the ternary down projections one row per neuron, exactly (I2_S), so that the zeros
    of relu² are not read; hidden:S and gate:S run on the same rows. Greedy tokens are those of the unsparsified
    model with XLA's products; logits within the kernels' 8-bit rounding (TQ2_0: Q8_K; the down rows round h to int8
    per panel of 16 rows where BitNet's reference rounds it per token: measured 2.1e-2 .. 2.5e-2 of the largest logit
    for both types and all three modes, against 2.7e-2 for TQ2_0's unsparsified kernels and 4e-7 for I2_S's)."""
    m = bitnet_model(tmp_path, "bitnet-b1.58", qtype)
    prompt = np.random.default_rng(5).integers(0, m.config.n_vocab, 6).astype(np.int32)
    expected_tokens, expected = greedy(m, m.config.replan(products="xla"), prompt, 5)
    thresholds = str(tmp_path / "thresholds.json")
    for method in ("hidden", "gate"):
        sparsity.save_thresholds(m.path, method, {0.5: np.full(SPEC["n_layer"], 1e-3)}, "test", thresholds)
    for spec, file in (("dense", None), ("hidden:0.5", thresholds), ("gate:0.5", thresholds)):
        sparse = sparsity.apply(m, sparsity.parse_spec(spec), thresholds_file=file)
        for layer, original in zip(sparse.weights.layers, m.weights.layers):
            assert layer.ffn_down is None and layer.ffn_down_t.qtype == ternary.I2_S
            np.testing.assert_array_equal(np.asarray(quant.dequantize(layer.ffn_down_t)),
                                          np.asarray(quant.dequantize(original.ffn_down)).T)
        tokens, got = greedy(sparse, sparse.config, prompt, 5)
        assert tokens == expected_tokens, spec
        np.testing.assert_allclose(got, expected, rtol=0, atol=4e-2 * np.abs(expected).max(), err_msg=spec)

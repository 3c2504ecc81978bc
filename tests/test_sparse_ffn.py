import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from jaxinfer import engine, model, quant, sparse_ffn, sparsity
from jaxinfer.errors import JaxinferError


def forward_logits(m, tokens):
    hidden, _, _ = jax.jit(model.forward, static_argnums=2)(tokens, m.weights, m.config)
    return np.asarray(model.logits(hidden, m.weights, m.config))


def with_thresholds(m, mode, value):
    layers = [dataclasses.replace(layer, ffn_threshold=jnp.float32(value)) for layer in m.weights.layers]
    return dataclasses.replace(m, config=m.config.replan(ffn_sparsity=mode),
                               weights=dataclasses.replace(m.weights, layers=layers))


@pytest.mark.parametrize("mode", ["gate", "hidden"])
def test_all_active_mask_equals_dense(make_model, mode):
    m = engine.load_model(make_model())
    tokens = np.random.default_rng(0).integers(0, m.config.n_vocab, size=(2, 12)).astype(np.int32)
    np.testing.assert_allclose(forward_logits(with_thresholds(m, mode, -1.0), tokens), forward_logits(m, tokens),
                               rtol=1e-6, atol=1e-6)


def test_masked_ffn_matches_a_numpy_reference(make_model):
    m = engine.load_model(make_model(weight_type=Q.Q8_0), exact=True)
    layer = m.weights.layers[0]
    x = np.random.default_rng(1).normal(size=(3, 64)).astype(np.float32)
    cfg = m.config.replan(ffn_sparsity="hidden")
    layer = dataclasses.replace(layer, ffn_threshold=jnp.float32(0.05))
    out, trace = sparse_ffn.ffn(jnp.asarray(x), jnp.asarray(x), layer, cfg)
    gate = x @ np.asarray(quant.dequantize(layer.ffn_gate)).T
    h = gate / (1 + np.exp(-gate)) * (x @ np.asarray(quant.dequantize(layer.ffn_up)).T)
    active = np.abs(h) > 0.05
    assert 0.05 < active.mean() < 0.95
    np.testing.assert_array_equal(np.asarray(trace.active), active)
    expected = np.where(active, h, 0) @ np.asarray(quant.dequantize(layer.ffn_down)).T
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-4, atol=1e-5)


def test_predictor_mask_follows_relu_activity_and_down_t_is_used(make_model):
    m = engine.load_model(make_model(n_embd=64, n_ff=256, sparsity=0.85, predictor_type=Q.F32))
    tokens = np.random.default_rng(2).integers(3, 259, size=(2, 32)).astype(np.int32)
    dense = forward_logits(m, tokens)
    predicted = sparsity.apply(m, sparsity.SparsitySpec("predictor"))

    def agreement(index, trace):
        relu_active = trace.hidden != 0
        return jnp.mean(trace.active == relu_active)

    _, _, observed = jax.jit(model.forward, static_argnums=(2, 4))(tokens, predicted.weights, predicted.config,
                                                                    None, agreement)
    assert min(float(a) for a in observed) > 0.99  # the exact synthetic predictor misses only near-zero gates
    np.testing.assert_allclose(forward_logits(predicted, tokens), dense, rtol=1e-3, atol=1e-3 * np.abs(dense).max())


def test_specs_are_validated(make_model):
    assert str(sparsity.parse_spec("hidden:0.5")) == "hidden:0.5"
    for bad in ["sparse", "gate", "gate:1.5", "dense:0.2", "hidden:x"]:
        with pytest.raises(JaxinferError):
            sparsity.parse_spec(bad)
    m = engine.load_model(make_model())
    with pytest.raises(JaxinferError, match="no activation predictors"):
        sparsity.apply(m, sparsity.SparsitySpec("predictor"))
    with pytest.raises(JaxinferError, match="calibrate"):
        sparsity.apply(m, sparsity.SparsitySpec("gate", 0.5))


def test_bamboo_is_relu_on_gate_and_up(make_model):
    m = engine.load_model(make_model(architecture="bamboo", n_embd=64, n_ff=128, sparsity=0.8))
    assert (m.config.gate_activation, m.config.up_activation) == ("relu", "relu")
    layer = m.weights.layers[0]
    x = np.random.default_rng(3).normal(size=(4, 64)).astype(np.float32)
    _, trace = sparse_ffn.ffn(jnp.asarray(x), jnp.asarray(x), layer, m.config)
    gate = np.maximum(x @ np.asarray(quant.dequantize(layer.ffn_gate)).T, 0)
    up = np.maximum(x @ np.asarray(quant.dequantize(layer.ffn_up)).T, 0)
    np.testing.assert_allclose(np.asarray(trace.hidden), gate * up, rtol=1e-5, atol=1e-6)
    assert np.asarray(trace.active).mean() < np.asarray(trace.gate > 0).mean()  # dReLU is sparser than ReLU alone


@pytest.mark.parametrize("mode, weight_type", [("hidden", Q.Q8_0), ("hidden", Q.Q4_1), ("gate", Q.Q8_0),
                                               ("predictor", Q.Q8_0)])
@pytest.mark.slow
def test_row_skipping_kernels_agree_with_the_masked_reference(make_model, mode, weight_type):
    """On the CPU the sparse modes go through cpu_ext's masked kernels (8-bit activations for gate/up; for down 8-bit
    integer dots over ffn_down packed neuron-major, or an f32 axpy over a PowerInfer file's transposed ffn_down_t):
    the same masks, and outputs within the 8-bit activation error of the exact masked FFN."""
    pytest.importorskip("cpu_ext")
    path = make_model(n_embd=64, n_ff=256, sparsity=0.85, weight_type=weight_type) if mode == "predictor" else \
        make_model(n_embd=64, weight_type=weight_type)
    fast, exact = engine.load_model(path), engine.load_model(path, exact=True)
    layer, exact_layer = fast.weights.layers[0], exact.weights.layers[0]
    if mode != "predictor":
        layer = sparsity.with_transposed_down(dataclasses.replace(layer, ffn_threshold=jnp.float32(0.05)))
        exact_layer = dataclasses.replace(exact_layer, ffn_threshold=jnp.float32(0.05), ffn_down=None,
                                          ffn_down_t=dataclasses.replace(layer.ffn_down_t, exact=True))
    assert layer.ffn_down_t is not None
    # Packed neuron-major at load; a PowerInfer file (the predictor model) brings its own transposed ffn_down_t.
    assert (layer.ffn_down_t.layout == quant.NEURON_MAJOR) == (mode != "predictor")
    cfg = fast.config.replan(ffn_sparsity=mode)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 3, fast.config.n_embd)).astype(np.float32))
    if cfg.plan.backend != "cpu":
        pytest.skip("cpu_ext's row-skipping kernels multiply in device memory on the CPU backend only")
    assert cfg.plan.products == "cpu_ext"

    @partial(jax.jit, static_argnums=3)
    def run(x, ffn_inp, layer, cfg):
        with quant.products(cfg.plan.products):
            return sparse_ffn.ffn(x, ffn_inp, layer, cfg)

    out, trace = run(x, x, layer, cfg)
    expected, expected_trace = run(x, x, exact_layer, cfg)
    active = np.asarray(expected_trace.active)
    assert 0.05 < active.mean() < 0.95
    assert (np.asarray(trace.active) != active).mean() < 0.02  # only neurons at the threshold may flip
    scale = np.abs(np.asarray(expected)).max()
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=0, atol=0.05 * scale)
    assert not np.allclose(np.asarray(out), np.asarray(expected), rtol=1e-6, atol=1e-7)  # the kernels did run


def test_down_projection_is_transposed_in_the_requested_type(make_model):
    m = engine.load_model(make_model(weight_type=Q.Q4_1))
    down = m.weights.layers[0].ffn_down
    transposed = quant.transpose(down)
    assert transposed.qtype == Q.Q4_1 and transposed.shape == down.shape[::-1]
    values = np.asarray(quant.dequantize(down)).T
    np.testing.assert_array_equal(np.asarray(transposed.data), gguf_quants.quantize(np.ascontiguousarray(values),
                                                                                     Q.Q4_1))
    q8 = quant.transpose(down, Q.Q8_0)
    assert q8.qtype == Q.Q8_0
    np.testing.assert_allclose(np.asarray(quant.dequantize(q8)), values, rtol=0, atol=np.abs(values).max() / 100)
    exact = quant.transpose(dataclasses.replace(down, exact=True))
    assert exact.qtype == Q.F32 and exact.exact
    np.testing.assert_array_equal(np.asarray(exact.data), values)
    with pytest.raises(JaxinferError, match="--down_t_type"):
        sparsity.parse_down_t_type("q6_k")
    assert sparsity.parse_down_t_type("Q8_0") == Q.Q8_0 and sparsity.parse_down_t_type("same") is None


def test_moderate_sparsity_packs_the_down_projection_and_high_sparsity_transposes_it(make_model):
    """Neuron-major up to NEURON_MAJOR_MAX_SPARSITY where its kernel is fast (and the same values), transposed above it
    and for predictors."""
    m = engine.load_model(make_model(n_embd=64, weight_type=Q.Q4_1))
    layer = m.weights.layers[0]
    assert "down projection" not in m.describe()
    layers = [sparsity.with_transposed_down(each) for each in m.weights.layers]
    packed_model = dataclasses.replace(m, weights=dataclasses.replace(m.weights, layers=layers))
    assert packed_model.describe().endswith(", down projection one row per neuron (Q4_1 neuron-major in spans of 64 "
                                            "outputs)")
    for fast in (True, False):
        plan = dataclasses.replace(m.config.plan, neuron_major=fast)
        assert sparsity.packs_neuron_major(sparsity.parse_spec("hidden:0.5"), plan) == fast
        assert sparsity.packs_neuron_major(sparsity.parse_spec("gate:0.7"), plan) == fast
        assert not sparsity.packs_neuron_major(sparsity.parse_spec("hidden:0.9"), plan)
        assert not sparsity.packs_neuron_major(sparsity.parse_spec("predictor"), plan)
    packed = sparsity.with_transposed_down(layer).ffn_down_t
    transposed = sparsity.with_transposed_down(layer, pack=False).ffn_down_t
    assert packed.layout == quant.NEURON_MAJOR and transposed.layout == quant.ROW_BLOCKS
    assert quant.layout_name(packed) == "Q4_1 neuron-major in spans of 64 outputs"
    assert quant.layout_name(transposed) == "Q4_1"
    np.testing.assert_array_equal(np.asarray(quant.dequantize(packed)),
                                  np.asarray(quant.dequantize(layer.ffn_down)).T)

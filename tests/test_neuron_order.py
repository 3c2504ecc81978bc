"""Hot neurons first (jaxinfer/neuron_order.py): a permutation of each layer's FFN neurons by the activation profile,
the same function as the file's order."""

import jax
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import activation_profile, engine, evaluation, model, neuron_order, quant, sparsity
from jaxinfer.sampling import SamplingParams

PREDICTOR = sparsity.SparsitySpec("predictor")
TOKENS = np.array([[5, 17, 250, 3, 99, 42, 7, 128]], np.int32)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A predictor model (Q8_0 predictors, repacked) with an activation profile beside it, and its counts."""
    from jaxinfer.synthetic import SyntheticSpec, write_model

    path = str(tmp_path_factory.mktemp("order") / "sparse.gguf")
    write_model(path, SyntheticSpec(n_embd=128, n_ff=512, weight_type=Q.Q8_0, sparsity=0.85, n_ctx=64,
                                    predictor_type=Q.Q8_0))
    m = engine.build_model(path, sparsity_spec=PREDICTOR)
    windows = evaluation.make_windows(np.random.default_rng(1).integers(3, 259, size=4 * 32), 32, -1, None)
    counts = activation_profile.profile_counts(m, windows)
    activation_profile.write_profile(activation_profile.default_directory(path, create=True), path, counts, 128,
                                     "predictor")
    return path, counts


def logits(m):
    return np.asarray(model.forward(TOKENS, m.weights, m.config)[0])


def test_the_rows_are_the_files_hottest_first(profiled):
    path, counts = profiled
    m = engine.build_model(path, sparsity_spec=PREDICTOR, exact=True)
    ordered = engine.build_model(path, sparsity_spec=PREDICTOR, exact=True, hot_first=True)
    assert ordered.neuron_order.startswith("from the activation profile in ") and "hottest first" in ordered.describe()
    for i, (layer, new) in enumerate(zip(m.weights.layers, ordered.weights.layers)):
        order = neuron_order.hottest_first(counts)[i]
        assert np.all(np.diff(counts[i][order]) <= 0)
        for name in ("ffn_gate", "ffn_up", "ffn_down_t", "fc2"):
            np.testing.assert_array_equal(np.asarray(quant.dequantize(getattr(new, name))),
                                          np.asarray(quant.dequantize(getattr(layer, name)))[order], err_msg=name)
        np.testing.assert_array_equal(np.asarray(quant.dequantize(new.fc1)), np.asarray(quant.dequantize(layer.fc1)))
    repacked = engine.build_model(path, sparsity_spec=PREDICTOR, hot_first=True).weights.layers[0]
    assert repacked.fc2.layout == quant.ROWS_X8 and repacked.ffn_down_t.layout == quant.DOWN_ROWS  # their layouts
    np.testing.assert_array_equal(np.asarray(quant.dequantize(repacked.fc2)), np.asarray(quant.dequantize(
        ordered.weights.layers[0].fc2)))


@pytest.mark.parametrize("spec", [PREDICTOR, sparsity.SparsitySpec("dense")], ids=str)
def test_a_built_model_holds_every_weight_placed(profiled, spec):
    """Whatever load made in numpy (rows reordered hottest first, down rows packed) is placed, 64-byte aligned: a
    numpy array among the weights is an argument every compiled call converts, a copy each time where it is not
    aligned (hot-first decode of a 7B-shaped predictor file ran 0.73-0.77x the file's order)."""
    path, _ = profiled
    m = engine.build_model(path, sparsity_spec=spec, hot_first=True)
    assert m.neuron_order is not None
    for leaf in jax.tree.leaves(m.weights):
        assert isinstance(leaf, jax.Array), type(leaf)
        assert leaf.unsafe_buffer_pointer() % 64 == 0


def test_the_same_function_with_exact_products_and_to_the_kernels_rounding_with_them(profiled):
    path, _ = profiled
    for exact, tolerance in ((True, 1e-5), (False, 5e-2)):  # the down projection's groups of 32 follow the order
        m = engine.build_model(path, sparsity_spec=PREDICTOR, exact=exact)
        ordered = engine.build_model(path, sparsity_spec=PREDICTOR, exact=exact, hot_first=True)
        expected = logits(m)
        np.testing.assert_allclose(logits(ordered), expected, rtol=0, atol=tolerance * max(1.0, np.abs(expected).max()))
        if exact:
            greedy = SamplingParams(temperature=0)
            assert (list(engine.generate_tokens(ordered, TOKENS[0].tolist(), 8, 32, greedy, 0, stop_ids=frozenset()))
                    == list(engine.generate_tokens(m, TOKENS[0].tolist(), 8, 32, greedy, 0, stop_ids=frozenset())))


def test_left_in_the_files_order_where_it_cannot_or_should_not_change(profiled, make_model, tmp_path):
    path, _ = profiled
    assert engine.build_model(path, sparsity_spec=PREDICTOR).neuron_order is None  # not asked (profile, calibrate)
    no_profile = make_model(n_embd=128, n_ff=512, sparsity=0.85, n_ctx=64)
    assert engine.build_model(no_profile, sparsity_spec=PREDICTOR, hot_first=True).neuron_order is None
    stale = str(tmp_path / "stale")  # a profile of another shape is not used, and not an error
    activation_profile.write_profile(stale, path, np.ones((2, 64)), 8, "predictor")
    assert engine.build_model(path, sparsity_spec=PREDICTOR, hot_first=True, activation_dir=stale).neuron_order is None
    dense_swiglu = make_model(name="dense.gguf", n_embd=64, n_ff=128)  # no down projection per neuron
    assert not any(neuron_order.can_order(layer) for layer in engine.build_model(dense_swiglu).weights.layers)

"""repack.py: which weights a model repacks eight rows to a group at load, and that the model computes what it computes
in GGUF's rows: the portable kernels' bits, the same greedy tokens, the same sparse FFN after load."""

import dataclasses

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import cpu_ext
from jaxinfer import engine, inspection, model, quant, repack, sparsity, x8_kquants
from jaxinfer.quant import ROW_BLOCKS, ROWS_X8
from jaxinfer.synthetic import SyntheticSpec, write_model
from jaxinfer.ternary import QUANT_SIZES

# Rows of 256 (attention, down), 96 (gate/up: 12 groups, an odd one out of the two-group tiles) and an untied output
# head of 263 (a padded last group).
SHAPE = dict(n_embd=256, n_ff=96, n_head=4, n_head_kv=2, tied_output=False, embedding_type=Q.Q8_0)


def greedy(m, prompt, steps):
    """Logits of an 8-token prefill and `steps` greedy decode steps, and the tokens chosen."""
    padded = np.zeros((1, 16), np.int32)
    padded[0, :len(prompt)] = prompt
    cache = model.init_cache(m.config, 1, 32)
    logits, cache = model.prefill(padded, jnp.int32(len(prompt)), m.weights, cache, m.config)
    out, tokens = [np.asarray(logits)[0]], []
    for _ in range(steps):
        tokens.append(int(np.argmax(out[-1])))
        logits, cache = model.decode_step(jnp.array(tokens[-1:], jnp.int32), m.weights, cache, m.config)
        out.append(np.asarray(logits)[0])
    return np.stack(out), tokens


def forward_logits(m, tokens):
    hidden, _, _ = jax.jit(model.forward, static_argnums=2)(tokens, m.weights, m.config)
    return np.asarray(model.logits(hidden, m.weights, m.config))


def assert_same_portable_bits(on, off, length):
    """Two loads of one model give the same logits for two random rows of `length` tokens, with the portable
    kernels."""
    tokens = np.random.default_rng(length).integers(0, on.config.n_vocab, size=(2, length)).astype(np.int32)
    try:
        cpu_ext.select_isa("scalar")
        np.testing.assert_array_equal(forward_logits(on, tokens), forward_logits(off, tokens))
    finally:
        cpu_ext.select_isa("best")


def layouts(m):
    layer = m.weights.layers[0]
    return {name: getattr(layer, name).layout for name in repack.ATTENTION + repack.FFN} | {
        "output": m.weights.output.layout, "token_embd": m.weights.token_embd.layout}


def repacked_nbytes(m):
    """Bytes the model's weights take with each repacked weight's groups in place of its rows."""
    total = quant.tree_nbytes(m.weights)
    for w in jax.tree.leaves(m.weights, is_leaf=lambda v: isinstance(v, quant.QuantArray)):
        if isinstance(w, quant.QuantArray) and w.layout == ROWS_X8:
            block_size, type_size = QUANT_SIZES[w.qtype]
            rows_bytes = w.shape[0] * w.shape[1] // block_size * type_size
            assert w.nbytes == -(-w.shape[0] // 8) * w.shape[1] // block_size * \
                x8_kquants.GROUP_BYTES.get(w.qtype, 8 * type_size)
            total += rows_bytes - w.nbytes
    return total


@pytest.mark.slow
@pytest.mark.parametrize("weight_type", sorted(quant.REPACKED_TYPES, key=int), ids=lambda q: q.name)
def test_repacked_model_gives_the_row_kernels_bits_and_greedy_tokens(make_model, monkeypatch, weight_type):
    """Every dense product's weight repacked, the embedding kept; each weight held once (its groups in place of its
    rows); with the portable kernels the logits of the row kernels bit for bit (32-value block types; K-quants and
    IQ4_XS, whose repacked kernels add each row's super-block in one integer, not the rows' eight lanes: close) for
    prefill and decode steps, and a 150-token forward with the row kernels allowed past their 128
    tokens; the same greedy tokens with the best kernels."""
    k_quant = weight_type in x8_kquants.GROUP_BYTES
    path = make_model(weight_type=weight_type, **{**SHAPE, "n_ff": 256 if k_quant else SHAPE["n_ff"]})
    on, off = engine.load_model(path), engine.load_model(path, repack=False)
    assert on.config.plan.repack and not off.config.plan.repack
    assert set(layouts(off).values()) == {ROW_BLOCKS}
    assert layouts(on) == {**{name: ROWS_X8 for name in layouts(on)}, "token_embd": ROW_BLOCKS}
    assert repacked_nbytes(on) == quant.tree_nbytes(off.weights)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    long = np.random.default_rng(1).integers(0, on.config.n_vocab, size=(1, 150)).astype(np.int32)
    monkeypatch.setattr(quant, "CPU_KERNEL_MAX_TOKENS", 2**31 - 1)  # the rows' kernels for the 150 tokens too
    jax.clear_caches()  # no program traced with the row kernels' limit
    # K-quants: a float rounding apart in one layer can move an activation across an 8-bit step in the next.
    same = (lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * np.abs(b).max())) if k_quant else \
        np.testing.assert_array_equal
    try:
        cpu_ext.select_isa("scalar")
        same(greedy(on, prompt, 3)[0], greedy(off, prompt, 3)[0])
        same(forward_logits(on, long), forward_logits(off, long))
    finally:
        cpu_ext.select_isa("best")
    logits_on, tokens_on = greedy(on, prompt, 6)
    logits_off, tokens_off = greedy(off, prompt, 6)
    assert tokens_on == tokens_off
    np.testing.assert_allclose(logits_on, logits_off, rtol=0, atol=2e-2 * np.abs(logits_off).max())


def test_a_tied_output_head_is_repacked_with_the_embedding(make_model):
    """The embedding that is also the output head is repacked once (the same array for both); its rows looked up
    through their groups and the head's products give the row kernels' bits with the portable kernels."""
    path = make_model(name="tied.gguf", weight_type=Q.Q8_0, **{**SHAPE, "tied_output": True})
    on, off = engine.load_model(path), engine.load_model(path, repack=False)
    assert on.weights.output is on.weights.token_embd and on.weights.output.layout == ROWS_X8
    assert off.weights.output.layout == ROW_BLOCKS
    assert_same_portable_bits(on, off, length=20)


def test_tq1_0_weights_are_held_as_tq2_0_and_give_the_same_bits(tmp_path):
    """A BitNet TQ1_0 model loads its matrices as TQ2_0 (the same values: the same dots, bit for bit, with the
    portable kernels); with the repack off, or marked exact, they stay TQ1_0."""
    path = write_model(str(tmp_path / "tq1.gguf"), SyntheticSpec(architecture="bitnet", n_embd=256, n_ff=512,
                                                                 weight_type=Q.TQ1_0, embedding_type=Q.TQ1_0))
    on, off = engine.load_model(path), engine.load_model(path, repack=False)
    assert {on.weights.layers[0].ffn_up.qtype, on.weights.token_embd.qtype} == {Q.TQ2_0}
    assert off.weights.layers[0].ffn_up.qtype == Q.TQ1_0
    assert engine.load_model(path, exact=True).weights.layers[0].ffn_up.qtype == Q.TQ1_0
    assert_same_portable_bits(on, off, length=12)


def test_q5_0_as_q8_0_keeps_every_value():
    """repack.q5_0_as_q8_0 against gguf.quants: every 5-bit code (random bytes for qh and qs), finite scales."""
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, size=(40, 7, 22), dtype=np.uint8)
    blocks[..., 0:2] = rng.normal(size=(40, 7)).astype(np.float16)[..., None].view(np.uint8)
    q8_0 = repack.q5_0_as_q8_0(blocks)
    assert q8_0.shape == (40, 7, 34) and q8_0.dtype == np.uint8
    np.testing.assert_array_equal(gguf.quants.dequantize(q8_0.reshape(40, -1), Q.Q8_0),
                                  gguf.quants.dequantize(blocks.reshape(40, -1), Q.Q5_0))


def test_q5_0_weights_that_would_be_repacked_are_held_as_q8_0(make_model):
    """Q5_0 has no repacked kernels: where a Q8_0 weight would be repacked, a Q5_0 one is held as Q8_0 (the same
    values) and repacked; an embedding only looked up, or every weight with the repack off, stays Q5_0. The logits
    are the Q5_0 row kernels' within rounding (each block's offset of 16 is summed apart there), the greedy tokens
    the same, and the plan line says so."""
    path = make_model(name="q5_0.gguf", weight_type=Q.Q5_0, **{**SHAPE, "embedding_type": Q.Q5_0})
    on, off = engine.load_model(path), engine.load_model(path, repack=False)
    assert layouts(on) == {**{name: ROWS_X8 for name in layouts(on)}, "token_embd": ROW_BLOCKS}
    assert (on.weights.layers[0].attn_q.qtype, on.weights.output.qtype, on.weights.token_embd.qtype) == (
        Q.Q8_0, Q.Q8_0, Q.Q5_0)
    assert set(layouts(off).values()) == {ROW_BLOCKS} and off.weights.layers[0].attn_q.qtype == Q.Q5_0
    for name in repack.ATTENTION + repack.FFN:
        held, stored = getattr(on.weights.layers[1], name), getattr(off.weights.layers[1], name)
        np.testing.assert_array_equal(np.asarray(quant.dequantize(held)), np.asarray(quant.dequantize(stored)))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    logits_on, tokens_on = greedy(on, prompt, 6)
    logits_off, tokens_off = greedy(off, prompt, 6)
    assert tokens_on == tokens_off
    np.testing.assert_allclose(logits_on, logits_off, rtol=0, atol=2e-2 * np.abs(logits_off).max())
    assert on.describe_plan().endswith("Q8_0 weights repacked eight rows to a group, Q5_0 held as Q8_0")
    assert "held as" not in off.describe_plan()
    assert inspection.kernel_route(Q.Q5_0, on.config.plan, "avx512").startswith("held as Q8_0 and repacked")
    assert "held as" not in inspection.kernel_route(Q.Q5_0, off.config.plan, "avx512")


def test_what_is_not_repacked(make_model):
    """Exact weights (XLA's f32 products), an embedding that is only looked up (SHAPE's head is untied), other
    types."""
    exact = engine.load_model(make_model(weight_type=Q.Q4_0, **SHAPE), exact=True)
    assert set(layouts(exact).values()) == {ROW_BLOCKS}
    other = engine.load_model(make_model(name="q5_1.gguf", weight_type=Q.Q5_1, **SHAPE))  # its Q8_0 head repacked
    assert {layout for name, layout in layouts(other).items() if name != "output"} == {ROW_BLOCKS}


def test_under_tensor_parallelism_rows_cut_on_whole_groups_only(make_model):
    """Cut 4 ways, gate/up's 96 rows are 24 a device, three groups: repacked; an output head of 264 rows is not
    whole groups a device (66): kept; columns (attention output, down) are cut on whole blocks of every group."""
    m = engine.load_model(make_model(weight_type=Q.Q8_0, **{**SHAPE, "n_vocab": 264}), repack=False)
    plan = dataclasses.replace(m.config.plan, repack=True, tp=4)
    layer = m.weights.layers[0]
    assert all(repack.packs(name, getattr(layer, name), plan) for name in ("ffn_gate", "attn_output", "ffn_down"))
    assert not repack.packs(repack.OUTPUT, m.weights.output, plan)
    assert not repack.packs(repack.OUTPUT, m.weights.output, dataclasses.replace(plan, tp=2))  # 132 rows a device
    assert repack.packs(repack.OUTPUT, m.weights.output, dataclasses.replace(plan, tp=1))  # padded
    assert not repack.packs("ffn_gate", layer.ffn_gate, plan, ffn=())
    assert repack.packs("ffn_gate", layer.ffn_gate, plan, ffn=repack.DENSE_FFN["gate"])
    assert not repack.packs("ffn_up", layer.ffn_up, plan, ffn=repack.DENSE_FFN["gate"])
    assert not repack.packs("ffn_gate", layer.ffn_gate, dataclasses.replace(plan, repack=False))


@pytest.mark.slow
@pytest.mark.parametrize("weight_type", [Q.Q4_0, Q.Q4_K], ids=lambda q: q.name)
def test_a_repacked_model_made_sparse_reads_the_rows_back(make_model, weight_type):
    """sparsity.apply after load (scripts that compare modes) gets the FFN's rows back without rounding; build_model
    reads a sparse FFN in rows."""
    path = make_model(weight_type=weight_type, **{**SHAPE, "n_ff": 256 if weight_type == Q.Q4_K else SHAPE["n_ff"]})
    on, off = engine.load_model(path), engine.load_model(path, repack=False)
    rows = repack.ffn_rows(on.weights.layers[0])
    for name in repack.FFN:
        assert getattr(rows, name).layout == ROW_BLOCKS
        np.testing.assert_array_equal(np.asarray(getattr(rows, name).data),
                                      np.asarray(getattr(off.weights.layers[0], name).data))
    sparsity.save_thresholds(path, "hidden", {0.5: np.full(2, 0.05, np.float32)}, "test")
    spec = sparsity.SparsitySpec("hidden", 0.5)
    sparse_on, sparse_off = sparsity.apply(on, spec), sparsity.apply(off, spec)
    tokens = np.arange(5, 14, dtype=np.int32)[None]
    np.testing.assert_allclose(forward_logits(sparse_on, tokens), forward_logits(sparse_off, tokens), rtol=0,
                               atol=2e-2 * np.abs(forward_logits(sparse_off, tokens)).max())
    assert sparse_on.weights.layers[0].attn_q.layout == ROWS_X8
    built = engine.build_model(path, sparsity_spec=spec).weights.layers[0]  # hidden: gate and up dense, repacked
    down_t = quant.NEURON_MAJOR if weight_type in quant.NEURON_MAJOR_TYPES else quant.DOWN_ROWS  # K-quants: Q8_0 rows
    assert (built.attn_q.layout, built.ffn_gate.layout, built.ffn_up.layout, built.ffn_down_t.layout) == (
        ROWS_X8, ROWS_X8, ROWS_X8, down_t)
    sparsity.save_thresholds(path, "gate", {0.5: np.full(2, 0.05, np.float32)}, "test")
    gate_mode = engine.build_model(path, sparsity_spec=sparsity.SparsitySpec("gate", 0.5)).weights.layers[0]
    assert (gate_mode.ffn_gate.layout, gate_mode.ffn_up.layout) == (ROWS_X8, ROW_BLOCKS)  # up: rows of active neurons

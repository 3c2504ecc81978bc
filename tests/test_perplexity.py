import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine, evaluation, model, quant
from jaxinfer.errors import JaxinferError

# The first 49.5 kB of WikiText-2's wiki.test.raw (CC BY-SA 3.0, tests/data/README.md): 11,833 tokens, the same first
# 10,240 as the whole file's, enough for 20 windows of 512.
WIKITEXT = pathlib.Path(__file__).parent / "data" / "wiki.test.head.raw"
# llama.cpp 0c1e570's llama-perplexity -c 512 --chunks 6 on the default model's F32 copy (llama-quantize
# --allow-requantize FILE F32 F32): its first 6 windows, 22.4598 (all 20: 28.6250).
LLAMA_CPP_F32_PPL_6 = 22.4598


@pytest.fixture
def tiny(make_model):
    return engine.load_model(make_model(n_ctx=64))


def direct_nll(m, windows):
    """Independent reference: full-window logits, float64 log-softmax in numpy, the llama.cpp scoring rule."""
    hidden, _, _ = jax.jit(model.forward, static_argnums=2)(windows, m.weights, m.config)
    logits = np.asarray(model.logits(hidden, m.weights, m.config), np.float64)
    n_ctx = windows.shape[1]
    rows = []
    for w in range(len(windows)):
        for pos in range(n_ctx // 2, n_ctx - 1):
            row = logits[w, pos]
            log_z = row.max() + np.log(np.exp(row - row.max()).sum())
            rows.append(log_z - row[windows[w, pos + 1]])
    return np.array(rows)


def test_windows_follow_llama_perplexity():
    tokens = np.arange(100, 150)
    windows = evaluation.make_windows(tokens, 16, -1, bos_id=7)
    assert windows.shape == (3, 16)  # the tail of 2 tokens is dropped
    assert windows[:, 0].tolist() == [7, 7, 7] and windows[1, 1:].tolist() == list(range(117, 132))
    assert evaluation.make_windows(tokens, 16, 2, bos_id=None)[1, 0] == 116
    assert evaluation.scored_positions(512) == (256, 255)
    with pytest.raises(JaxinferError, match="needs at least 64"):
        evaluation.make_windows(tokens[:40], 32, -1, bos_id=None)


def test_batched_evaluation_equals_window_by_window_and_direct_reference(tiny):
    tokens = np.random.default_rng(0).integers(0, tiny.config.n_vocab, size=5 * 32 + 3)
    windows = evaluation.make_windows(tokens, 32, -1, bos_id=None)
    batched = evaluation.evaluate_windows(tiny.weights, tiny.config, windows, n_seq=3, progress=False)
    single = evaluation.evaluate_windows(tiny.weights, tiny.config, windows, n_seq=1, progress=False)
    assert batched.n_scored == single.n_scored == 5 * 15
    np.testing.assert_allclose(batched.nll, single.nll, rtol=1e-5, atol=1e-5)
    assert batched.ppl == pytest.approx(single.ppl, rel=1e-6)
    np.testing.assert_allclose(batched.nll, direct_nll(tiny, windows), rtol=1e-4, atol=1e-4)
    mean = direct_nll(tiny, windows).mean()
    assert batched.ppl == pytest.approx(np.exp(mean), rel=1e-4)


def test_logits_file_round_trip_and_self_kl_divergence(tiny, tmp_path):
    tokens = np.random.default_rng(1).integers(0, tiny.config.n_vocab, size=4 * 32)
    windows = evaluation.make_windows(tokens, 32, -1, bos_id=None)
    path = tmp_path / "base.kld"
    with open(path, "wb") as f:
        evaluation.write_logits_header(f, 32, tiny.config.n_vocab, tokens)
        saved = evaluation.evaluate_windows(tiny.weights, tiny.config, windows, n_seq=2, save_logits=f,
                                            progress=False)
    base = evaluation.read_logits_file(str(path))
    assert (base.n_ctx, base.n_vocab, base.n_chunk) == (32, tiny.config.n_vocab, 4)
    np.testing.assert_array_equal(base.tokens, tokens)
    again = evaluation.evaluate_windows(tiny.weights, tiny.config, windows, n_seq=2, base=base, progress=False)
    assert again.kl.same_top == 1.0
    assert abs(again.kl.mean) < 1e-6  # only the 16-bit quantization of the base separates the two
    assert again.kl.base_ppl == pytest.approx(saved.ppl, rel=1e-4)


@pytest.mark.slow
def test_the_default_model_against_its_own_base(default_model, tmp_path):
    """Before: "KL-divergence -0.000000" (the base's 16-bit rounding takes the mean just below 0) and a base PPL
    under the run's with nothing saying why: the base holds log-probs clamped 16 nats below each top one (llama.cpp's
    format), and llama-perplexity reads a base's PPL from them as they are."""
    m, path = default_model, tmp_path / "base.kld"
    tokens = np.asarray(m.tokenizer.encode(WIKITEXT.read_text(encoding="utf-8")), np.int32)
    with open(path, "wb") as f:  # 4 windows of 64: a case where the mean came out at -6e-8
        evaluation.write_logits_header(f, 64, m.config.n_vocab, tokens[:4 * 64])
        saved = evaluation.evaluate(m, tokens, n_ctx=64, n_chunks=4, save_logits=f)
    again = evaluation.evaluate(m, tokens, n_ctx=64, n_chunks=4, base=evaluation.read_logits_file(str(path)))
    line = again.summary()
    # The base's 16-bit rounding takes the mean of equal distributions just below 0 or just above it, by machine
    # (-6e-8 on the AMD machine of docs/benchmarks.md, reported as 0; 7e-7 on the Intel one): never below 0, never
    # above the rounding.
    assert again.ppl == saved.ppl and 0.0 <= again.kl.mean < 1e-5
    assert re.search(r"KL-divergence 0\.00000\d \+/- ", line), line
    assert "-0.0" not in line and "same top-1 100.00%" in line, line
    assert again.kl.base_ppl < 0.999 * again.ppl  # targets under the clamp count at it
    assert again.kl.stored_ppl == pytest.approx(again.kl.base_ppl, rel=1e-6)
    assert line.endswith(f", base PPL {again.kl.base_ppl:.4f} from its stored log-probs, which llama.cpp's format "
                         f"clamps at 16 nats below the top one (this run's PPL clamped so: {again.kl.base_ppl:.4f})")


def test_quantized_log_probs_decode_to_log_softmax():
    logits = np.random.default_rng(2).normal(scale=4, size=(3, 101)).astype(np.float32)
    records = evaluation.quantize_log_probs(logits)
    assert records.shape == (3, 2 * 51 + 4)
    scale, min_log_prob = records[:, 0:4].copy().view(np.float32).T
    decoded = min_log_prob[:, None] + scale[:, None] * records[:, 4:105]
    log_softmax = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) \
        - logits.max(1, keepdims=True)
    visible = log_softmax > min_log_prob[:, None]  # below max-16 llama.cpp stores the floor
    np.testing.assert_allclose(decoded[visible], log_softmax[visible], atol=1e-3)


def test_leading_tokens_are_the_whole_texts_first_tokens(default_model):
    """A prefix of the text, cut at a line break, tokenizes to the whole text's first tokens (SmolLM2's BPE); only as
    much is read as the tokens asked for need, and a text with fewer gives all of them."""
    text = WIKITEXT.read_text(encoding="utf-8")
    whole = default_model.tokenizer.encode(text)
    read = []

    def encode(piece):
        read.append(len(piece))
        return default_model.tokenizer.encode(piece)

    for n in (1, 700, 2 * 512, 10_240):
        read.clear()
        np.testing.assert_array_equal(evaluation.leading_tokens(encode, text, n), whole[:n])
        assert n == 10_240 or max(read) < len(text) / 2
    np.testing.assert_array_equal(evaluation.leading_tokens(encode, text, len(whole) + 1), whole)


@pytest.mark.slow
def test_default_model_matches_llama_cpp_perplexity(default_model):
    tokens = default_model.tokenizer.encode(WIKITEXT.read_text(encoding="utf-8"))
    result = evaluation.evaluate(default_model, tokens, n_ctx=512, n_chunks=6)
    assert result.n_scored == 6 * 255  # a window scores its second half but its first token, as llama.cpp
    assert result.ppl == pytest.approx(LLAMA_CPP_F32_PPL_6, rel=0.01)  # measured 22.5864: 0.56% above


def run_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxinfer.perplexity", *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.mark.parametrize("case", ["missing", "empty", "short", "kl_without_base"])
def test_cli_errors(make_model, tmp_path, case):
    model_path = make_model(n_ctx=64)
    text = tmp_path / "text.txt"
    text.write_text({"empty": "  \n", "short": "a few words only"}.get(case, "words " * 200))
    args = {
        "missing": ["-f", str(tmp_path / "nope.txt")],
        "empty": ["-f", str(text)],
        "short": ["-f", str(text), "-c", "32"],
        "kl_without_base": ["-f", str(text), "--kl-divergence"],
    }[case]
    result = run_cli("-m", model_path, *args)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")


@pytest.mark.slow
def test_cli_writes_base_then_compares(make_model, tmp_path):
    model_path = make_model(n_ctx=64)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 20)
    base = tmp_path / "base.kld"
    (tmp_path / "base.kld.tmp").mkdir()  # where an older version wrote: its temp name must not be shared
    first = run_cli("-m", model_path, "-f", str(text), "-c", "32", "-b", "64", "--kl-divergence-base", str(base))
    assert first.returncode == 0, first.stderr
    assert sorted(os.listdir(tmp_path)) == ["base.kld", "base.kld.tmp", "text.txt", "tiny.gguf"]
    assert os.stat(base).st_mode & 0o777 == 0o666 & ~current_umask()
    second = run_cli("-m", model_path, "-c", "32", "--kl-divergence-base", str(base), "--kl-divergence")
    assert second.returncode == 0, second.stderr
    assert "same top-1 100.00%" in second.stdout
    assert first.stdout.split("|")[0] == second.stdout.split("|")[0]  # same PPL line
    # -c beyond the model's 64 is capped as in generate; --chunks 2 evaluates 2 windows in one batch, not -b 512's 8
    # (6 of them padding)
    capped = run_cli("-m", model_path, "-f", str(text), "-c", "128", "--chunks", "2", "-b", "512")
    assert capped.returncode == 0, capped.stderr
    assert "note: -c 128 exceeds the model's training context; using 64" in capped.stderr
    assert "n_ctx=64, 2 windows per batch" in capped.stderr


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_unwritable_base_fails_before_the_run(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("words " * 200)
    model = tmp_path / "not-a-model.gguf"
    model.write_text("not a model: the output is checked first")
    result = run_cli("-m", str(model), "-f", str(text), "--kl-divergence-base", str(tmp_path / "no" / "base.kld"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith("does not exist")


def write_base(path, n_ctx=8, n_vocab=5, n_chunk=1, tokens=np.zeros(8), records=None, extra=b""):
    """A logits file whose header says (n_ctx, n_vocab, n_chunk) and whose body is that of one chunk of 8 tokens
    over a vocabulary of 5 (3 scored tokens of 10 uint16 each), unless given."""
    if records is None:
        records = np.zeros((1, 3, 10), np.uint16)
        records[..., 0:4] = np.array([0.01, -5.0], np.float32).view(np.uint16)
    with open(path, "wb") as f:
        f.write(evaluation.LOGITS_MAGIC + np.array([n_ctx, n_vocab, n_chunk], np.int32).tobytes())
        f.write(np.asarray(tokens, np.int32).tobytes() + records.tobytes() + extra)
    return str(path)


def nan_records():
    records = np.zeros((1, 3, 10), np.uint16)
    records[..., 0:4] = np.array([np.nan, -5.0], np.float32).view(np.uint16)
    return records


@pytest.mark.parametrize("case, kwargs, message", [
    ("zero context", dict(n_ctx=0), "impossible header"),
    ("negative vocabulary", dict(n_vocab=-3), "impossible header"),
    ("no chunks", dict(n_chunk=0), "impossible header"),
    ("huge", dict(n_ctx=2**30, n_chunk=2**30), "truncated"),
    ("too long", dict(extra=b"\0\0"), "too long"),
    ("token outside", dict(tokens=np.full(8, 9)), "outside its vocabulary"),
    ("nan scale", dict(records=nan_records()), "impossible"),
])
def test_bad_logits_files_are_one_line_errors(tmp_path, case, kwargs, message):
    path = write_base(tmp_path / "base.kld", **kwargs)
    with pytest.raises(JaxinferError, match=message):
        evaluation.read_logits_file(path)


def test_a_well_formed_logits_file_is_read(tmp_path):
    base = evaluation.read_logits_file(write_base(tmp_path / "base.kld"))
    assert (base.n_ctx, base.n_vocab, base.n_chunk, base.records.shape) == (8, 5, 1, (1, 3, 10))


def test_micro_batches_give_the_same_scores(tiny):
    tokens = np.random.default_rng(3).integers(0, tiny.config.n_vocab, size=3 * 32)
    windows = evaluation.make_windows(tokens, 32, -1, bos_id=None)
    whole = evaluation.evaluate_windows(tiny.weights, tiny.config, windows, n_seq=2, progress=False)
    for ubatch in (5, 8, 16):  # 5 leaves a short last micro-batch
        chunked = evaluation.evaluate_windows(tiny.weights, tiny.config, windows, n_seq=2, ubatch=ubatch,
                                              progress=False)
        np.testing.assert_allclose(chunked.nll, whole.nll, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("weight_type", [Q.Q8_0, Q.F32], ids=["repacked", "rows"])
def test_the_head_in_pieces_of_the_vocabulary_gives_the_whole_heads_nll(make_model, monkeypatch, weight_type):
    """Pieces of 64 words over 263 (the last piece starts early, and a repacked head's last group is padding): the
    merged log-sum-exp and the target's logit give the whole head's nll and the float64 reference's; an infinity
    anywhere still makes the row's nll NaN."""
    m = engine.load_model(make_model(n_ctx=64, tied_output=False, weight_type=weight_type,
                                     embedding_type=weight_type))
    assert m.weights.output.shape[0] == 263
    monkeypatch.setattr(evaluation, "VOCABULARY_PIECE", 64)
    windows = jnp.asarray(evaluation.make_windows(np.random.default_rng(5).integers(0, 263, size=3 * 32), 32, -1,
                                                  bos_id=None))
    hidden = jax.jit(model.forward, static_argnums=2)(windows, m.weights, m.config)[0]
    pieces = jax.jit(evaluation.hidden_nll, static_argnums=3)(hidden, windows, m.weights, m.config)
    whole = evaluation.hidden_logits(hidden, windows, m.weights, m.config)[1]
    np.testing.assert_allclose(np.asarray(pieces), np.asarray(whole), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(pieces).reshape(-1), direct_nll(m, np.asarray(windows)), rtol=1e-4,
                               atol=1e-4)
    out = m.weights.output
    rows = np.asarray((quant.unpack_rows_x8(out) if out.layout == quant.ROWS_X8 else out).data)
    for row in (3, 200, 262):  # in the first, a middle and the last piece
        data = rows.copy()
        if weight_type == Q.Q8_0:
            data[row, 0:2] = [0x00, 0x7C]  # the first block's scale: f16 +inf
        else:
            data[row, 0] = np.inf
        head = dataclasses.replace(out, data=data, layout=quant.ROW_BLOCKS)
        head = quant.pack_rows_x8(head) if out.layout == quant.ROWS_X8 else head
        nll = evaluation.hidden_nll(hidden, windows, dataclasses.replace(m.weights, output=head), m.config)
        assert np.isnan(np.asarray(nll)).all(), row


def test_nonfinite_logits_stop_with_an_error(make_model):
    """Before, one infinite logit per position left the other tokens' NLL finite (or made it NaN): PPL was reported,
    exit 0. The check is a reduction inside the compiled call."""
    m = engine.load_model(make_model(n_ctx=64, tied_output=False))
    out = m.weights.output
    weights = dataclasses.replace(m.weights, output=dataclasses.replace(out, data=out.data.at[5, 0].set(-jnp.inf)))
    windows = evaluation.make_windows(np.arange(10, 10 + 4 * 16), 16, -1, bos_id=None)
    with pytest.raises(JaxinferError, match="logits are NaN or infinite in chunk 1"):
        evaluation.evaluate_windows(weights, m.config, windows, n_seq=2, progress=False)

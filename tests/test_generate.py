import collections
import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine, model, programs, quant
from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import SamplingParams, sample

DATA = pathlib.Path(__file__).parent / "data"


def run_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxinfer.generate", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.strip().endswith(errors[0]), result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


@pytest.mark.slow
@pytest.mark.parametrize("prompt", json.loads((DATA / "llama_cpp_greedy.json").read_text())["continuations"])
def test_greedy_output_matches_llama_cpp_f32(default_model_exact, prompt):
    """The Q4_1 weights dequantized to f32 must reproduce llama.cpp's F32 greedy text token for token."""
    m = default_model_exact
    expected = json.loads((DATA / "llama_cpp_greedy.json").read_text())["continuations"][prompt]
    new = list(engine.generate_tokens(m, m.tokenizer.encode(prompt), 32, 128, SamplingParams(temperature=0), seed=0))
    assert m.tokenizer.decode(new) == expected


@pytest.mark.slow
def test_cli_streams_text_and_reports_timings(make_model):
    result = run_cli("-m", make_model(), "-p", "hello the", "-n", "6", "--temp", "0", "-c", "64")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hello the")
    assert "loaded tiny.gguf" in result.stderr
    assert "compile" in result.stderr and "tok/s" in result.stderr
    assert "f32 KV cache" in result.stderr
    f16 = run_cli("-m", make_model(), "-p", "hello the", "-n", "6", "--temp", "0", "-c", "64", "--cache_type", "f16")
    assert f16.returncode == 0 and "f16 KV cache" in f16.stderr, f16.stderr


@pytest.mark.slow
def test_cli_reads_the_prompt_from_a_file(make_model, tmp_path):
    path, prompt = make_model(), tmp_path / "prompt.txt"
    prompt.write_text("hello the\nthe hello", encoding="utf-8")
    from_file = run_cli("-m", path, "-f", str(prompt), "-n", "6", "--temp", "0", "-c", "64")
    inline = run_cli("-m", path, "-p", "hello the\nthe hello", "-n", "6", "--temp", "0", "-c", "64")
    assert from_file.returncode == 0, from_file.stderr
    assert from_file.stdout.startswith("hello the\nthe hello") and from_file.stdout == inline.stdout
    assert_one_line_error(run_cli("-m", path, "-f", str(tmp_path / "nope.txt")), "prompt file not found")
    assert_one_line_error(run_cli("-m", path, "-f", str(prompt), "-p", "hi"), "not both")


@pytest.mark.slow
def test_cli_chat_template(make_model):
    path = make_model()
    tokenizer = engine.load_model(path).tokenizer
    chat = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert chat[0] == tokenizer.token_id("<|im_start|>")
    result = run_cli("-m", path, "-p", "hi", "--chat", "-n", "3", "--seed", "3", "-c", "64")
    assert result.returncode == 0, result.stderr
    assert f"prompt {len(chat)} tokens" in result.stderr


def test_missing_file():
    assert_one_line_error(run_cli("-m", "/no/such/model.gguf"), "not found")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("this is not a model\n")
    assert_one_line_error(run_cli("-m", str(path)), "not a GGUF file")


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_gguf(make_model, tmp_path, keep):
    data = pathlib.Path(make_model()).read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    assert_one_line_error(run_cli("-m", str(path)), "truncated")


def test_unsupported_architecture(make_model):
    assert_one_line_error(run_cli("-m", make_model(architecture="gpt2")), "unsupported architecture 'gpt2'")


def test_unsupported_quant_type_is_named(make_model):
    assert_one_line_error(run_cli("-m", make_model(weight_type=Q.MXFP4)), "MXFP4")


def test_prompt_longer_than_context(make_model):
    result = run_cli("-m", make_model(), "-p", "x" * 40, "-c", "16")
    assert_one_line_error(result, "longer than the context")
    assert result.stdout == ""  # the prompt is not echoed before the error


@pytest.mark.parametrize("template,fragment", [
    ("{% for m in messages %}{{ m.content }", "TemplateSyntaxError at line 1"),
    ("{{ messages[0].content + 3 }}", "TypeError"),
    ("{{ messages[0].nope.deeper }}", "UndefinedError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("{{ raise_exception('only system turns') }}", "chat template: only system turns"),
])
def test_a_chat_template_that_fails_is_one_line_naming_the_problem(make_model, template, fragment):
    tokenizer = engine.load_model(make_model()).tokenizer
    with pytest.raises(JaxinferError, match=fragment) as error:
        engine.apply_chat_template(template, "hi", tokenizer)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("flag,value,fragment", [
    ("-n", "-1", "n_predict"), ("--temp", "-0.5", "--temp"), ("--top_p", "0", "--top_p"),
    ("--top_k", "-3", "--top_k"), ("--min_p", "1.5", "--min_p"), ("-c", "0", "ctx_size"),
    ("--n_predict", "many", "n_predict"), ("--cache_type", "q8_0", "--cache_type"),
])
def test_bad_flag_values(make_model, flag, value, fragment):
    assert_one_line_error(run_cli("-m", make_model(), flag, value), fragment)


@pytest.mark.slow
def test_results_are_identical_across_micro_batch_sizes(make_model):
    """A 21-token prompt prefilled in chunks of 3, 8 or all at once gives the same greedy continuation, also when
    the padded last chunk reaches past the context."""
    m = engine.load_model(make_model())
    prompt = m.tokenizer.encode("in the hall of the mountain king")[:21]
    runs = {ub: list(engine.generate_tokens(m, prompt, 6, 27, SamplingParams(temperature=0), 0, ubatch=ub))
            for ub in (3, 8, 512)}
    assert runs[3] == runs[8] == runs[512] and len(runs[512]) == 6


def test_generation_runs_each_program_only_for_its_tokens(make_model, monkeypatch):
    """A 21-token prompt in chunks of 8 runs the prefill program three times and the decode program once per chunk of
    steps: no warm-up run (which cost a whole chunk, 1.7 s for 512 tokens of a 7B-shaped file, and no longer made
    the first real run faster)."""
    m = engine.load_model(make_model())
    runs = collections.Counter()
    compile_step = programs.compile_step

    def counted(step, *args, **kwargs):
        program = compile_step(step, *args, **kwargs)

        def run(*call_args):
            runs[step.__qualname__] += 1
            return program(*call_args)
        return run

    monkeypatch.setattr(programs, "compile_step", counted)
    prompt = m.tokenizer.encode("in the hall of the mountain king")[:21]
    tokens = list(engine.generate_tokens(m, prompt, 6, 64, SamplingParams(temperature=0), 0, ubatch=8,
                                         stop_ids=frozenset()))
    assert len(tokens) == 6
    assert runs == {"prefill_and_sample": 3, "decode_chunk": -(-5 // engine.DECODE_CHUNK)}


@pytest.mark.parametrize("params", [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=0, top_p=1.0,
                                                                                  min_p=0.0, repeat_penalty=1.3)])
@pytest.mark.slow
def test_decode_chunk_matches_step_by_step_decoding(make_model, params):
    """The on-device decode loop feeds and samples exactly as stepping model.decode_step from the host would: same
    tokens, same key splits, same repeat-penalty window, same cache."""
    m = engine.load_model(make_model())
    prompt = np.array([m.tokenizer.encode("hello the hall")], np.int32)
    recent = np.full((1, 4), -1, np.int32)
    recent[0, -prompt.shape[1]:] = prompt[0, -4:]
    key = jax.random.key(7)

    def prefilled():
        logits, cache = model.prefill(prompt, jnp.int32(prompt.shape[1]), m.weights,
                                      model.init_cache(m.config, 1, 32), m.config)
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

    token, cache = prefilled()
    expected, state_recent, step_key = [], jnp.asarray(recent), key
    for _ in range(6):
        step_key, subkey = jax.random.split(step_key)
        state_recent = jnp.concatenate([state_recent[:, 1:], token[:, None]], axis=1)
        logits, cache = model.decode_step(token, m.weights, cache, m.config)
        token = sample(logits, state_recent, subkey[None], params)
        expected.append(int(token[0]))
    expected_cache = cache

    token, cache = prefilled()
    state = engine.start_state(token, recent, key, 6)
    no_stop = jnp.array([-1], jnp.int32)
    first, state, cache = engine.decode_chunk(state, no_stop, m.weights, cache, m.config, params, n_steps=4)
    second, state, cache = engine.decode_chunk(state, no_stop, m.weights, cache, m.config, params, n_steps=4)
    assert np.asarray(first)[:, 0].tolist() == expected[:4]
    assert np.asarray(second)[:, 0].tolist() == expected[4:] + [-1, -1]  # the 6 steps end in the chunk
    assert cache.length.tolist() == expected_cache.length.tolist() == [prompt.shape[1] + 6]
    np.testing.assert_array_equal(np.asarray(cache.k), np.asarray(expected_cache.k))


def test_decode_chunk_stops_after_a_stop_token(make_model):
    m = engine.load_model(make_model())
    params = SamplingParams(temperature=0)
    cache = model.init_cache(m.config, 1, 32)
    start = engine.start_state(jnp.array([5], jnp.int32), jnp.full((1, 1), -1, jnp.int32), jax.random.key(0), 6)
    free, _, _ = engine.decode_chunk(start, jnp.array([-1], jnp.int32), m.weights, cache, m.config, params,
                                     n_steps=6)
    free = np.asarray(free)[:, 0].tolist()
    stop = free[2]  # make the third token a stop token: the loop keeps it and runs no further step
    cache = model.init_cache(m.config, 1, 32)
    stopped, state, cache = engine.decode_chunk(start, jnp.array([stop], jnp.int32), m.weights, cache, m.config,
                                                params, n_steps=6)
    first_stop = free.index(stop)
    assert np.asarray(stopped)[:, 0].tolist() == free[:first_stop + 1] + [-1] * (5 - first_stop)
    assert bool(state.stopped) and cache.length.tolist() == [first_stop + 1]


def test_decode_chunk_over_the_first_rows_leaves_the_others_as_they_were(make_model):
    """rows=2 of a 4-row state and cache: the first two rows decode as a 2-row state and cache do, with their own
    sampling values (one greedy, one drawing); rows 2 and 3 of the state and cache are untouched."""
    m = engine.load_model(make_model())
    params = dataclasses.replace(SamplingParams(), temperature=np.array([0.0, 1.0, 0.0, 0.0], np.float32),
                                 top_k=np.zeros(4, np.int32), top_p=np.ones(4, np.float32),
                                 min_p=np.zeros(4, np.float32), repeat_penalty=np.ones(4, np.float32), repeat_last_n=4)
    state = engine.DecodeState(jnp.array([5, 9, 11, 12], jnp.int32), jnp.full((4, 4), -1, jnp.int32),
                               jax.random.split(jax.random.key(3), 4), jnp.full((4,), 5, jnp.int32),
                               jnp.zeros((4,), bool), jnp.zeros((4,), bool))
    no_stop = jnp.array([-1], jnp.int32)
    first_rows = engine.leading_rows(state, 2), engine.leading_rows(params, 2)
    expected, expected_state, expected_cache = engine.decode_chunk(
        first_rows[0], no_stop, m.weights, model.init_cache(m.config, 2, 16), m.config, first_rows[1], n_steps=4)
    tokens, after, cache = engine.decode_chunk(state, no_stop, m.weights, model.init_cache(m.config, 4, 16), m.config,
                                               params, n_steps=4, rows=2)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected))
    assert cache.length.tolist() == [4, 4, 0, 0] and not np.asarray(cache.k)[:, 2:].any()
    np.testing.assert_array_equal(np.asarray(cache.k)[:, :2], np.asarray(expected_cache.k))
    for name in ("token", "recent", "steps_left"):
        np.testing.assert_array_equal(np.asarray(getattr(after, name))[:2], np.asarray(getattr(expected_state, name)))
        np.testing.assert_array_equal(np.asarray(getattr(after, name))[2:], np.asarray(getattr(state, name))[2:])


def test_generation_ends_when_the_context_is_full(make_model):
    m = engine.load_model(make_model())
    prompt = m.tokenizer.encode("hello the")
    stats = engine.GenerationStats()
    ctx = len(prompt) + 11  # room for the prefill's token and 11 decode steps: more than one chunk
    tokens = list(engine.generate_tokens(m, prompt, 100, ctx, SamplingParams(temperature=0), 0, stats,
                                         stop_ids=frozenset()))
    assert len(tokens) == 12 and stats.stop_reason == "context full"


def test_new_sampling_values_reuse_the_compiled_decode_loop(make_model):
    """--temp, --top_k, --top_p, --min_p and --repeat_penalty are traced: a new value runs the compiled loop (and
    hits the persistent compilation cache in a new process) instead of compiling ~8 s anew."""
    m = engine.load_model(make_model())
    state = engine.start_state(jnp.array([5], jnp.int32), jnp.full((1, 4), -1, jnp.int32), jax.random.key(0), 4)
    before = engine.decode_chunk._cache_size()
    outputs = []
    for params in (SamplingParams(temperature=0, repeat_last_n=4), SamplingParams(temperature=1.5, top_k=3,
                                                                                   repeat_last_n=4),
                   SamplingParams(temperature=0.7, top_k=0, top_p=0.5, min_p=0.1, repeat_penalty=1.2,
                                  repeat_last_n=4)):
        tokens, _, _ = engine.decode_chunk(state, jnp.array([-1], jnp.int32), m.weights,
                                           model.init_cache(m.config, 1, 16), m.config, params.as_arrays(), n_steps=4)
        outputs.append(np.asarray(tokens)[:, 0].tolist())
    assert engine.decode_chunk._cache_size() == before + 1
    assert outputs[0] != outputs[1]  # the values did reach the program


def last_prompt_logits(m, ids, ubatch):
    """The prompt prefilled as generate cuts it for -ub `ubatch` -> logits after its last token."""
    chunk = engine._prefill_chunk(len(ids), ubatch)
    cache = model.init_cache(m.config, 1, -(-len(ids) // chunk) * chunk)
    for start in range(0, len(ids), chunk):
        piece = np.zeros((1, chunk), np.int32)
        piece[0, :len(ids[start:start + chunk])] = ids[start:start + chunk]
        logits, cache = model.prefill(piece, jnp.int32(len(ids[start:start + chunk])), m.weights, cache, m.config)
    return np.asarray(logits[0])


def test_what_ubatch_changes_is_as_the_docs_state(make_model):
    """docs/numerics.md, "Micro-batches": same flags, same tokens; every -ub at least the prompt (as a power of two)
    cuts it once; with repacked weights, cuts into pieces of more than 8 tokens agree to f32 rounding (the products
    compute each token alone, the tiled attention walks each query's keys in the same blocks; XLA's element-wise
    code may round differently for other shapes); pieces of up to 8 take the decode attention kernel and agree to
    the 8-bit kernels' rounding."""
    m = engine.load_model(make_model(n_ctx=512, weight_type=Q.Q8_0, embedding_type=Q.Q8_0))
    assert all(layer.attn_q.layout == quant.ROWS_X8 for layer in m.weights.layers)
    ids = np.random.default_rng(0).integers(3, m.config.n_vocab, size=200).tolist()
    greedy = SamplingParams(temperature=0)
    runs = [list(engine.generate_tokens(m, ids[:40], 8, 512, greedy, seed=0, ubatch=ub)) for ub in (64, 64, 512)]
    assert runs[0] == runs[1] == runs[2]
    by_ubatch = {ub: last_prompt_logits(m, ids, ub) for ub in (4, 8, 16, 64, 200, 512)}
    span = np.ptp(by_ubatch[512])
    for ub in (16, 64, 200):
        np.testing.assert_allclose(by_ubatch[ub], by_ubatch[512], atol=1e-5 * span)
    for ub in (4, 8):
        np.testing.assert_allclose(by_ubatch[ub], by_ubatch[512], atol=0.05 * span)


def with_nonfinite_output_row(m, row=5):
    """The model with one output row of -inf in its first column: that token's logit is infinite or NaN, the others
    stay finite (as corrupt weights on disk would make them)."""
    out = m.weights.output
    broken = dataclasses.replace(out, data=out.data.at[row, 0].set(-jnp.inf))
    return dataclasses.replace(m, weights=dataclasses.replace(m.weights, output=broken))


def test_nonfinite_logits_stop_generation_with_an_error(make_model):
    """Before, the sampler picked a token from NaN/inf logits and generation ended "stop: end of text", exit 0."""
    m = with_nonfinite_output_row(engine.load_model(make_model(tied_output=False)))
    with pytest.raises(JaxinferError, match="logits are NaN or infinite at position 3"):
        list(engine.generate_tokens(m, m.tokenizer.encode("hi!"), 4, 32, SamplingParams(temperature=0), 0))


@pytest.mark.slow
def test_a_decode_step_with_nonfinite_logits_stops_the_loop():
    state = engine.DecodeState(jnp.array([5, 6], jnp.int32), jnp.full((2, 1), -1, jnp.int32),
                               jax.random.split(jax.random.key(0), 2), jnp.full((2,), 4, jnp.int32),
                               jnp.zeros((2,), bool), jnp.zeros((2,), bool))
    logits = jnp.zeros((2, 8)).at[1, 3].set(jnp.nan)
    after = engine.sample_next(state, logits, jnp.array([-1], jnp.int32), SamplingParams(temperature=0))
    assert after.token.tolist() == [0, engine.NONFINITE_LOGITS] and after.stopped.tolist() == [False, True]

"""Prompt-processing and generation speed, measured like llama-bench: pp = prefill of N prompt tokens,
tg = N greedy decode steps after a one-token prompt, through `generate`'s own decode loop, into a KV cache of
--ctx_size positions as `generate` allocates. Compile time is excluded.

    python scripts/bench_generate.py [-m MODEL] [--pp 128,512] [--tg 64] [--repetitions 3] [--json]
        [--sparsity hidden:0.5 [--down_t_type same]] [--llama_bench path/to/llama-bench [--threads 2]]

With --json the last line is one JSON object with prompt_tokens_per_s and generation_tokens_per_s (the best
repetition of the largest pp and of tg). With --llama_bench (a llama.cpp build you have; nothing is downloaded or
built here) llama-bench runs the same tests on the same model right after, and the ratios are printed: absolute
numbers on shared machines are noisy, ratios measured in one run much less so.
"""

import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from jaxinfer import engine, model, runtime, sparsity
from jaxinfer.errors import JaxinferError, exit_on_error
from jaxinfer.sampling import SamplingParams

flags.DEFINE_string("model", None, "GGUF model (default: the built-in SmolLM2 Q4_1)", short_name="m")
flags.DEFINE_list("pp", ["128", "512"], "prompt lengths to time")
flags.DEFINE_integer("tg", 64, "tokens to generate")
flags.DEFINE_integer("repetitions", 3, "timed repetitions of each test (after one untimed warm-up)")
flags.DEFINE_bool("json", False, "print a JSON summary as the last line")
flags.DEFINE_integer("ctx_size", 4096, "KV cache positions for tg (generate's default)", short_name="c")
flags.DEFINE_string("sparsity", "dense", "FFN activation sparsity, as generate's --sparsity")
flags.DEFINE_string("down_t_type", "same", "as generate's --down_t_type")
flags.DEFINE_string("llama_bench", None, "path to llama.cpp's llama-bench: run it on the same model and report ratios")
flags.DEFINE_integer("threads", 2, "llama-bench threads (-t)")
FLAGS = flags.FLAGS


def time_prefill(m, n_tokens, repetitions):
    tokens = np.random.default_rng(0).integers(0, m.config.n_vocab, size=(1, n_tokens)).astype(np.int32)
    times = []
    for _ in range(repetitions + 1):
        cache = model.init_cache(m.config, 1, n_tokens)
        start = time.perf_counter()
        logits, cache = model.prefill(tokens, jnp.int32(n_tokens), m.weights, cache, m.config)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - start)
    return n_tokens / min(times[1:])


def time_decode(m, n_tokens, repetitions):
    """generate's own decode loop (greedy, stop tokens ignored) after a one-token prompt: n_tokens decode steps."""
    rates = []
    for _ in range(repetitions + 1):
        stats = engine.GenerationStats()
        for _ in engine.generate_tokens(m, [m.tokenizer.bos_id or 0], n_tokens + 1, max(FLAGS.ctx_size, n_tokens + 1),
                                        SamplingParams(temperature=0), 0, stats, stop_ids=frozenset()):
            pass
        rates.append((stats.generated_tokens - 1) / stats.decode_seconds)
    return max(rates[1:])


def run_llama_bench(path, pp, tg) -> dict[str, float]:
    """llama-bench's best repetition of each test, in tokens/s, keyed like ours (pp128, tg64)."""
    command = [FLAGS.llama_bench, "-m", path, "-t", str(FLAGS.threads), "-p", ",".join(pp), "-n", str(tg), "-r",
               str(FLAGS.repetitions), "-o", "json"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise JaxinferError(f"llama-bench failed: {e}") from None
    results = {}
    for row in json.loads(done.stdout):
        test = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
        results[test] = max(row["samples_ts"])
        print(f"llama.cpp {test}: {results[test]:.1f} tokens/s (best of {len(row['samples_ts'])})", flush=True)
    return results


@exit_on_error
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    runtime.enable_compilation_cache()
    spec = sparsity.parse_spec(FLAGS.sparsity)
    m = sparsity.apply(engine.load_model(FLAGS.model), spec, sparsity.parse_down_t_type(FLAGS.down_t_type))
    print(m.describe() + f", --sparsity {spec}", file=sys.stderr)
    results = {}
    for n in [int(p) for p in FLAGS.pp]:
        results[f"pp{n}"] = time_prefill(m, n, FLAGS.repetitions)
        print(f"pp{n}: {results[f'pp{n}']:.1f} tokens/s", flush=True)
    results[f"tg{FLAGS.tg}"] = time_decode(m, FLAGS.tg, FLAGS.repetitions)
    print(f"tg{FLAGS.tg}: {results[f'tg{FLAGS.tg}']:.2f} tokens/s", flush=True)
    if FLAGS.llama_bench:
        llama = run_llama_bench(m.path, FLAGS.pp, FLAGS.tg)
        for test, ours in results.items():
            if test in llama:
                print(f"{test}: jaxinfer {ours:.1f} / llama.cpp {llama[test]:.1f} tokens/s = {ours / llama[test]:.2f}x")
    if FLAGS.json:
        largest_pp = max(int(p) for p in FLAGS.pp)
        print(json.dumps({"model": m.path, "backend": jax.default_backend(),
                          "prompt_tokens_per_s": round(results[f"pp{largest_pp}"], 2),
                          "generation_tokens_per_s": round(results[f"tg{FLAGS.tg}"], 2), **{
                              k: round(v, 2) for k, v in results.items()}}))


if __name__ == "__main__":
    app.run(main)

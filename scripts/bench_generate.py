"""Prompt-processing and generation speed, measured like llama-bench: pp = prefill of N prompt tokens,
tg = N greedy decode steps after a short prompt. Compile time is excluded (and reported separately).

    python scripts/bench_generate.py [-m MODEL] [--pp 128,512] [--tg 64] [--repetitions 3] [--json]

With --json the last line is one JSON object with prompt_tokens_per_s and generation_tokens_per_s (the best
repetition of the largest pp and of tg). Compare with llama.cpp on the same machine in the same run; absolute numbers
on shared machines are noisy.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from jaxinfer import engine, model, runtime
from jaxinfer.errors import exit_on_error

flags.DEFINE_string("model", None, "GGUF model (default: the built-in SmolLM2 Q4_1)", short_name="m")
flags.DEFINE_list("pp", ["128", "512"], "prompt lengths to time")
flags.DEFINE_integer("tg", 64, "tokens to generate")
flags.DEFINE_integer("repetitions", 3, "timed repetitions of each test (after one untimed warm-up)")
flags.DEFINE_bool("json", False, "print a JSON summary as the last line")
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
    times = []
    for _ in range(repetitions + 1):
        cache = model.init_cache(m.config, 1, n_tokens + 16)
        prompt = np.zeros((1, 16), np.int32)
        logits, cache = model.prefill(prompt, jnp.int32(1), m.weights, cache, m.config)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        jax.block_until_ready(token)
        start = time.perf_counter()
        for _ in range(n_tokens):
            logits, cache = model.decode_step(token, m.weights, cache, m.config)
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            int(token[0])  # the host needs each token, as in real generation
        times.append(time.perf_counter() - start)
    return n_tokens / min(times[1:])


@exit_on_error
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    runtime.enable_compilation_cache()
    m = engine.load_model(FLAGS.model)
    print(m.describe(), file=sys.stderr)
    results = {}
    for n in [int(p) for p in FLAGS.pp]:
        results[f"pp{n}"] = time_prefill(m, n, FLAGS.repetitions)
        print(f"pp{n}: {results[f'pp{n}']:.1f} tokens/s", flush=True)
    results[f"tg{FLAGS.tg}"] = time_decode(m, FLAGS.tg, FLAGS.repetitions)
    print(f"tg{FLAGS.tg}: {results[f'tg{FLAGS.tg}']:.2f} tokens/s", flush=True)
    if FLAGS.json:
        largest_pp = max(int(p) for p in FLAGS.pp)
        print(json.dumps({"model": m.path, "backend": jax.default_backend(),
                          "prompt_tokens_per_s": round(results[f"pp{largest_pp}"], 2),
                          "generation_tokens_per_s": round(results[f"tg{FLAGS.tg}"], 2), **{
                              k: round(v, 2) for k, v in results.items()}}))


if __name__ == "__main__":
    app.run(main)

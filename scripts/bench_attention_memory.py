"""Peak memory and time of one layer's attention in a perplexity-style forward at -c 8192, with and without
`--attn-max-batch` (jaxinfer.attention), on the default model's shapes (SmolLM2-135M: 9 heads, 3 KV heads, hd 64).

    PYTHONPATH=. python scripts/bench_attention_memory.py [--n_ctx 8192] [--ubatches 8192,512] \\
        [--limits none,default,256,32]

One attention call of random q/k/v with the model's shapes, not the whole model: 30 layers of 8192² attention take
minutes on 2 cores, and every layer's attention is the same call. The rows are the last micro-batch of a window
(T = ubatch queries at positions n_ctx-T .. n_ctx-1 against the n_ctx-key cache), the largest K·Q of the window.
Two paths: "heads" is `attention` over the whole window (no KV cache: a window evaluated in one piece), split by
KV groups of heads and query chunks under the limit; "cached" is `cached_attention`, micro-batches (and decode)
against the KV cache in steps of keys, only as far as the filled positions. Each configuration runs in a fresh
process, so its peak RSS is its own:
  scores   the K·Q tensor per step (plan_attention), and how many steps;
  temp     XLA's temporary buffers of the compiled call (compiled.memory_analysis()), which is what a limit bounds;
  peak RSS the process's maximum resident memory (includes JAX, the inputs and the output);
  time     best of --repetitions calls after one warm-up.
"""

import concurrent.futures
import multiprocessing
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jaxinfer.attention import (MIB, attention, cached_attention, default_max_batch_mib, key_step, plan_attention,
                                scores_bytes)
from jaxinfer.cli import check_list, check_range, parse_flags
from jaxinfer.errors import JaxinferError, exit_on_error

flags.DEFINE_integer("n_ctx", 8192, "context: keys in the cache")
flags.DEFINE_list("ubatches", ["8192", "512"], "queries per call (-ub); 8192 = the whole window at once")
flags.DEFINE_list("limits", ["none", "default", "256", "32"], "--attn-max-batch in MiB; none = unlimited; default = "
                  "default_max_batch_mib for the shapes")
flags.DEFINE_integer("n_head", 9, "query heads")
flags.DEFINE_integer("n_head_kv", 3, "KV heads")
flags.DEFINE_integer("head_dim", 64, "head dimension")
flags.DEFINE_integer("repetitions", 1, "timed calls after one warm-up")
check_range("n_ctx", 1)
check_list("ubatches", 1)
check_list("limits", 0, low_open=True, number=float, words=("none", "default"))
check_range("n_head", 1)
check_range("n_head_kv", 1)
check_range("head_dim", 1)
check_range("repetitions", 1)
FLAGS = flags.FLAGS


def measure(n_ctx, n_query, n_head, n_head_kv, head_dim, limit_mib, repetitions, cached):
    """In a fresh process: (XLA temp bytes, best seconds, peak RSS bytes) of one attention call: over head groups
    (`attention`, the path without a KV cache) or, `cached`, in key steps against a one-layer cache
    (`cached_attention`, the path of micro-batches and decode)."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, n_query, n_head, head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, n_ctx, n_head_kv, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, 1, n_ctx, n_head_kv, head_dim)), jnp.float32)
    q_pos = jnp.arange(n_ctx - n_query, n_ctx, dtype=jnp.int32)
    if cached:
        args = (q, k, v, jnp.int32(0), q_pos)
        compiled = jax.jit(cached_attention, static_argnames="max_batch_mib").lower(
            *args, max_batch_mib=limit_mib).compile()
    else:
        args = (q, k[0], v[0], q_pos, jnp.arange(n_ctx, dtype=jnp.int32))
        compiled = jax.jit(attention, static_argnames="max_batch_mib").lower(*args, max_batch_mib=limit_mib).compile()
    times = []
    for _ in range(repetitions + 1):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return compiled.memory_analysis().temp_size_in_bytes, min(times[1:]), peak_rss


def parse_limit(name, n_head, n_kv, n_ctx, n_query) -> float | None:
    if name == "none":
        return None
    if name == "default":
        return default_max_batch_mib(n_head, n_kv, n_ctx, n_query)
    return float(name)


@exit_on_error
def main(_):
    n_ctx, n_head, n_kv, hd = FLAGS.n_ctx, FLAGS.n_head, FLAGS.n_head_kv, FLAGS.head_dim
    if n_head % n_kv:
        raise JaxinferError(f"--n_head_kv {n_kv} does not divide --n_head {n_head}")
    if max(map(int, FLAGS.ubatches)) > n_ctx:
        raise JaxinferError(f"--ubatches: a micro-batch holds at most --n_ctx {n_ctx} queries, got "
                            f"{','.join(FLAGS.ubatches)}")
    print(f"attention of one layer: {n_head} heads, {n_kv} KV heads, hd {hd}, {n_ctx} keys, f32, "
          f"{jax.devices()[0].device_kind}")
    print(f"{'path':>7} {'-ub':>6} {'-amb MiB':>9} {'steps':>11} {'scores/step MiB':>16} {'temp MiB':>9} "
          f"{'peak RSS MiB':>13} {'time s':>8}  bound")
    spawn = multiprocessing.get_context("spawn")
    for n_query in map(int, FLAGS.ubatches):
        limits = [parse_limit(name, n_head, n_kv, n_ctx, n_query) for name in FLAGS.limits]
        # A whole window (-ub = -c) runs without a cache; micro-batches run against it, in key steps.
        for cached in (False,) if n_query == n_ctx else (False, True):
            for limit in dict.fromkeys(limits):  # "default" may equal another limit: run it once
                if cached:
                    keys = key_step(1, n_query, n_head, n_ctx, limit)
                    steps, step_bytes = f"{n_ctx // keys}x{keys} keys", scores_bytes(1, n_head, n_query, keys)
                else:
                    plan = plan_attention(1, n_query, n_ctx, n_head, n_kv, limit)
                    steps, step_bytes = f"{plan.head_steps}x{plan.query_steps}", plan.step_bytes
                with concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
                    temp, seconds, rss = pool.submit(measure, n_ctx, n_query, n_head, n_kv, hd, limit,
                                                     FLAGS.repetitions, cached).result()
                bound = "-" if limit is None else ("holds" if step_bytes <= limit * MIB else "above (floor)")
                print(f"{'cached' if cached else 'heads':>7} {n_query:>6} {'none' if limit is None else f'{limit:g}':>9} "
                      f"{steps:>11} {step_bytes / MIB:>16.1f} {temp / MIB:>9.1f} {rss / MIB:>13.0f} {seconds:>8.3f}  "
                      f"{bound}", flush=True)
    print("heads: steps = head steps x query steps (KV groups of heads, then query chunks), no KV cache; cached: "
          "key steps against a KV cache (micro-batches, decode); temp = XLA temporary buffers")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

"""Decode speed of hot/cold placements at one accelerator budget, on a sparse (predictor) model:

    neurons   jaxinfer's split: the most-fired neurons of every layer on the accelerator (placement.solve)
    layers    llama.cpp's -ngl strategy at the same budget: whole layers' FFNs on the accelerator, the rest on the host
    host      everything on the host CPU (no split)
    all       everything on the accelerator (no budget), for reference

    python scripts/bench_hybrid.py -m sparse.gguf -f text.txt --ffn_share 0.5 [-n 32] [--json]

The budget is given as the share of FFN bytes the accelerator may hold. On a machine without a GPU the
"accelerator" is a second CPU device sharing the same cores: the numbers then measure the mechanics (dispatch,
transfers), not a GPU's speed; the script says which devices it used.
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "2")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from jaxinfer import activation_profile, engine, evaluation, hybrid, model, placement, runtime, sparsity  # noqa: E402
from jaxinfer.cli import parse_flags  # noqa: E402
from jaxinfer.errors import JaxinferError, exit_on_error  # noqa: E402

flags.DEFINE_string("model", None, "sparse GGUF with predictors (e.g. from scripts/make_sparse_model.py)",
                    short_name="m")
flags.DEFINE_string("file", None, "text to profile neuron activity on", short_name="f")
flags.DEFINE_float("ffn_share", 0.5, "share of the FFN bytes the accelerator may hold")
flags.DEFINE_integer("n_predict", 32, "decode steps to time", short_name="n")
flags.DEFINE_integer("ctx_size", 256, "context", short_name="c")
flags.DEFINE_bool("json", False, "print a JSON summary as the last line")
FLAGS = flags.FLAGS


def layer_split(costs, capacity: int) -> list[np.ndarray]:
    """Whole layers' FFNs on the accelerator, first layers first, while they fit (llama.cpp's -ngl)."""
    hot, used = [], 0
    for layer_bytes in costs.unit_bytes * (costs.n_ff // costs.neurons_per_unit()):
        fits = used + layer_bytes <= capacity
        used += layer_bytes if fits else 0
        hot.append(np.arange(costs.n_ff) if fits else np.zeros(0, np.int64))
    return hot


def time_decode(step, cache, n: int) -> float:
    token = jnp.zeros((1,), jnp.int32)
    logits, cache = step(token, cache)  # warm-up: compiles
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    start = time.perf_counter()
    for _ in range(n):
        logits, cache = step(token, cache)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        int(token[0])
    return n / (time.perf_counter() - start)


@exit_on_error
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    if not FLAGS.file:
        raise JaxinferError("-f/--file is required (text to profile on)")
    runtime.enable_compilation_cache()
    m = sparsity.apply(engine.load_model(FLAGS.model), sparsity.SparsitySpec("predictor"))
    print(m.describe(), file=sys.stderr)
    devices = hybrid.Placement.detect()
    tokens = np.asarray(m.tokenizer.encode(open(FLAGS.file, encoding="utf-8").read()), np.int32)
    counts = activation_profile.profile_counts(m, evaluation.make_windows(tokens, 128, 8, None))
    costs = hybrid.placement_costs(m.weights, m.config, devices, placement.kv_cache_bytes(m.config, FLAGS.ctx_size))
    ffn_total = int((costs.unit_bytes * (costs.n_ff // costs.neurons_per_unit())).sum())
    capacity = int(FLAGS.ffn_share * ffn_total)
    budget = capacity + costs.dense_bytes + costs.kv_bytes + placement.WORKSPACE_BYTES
    splits = {"neurons": placement.solve(counts, costs, budget).hot, "layers": layer_split(costs, capacity)}
    results = {}
    for name, hot in splits.items():
        hw = hybrid.split_weights(m.weights, hot, devices, m.config)
        cache = jax.device_put(model.init_cache(m.config, 1, FLAGS.ctx_size), devices.accelerator)
        hit = sum(counts[i, h].sum() for i, h in enumerate(hot)) / counts.sum()
        results[name] = {
            "tokens_per_s": time_decode(lambda t, c: hybrid.decode_step(t, hw, c, m.config, devices), cache,
                                        FLAGS.n_predict),
            "accelerator_ffn_mib": hybrid.ffn_bytes(hw.hot) / 2**20, "activations_on_accelerator": float(hit)}
    for name, device in (("host", devices.host), ("all", devices.accelerator)):
        weights = jax.device_put(m.weights, device)
        cache = jax.device_put(model.init_cache(m.config, 1, FLAGS.ctx_size), device)
        results[name] = {"tokens_per_s": time_decode(lambda t, c: model.decode_step(t, weights, c, m.config), cache,
                                                     FLAGS.n_predict)}
    print(f"devices: accelerator {devices.accelerator}, host {devices.host}; budget {FLAGS.ffn_share:.0%} of "
          f"{ffn_total / 2**20:.1f} MiB of FFN weights")
    for name, r in results.items():
        extra = (f", {r['accelerator_ffn_mib']:.1f} MiB FFN on the accelerator serving "
                 f"{r['activations_on_accelerator']:.0%} of activations" if "accelerator_ffn_mib" in r else "")
        print(f"{name:>8}: {r['tokens_per_s']:.2f} tokens/s{extra}")
    if FLAGS.json:
        print(json.dumps({"devices": [str(devices.accelerator), str(devices.host)], **results}))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

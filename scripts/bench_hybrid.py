"""Decode speed of hot/cold placements at one accelerator budget, on a sparse (predictor) model or a mixture of
experts:

    neurons   jaxinfer's split: the most-fired neurons of every layer in device memory (placement.solve); in a
              mixture (`experts`), whole experts, the most routed to per byte first
    layers    llama.cpp's -ngl strategy at the same budget: whole layers' FFNs in device memory, the rest on the host;
              in a mixture, its --n-cpu-moe N: the first N layers' experts on the host, the later ones in device memory
    host      every FFN neuron (expert) in host memory
    all       everything in device memory (no split), for reference

    python scripts/bench_hybrid.py -m sparse.gguf -f text.txt --ffn_share 0.5 [-n 32] [--json]

The budget is given as the share of FFN (expert) bytes device memory may hold. Every placement runs generate's own
compiled decode loop (hybrid.py: one program, cold parts under compute_on in host memory), and says which share of
the profiled activations (routings) its device memory serves. On a machine without a GPU the device and the host
are the same cores: the speeds then measure what the split costs in itself, not a GPU's speed.
"""

import dataclasses
import json
import sys

import numpy as np
from absl import app, flags, logging

from jaxinfer import activation_profile, cli, engine, evaluation, hybrid, placement, receipt, runtime, sparsity
from jaxinfer.cli import check_range, parse_flags
from jaxinfer.errors import exit_on_error
from jaxinfer.sampling import SamplingParams

flags.DEFINE_string("model", None, "sparse GGUF with predictors, or a mixture of experts (e.g. from "
                    "scripts/make_sparse_model.py)",
                    short_name="m")
flags.DEFINE_string("file", None, "text to profile neuron activity on", short_name="f")
flags.DEFINE_float("ffn_share", 0.5, "share of the FFN (expert) bytes the accelerator may hold")
flags.DEFINE_integer("n_predict", 32, "decode steps to time", short_name="n")
flags.DEFINE_integer("ctx_size", 256, "context", short_name="c")
flags.DEFINE_bool("json", False, "print a JSON summary as the last line")
cli.define_receipt_flag()
check_range("ffn_share", 0, 1)
check_range("n_predict", 1)
check_range("ctx_size", 2)  # the one-token prompt and a decode step
flags.adopt_module_key_flags(cli)
FLAGS = flags.FLAGS


def layer_split(costs, capacity: int, last_first: bool = False) -> list[np.ndarray]:
    """Whole layers' FFNs on the accelerator while they fit: first layers first (llama.cpp's -ngl), or with
    `last_first` the last ones (its --n-cpu-moe N keeps the first N layers' experts on the host)."""
    layer_bytes = costs.unit_bytes * (costs.n_ff // costs.neurons_per_unit())
    order = range(costs.n_layer - 1, -1, -1) if last_first else range(costs.n_layer)
    hot, used = [np.zeros(0, np.int64)] * costs.n_layer, 0
    for i in order:
        if used + layer_bytes[i] > capacity:
            break
        used += layer_bytes[i]
        hot[i] = np.arange(costs.n_ff)
    return hot


def decode_rate(m, n: int) -> float:
    """Tokens/s of n greedy decode steps through generate's programs, after one untimed run (compile, warm-up)."""
    rates = []
    for _ in range(2):
        stats = engine.GenerationStats()
        list(engine.generate_tokens(m, [0], n + 1, FLAGS.ctx_size, SamplingParams(temperature=0), 0, stats,
                                    stop_ids=frozenset()))
        rates.append((stats.generated_tokens - 1) / stats.decode_seconds)
    return rates[-1]


@exit_on_error
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    text = cli.read_text_file(FLAGS.file, "-f/--file is required (text to profile on)")
    receipt.check_path(FLAGS.receipt)
    runtime.enable_compilation_cache()
    m = engine.load_model(FLAGS.model)
    mixture = bool(m.config.n_expert)  # a mixture runs dense: its router chooses the experts
    m = m if mixture else sparsity.apply(m, sparsity.SparsitySpec("predictor"))
    print(m.describe(), file=sys.stderr)
    tokens = np.asarray(m.tokenizer.encode(text), np.int32)
    counts = activation_profile.profile_counts(m, evaluation.make_windows(tokens, 128, 8, None))
    costs = hybrid.placement_costs(m.weights, m.config, placement.kv_cache_bytes(m.config, FLAGS.ctx_size))
    ffn_total = int((costs.unit_bytes * (costs.n_ff // costs.neurons_per_unit())).sum())
    capacity = int(FLAGS.ffn_share * ffn_total)
    budget = capacity + costs.dense_bytes + costs.kv_bytes + placement.WORKSPACE_BYTES
    splits = {"experts" if mixture else "neurons": placement.solve(counts, costs, budget).hot,
              "layers": layer_split(costs, capacity, last_first=mixture),
              "host": [np.zeros(0, np.int64)] * m.config.n_layer}
    results = {}
    for name, hot in splits.items():
        split = dataclasses.replace(m, weights=hybrid.split_weights(m.weights, hot, m.config))
        hit = sum(counts[i, h].sum() for i, h in enumerate(hot)) / counts.sum()
        results[name] = {"tokens_per_s": decode_rate(split, FLAGS.n_predict),
                         "device_ffn_mib": hybrid.ffn_bytes(split.weights, on_host=False) / 2**20,
                         "activations_in_device_memory": float(hit)}
    results["all"] = {"tokens_per_s": decode_rate(m, FLAGS.n_predict)}
    what = ("expert", "routings") if mixture else ("FFN", "activations")
    print(f"{m.config.plan.describe()}; budget {FLAGS.ffn_share:.0%} of {ffn_total / 2**20:.1f} MiB of {what[0]} "
          f"weights")
    for name, r in results.items():
        extra = (f", {r['device_ffn_mib']:.1f} MiB {what[0]} weights in device memory serving "
                 f"{r['activations_in_device_memory']:.1%} of {what[1]}" if "device_ffn_mib" in r else "")
        print(f"{name:>8}: {r['tokens_per_s']:.2f} tokens/s{extra}")
    receipt.write(FLAGS.receipt, m, {"ffn_share": FLAGS.ffn_share, "ffn_mib": ffn_total / 2**20, **results})
    if FLAGS.json:
        print(json.dumps({"plan": dataclasses.asdict(m.config.plan), **results}))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

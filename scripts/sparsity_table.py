"""PPL vs activation sparsity on WikiText-2, through the real inference path, as a Markdown table for the README.

    python scripts/sparsity_table.py -f wiki.test.raw [-m MODEL] [--levels 0.3,0.5,0.7] [--predictor_labels 0.5,0.7]

Evaluation: llama-perplexity's convention, -c 512, the first --chunks windows. Thresholds are calibrated, and
predictors trained, on windows taken from the far end of the same file, disjoint from the evaluated ones.
"FFN bytes" is the share of FFN weight bytes a row-skipping kernel reads per token, from the active share measured on
the evaluated text: hidden reads gate and up fully and down for active neurons; gate (CATS) reads the gate fully and
up and down for active neurons; predictor reads its own weights plus gate, up and down for predicted neurons.
"""

import dataclasses
import sys
import time

import numpy as np
from absl import app, flags, logging

from jaxinfer import activation_profile, calibrate, engine, evaluation, runtime, sparsity, train_predictor
from jaxinfer.cli import check_list, check_range, parse_flags, read_text_file
from jaxinfer.errors import JaxinferError, exit_on_error

METHODS = ("gate", "hidden", "predictor")
flags.DEFINE_string("model", None, "GGUF model (default: SmolLM2-135M-Instruct Q4_1)", short_name="m")
flags.DEFINE_string("file", None, "evaluation text: WikiText-2's whole wiki.test.raw (calibration and training "
                    "windows come from its far end)", short_name="f")
flags.DEFINE_integer("chunks", 20, "evaluated windows of 512 tokens")
flags.DEFINE_list("levels", ["0.3", "0.5", "0.7"], "target sparsity levels for the threshold methods")
flags.DEFINE_list("predictor_labels", ["0.5", "0.7"], "hidden:S label sparsities to train predictors for")
flags.DEFINE_integer("calibration_chunks", 8, "windows for calibration (from the end of the file)")
flags.DEFINE_integer("train_chunks", 32, "windows to train predictors on (from the end of the file)")
flags.DEFINE_float("budget", 0.05, "predictor parameters as a share of FFN parameters")
flags.DEFINE_float("positive_weight", 1.5, "predictor loss weight of active neurons (higher favours recall)")
flags.DEFINE_list("methods", list(METHODS), "which rows to produce")
check_range("chunks", 1)
check_list("levels", 0, 1, low_open=True, high_open=True, number=float)
check_list("predictor_labels", 0, 1, low_open=True, high_open=True, number=float)
check_range("calibration_chunks", 1)
check_range("train_chunks", 1)
check_range("budget", 0, 1, low_open=True)
check_range("positive_weight", 0, low_open=True)
FLAGS = flags.FLAGS
N_CTX = 512


def ffn_bytes(m):
    total = {"gate": 0, "up": 0, "down": 0, "predictor": 0}
    for layer in m.weights.layers:
        total["gate"] += layer.ffn_gate.nbytes
        total["up"] += layer.ffn_up.nbytes
        total["down"] += (layer.ffn_down if layer.ffn_down is not None else layer.ffn_down_t).nbytes
        if layer.fc1 is not None:
            total["predictor"] += layer.fc1.nbytes + layer.fc2.nbytes
    return total


def bytes_ratio(mode, active, b, reference):
    dense = reference["gate"] + reference["up"] + reference["down"]
    if mode == "hidden":
        read = b["gate"] + b["up"] + active * b["down"]
    elif mode == "gate":
        read = b["gate"] + active * (b["up"] + b["down"])
    elif mode == "predictor":
        read = b["predictor"] + active * (b["gate"] + b["up"] + b["down"])
    else:
        read = b["gate"] + b["up"] + b["down"]
    return read / dense


@exit_on_error
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    text = read_text_file(FLAGS.file, "-f/--file is required: WikiText-2's wiki.test.raw")
    if not set(FLAGS.methods) <= set(METHODS):
        raise JaxinferError(f"--methods must be some of {', '.join(METHODS)}, got {','.join(FLAGS.methods)}")
    runtime.enable_compilation_cache()
    base = engine.load_model(FLAGS.model)
    print(base.describe(), file=sys.stderr)
    tokens = np.asarray(base.tokenizer.encode(text), np.int32)
    all_windows = evaluation.make_windows(tokens, N_CTX, -1, base.tokenizer.bos_id if base.tokenizer.add_bos else None)
    evaluated = all_windows[:FLAGS.chunks]
    calibration = all_windows[-FLAGS.calibration_chunks:]
    training = all_windows[-FLAGS.train_chunks - FLAGS.calibration_chunks:-FLAGS.calibration_chunks]
    reference_bytes = ffn_bytes(base)
    rows = []

    def measure(label, m, mode):
        start = time.perf_counter()
        result = evaluation.evaluate_windows(m.weights, m.config, evaluated, progress=False)
        active = float(activation_profile.profile_counts(m, evaluated[:4]).sum() / (evaluated[:4].size * m.config.n_ff
                                                                          * m.config.n_layer))
        ratio = bytes_ratio(mode, active, ffn_bytes(m), reference_bytes)
        rows.append((label, 1 - active, result.ppl, result.error, ratio))
        print(f"{label}: sparsity {1 - active:.3f}, PPL {result.ppl:.4f} ± {result.error:.4f}, FFN bytes {ratio:.3f} "
              f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)

    measure("dense", base, "dense")
    levels = [float(v) for v in FLAGS.levels]
    for method in [m for m in sparsity.THRESHOLD_METHODS if m in FLAGS.methods]:
        sparsity.save_thresholds(base.path, method, calibrate.calibrate(base, calibration, method, levels),
                                 f"{FLAGS.file}: last {FLAGS.calibration_chunks} windows")
        for level in levels:
            measure(f"{method}:{level:g}" + (" (CATS)" if method == "gate" else ""),
                    sparsity.apply(base, sparsity.SparsitySpec(method, level)), method)
    for label_level in [float(v) for v in FLAGS.predictor_labels] if "predictor" in FLAGS.methods else []:
        if "hidden" not in FLAGS.methods or f"{label_level:g}" not in [f"{v:g}" for v in levels]:
            sparsity.save_thresholds(base.path, "hidden", calibrate.calibrate(base, calibration, "hidden",
                                                                              [label_level]), "table")
        labelled = sparsity.apply(base, sparsity.SparsitySpec("hidden", label_level))
        x, y = train_predictor.collect(labelled, training)
        ranks = train_predictor.choose_ranks(np.array([v.mean() for v in y]), base.config.n_embd, base.config.n_ff,
                                             FLAGS.budget)
        predictors = [train_predictor.train_layer(x[i], y[i], r, steps=400, batch=1024, learning_rate=3e-3,
                                                  positive_weight=FLAGS.positive_weight, seed=i)
                      for i, r in enumerate(ranks)]
        del x, y
        weights = train_predictor.with_predictors(base.weights, predictors, plan=base.config.plan)
        predicted = dataclasses.replace(base, weights=weights)
        measure(f"predictor (hidden:{label_level:g} labels, budget {FLAGS.budget:g}, "
                f"{train_predictor.DEFAULT_PREDICTOR_TYPE.name})",
                sparsity.apply(predicted, sparsity.SparsitySpec("predictor")), "predictor")

    print(f"| method | FFN sparsity (measured) | PPL (wiki.test.raw, -c 512, {FLAGS.chunks} chunks) | FFN bytes / token |")
    print("|---|---|---|---|")
    for label, measured, ppl, error, ratio in rows:
        print(f"| {label} | {measured:.1%} | {ppl:.4f} ± {error:.4f} | {ratio:.2f} |")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

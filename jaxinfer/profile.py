"""python -m jaxinfer.profile: count how often every FFN neuron fires over a text, for placement and research.

Writes, into `<model file>.activation/` beside the model (named after it, so that the profiles of models sharing a
folder stay apart; in the model's cache folder when the model's folder is read-only or an installed package's, see
sidecar.derived_path) or `-o DIR`, replacing the folder as one unit (PowerInfer's file names inside it):
    activation_{i}.pt   one file per layer i: a 1-D int64 torch tensor of length n_ff, how many of the profiled
                        tokens activated each neuron (PowerInfer's format; read it with torch.load or
                        jaxinfer.torch_format.load_tensor). Layers are numbered in numeric order.
    profile.json        model fingerprint, tokens profiled, sparsity spec, per-layer share of neurons that cover
                        50/80/95% of activations (a mixture of ReLU experts: also the share of its routed experts'
                        neurons left nonzero, expert_neurons_active), SHA-256 of each layer file
    activation.png      sorted firing frequency per layer, and the coverage shares
"Active" is what the inference path computes under `--sparsity` (ReLU models: nonzero activations).
"""

import os
import sys
import time

from jaxinfer.errors import JaxinferError, exit_on_error


def _cli_main(argv):
    # JAX is imported here, under exit_on_error, where a Ctrl-C while it loads is one line rather than a traceback.
    import numpy as np
    from absl import flags

    from jaxinfer import cli, engine, runtime, sparsity
    from jaxinfer.activation_profile import (COVERAGE_SHARES, check_output_directory, default_directory, profile,
                                             write_profile)
    from jaxinfer.evaluation import make_windows

    f = flags.FLAGS
    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not f.file or not os.path.isfile(f.file):
        raise JaxinferError(f"text file not found: {f.file}" if f.file else "-f/--file is required")
    spec = sparsity.parse_spec(f.sparsity)
    directory = f.output or default_directory(f.model or engine.default_model_path(), create=True)
    check_output_directory(directory)
    runtime.enable_compilation_cache()
    m = engine.build_model(f.model, sparsity_spec=spec, thresholds_file=f.thresholds)
    print(m.describe(), file=sys.stderr)
    print(f"the activation profile goes to {directory}", file=sys.stderr)
    tokens = np.asarray(m.tokenizer.encode(open(f.file, encoding="utf-8", errors="replace").read()), np.int32)
    n_ctx = cli.capped_context(f.ctx_size, m.config.n_ctx_train)
    windows = make_windows(tokens, n_ctx, f.chunks, m.tokenizer.bos_id if m.tokenizer.add_bos else None)
    start = time.perf_counter()
    counts, expert_active = profile(m, windows, cli.windows_per_batch(f.batch_size, n_ctx, len(windows)))
    seconds = time.perf_counter() - start
    summary = write_profile(directory, m.path, counts, windows.size, str(spec), expert_active)
    neurons = "" if expert_active is None else f" {'neurons':>8}"  # a ReLU mixture: its routed experts' nonzero share
    print(f"{'layer':>5} {'active':>7}{neurons} " + " ".join(f"{'cover ' + format(s, '.0%'):>10}"
                                                             for s in COVERAGE_SHARES))
    for entry in summary["layers"]:
        share = f" {entry['expert_neurons_active']:>8.3f}" if neurons else ""
        print(f"{entry['layer']:>5} {entry['mean_active']:>7.3f}{share} "
              + " ".join(f"{entry['coverage'][format(s, 'g')]:>10.3f}" for s in COVERAGE_SHARES))
    print(f"profiled {windows.size} tokens with --sparsity {spec} in {seconds:.1f} s "
          f"({windows.size / seconds:.0f} tokens/s); wrote {directory}/activation_{{0..{len(counts) - 1}}}.pt, "
          f"profile.json, activation.png")


def main():
    from absl import app, flags

    from jaxinfer.cli import MIN_WINDOW, THRESHOLDS_HELP, check_range, parse_flags

    flags.DEFINE_string("model", None, "GGUF model (default: SmolLM2-135M-Instruct Q4_1)", short_name="m")
    flags.DEFINE_string("file", None, "text to profile on", short_name="f")
    flags.DEFINE_integer("ctx_size", 512, "tokens per window; capped at the model's training context",
                         short_name="c")
    flags.DEFINE_integer("chunks", -1, "profile only the first N windows; -1 for all")
    flags.DEFINE_integer("batch_size", 2048, "tokens per compiled call", short_name="b")
    check_range("ctx_size", MIN_WINDOW)
    check_range("chunks", 1, sentinel=-1)
    check_range("batch_size", 1)
    flags.DEFINE_string("sparsity", "dense", "what counts as active: dense | predictor | gate:S | hidden:S")
    flags.DEFINE_string("thresholds", None, THRESHOLDS_HELP)
    flags.DEFINE_string("output", None, "output folder, replaced as a whole (default: MODEL.activation/ beside the "
                        "model, or in the model's cache folder when the model's folder is read-only)", short_name="o")
    app.run(exit_on_error(_cli_main), flags_parser=parse_flags)


if __name__ == "__main__":
    main()

"""python -m jaxinfer.calibrate: training-free activation sparsity for SwiGLU (or any gated) models.

Per layer, a threshold t is set so that a target share S of neurons is inactive on a calibration text:
    gate    |gate_act(x W_gateᵀ)| <= t   (CATS: the gate stays dense, up and down rows of inactive neurons are skipped)
    hidden  |h| <= t, h = gate_act(...) * up(...)   (only down rows are skipped; much cheaper in quality)
Magnitudes are accumulated in a log-spaced histogram inside the compiled forward (4096 bins over 1e-8..1e4, so a
threshold is resolved to 0.7%), then the S-quantile of each layer becomes its threshold. The thresholds go into
`<model>.sparsity.json` (sparsity.thresholds_path: beside the model, or in its cache folder when the model's folder is
read-only or an installed package's) or `-o FILE`; `--sparsity gate:S` / `hidden:S` on generate, perplexity,
profile and train_predictor apply the ones in `<model>.sparsity.json`, or with `--thresholds FILE` those of FILE.
"""

import sys
import time

import numpy as np

from jaxinfer.errors import JaxinferError, exit_on_error

# JAX (and jaxinfer.sparsity, which imports it) is imported by the functions that use it: `python -m
# jaxinfer.calibrate` loads it under exit_on_error, where a Ctrl-C while it loads is one line rather than a traceback.
LOG10_EDGES = np.linspace(-8.0, 4.0, 4097, dtype=np.float32)


def _histogram(values, valid):
    """Counts of log10|values| over real windows' tokens, per bin of LOG10_EDGES (clipped into range)."""
    import jax.numpy as jnp

    logs = jnp.clip(jnp.log10(jnp.abs(values) + 1e-30), LOG10_EDGES[0], LOG10_EDGES[-1] - 1e-6)
    weights = jnp.broadcast_to(valid[:, None, None], values.shape).astype(jnp.float32)
    return jnp.histogram(logs, bins=jnp.asarray(LOG10_EDGES), weights=weights)[0]


def gate_histogram(trace, valid):
    return _histogram(trace.gate, valid)


def hidden_histogram(trace, valid):
    return _histogram(trace.hidden, valid)


HISTOGRAMS = {"gate": gate_histogram, "hidden": hidden_histogram}


def thresholds_from_histogram(histogram: np.ndarray, level: float) -> float:
    """The magnitude below which a share `level` of the counted values lie (upper edge of the quantile's bin)."""
    cumulative = np.cumsum(histogram) / histogram.sum()
    return float(10.0 ** LOG10_EDGES[np.searchsorted(cumulative, level) + 1])


def calibrate(m, windows: np.ndarray, method: str, levels, n_seq: int = 4) -> dict[float, np.ndarray]:
    """{level: per-layer thresholds [n_layer]} for `method` on the windows' tokens (model run densely)."""
    from jaxinfer import sparsity

    dense = sparsity.apply(m, sparsity.SparsitySpec("dense"))
    histograms = sparsity.reduce_over_windows(dense, windows, HISTOGRAMS[method], n_seq, desc="calibrating")
    return {level: np.array([thresholds_from_histogram(h, level) for h in histograms], np.float32)
            for level in levels}


def _cli_main(argv):
    from absl import flags

    from jaxinfer import cli, engine, runtime, sidecar, sparsity
    from jaxinfer.evaluation import make_windows

    f = flags.FLAGS
    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    if f.method not in sparsity.THRESHOLD_METHODS:
        raise JaxinferError(f"--method must be one of {', '.join(sparsity.THRESHOLD_METHODS)}, got {f.method!r}")
    try:
        levels = [float(v) for v in f.levels]
    except ValueError:
        raise JaxinferError(f"--levels must be numbers in (0, 1), got {','.join(f.levels)}") from None
    if not all(0 < v < 1 for v in levels):
        raise JaxinferError(f"--levels must be numbers in (0, 1), got {','.join(f.levels)}")
    text = cli.read_text_file(f.file, "-f/--file is required (the calibration text)")
    output = f.output or sparsity.thresholds_path(f.model or engine.default_model_path(), create=True)
    sidecar.check_writable_file(output)  # before calibrating, not after
    runtime.enable_compilation_cache()
    m = engine.build_model(f.model)
    sparsity.check_neuron_statistics(m.config, "calibrate")
    print(m.describe(), file=sys.stderr)
    print(f"thresholds go to {output}", file=sys.stderr)
    tokens = np.asarray(m.tokenizer.encode(text), np.int32)
    n_ctx = cli.capped_context(f.ctx_size, m.config.n_ctx_train)
    windows = make_windows(tokens, n_ctx, f.chunks, m.tokenizer.bos_id if m.tokenizer.add_bos else None)
    start = time.perf_counter()
    thresholds = calibrate(m, windows, f.method, levels, cli.windows_per_batch(f.batch_size, n_ctx, len(windows)))
    path = sparsity.save_thresholds(m.path, f.method, thresholds, f"{f.file} ({windows.size} tokens)", output)
    for level, values in thresholds.items():
        print(f"{f.method}:{level:g}  thresholds median {np.median(values):.4g} (layers {values.min():.4g} .. "
              f"{values.max():.4g})")
    print(f"calibrated on {windows.size} tokens in {time.perf_counter() - start:.1f} s; wrote {path}")


def main():
    from absl import app, flags

    from jaxinfer.cli import MIN_WINDOW, check_range, parse_flags

    flags.DEFINE_string("model", None, "GGUF model (default: SmolLM2-135M-Instruct Q4_1)", short_name="m")
    flags.DEFINE_string("file", None, "calibration text", short_name="f")
    flags.DEFINE_string("method", "hidden", "gate (CATS: skip up and down) or hidden (skip down only)")
    flags.DEFINE_list("levels", ["0.5"], "target shares of inactive neurons, e.g. 0.3,0.5,0.7")
    flags.DEFINE_integer("ctx_size", 512, "tokens per window; capped at the model's training context",
                         short_name="c")
    flags.DEFINE_integer("chunks", 8, "calibrate on the first N windows; -1 for all")
    flags.DEFINE_integer("batch_size", 2048, "tokens per compiled call", short_name="b")
    flags.DEFINE_string("output", None, "thresholds file to merge into (default: MODEL.sparsity.json, where --sparsity "
                        "gate:S / hidden:S look for them: beside the model, or in the model's cache folder when the "
                        "model's folder is read-only or an installed package's; another file is used with "
                        "--thresholds FILE)", short_name="o")
    check_range("ctx_size", MIN_WINDOW)
    check_range("chunks", 1, sentinel=-1)
    check_range("batch_size", 1)
    app.run(exit_on_error(_cli_main), flags_parser=parse_flags)


if __name__ == "__main__":
    main()

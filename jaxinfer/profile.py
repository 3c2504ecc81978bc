"""python -m jaxinfer.profile: count how often every FFN neuron fires over a text, for placement and research.

Writes, into `<model file>.activation/` beside the model (named after it, so that the profiles of models sharing a
folder stay apart; in the model's cache folder when the model's folder is read-only or an installed package's, see
sidecar.derived_path) or `-o DIR`, replacing the folder as one unit (PowerInfer's file names inside it):
    activation_{i}.pt   one file per layer i: a 1-D int64 torch tensor of length n_ff, how many of the profiled
                        tokens activated each neuron (PowerInfer's format; read it with torch.load or
                        jaxinfer.torch_format.load_tensor). Layers are numbered in numeric order.
    profile.json        model fingerprint, tokens profiled, sparsity spec, per-layer share of neurons that cover
                        50/80/95% of activations, SHA-256 of each layer file
    activation.png      sorted firing frequency per layer, and the coverage shares
"Active" is what the inference path computes under `--sparsity` (ReLU models: nonzero activations).
"""

import hashlib
import os
import re
import sys
import time

import numpy as np

from jaxinfer import sidecar, sparsity, torch_format
from jaxinfer.errors import JaxinferError, exit_on_error

COVERAGE_SHARES = (0.5, 0.8, 0.95)
PROFILE_FILE = re.compile(r"activation_\d+\.pt|profile\.json|activation\.png")


def profile_counts(m, windows: np.ndarray, n_seq: int = 4) -> np.ndarray:
    """[n_layer, n_ff] int64 activation counts over the windows' tokens."""
    counts = sparsity.reduce_over_windows(m, windows, sparsity.count_active, n_seq, desc="profiling")
    return np.stack(counts).astype(np.int64)


def default_directory(model_path: str, create: bool = False) -> str:
    """`<model file>.activation/` beside the model, or in its cache folder (sidecar.derived_path): one folder per
    model, where the profile CLI writes and a split reads by default."""
    return sidecar.derived_path(model_path, os.path.basename(model_path) + ".activation", create)


def check_output_directory(directory: str) -> None:
    """Fail before a run when `directory` cannot take a profile: it is replaced as a whole, so it may hold nothing but
    a profile's files."""
    sidecar.check_writable_folder(directory)
    if os.path.isdir(directory):
        foreign = sorted(name for name in os.listdir(directory) if not PROFILE_FILE.fullmatch(name))
        if foreign:
            raise JaxinferError(f"{directory} holds files that are not an activation profile's ({foreign[0]}, ...); "
                                f"a profile replaces the whole folder: choose another -o")


def write_profile(directory: str, model_path: str, counts: np.ndarray, n_tokens: int, spec: str) -> dict:
    """Write the profile into a new folder that then replaces `directory` as one unit (sidecar.atomic_directory):
    a killed run leaves the previous profile whole. profile.json records each layer file's SHA-256, so that files
    from different runs put together by hand are rejected by read_profile."""
    summary = {
        "tokens": n_tokens,
        "sparsity": spec,
        "layers": [
            {"layer": i, "mean_active": float(c.sum() / (n_tokens * len(c))),
             "coverage": {f"{s:g}": v for s, v in sparsity.coverage(c, COVERAGE_SHARES).items()}}
            for i, c in enumerate(counts)
        ],
    }
    with sidecar.atomic_directory(directory) as tmp:
        digests = {}
        for i, layer_counts in enumerate(counts):
            name = f"activation_{i}.pt"
            torch_format.save_tensor(os.path.join(tmp, name), layer_counts)
            digests[name] = _digest(os.path.join(tmp, name))
        sidecar.write_json(os.path.join(tmp, "profile.json"), model_path, {**summary, "files": digests})
        plot(os.path.join(tmp, "activation.png"), counts, n_tokens, summary)
    return summary


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_profile(directory: str, model_path: str, n_layer: int, n_ff: int) -> np.ndarray:
    """[n_layer, n_ff] counts from an activation folder (ours or PowerInfer's), every file checked for its shape and
    values; with our profile.json, also against the model and against the files that run wrote."""
    digests = None
    if os.path.exists(os.path.join(directory, "profile.json")):
        document = sidecar.read_json(os.path.join(directory, "profile.json"), model_path)  # raises if stale or foreign
        digests = document.get("files")
        if not isinstance(digests, dict):
            raise JaxinferError(f"{directory}/profile.json lists no layer files; profile again")
    files = [os.path.join(directory, f"activation_{i}.pt") for i in range(n_layer)]
    missing = [p for p in files if not os.path.exists(p)]
    if missing:
        raise JaxinferError(f"activation profile incomplete: {missing[0]} is missing")
    counts = []
    for path in files:
        if digests is not None and digests.get(os.path.basename(path)) != _digest(path):
            raise JaxinferError(f"{path} is not the file profile.json's run wrote (a mix of profiling runs?); "
                                f"profile again")
        layer_counts = torch_format.load_tensor(path, max_elements=n_ff)
        if layer_counts.shape != (n_ff,):
            raise JaxinferError(f"{path} holds {layer_counts.shape[0]} counts, the model has {n_ff} neurons per layer")
        if not np.all(np.isfinite(layer_counts)) or np.any(layer_counts < 0):
            raise JaxinferError(f"{path} holds counts that are negative or not finite")
        counts.append(layer_counts)
    return np.stack(counts)


def plot(path: str, counts: np.ndarray, n_tokens: int, summary: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.cm.viridis(np.linspace(0, 1, len(counts)))
    for i, c in enumerate(counts):
        frequency = np.sort(c)[::-1] / n_tokens
        left.plot(np.arange(1, len(c) + 1) / len(c), frequency, color=colors[i], lw=0.8,
                  label=f"layer {i}" if i in (0, len(counts) - 1) else None)
    left.set(yscale="log", xlabel="neurons, hottest first (share of layer)", ylabel="firing frequency",
             title=f"Neuron firing frequency ({n_tokens} tokens)")
    left.legend()
    layers = np.arange(len(counts))
    for share, marker in zip(COVERAGE_SHARES, "o^s"):
        right.plot(layers, [entry["coverage"][f"{share:g}"] for entry in summary["layers"]], marker=marker,
                   label=f"{share:.0%} of activations")
    right.set(xlabel="layer", ylabel="share of neurons needed", ylim=(0, 1), title="Coverage by the hottest neurons")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cli_main(argv):
    from absl import flags

    from jaxinfer import cli, engine, perplexity, runtime

    f = flags.FLAGS
    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not f.file or not os.path.isfile(f.file):
        raise JaxinferError(f"text file not found: {f.file}" if f.file else "-f/--file is required")
    spec = sparsity.parse_spec(f.sparsity)
    directory = f.output or default_directory(f.model or engine.default_model_path(), create=True)
    check_output_directory(directory)
    runtime.enable_compilation_cache()
    m = sparsity.apply(engine.load_model(f.model), spec)
    print(m.describe(), file=sys.stderr)
    print(f"the activation profile goes to {directory}", file=sys.stderr)
    tokens = np.asarray(m.tokenizer.encode(open(f.file, encoding="utf-8", errors="replace").read()), np.int32)
    n_ctx = cli.capped_context(f.ctx_size, m.config.n_ctx_train)
    windows = perplexity.make_windows(tokens, n_ctx, f.chunks, m.tokenizer.bos_id if m.tokenizer.add_bos else None)
    start = time.perf_counter()
    counts = profile_counts(m, windows, cli.windows_per_batch(f.batch_size, n_ctx, len(windows)))
    seconds = time.perf_counter() - start
    summary = write_profile(directory, m.path, counts, windows.size, str(spec))
    print(f"{'layer':>5} {'active':>7} " + " ".join(f"{'cover ' + format(s, '.0%'):>10}" for s in COVERAGE_SHARES))
    for entry in summary["layers"]:
        print(f"{entry['layer']:>5} {entry['mean_active']:>7.3f} "
              + " ".join(f"{entry['coverage'][format(s, 'g')]:>10.3f}" for s in COVERAGE_SHARES))
    print(f"profiled {windows.size} tokens with --sparsity {spec} in {seconds:.1f} s "
          f"({windows.size / seconds:.0f} tokens/s); wrote {directory}/activation_{{0..{len(counts) - 1}}}.pt, "
          f"profile.json, activation.png")


def main():
    from absl import app, flags

    from jaxinfer.cli import MIN_WINDOW, check_range, parse_flags

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
    flags.DEFINE_string("output", None, "output folder, replaced as a whole (default: MODEL.activation/ beside the "
                        "model, or in the model's cache folder when the model's folder is read-only)", short_name="o")
    app.run(exit_on_error(_cli_main), flags_parser=parse_flags)


if __name__ == "__main__":
    main()

"""Activation profiles: how often every FFN neuron fires over a text, counted, written as a folder of PowerInfer's
files (`<model file>.activation/` by default) and read back for placement. The files are described in
`python -m jaxinfer.profile`'s docstring.
"""

import hashlib
import os
import re

import jax.numpy as jnp
import numpy as np

from jaxinfer import sidecar, sparsity, torch_format
from jaxinfer.errors import JaxinferError

COVERAGE_SHARES = (0.5, 0.8, 0.95)
PROFILE_FILE = re.compile(r"activation_\d+\.pt|profile\.json|activation\.png")


def profile_counts(m, windows: np.ndarray, n_seq: int = 4) -> np.ndarray:
    """[n_layer, n_ff] int64 activation counts over the windows' tokens."""
    return profile(m, windows, n_seq)[0]


def profile(m, windows: np.ndarray, n_seq: int = 4) -> tuple[np.ndarray, np.ndarray | None]:
    """(profile_counts, and for a mixture of experts with natural zeros the share of its routed experts' neurons
    the tokens left nonzero, [n_layer] f64; None for other models), in one pass over the windows."""
    observed = sparsity.reduce_over_windows(m, windows, _count, n_seq, desc="profiling")
    counts = np.stack([layer[0] for layer in observed]).astype(np.int64)
    if len(observed[0]) == 1:
        return counts, None
    nonzero = np.array([float(layer[1]) for layer in observed])
    return counts, nonzero / np.maximum(counts.sum(axis=1), 1) / m.config.n_ff_exp


def _count(trace, valid):
    """One layer's activation counts, and the nonzero neurons of its routed experts summed where the trace has them
    (FFNTrace.nonzero)."""
    counts = sparsity.count_active(trace, valid)
    if trace.nonzero is None:
        return (counts,)
    return counts, jnp.sum(jnp.where(valid[:, None, None], trace.nonzero, 0), dtype=jnp.float32)


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


def write_profile(directory: str, model_path: str, counts: np.ndarray, n_tokens: int, spec: str,
                  expert_active: np.ndarray | None = None) -> dict:
    """Write the profile into a new folder that then replaces `directory` as one unit (sidecar.atomic_directory):
    a killed run leaves the previous profile whole. profile.json records each layer file's SHA-256, so that files
    from different runs put together by hand are rejected by read_profile; for a mixture of ReLU experts, each
    layer's `expert_neurons_active` (`profile`'s second value), which decides how its experts are held
    (expert_neuron_shares)."""
    summary = {
        "tokens": n_tokens,
        "sparsity": spec,
        "layers": [
            {"layer": i, "mean_active": float(c.sum() / (n_tokens * len(c))),
             "coverage": {f"{s:g}": v for s, v in sparsity.coverage(c, COVERAGE_SHARES).items()},
             **({} if expert_active is None else {"expert_neurons_active": float(expert_active[i])})}
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


def expert_neuron_shares(directory: str, model_path: str) -> tuple[list[float] | None, str]:
    """(each layer's share of its routed experts' neurons a mixture of ReLU experts left nonzero over the tokens of
    its profile in `directory`, the layers' `expert_neurons_active`; where it came from), or (None, why not) where
    there is no profile of this model that measured it."""
    path = os.path.join(directory, "profile.json")
    if not os.path.exists(path):
        return None, f"no activation profile in {directory}"
    try:
        layers = sidecar.read_json(path, model_path).get("layers")
    except JaxinferError as e:
        return None, f"the activation profile in {directory} was not used: {e}"
    shares = [layer.get("expert_neurons_active") if isinstance(layer, dict) else None
              for layer in (layers if isinstance(layers, list) else [None])]
    if not shares or not all(isinstance(share, float) and 0 <= share <= 1 for share in shares):
        return None, f"the activation profile in {directory} does not measure the experts' neurons"
    return [float(share) for share in shares], f"in the activation profile in {directory}"


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

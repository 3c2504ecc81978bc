"""Activation-sparsity settings of a loaded model, their calibrated thresholds, and running the model over text
while reducing what its FFNs did (the common engine of profile, calibrate and train_predictor).

A sparsity spec, as the CLIs' `--sparsity` flag takes it:
    dense             no skipping beyond exact zeros (ReLU models skip their natural zeros)
    predictor         the file's fc1/fc2 predictors decide (PowerInfer); `predictor:T` overrides the threshold T
    gate:S / hidden:S thresholds calibrated for a share S of inactive neurons (see sparse_ffn.py and calibrate.py)
Calibrated thresholds live in `<model>.sparsity.json` (beside the model, or in its cache folder when the model's
folder is read-only or an installed package's: sidecar.derived_path), stamped with the model's fingerprint.
"""

import dataclasses
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from gguf import GGMLQuantizationType
from tqdm import tqdm

from jaxinfer import model, quant, repack, sidecar
from jaxinfer.config import NATURAL_ZEROS
from jaxinfer.plan import SPARSITY_MODES
from jaxinfer.errors import JaxinferError
from jaxinfer.plan import Plan

THRESHOLD_METHODS = ("gate", "hidden")
# Up to this share of inactive neurons the down projection is packed neuron-major (quant.pack_neuron_major: integer
# dots, but every 32-neuron block with an active neuron reads its scales and is worked through); sparser, it is
# transposed (quant.transpose: an f32 axpy over just the active rows). Measured on single calls, weights from cache or
# memory: at 50% the packing takes 0.45-0.82x the dense kernel's time against 0.92-1.25x for the axpy, at 90% 0.31-0.77x
# against 0.20-0.47x (d = 576 and 4096, Q4_0/Q4_1/Q8_0); they cross near 70-80%.
NEURON_MAJOR_MAX_SPARSITY = 0.7


@dataclasses.dataclass(frozen=True)
class SparsitySpec:
    mode: str = "dense"
    level: float | None = None  # target share of inactive neurons (gate/hidden) or predictor threshold override

    def __str__(self):
        return self.mode if self.level is None else f"{self.mode}:{self.level:g}"


def parse_spec(text: str) -> SparsitySpec:
    mode, _, value = text.partition(":")
    if mode not in SPARSITY_MODES:
        raise JaxinferError(f"--sparsity mode must be one of {', '.join(SPARSITY_MODES)}, got {mode!r}")
    level = None
    if value:
        try:
            level = float(value)
        except ValueError:
            raise JaxinferError(f"--sparsity {text!r}: {value!r} is not a number") from None
    if mode in THRESHOLD_METHODS and (level is None or not 0.0 < level < 1.0):
        raise JaxinferError(f"--sparsity {mode}:S needs a target share S in (0, 1), got {text!r}")
    if mode == "dense" and level is not None:
        raise JaxinferError("--sparsity dense takes no value")
    return SparsitySpec(mode, level)


DOWN_T_TYPES = ("same", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0")


def parse_down_t_type(text: str):
    """`--down_t_type`: "same" (None: each down projection's own type) or a GGML type gguf-py can quantize to."""
    if text.lower() not in DOWN_T_TYPES:
        raise JaxinferError(f"--down_t_type must be one of {', '.join(DOWN_T_TYPES)}, got {text!r}")
    return None if text.lower() == "same" else GGMLQuantizationType[text.upper()]


def thresholds_path(model_path: str, create: bool = False) -> str:
    """`<model>.sparsity.json`, beside the model or in its cache folder (sidecar.derived_path)."""
    return sidecar.derived_path(model_path, os.path.basename(model_path) + ".sparsity.json", create)


def _threshold_tables(document: dict, path: str) -> dict:
    """The document's {method: {level: [per-layer thresholds]}}, checked for its shape (the values by the reader)."""
    tables = document.get("thresholds", {})
    if not isinstance(tables, dict) or not all(isinstance(t, dict) for t in tables.values()):
        raise JaxinferError(f"{path} is malformed: \"thresholds\" must map each method to its levels")
    return tables


def load_thresholds(model_path: str, method: str, level: float, n_layer: int, path: str | None = None) -> np.ndarray:
    """The per-layer thresholds [n_layer] of `method` at `level` from `path` (default: the model's sidecar)."""
    path = path or thresholds_path(model_path)
    hint = f"calibrate them: python -m jaxinfer.calibrate -m {model_path} -f TEXT --method {method} --levels {level:g}"
    try:
        document = sidecar.read_json(path, model_path)
    except JaxinferError as e:
        raise JaxinferError(f"no calibrated {method}:{level:g} thresholds ({e}); {hint}") from None
    table = _threshold_tables(document, path).get(method, {})
    if f"{level:g}" not in table:
        raise JaxinferError(f"{path} has no {method}:{level:g} thresholds; {hint}")
    values = sidecar.checked_numbers(table[f"{level:g}"], n_layer,
                                     f"{path}: the {method}:{level:g} thresholds (one per layer)")
    if np.any(values < 0):
        raise JaxinferError(f"{path}: the {method}:{level:g} thresholds are magnitudes, found a negative one")
    return values.astype(np.float32)


def save_thresholds(model_path: str, method: str, thresholds: dict[float, np.ndarray], source: str,
                    path: str | None = None) -> str:
    """Merge calibrated per-layer thresholds into `path` (default: the model's sidecar), atomically."""
    path = path or thresholds_path(model_path, create=True)
    try:
        document = sidecar.read_json(path, model_path)
        _threshold_tables(document, path)
    except JaxinferError:
        document = {}  # missing, foreign or malformed: replaced by what was just calibrated
    table = document.setdefault("thresholds", {}).setdefault(method, {})
    for level, values in thresholds.items():
        table[f"{level:g}"] = [float(v) for v in values]
    if not isinstance(document.get("calibrated_on"), dict):
        document["calibrated_on"] = {}
    document["calibrated_on"][method] = source
    document.pop("model_fingerprint", None)
    sidecar.write_json(path, model_path, document)
    return path


def apply(m, spec: SparsitySpec, down_t_type=None, thresholds_file: str | None = None):
    """A copy of the loaded model (`engine.LoadedModel`) that runs its FFNs with `spec`. Unless dense, its down
    projections are stored one row per neuron, quantized to `down_t_type` (default: each one's own type; see
    quant.transpose); dense, so are the ternary ones of models with natural zeros (NATURAL_ZEROS). gate:S / hidden:S
    read their thresholds from `thresholds_file` (calibrate -o), by default from the model's sidecar."""
    if thresholds_file is not None and spec.mode not in THRESHOLD_METHODS:
        raise JaxinferError(f"--thresholds is for --sparsity gate:S or hidden:S, not {spec}")
    cfg = m.config.replan(ffn_sparsity=spec.mode)
    layers = m.weights.layers
    if spec.mode == "predictor":
        if any(layer.fc1 is None or layer.fc2 is None for layer in layers):
            raise JaxinferError(f"{m.path} has no activation predictors (blk.N.fc1/fc2); train them with "
                                f"python -m jaxinfer.train_predictor")
        if spec.level is not None:
            cfg = dataclasses.replace(cfg, sparse_threshold=spec.level)
    elif spec.mode in THRESHOLD_METHODS:
        values = load_thresholds(m.path, spec.mode, spec.level, len(layers), thresholds_file)
        m = dataclasses.replace(m, thresholds_path=thresholds_file or thresholds_path(m.path))
        layers = [dataclasses.replace(layer, ffn_threshold=jnp.float32(t)) for layer, t in zip(layers, values)]
    if spec.mode != "dense":
        # What the mode reads row by row for active neurons is in GGUF's rows (a model loaded dense has them repacked).
        sparse_rows = tuple(name for name in ("ffn_gate", "ffn_up") if name not in repack.DENSE_FFN[spec.mode])
        layers = [with_transposed_down(repack.ffn_rows(layer, sparse_rows), down_t_type,
                                       packs_neuron_major(spec, cfg.plan)) for layer in layers]
    elif cfg.gate_activation in NATURAL_ZEROS:
        layers = [_with_ternary_down_t(m.path, layer) for layer in layers]
    if cfg.plan.down_rows:
        layers = [with_down_rows(layer) for layer in layers]
    weights = dataclasses.replace(m.weights, layers=layers)
    return dataclasses.replace(m, config=cfg, weights=weights)


def with_down_rows(layer):
    """The layer with a Q4_0/Q8_0 down projection held one row per neuron (a PowerInfer file's ffn_down_t, or a
    transposed copy) laid out for cpu_ext's integer axpy (quant.pack_down_rows: the same bytes, each row's scales in
    front): at 4096-wide rows the f32 axpy is compute-bound, this one reads at the dense kernels' pace."""
    if layer.ffn_down_t is None or not quant.can_pack_down_rows(layer.ffn_down_t):
        return layer
    return dataclasses.replace(layer, ffn_down_t=quant.pack_down_rows(layer.ffn_down_t))


def packs_neuron_major(spec: SparsitySpec, plan: Plan) -> bool:
    """Whether `apply` packs down projections neuron-major for `spec`: calibrated sparsity up to
    NEURON_MAJOR_MAX_SPARSITY (predictor models are the sparse ReLU kind, and transposed), where the plan says its
    kernel runs fast."""
    return spec.mode in THRESHOLD_METHODS and spec.level <= NEURON_MAJOR_MAX_SPARSITY and plan.neuron_major


# With a gate activation of NATURAL_ZEROS (config.py), a ternary down projection (BitNet b1.58: squared ReLU, about
# half the neurons zero) is stored one row per neuron, losslessly (quant.transpose_ternary), so that the zero neurons'
# rows are not read; other types keep their down projection whole in the dense mode, as a transposed copy would be
# rounded again.


def _with_ternary_down_t(path: str, layer):
    """The layer with its ternary ffn_down as rows per neuron (exact I2_S), or as it is where that cannot be done."""
    if layer.ffn_down is None or layer.ffn_down.qtype not in quant.TERNARY_TYPES:
        return layer
    down_t = quant.transpose_ternary(layer.ffn_down)
    if down_t is None:
        logging.warning("%s: a %s ffn_down that is not one scale times {-1, 0, 1} (or has rows that are not a multiple "
                        "of 256) stays whole: the dense mode reads all of it", path, layer.ffn_down.qtype.name)
        return layer
    return dataclasses.replace(layer, ffn_down=None, ffn_down_t=down_t)


def with_transposed_down(layer, qtype=None, pack: bool = True):
    """The layer with its down projection stored one row per neuron (ffn_down_t, as PowerInfer files have it), so
    the rows of inactive neurons need not be read: with `pack`, a Q4_0/Q4_1/Q8_0 one repacked neuron-major, without
    rounding (quant.pack_neuron_major), unless `qtype` asks for a transposed copy; a ternary one as I2_S, exactly,
    where quant.transpose_ternary can; otherwise transposed (quant.transpose, for what that costs in accuracy). A down
    projection repacked at load for dense products is read back in GGUF's rows first (repack.ffn_rows)."""
    layer = repack.ffn_rows(layer, ("ffn_down",))
    if layer.ffn_down_t is not None:
        return layer
    if pack and qtype is None and quant.can_pack_neuron_major(layer.ffn_down):
        return dataclasses.replace(layer, ffn_down=None, ffn_down_t=quant.pack_neuron_major(layer.ffn_down))
    if qtype is None and (down_t := quant.transpose_ternary(layer.ffn_down)) is not None:
        return dataclasses.replace(layer, ffn_down=None, ffn_down_t=down_t)
    return dataclasses.replace(layer, ffn_down=None, ffn_down_t=quant.transpose(layer.ffn_down, qtype))


@partial(jax.jit, static_argnames=("statistic",))
def _observe_batch(windows, valid, weights, cfg, statistic):
    hidden, _, observed = model.forward(windows, weights, cfg, observe=lambda i, trace: statistic(trace, valid))
    return observed, jnp.all(jnp.isfinite(hidden))  # one reduction: corrupt weights must not become statistics


def map_over_windows(m, windows: np.ndarray, statistic, n_seq: int = 4, desc: str = "observing"):
    """Run the model over `windows` [n, n_ctx] in jitted batches of `n_seq` (the last padded: one compiled program).
    `statistic(trace, valid)`, a module-level function (it is a static argument), maps one layer's
    sparse_ffn.FFNTrace and the batch's real-window mask [B] to a pytree. Yields (number of real windows, per-layer
    results on the host) for each batch. NaN or infinite activations (corrupt weights) are a JaxinferError, not
    thresholds, profiles or training labels."""
    for start in tqdm(range(0, len(windows), n_seq), desc=desc, unit="batch"):
        batch = windows[start:start + n_seq]
        valid = np.arange(n_seq) < len(batch)
        padded = np.concatenate([batch, np.repeat(batch[-1:], n_seq - len(batch), axis=0)])
        observed, finite = jax.device_get(_observe_batch(padded, valid, m.weights, m.config, statistic))
        if not finite:
            raise JaxinferError(f"{m.path}: the model's activations are NaN or infinite in windows {start}.."
                                f"{start + len(batch) - 1} (corrupt weights?)")
        yield len(batch), observed


def reduce_over_windows(m, windows: np.ndarray, statistic, n_seq: int = 4, desc: str = "observing"):
    """map_over_windows, with each layer's results summed over all batches."""
    total = None
    for _, observed in map_over_windows(m, windows, statistic, n_seq, desc):
        total = observed if total is None else jax.tree.map(np.add, total, observed)
    return total


def check_neuron_statistics(cfg, what: str) -> None:
    """Refuse, in one line, `what` (per-neuron thresholds or predictors) for a mixture of experts: its router decides
    which experts run, and `profile` counts its routings instead."""
    if cfg.n_expert:
        raise JaxinferError(f"{what}: a mixture of experts ({cfg.arch}, {cfg.n_expert} experts) has no per-neuron "
                            f"thresholds or predictors: its router chooses the experts (python -m jaxinfer.profile "
                            f"counts its routings)")


def count_active(trace, valid):
    """[n_ff] int32: how many real tokens activated each neuron."""
    return jnp.sum(trace.active & valid[:, None, None], axis=(0, 1), dtype=jnp.int32)


def coverage(counts: np.ndarray, shares=(0.5, 0.8, 0.95)) -> dict[float, float]:
    """Share of a layer's neurons that, hottest first, account for each share of its activations."""
    ordered = np.sort(counts)[::-1].astype(np.float64)
    cumulative = np.cumsum(ordered) / max(ordered.sum(), 1.0)
    return {s: float((np.searchsorted(cumulative, s) + 1) / len(counts)) for s in shares}

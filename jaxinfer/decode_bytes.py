"""What one decode step costs: the bytes of weights it reads, by class, and its measured speed (the measures of
scripts/bench_generate.py --compare_dense and scripts/bench_sparse.py).

A decode step reads every weight matrix once (a tied output head once, as the head; of the embedding only one row,
not counted; norms are not counted), except the rows of inactive FFN neurons that the model's sparsity mode
(sparse_ffn.py) skips:

    mode       rows read for active neurons only      predictor fc1, fc2
    dense      ffn_down_t                              not read
    hidden     ffn_down_t                              not read
    gate       ffn_up, ffn_down_t                      not read
    predictor  ffn_gate, ffn_up, ffn_down_t            read whole

A down projection held one row per neuron (ffn_down_t: a PowerInfer file's, or made by sparsity.apply) is always
multiplied with the mask of active neurons, also in the dense mode, where a ReLU model's natural zeros are inactive;
one held as GGUF's ffn_down [d, n_ff] is read whole (its neurons are columns inside the blocks). A predictor a model
holds is read only in the predictor mode: counting it in another mode's bytes would overstate what that mode reads.
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from jaxinfer import engine, quant, sparsity
from jaxinfer.sampling import SamplingParams

CLASSES = ("attention", "output", "ffn_gate", "ffn_up", "ffn_down", "predictor")
MATRIX_CLASSES = {"attn_q": "attention", "attn_k": "attention", "attn_v": "attention", "attn_output": "attention",
                  "ffn_gate": "ffn_gate", "ffn_up": "ffn_up", "ffn_down": "ffn_down", "ffn_down_t": "ffn_down",
                  "fc1": "predictor", "fc2": "predictor"}
SKIPPED_BY_NEURON = {"dense": ("ffn_down_t",), "hidden": ("ffn_down_t",), "gate": ("ffn_up", "ffn_down_t"),
                     "predictor": ("ffn_gate", "ffn_up", "ffn_down_t")}
LINE_BYTES = 64


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """Weight bytes one decode step reads, by class (CLASSES), and the same counted in whole 64-byte lines (a line
    is read when any neuron with bytes on it is active, neurons active independently with their layer's share)."""

    read: dict[str, float]
    lines: dict[str, float]
    active_share: float  # share of FFN neurons active, over all layers

    @property
    def total(self) -> float:
        return sum(self.read.values())

    @property
    def total_lines(self) -> float:
        return sum(self.lines.values())


def held_bytes(w: quant.QuantArray) -> float:
    """Bytes of w's rows as held: of a weight repacked eight rows to a group, without the padding rows of its last
    group (a vocabulary that is not a multiple of 8: the rows a file stores are what a step reads)."""
    if w.layout == quant.ROWS_X8:
        return w.nbytes * w.shape[0] / (w.data.shape[0] * quant.INTERLEAVE)
    return float(w.nbytes)


def skippable_bytes(w: quant.QuantArray) -> float:
    """Bytes of a matrix stored one row per neuron that belong to single neurons: all of them, but for a
    neuron-major packing the scales, which every 32-neuron block with an active neuron reads (all, at 50%)."""
    return quant.neuron_row_bytes(w) if w.layout == quant.NEURON_MAJOR else w.nbytes


def neuron_run_bytes(w: quant.QuantArray) -> int:
    """Bytes one neuron owns in a row, contiguously: its piece of a 64-output tile of a neuron-major packing in spans
    of 64 (its q for a longer span is one run), or its whole row."""
    if w.layout == quant.NEURON_MAJOR and quant.neuron_span(w.shape[1], w.qtype) == 64:
        return 64 * quant.neuron_row_bytes(w) // (w.shape[0] * w.shape[1])
    return quant.neuron_row_bytes(w) // w.shape[0] if w.layout == quant.NEURON_MAJOR else w.nbytes // w.shape[0]


def touched_line_share(run_bytes: int, active: float, line: int = LINE_BYTES) -> float:
    """Expected share of the cache lines under back-to-back runs of `run_bytes` (one per neuron) that a step reads
    when each neuron is active with probability `active`, independently: a line is read if any run on it is."""
    n_runs = line // math.gcd(run_bytes, line)  # the layout repeats every n_runs runs
    starts = np.arange(n_runs * run_bytes // line) * line
    runs_on_line = (starts + line - 1) // run_bytes - starts // run_bytes + 1
    return float(np.mean(1.0 - (1.0 - active) ** runs_on_line))


def step_bytes(m, active: Sequence[float]) -> StepBytes:
    """The weight bytes a decode step of the loaded model `m` (engine.LoadedModel, as sparsity.apply made it: its
    mode is m.config.plan.ffn_sparsity) reads when a share active[i] of layer i's FFN neurons is active."""
    mode = m.config.plan.ffn_sparsity
    layers = m.weights.layers
    if len(active) != len(layers):
        raise ValueError(f"{len(active)} active shares for {len(layers)} layers")
    if any(layer.ffn_parts is not None for layer in layers):
        raise ValueError("count the bytes of an unsplit model (a split one holds its FFN in parts)")
    read = dict.fromkeys(CLASSES, 0.0)
    lines = dict.fromkeys(CLASSES, 0.0)
    read["output"] = lines["output"] = held_bytes(m.weights.output)
    skipped = SKIPPED_BY_NEURON[mode]
    for layer, share in zip(layers, active):
        for name, kind in MATRIX_CLASSES.items():
            w = getattr(layer, name)
            if w is None or (kind == "predictor" and mode != "predictor"):
                continue
            if name in skipped:
                read[kind] += w.nbytes - (1.0 - share) * skippable_bytes(w)
                unread = 1.0 - touched_line_share(neuron_run_bytes(w), share)
                lines[kind] += w.nbytes - unread * skippable_bytes(w)
            else:
                read[kind] += held_bytes(w)
                lines[kind] += held_bytes(w)
    return StepBytes(read, lines, float(np.mean(active)))


def active_shares(m, tokens: Sequence[int]) -> np.ndarray:
    """[n_layer]: the share of each layer's FFN neurons active on `tokens`, the model run over them (one window) with
    its own sparsity mode."""
    counts = sparsity.reduce_over_windows(m, np.array([tokens], np.int32), sparsity.count_active, n_seq=1,
                                          desc="counting")
    return np.array([float(np.sum(count)) / (len(tokens) * m.config.n_ff) for count in counts])


def decode_rates(m, prompt: Sequence[int], n_tokens: int, repetitions: int, ctx: int,
                 warm_up: bool = True) -> tuple[list[float], list[int]]:
    """generate's own decode loop (greedy, stop tokens ignored) after `prompt`: n_tokens decode steps, `repetitions`
    timed runs after an untimed one (with `warm_up`) -> (tokens/s of each timed run, the tokens generated)."""
    ctx = max(ctx, len(prompt) + n_tokens + 1)
    rates, tokens = [], []
    for _ in range(repetitions + int(warm_up)):
        stats = engine.GenerationStats()
        tokens = list(engine.generate_tokens(m, list(prompt), n_tokens + 1, ctx, SamplingParams(temperature=0), 0,
                                             stats, stop_ids=frozenset()))
        rates.append((stats.generated_tokens - 1) / stats.decode_seconds)
    return rates[int(warm_up):], list(prompt) + tokens


def alternate_decode(models: dict, prompt: Sequence[int], n_tokens: int, repetitions: int, ctx: int,
                     on_run=None, warm_up: bool = True) -> tuple[dict[str, list[float]], list[int]]:
    """Each model's decode timed `repetitions` times, the models alternating run by run so that load from other
    processes hits them alike, with `warm_up` after one untimed run of each (it compiles) -> ({name: tokens/s of each
    run}, the tokens the last model generated). `on_run(name, rate)` is called after each timed run."""
    for m in models.values() if warm_up else ():
        decode_rates(m, prompt, n_tokens, 0, ctx, warm_up=True)
    rates = {name: [] for name in models}
    tokens = []
    for _ in range(repetitions):
        for name, m in models.items():
            (rate,), tokens = decode_rates(m, prompt, n_tokens, 1, ctx, warm_up=False)
            rates[name].append(rate)
            if on_run is not None:
                on_run(name, rate)
    return rates, tokens

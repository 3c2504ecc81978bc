"""python -m jaxinfer.train_predictor: train PowerInfer-style activation predictors and export a PowerInfer GGUF.

Per layer, a low-rank MLP predicts which FFN neurons will be active for a token, from the pre-FFN-norm residual
(PowerInfer's input for llama/bamboo): logits = fc2 · relu(fc1 · x), fc1 [rank, d], fc2 [n_ff, rank], no biases;
a neuron runs iff its logit >= the threshold (0 by default, `powerinfer.sparse_threshold`). The predictor is a
flax.nnx Module holding fc1 and fc2 in that layout, so export writes its parameters as they are.

Labels are what the inference path marks active under `--sparsity` (ReLU models: nonzero activations; SwiGLU models:
a calibrated `gate:S`/`hidden:S` mask). Training: binary cross-entropy with positive examples weighted by
`--positive_weight` (missed neurons cost quality, extra ones only time), Adam through nnx.Optimizer, minibatches;
evaluation on held-out windows reports recall, precision and predicted sparsity per layer, of the predictor as it is
stored (`--predictor_type`: F16, or Q8_0/Q4_0 blocks, quantized and dequantized with gguf-py first). Predictors are
read every decode step, so their bytes count: an F16 predictor of a 7B model costs more than the sparse FFN it steers.

Ranks come from `--budget`, the predictors' parameters as a share of the FFN's: the total is split across layers in
proportion to sqrt(rho (1 - rho)) of each layer's active share rho (layers near 50% active are the hardest to
predict), rounded to multiples of 16, and up to multiples of 32 for the block types (fc2's rows are blocks of 32
along the rank).
"""

import dataclasses
import math
import sys
import time

import gguf.quants
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from tqdm import tqdm

from jaxinfer import powerinfer, quant, repack, sparsity
from jaxinfer.config import GATE_ACTIVATION_KEY, NATURAL_ZEROS, SPARSE_THRESHOLD_KEY
from jaxinfer.errors import JaxinferError, exit_on_error
from jaxinfer.gguf_io import load_matrix
from jaxinfer.powerinfer import PendingTensor

RANK_MULTIPLE = 16
LOSS_EVERY = 20  # optimizer steps between loss readings for the progress bar
PREDICTOR_TYPES = {t.name.lower(): t for t in (GGMLQuantizationType.F16, GGMLQuantizationType.Q8_0,
                                               GGMLQuantizationType.Q4_0)}
# Q8_0: half F16's bytes at F16's held-out recall (mean recall as stored, tiny synthetic models, 2026-11-27: SwiGLU
# with hidden:0.5 labels F16 0.870, Q8_0 0.870, Q4_0 0.868; ReLU 90% sparse, dense labels F16 0.958, Q8_0 0.959,
# Q4_0 0.949: Q4_0 loses more than 0.005 there).
DEFAULT_PREDICTOR_TYPE = GGMLQuantizationType.Q8_0


def inputs_and_labels(trace, valid):
    del valid  # padded windows are dropped on the host
    return trace.ffn_inp, trace.active


def collect(m, windows: np.ndarray, n_seq: int = 4) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per layer: predictor inputs [N, d] f32 and activity labels [N, n_ff] bool over the windows' tokens."""
    inputs, labels = [[] for _ in m.weights.layers], [[] for _ in m.weights.layers]
    for n_real, observed in sparsity.map_over_windows(m, windows, inputs_and_labels, n_seq, desc="collecting"):
        for i, (x, active) in enumerate(observed):
            inputs[i].append(x[:n_real].reshape(-1, x.shape[-1]))
            labels[i].append(active[:n_real].reshape(-1, active.shape[-1]))
    return [np.concatenate(x) for x in inputs], [np.concatenate(y) for y in labels]


def rank_multiple(predictor_type: GGMLQuantizationType) -> int:
    """What a rank must be a multiple of: fc2 [n_ff, rank] stores its rows in blocks along the rank."""
    return RANK_MULTIPLE if predictor_type == GGMLQuantizationType.F16 else GGML_QUANT_SIZES[predictor_type][0]


def choose_ranks(active_share: np.ndarray, n_embd: int, n_ff: int, budget: float,
                 predictor_type: GGMLQuantizationType = DEFAULT_PREDICTOR_TYPE) -> list[int]:
    difficulty = np.sqrt(np.clip(active_share * (1 - active_share), 1e-4, None))
    total = budget * 3 * n_embd * n_ff / (n_embd + n_ff) * len(active_share)
    ranks = total * difficulty / difficulty.sum()
    rounded = [max(RANK_MULTIPLE, RANK_MULTIPLE * round(r / RANK_MULTIPLE)) for r in ranks]
    multiple = rank_multiple(predictor_type)
    return [int(math.ceil(r / multiple) * multiple) for r in rounded]


def encode(values: np.ndarray, predictor_type: GGMLQuantizationType) -> np.ndarray:
    """f32 [rows, cols] -> what a GGUF file stores for `predictor_type`: F16 values, or Q8_0/Q4_0 blocks as bytes."""
    if predictor_type == GGMLQuantizationType.F16:
        return np.asarray(values).astype(np.float16)
    return gguf.quants.quantize(np.asarray(values, np.float32), predictor_type)


def decode(stored: np.ndarray, predictor_type: GGMLQuantizationType) -> np.ndarray:
    if predictor_type == GGMLQuantizationType.F16:
        return stored.astype(np.float32)
    return gguf.quants.dequantize(stored, predictor_type).astype(np.float32)


class Predictor(nnx.Module):
    """PowerInfer's predictor, logits = fc2 · relu(fc1 · x), with its parameters in PowerInfer's layout: fc1
    [rank, d], fc2 [n_ff, rank], no biases."""

    def __init__(self, fc1, fc2):
        self.fc1 = nnx.Param(jnp.asarray(fc1, jnp.float32))
        self.fc2 = nnx.Param(jnp.asarray(fc2, jnp.float32))

    def __call__(self, x):
        return jax.nn.relu(x @ self.fc1[...].T) @ self.fc2[...].T

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.fc1[...]), np.asarray(self.fc2[...])

    def stored(self, predictor_type: GGMLQuantizationType) -> "Predictor":
        """This predictor with the values a file of `predictor_type` holds (rounded to F16, or quantized)."""
        return Predictor(*(decode(encode(values, predictor_type), predictor_type) for values in self.arrays()))


@nnx.jit
def _train_step(predictor, optimizer, x, y, positive_weight):
    def loss_fn(p):
        per_label = optax.sigmoid_binary_cross_entropy(p(x), y)
        return jnp.mean(per_label * jnp.where(y, positive_weight, 1.0))

    loss, grads = nnx.value_and_grad(loss_fn)(predictor)
    optimizer.update(predictor, grads)
    return loss


def train_layer(x: np.ndarray, y: np.ndarray, rank: int, *, steps: int, batch: int, learning_rate: float,
                positive_weight: float, seed: int, bar: tqdm | None = None) -> Predictor:
    """Train one layer's predictor; `bar` advances one per step and shows the loss (read back every
    LOSS_EVERY steps: reading it each step would wait for every step to finish)."""
    key1, key2, key3 = jax.random.split(jax.random.key(seed), 3)
    d, f = x.shape[1], y.shape[1]
    scale = float(np.std(x)) or 1.0  # residual magnitudes grow with depth: start at unit pre-activations
    predictor = Predictor(jax.random.normal(key1, (rank, d)) / (scale * math.sqrt(d)),
                          jax.random.normal(key2, (f, rank)) / math.sqrt(rank))
    optimizer = nnx.Optimizer(predictor, optax.adam(learning_rate), wrt=nnx.Param)
    step_fn = nnx.cached_partial(_train_step, predictor, optimizer)  # the graph walked once, not every step
    order = np.asarray(jax.random.permutation(key3, len(x)))
    for step in range(steps):
        rows = order[(step * batch + np.arange(batch)) % len(x)]
        loss = step_fn(x[rows], y[rows], positive_weight)
        if bar is not None:
            if step % LOSS_EVERY == 0 or step == steps - 1:
                bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
            bar.update()
    return predictor


def evaluate_predictor(p: Predictor, x: np.ndarray, y: np.ndarray,
                       predictor_type: GGMLQuantizationType = DEFAULT_PREDICTOR_TYPE, threshold: float = 0.0) -> dict:
    """Held-out metrics of `p` as a file of `predictor_type` stores it."""
    predicted = np.asarray(p.stored(predictor_type)(jnp.asarray(x))) >= threshold
    true_positive = np.sum(predicted & y)
    return {"recall": float(true_positive / max(y.sum(), 1)),
            "precision": float(true_positive / max(predicted.sum(), 1)),
            "predicted_sparsity": float(1 - predicted.mean()), "true_sparsity": float(1 - y.mean())}


def with_predictors(weights, predictors: list[Predictor],
                    predictor_type: GGMLQuantizationType = DEFAULT_PREDICTOR_TYPE, plan=None):
    """The model's weights with these predictors attached in memory, stored as `export` writes them and held as the
    loader holds that file's: marked exact with the model's own matrices, repacked where `plan` (the model's
    config.plan) repacks a predictor (repack.packs)."""
    def as_array(name, values, exact):
        stored = quant.from_gguf_data(encode(values, predictor_type), predictor_type, values.shape)
        w = dataclasses.replace(stored, exact=exact)
        if plan is not None and repack.packs(name, w, plan):
            return quant.pack_rows_x8(w)
        return dataclasses.replace(w, data=jnp.asarray(w.data))

    layers = []
    for layer, p in zip(weights.layers, predictors):
        fc1, fc2 = p.arrays()
        exact = layer.attn_q.exact
        layers.append(dataclasses.replace(layer, fc1=as_array("fc1", fc1, exact), fc2=as_array("fc2", fc2, exact)))
    return dataclasses.replace(weights, layers=layers)


def _transposed_f16(g, name: str) -> np.ndarray:
    return np.asarray(quant.dequantize(load_matrix(g, name, exact=True))).T.astype(np.float16)


def export(m, predictors: list[Predictor], path: str, threshold: float,
           predictor_type: GGMLQuantizationType = DEFAULT_PREDICTOR_TYPE):
    """Write the model with its predictors as a PowerInfer file: fc1/fc2 added (replacing any) as `predictor_type`,
    the down projection stored transposed (ffn_down_t, F16, as PowerInfer's axpy kernels read it), the threshold in
    the metadata."""
    g = m.gguf
    fields = [f for f in powerinfer.metadata_fields(g) if f[0] not in (SPARSE_THRESHOLD_KEY, GATE_ACTIVATION_KEY)]
    fields.append((SPARSE_THRESHOLD_KEY, threshold, GGUFValueType.FLOAT32, None))
    if m.config.gate_activation != "relu":  # PowerInfer reads a PWRI file as ReLU-gated; keep this model's gate
        fields.append((GATE_ACTIVATION_KEY, m.config.gate_activation, GGUFValueType.STRING, None))
    multiple = rank_multiple(predictor_type)
    ranks = [p.fc1.shape[0] for p in predictors]
    if any(rank % multiple for rank in ranks):
        raise JaxinferError(f"{predictor_type.name} predictors need ranks that are multiples of {multiple}, got "
                            f"{ranks} (choose_ranks with this predictor_type rounds them)")
    replaced = {f"blk.{i}.{name}.weight" for i in range(len(predictors)) for name in ("fc1", "fc2", "ffn_down")}
    tensors = powerinfer.stored_tensors(g, skip=replaced)
    for i, p in enumerate(predictors):
        for name, values in zip(("fc1", "fc2"), p.arrays()):
            tensors.append(PendingTensor(f"blk.{i}.{name}.weight", values.shape, predictor_type,
                                         lambda v=values: encode(v, predictor_type)))
        # From the file, not from m.weights: a model run with --sparsity gate|hidden holds its down projection
        # repacked (ffn_down is None then), and a PowerInfer file's own ffn_down_t is kept by stored_tensors.
        down_name = f"blk.{i}.ffn_down.weight"
        if down_name in g.tensors:
            n_embd, n_ff = (int(n) for n in reversed(g.tensors[down_name].shape.tolist()))
            tensors.append(PendingTensor(f"blk.{i}.ffn_down_t.weight", (n_ff, n_embd), GGMLQuantizationType.F16,
                                         lambda name=down_name: _transposed_f16(g, name)))
    return powerinfer.write_gguf(path, m.config.arch, fields, tensors, powerinfer=True, progress=True)


def _cli_main(argv):
    from absl import flags

    from jaxinfer import cli, engine, runtime, sidecar
    from jaxinfer.evaluation import make_windows

    f = flags.FLAGS
    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    text = cli.read_text_file(f.file, "-f/--file is required (the training text)")
    spec = sparsity.parse_spec(f.sparsity)
    if spec.mode == "predictor":
        raise JaxinferError("--sparsity defines the labels to learn: dense, gate:S or hidden:S")
    predictor_type = PREDICTOR_TYPES[f.predictor_type]
    if f.output:
        sidecar.check_writable_file(f.output)  # before training, not after
    _check_header(f.model or engine.default_model_path(), spec, predictor_type)
    if not f.output:
        print("note: no -o given: the predictors are trained and evaluated, not saved", file=sys.stderr)
    runtime.enable_compilation_cache()
    m = engine.build_model(f.model, sparsity_spec=spec, thresholds_file=f.thresholds)
    sparsity.check_neuron_statistics(m.config, "train_predictor")
    print(m.describe() + f", labels from --sparsity {spec}", file=sys.stderr)
    tokens = np.asarray(m.tokenizer.encode(text), np.int32)
    n_ctx = cli.capped_context(f.ctx_size, m.config.n_ctx_train)
    windows = make_windows(tokens, n_ctx, -1, m.tokenizer.bos_id if m.tokenizer.add_bos else None)
    if len(windows) < f.train_chunks + f.heldout_chunks:
        raise JaxinferError(f"{f.file} has {len(windows)} windows of {n_ctx} tokens; need "
                            f"{f.train_chunks + f.heldout_chunks}")
    n_seq = cli.windows_per_batch(f.batch_size, n_ctx, f.train_chunks)
    start = time.perf_counter()
    train_x, train_y = collect(m, windows[:f.train_chunks], n_seq)
    test_x, test_y = collect(m, windows[-f.heldout_chunks:], n_seq)
    ranks = choose_ranks(np.array([y.mean() for y in train_y]), m.config.n_embd, m.config.n_ff, f.budget,
                         predictor_type)
    predictors, rows = [], []
    print(f"{'layer':>5} {'rank':>5} {'recall':>7} {'precision':>9} {'pred. sparsity':>14} {'true sparsity':>13}")
    bar = tqdm(total=len(ranks) * f.steps, desc="training", unit="step", file=sys.stderr)
    for i, (x, y, rank) in enumerate(zip(train_x, train_y, ranks)):
        p = train_layer(x, y, rank, steps=f.steps, batch=f.minibatch, learning_rate=f.learning_rate,
                        positive_weight=f.positive_weight, seed=i, bar=bar)
        metrics = evaluate_predictor(p, test_x[i], test_y[i], predictor_type)
        predictors.append(p)
        rows.append(metrics)
        print(f"{i:>5} {rank:>5} {metrics['recall']:>7.3f} {metrics['precision']:>9.3f} "
              f"{metrics['predicted_sparsity']:>14.3f} {metrics['true_sparsity']:>13.3f}", flush=True)
    bar.close()
    mean = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    print(f"mean ({predictor_type.name}, as stored): recall {mean['recall']:.3f}, precision {mean['precision']:.3f}, "
          f"predicted sparsity "
          f"{mean['predicted_sparsity']:.3f} (true {mean['true_sparsity']:.3f}) on {test_x[0].shape[0]} held-out "
          f"tokens; trained on {train_x[0].shape[0]} in {time.perf_counter() - start:.1f} s")
    if f.output:
        export(m, predictors, f.output, threshold=0.0, predictor_type=predictor_type)
        print(f"wrote {f.output} (PowerInfer GGUF; run it with --sparsity predictor)")


def _check_header(path: str, spec: sparsity.SparsitySpec, predictor_type: GGMLQuantizationType):
    """From the model's header, before the load. --sparsity dense labels a neuron active where its activation is not
    zero: only a model whose FFN zeroes neurons itself (ReLU-family activations) has labels to learn; in a SwiGLU
    model every neuron is active, and a predictor trained on that would skip neurons that were never inactive. A
    block type stores fc1's rows of n_embd values in whole blocks."""
    from jaxinfer.gguf_io import load_config, open_gguf

    cfg = load_config(open_gguf(path))
    block = rank_multiple(predictor_type)
    if predictor_type != GGMLQuantizationType.F16 and cfg.n_embd % block:
        raise JaxinferError(f"--predictor_type {predictor_type.name.lower()} stores fc1's rows in blocks of {block} "
                            f"values, and this model's n_embd ({cfg.n_embd}) is not a multiple of {block}: use "
                            f"--predictor_type f16")
    if spec.mode == "dense" and not {cfg.gate_activation, cfg.up_activation} & set(NATURAL_ZEROS):
        raise JaxinferError(f"--sparsity dense (the default) learns which neurons a ReLU-family model zeroes "
                            f"itself, and this {cfg.arch} model's FFN ({cfg.gate_activation} gate) has no natural "
                            f"zeros: every neuron is active. Give --sparsity hidden:S or gate:S (thresholds from "
                            f"python -m jaxinfer.calibrate)")


def main():
    from absl import app, flags

    from jaxinfer.cli import MIN_WINDOW, THRESHOLDS_HELP, check_range, parse_flags

    flags.DEFINE_string("model", None, "GGUF model (default: SmolLM2-135M-Instruct Q4_1)", short_name="m")
    flags.DEFINE_string("file", None, "training text; the last --heldout_chunks windows are held out", short_name="f")
    flags.DEFINE_string("sparsity", "dense", "labels: dense (ReLU models) | gate:S | hidden:S (calibrated)")
    flags.DEFINE_string("thresholds", None, THRESHOLDS_HELP)
    flags.DEFINE_string("output", None, "write the model with these predictors to this PowerInfer GGUF",
                        short_name="o")
    flags.DEFINE_float("budget", 0.1, "predictor parameters as a share of the FFN parameters")
    flags.DEFINE_integer("ctx_size", 512, "tokens per window; capped at the model's training context",
                         short_name="c")
    flags.DEFINE_integer("train_chunks", 16, "windows to train on")
    flags.DEFINE_integer("heldout_chunks", 4, "windows (from the end of the text) to evaluate on")
    flags.DEFINE_integer("batch_size", 2048, "tokens per compiled forward call", short_name="b")
    flags.DEFINE_integer("steps", 400, "optimizer steps per layer")
    flags.DEFINE_integer("minibatch", 1024, "tokens per optimizer step")
    flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate")
    flags.DEFINE_float("positive_weight", 3.0, "loss weight of active neurons (higher favours recall)")
    flags.DEFINE_enum("predictor_type", DEFAULT_PREDICTOR_TYPE.name.lower(), list(PREDICTOR_TYPES),
                      "how fc1/fc2 are stored (read every decode step); q8_0/q4_0 round ranks up to multiples of 32. "
                      "The reported metrics are those of the stored values. Mean held-out recall measured on tiny "
                      "synthetic models (SwiGLU, hidden:0.5 labels / ReLU, dense labels): f16 0.870/0.958, q8_0 "
                      "0.870/0.959 at half the bytes, q4_0 0.868/0.949")
    check_range("budget", 0, 1, low_open=True)
    check_range("ctx_size", MIN_WINDOW)
    for name in ("train_chunks", "heldout_chunks", "batch_size", "steps", "minibatch"):
        check_range(name, 1)
    check_range("learning_rate", 0, low_open=True)
    check_range("positive_weight", 0, low_open=True)
    app.run(exit_on_error(_cli_main), flags_parser=parse_flags)


if __name__ == "__main__":
    main()

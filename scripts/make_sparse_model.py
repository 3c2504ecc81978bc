"""Write a SYNTHETIC sparse model: a PowerInfer GGUF (PWRI) of a ReLU-gated llama with RANDOM weights, whose FFN
neurons fire with power-law frequencies at a chosen overall sparsity, and with exact activation predictors.

The weights are random: the model generates noise. It exists so the sparse and hybrid paths can be tested and
benchmarked at real shapes (up to 7B) without downloading a model. See jaxinfer/synthetic.py for the construction.
The predictors are stored Q8_0 by default (--predictor_type f16|q8_0|q4_0).

    python scripts/make_sparse_model.py -o sparse-tiny.gguf
    python scripts/make_sparse_model.py --shape 7b --weight_type Q4_0 -o sparse-7b.gguf   # ~3.8 GB

With --sparsity 0 it writes a plain llama file instead (SwiGLU, random weights, no predictors): a model for the
training-free sparsity modes (calibrate, then --sparsity hidden:S), e.g. four 7B-shaped layers (436 MiB):

    python scripts/make_sparse_model.py --shape 7b --n_layer 4 --sparsity 0 -o llama7b-4l.gguf

--architecture bitnet or bitnet-b1.58 writes a plain BitNet file (sub-norms; with a ternary --weight_type, TQ1_0,
TQ2_0 or I2_S, each matrix a scale times values in {-1, 0, +1}), e.g. the 7B-shaped BitNet of the README's table:

    python scripts/make_sparse_model.py --architecture bitnet --shape 7b --n_layer 4 --n_vocab 32000 --sparsity 0 \
        --weight_type TQ2_0 -o bitnet-7b4l-TQ2_0.gguf

The other architectures jaxinfer runs (qwen2, qwen3, gemma3, phi3, falcon) are written plain too, with their blocks'
tensors as llama.cpp reads them (phi3's and falcon's fused attn_qkv, phi3's ffn_up [gate; up], falcon's biases);
--head_dim sets a head size of its own (Qwen3, Gemma 3), --sliding_window Gemma 3's window:

    python scripts/make_sparse_model.py --architecture gemma3 --head_dim 64 --sliding_window 512 --sparsity 0 \
        -o gemma3-tiny.gguf

--n_expert makes the FFN a mixture of that many experts of --n_ff neurons, --n_expert_used (2) of them per token:
qwen3moe's (it needs them), or Mixtral's in a llama file; e.g. Qwen3-30B-A3B's width and experts in 2 layers:

    python scripts/make_sparse_model.py --architecture qwen3moe --n_layer 2 --n_embd 2048 --n_ff 768 --n_head 32 \
        --n_head_kv 4 --head_dim 128 --n_expert 128 --n_expert_used 8 --n_vocab 151936 --sparsity 0 -o qwen3moe.gguf

--gate_activation relu writes ReLU experts (jaxinfer.gate_activation; llama.cpp runs its own SiLU on the same bytes),
whose zero neurons a decode step does not read. A smallthinker mixture has ReLU experts of its own (llama.cpp runs
them so), its router before the attention, and the gating function --expert_gating (softmax or sigmoid); e.g.
SmallThinker-4B-A0.6B's width and experts in 4 layers (--expert_sparsity 0.85: experts that leave about 85% of their
neurons zero, as sparse-trained ones do; random ones leave about half):

    python scripts/make_sparse_model.py --architecture smallthinker --n_layer 4 --n_embd 1536 --n_ff 768 \
        --n_head 12 --n_head_kv 2 --n_expert 32 --n_expert_used 4 --n_vocab 151936 --sparsity 0 -o smallthinker.gguf

--transpose_down stores the down projection one row per neuron under its usual name, as PowerInfer's converter writes
SmallThinker's sparse files (--transpose-down all): jaxinfer reads such a file's rows as they are; llama.cpp cannot.

--dense_twin FILE writes the dense twin of the PowerInfer FILE instead (synthetic.write_dense_twin): the same weights
as a plain GGUF that llama.cpp loads (no predictors, ffn_down [d, n_ff] quantized again along the neurons in place of
ffn_down_t), for the dense baseline on the same weights (scripts/bench_sparse.py runs llama-bench on it):

    python scripts/make_sparse_model.py --dense_twin sparse-7b.gguf -o sparse-7b.dense.gguf
"""

import dataclasses
import os
import sys

from absl import app, flags
from gguf import GGMLQuantizationType

from jaxinfer.cli import check_range, parse_flags
from jaxinfer.config import ARCHITECTURES, EXPERT_GATINGS, GATE_ACTIVATIONS
from jaxinfer.errors import JaxinferError, exit_on_error
from jaxinfer.synthetic import SyntheticSpec, check_loadable, write_dense_twin, write_model
from jaxinfer.ternary import BitNetType

SHAPES = {  # (layers, d, ffn, heads, kv heads, vocab)
    "tiny": (4, 256, 1024, 4, 4, 0),
    "small": (12, 768, 3072, 12, 12, 32000),
    "7b": (32, 4096, 11008, 32, 32, 49152),  # llama-7B shapes, as in shared/reference's GPU benchmark
}
WEIGHT_TYPES = {t.name: t for t in (*GGMLQuantizationType, *BitNetType)}
flags.DEFINE_string("output", None, "output path", short_name="o")
flags.DEFINE_enum("shape", "tiny", list(SHAPES), "preset shape (overridden by the explicit flags below)")
flags.DEFINE_integer("n_layer", None, "layers")
flags.DEFINE_integer("n_embd", None, "hidden size")
flags.DEFINE_integer("n_ff", None, "FFN neurons per layer")
flags.DEFINE_integer("n_head", None, "attention heads; they must divide --n_embd (default: the shape's)")
flags.DEFINE_integer("n_head_kv", None, "KV heads, dividing --n_head (default: the shape's; with --n_head, as many as "
                     "--n_head)")
flags.DEFINE_float("sparsity", 0.9, "mean share of inactive FFN neurons per token; 0: a plain llama file "
                   "(SwiGLU, no predictors)")
flags.DEFINE_float("power_law", 1.0, "firing frequency of the k-th hottest neuron ~ k^-power_law")
flags.DEFINE_string("weight_type", "Q4_0", "GGML type of the large matrices (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0, ...; "
                    "ternary: TQ1_0, TQ2_0, I2_S)")
flags.DEFINE_integer("seed", 0, "random seed")
flags.DEFINE_enum("predictor_type", "q8_0", ["f16", "q8_0", "q4_0"], "how the exact predictors (fc1/fc2) are "
                  "stored; q8_0/q4_0 pad their rank (2 gate ranks + 2) with zeros to a multiple of 32. Mean recall "
                  "against the gate's firing, tiny and small shapes: f16 0.939, 0.943; q8_0 the same to 0.0002, at "
                  "0.56x f16's bytes at 7B shape (rank 514 padded to 544); q4_0 0.891, 0.919")
flags.DEFINE_enum("architecture", "llama", sorted(ARCHITECTURES), "the block: llama's, or another architecture's "
                  "(plain files only: --sparsity 0)")
flags.DEFINE_integer("head_dim", 0, "the attention's head size, written as attention.key_length (0: n_embd / n_head)")
flags.DEFINE_integer("sliding_window", 0, "attention.sliding_window, for an architecture with sliding-window layers "
                     "(gemma3)")
flags.DEFINE_integer("n_expert", 0, "a mixture of this many experts of --n_ff neurons in place of the FFN (0: none)")
flags.DEFINE_integer("n_expert_used", 2, "the experts each token runs, with --n_expert")
flags.DEFINE_enum("gate_activation", "", ["", *GATE_ACTIVATIONS], "the gate activation, written as "
                  "jaxinfer.gate_activation (relu: ReLU experts, whose zero neurons a decode step skips); default: the "
                  "architecture's")
flags.DEFINE_float("expert_sparsity", 0.0, "ReLU experts that leave about this share of their neurons zero for a "
                   "token (0: random experts, about half)")
flags.DEFINE_enum("expert_gating", "softmax", sorted(EXPERT_GATINGS.values()), "the router's gating function, for "
                  "an architecture that reads it from the file (smallthinker)")
flags.DEFINE_bool("transpose_down", False, "store the down projection one row per neuron under its usual name "
                  "(ffn_down_exps [n_expert, n_ff, d], or ffn_down [n_ff, d] in a plain file), as PowerInfer's "
                  "converter writes SmallThinker's sparse files (--transpose-down all); plain files only")
check_range("head_dim", 0)
check_range("n_expert", 0)
check_range("n_expert_used", 1)
check_range("sliding_window", 0)
flags.DEFINE_integer("n_vocab", None, "vocabulary size (default: the shape's; the tiny one's is byte-level, 263)")
flags.DEFINE_string("dense_twin", None, "write the dense twin of this PowerInfer file instead: its weights as a plain "
                    "GGUF that llama.cpp loads (no predictors, ffn_down in place of ffn_down_t)")
check_range("n_head", 1)
check_range("n_head_kv", 1)
check_range("n_layer", 1)
check_range("n_embd", 1)
check_range("n_ff", 1)
check_range("n_vocab", 0)
check_range("seed", 0)
check_range("sparsity", 0, 1, high_open=True)
check_range("power_law", 0)
FLAGS = flags.FLAGS
MODEL_FLAGS = ("shape", "n_layer", "n_embd", "n_ff", "n_head", "n_head_kv", "sparsity", "power_law", "weight_type",
               "seed", "architecture", "n_vocab", "head_dim", "sliding_window", "n_expert", "n_expert_used",
               "predictor_type", "gate_activation", "expert_gating", "expert_sparsity",
               "transpose_down")  # not with --dense_twin
SHAPE_FLAGS = "--n_layer, --n_embd, --n_ff, --n_head, --n_head_kv, --n_vocab, --weight_type"


@exit_on_error
def main(argv):
    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    if not FLAGS.output:
        raise JaxinferError("-o/--output is required")
    if FLAGS.dense_twin:
        given = [f"--{name}" for name in MODEL_FLAGS if FLAGS[name].present]
        if given:
            raise JaxinferError(f"--dense_twin takes the model from its file: drop {', '.join(given)}")
        write_dense_twin(FLAGS.output, FLAGS.dense_twin, progress=True)
        print(f"wrote {FLAGS.output} ({os.path.getsize(FLAGS.output) / 2**20:.1f} MiB), the dense twin of "
              f"{FLAGS.dense_twin}")
        return
    if FLAGS.architecture != "llama" and FLAGS.sparsity:
        raise JaxinferError(f"a {FLAGS.architecture} model is written plain: give --sparsity 0")
    if FLAGS.transpose_down and FLAGS.sparsity:
        raise JaxinferError("--transpose_down is for plain files (a sparse one has ffn_down_t): give --sparsity 0")
    if FLAGS.n_expert and FLAGS.sparsity:
        raise JaxinferError("a mixture of experts (--n_expert) is written plain: give --sparsity 0")
    weight_type = WEIGHT_TYPES.get(FLAGS.weight_type.upper())
    if weight_type is None:
        raise JaxinferError(f"unknown --weight_type {FLAGS.weight_type!r}")
    n_layer, n_embd, n_ff, n_head, n_head_kv, n_vocab = SHAPES[FLAGS.shape]
    if FLAGS.n_head is not None:
        n_head = n_head_kv = FLAGS.n_head
    spec = SyntheticSpec(
        n_layer=FLAGS.n_layer or n_layer, n_embd=FLAGS.n_embd or n_embd, n_ff=FLAGS.n_ff or n_ff, n_head=n_head,
        n_head_kv=n_head_kv if FLAGS.n_head_kv is None else FLAGS.n_head_kv,
        n_vocab=n_vocab if FLAGS.n_vocab is None else FLAGS.n_vocab, n_ctx=4096, weight_type=weight_type,
        embedding_type=GGMLQuantizationType.Q8_0 if weight_type != GGMLQuantizationType.F32 else weight_type,
        architecture=FLAGS.architecture, sparsity=FLAGS.sparsity or None, power_law=FLAGS.power_law, seed=FLAGS.seed,
        predictor_type=GGMLQuantizationType[FLAGS.predictor_type.upper()], head_dim=FLAGS.head_dim,
        sliding_window=FLAGS.sliding_window, n_expert=FLAGS.n_expert, n_expert_used=FLAGS.n_expert_used,
        gate_activation=FLAGS.gate_activation, expert_gating=FLAGS.expert_gating,
        expert_sparsity=FLAGS.expert_sparsity, transposed_down=FLAGS.transpose_down)
    try:
        check_loadable(spec)  # a file that would not load is not written
    except JaxinferError as e:
        raise JaxinferError(f"a model of this shape would not load, so nothing was written: {e} ({SHAPE_FLAGS} set "
                            f"the shape)") from None
    kind = "sparse model" if spec.sparsity else f"plain {FLAGS.architecture} model"
    print(f"writing a SYNTHETIC (random-weight) {kind}: {dataclasses.asdict(spec)}", file=sys.stderr)
    write_model(FLAGS.output, spec, progress=True)
    print(f"wrote {FLAGS.output} ({os.path.getsize(FLAGS.output) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

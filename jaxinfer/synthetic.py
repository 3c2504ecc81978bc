"""Synthetic GGUF models with random weights: tests and benchmarks need no downloads. THE WEIGHTS ARE RANDOM: the
text such a model generates is noise; only shapes, formats, numerics and (for sparse models) firing statistics
mean anything.

The vocabulary is byte-level BPE (every byte is a token, plus a few merges, ChatML control tokens and unused fillers
up to `n_vocab`), so the tokenizer, chat template and CLI paths run exactly as with a real model.

BitNet models (architecture "bitnet" or "bitnet-b1.58") have the sub-norms, and with a ternary weight type (TQ1_0,
TQ2_0, I2_S) ternary weights: each matrix is a scale times values in {-1, 0, +1}, stored exactly; `projection_scales`
adds llama.cpp's per-projection `*.scale` tensors. The other architectures get the tensors and metadata their block
reads (config.ARCHITECTURES): QKV biases (`qkv_bias`; Qwen2's by default), QK-norms, post-norms, a head size of its
own (`head_dim`), sliding-window layers (`sliding_window`), llama's rope_freqs (`rope_freqs`: Llama 3's factors),
soft-caps (`attn_softcap`, `final_softcap`: Gemma 2's).
With `n_expert` the FFN is a mixture of experts (moe.py: qwen3moe's and qwen2moe's, the latter with a shared expert
of `n_ff_shexp` neurons, smallthinker's with its gating function `expert_gating`, or for llama Mixtral's layout): a
router (ffn_gate_inp) and `n_expert` gated experts (the architecture's activation) of `n_ff` neurons stacked in
ffn_{gate,up,down}_exps, `n_expert_used` of them run per token. ReLU experts leave about half their neurons zero;
with `expert_sparsity` S, about S of them: residual dimension 0 is held constant as for sparse models (below), and
column 0 of each expert's gate is a bias that makes each neuron fire with probability ~1 - S.

Sparse models (`sparsity` set) are PowerInfer files of a ReLU-gated llama (ReluLLaMA-like) whose neuron firing
frequencies follow a power law with a chosen mean, with exact predictors:

  * dimension 0 of the residual stream is a constant c: every embedding row has c there, and no layer writes to it
    (row 0 of attn_output and column 0 of ffn_down_t are zero), so after the norm it acts as a bias input;
  * gate row i = [b_i, A_i B]: a low-rank random part plus a bias. With x_rest ~ isotropic, the pre-activation is
    ~ N(b_i x_0, |A_i B|² |x_rest|² / (d-1)), so b_i = |A_i B| Φ⁻¹(p_i) / c makes neuron i fire with probability ~p_i;
  * the predictor fc2(relu(fc1 v)) with fc1 = [B; -B; e_0; -e_0], fc2 = [A, -A, b, -b] equals the gate's
    pre-activation exactly (relu(u) - relu(-u) = u), so it predicts firing up to the gate's quantization error.
    Stored in a block type (`predictor_type` Q8_0, Q4_0: fc2's rows are blocks along the rank), its rank 2r + 2 is
    padded to whole blocks with zero rows of fc1 and zero columns of fc2, which add nothing to the logits.
"""

import dataclasses
import types
import zlib

import gguf
import numpy as np
import scipy.special
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from jaxinfer import blocks, gguf_io, powerinfer, ternary, validate
from jaxinfer.config import (ARCHITECTURES, EXPERT_GATINGS, GATE_ACTIVATION_KEY, NATURAL_ZEROS, SPARSE_THRESHOLD_KEY,
                             Config)
from jaxinfer.errors import JaxinferError
from jaxinfer.powerinfer import PendingTensor, write_gguf

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
BIAS_VALUE = 4.0  # c: the constant residual dimension that lets gates of a bias-free block carry a bias
MIN_FIRING, MAX_FIRING = 1e-4, 0.999
TERNARY_TYPES = (GGMLQuantizationType.TQ1_0, GGMLQuantizationType.TQ2_0, ternary.I2_S)
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in character for each byte value, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | \
        set(range(ord("®"), ord("ÿ") + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    n_ctx: int = 256
    n_vocab: int = 0  # 0: just the byte-level vocabulary (263 tokens)
    rope_theta: float = 10000.0
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32
    embedding_type: GGMLQuantizationType = GGMLQuantizationType.F32
    tied_output: bool = True
    architecture: str = "llama"
    seed: int = 0
    # Sparse ReLU model (PowerInfer file with predictors) when set: the mean share of inactive neurons.
    sparsity: float | None = None
    power_law: float = 1.0  # firing frequency of the k-th most active neuron ~ k^-power_law
    gate_rank: int = 0  # rank of the gates' random part (0: n_embd // 16, at least 4)
    predictor_type: GGMLQuantizationType = GGMLQuantizationType.F16  # fc1/fc2's type (a block type pads the rank)
    projection_scales: bool = False  # BitNet: a blk.N.PROJ.scale tensor beside each projection
    head_dim: int = 0  # 0: n_embd // n_head; else written as attention.key_length (Qwen3, Gemma 3)
    qkv_bias: bool | None = None  # blk.N.attn_{q,k,v}.bias; None: where the architecture's checkpoints have them
    sliding_window: int = 0  # {arch}.attention.sliding_window (an architecture with sliding-window layers)
    swa_pattern: int = 0  # {arch}.attention.sliding_window_pattern, the period of global layers; 0: unwritten
    attn_softcap: float = 0.0  # {arch}.attn_logit_softcapping (Gemma 2); 0: unwritten
    final_softcap: float = 0.0  # {arch}.final_logit_softcapping; 0: unwritten
    rope_freqs: bool = False  # rope_freqs.weight: Llama 3.1's RoPE frequency factors for head_dim / 2 pairs
    rope_dim: int = 0  # {arch}.rope.dimension_count, the rotated dims of a head (Phi-4 mini: 3/4); 0: all of them
    n_expert: int = 0  # a mixture of this many experts of n_ff neurons in place of the FFN (0: none)
    n_expert_used: int = 2  # the experts run per token (with n_expert)
    n_ff_shexp: int = 0  # the shared expert's neurons where the architecture has one (0: 2 n_ff)
    gate_activation: str = ""  # written as jaxinfer.gate_activation where set (ReLU experts); "": the architecture's
    # {arch}.expert_gating_func where the architecture reads it (Architecture.expert_gating_from_file: SmallThinker)
    expert_gating: str = "softmax"
    # ReLU experts (a gate activation with zeros) that leave about this share of their neurons zero for a token (0:
    # random experts, about half): the constant-dimension bias below, in each expert's gate.
    expert_sparsity: float = 0.0
    # The down projection stored one row per neuron under its usual name (ffn_down_exps [n_expert, n_ff, d], a plain
    # FFN's ffn_down [n_ff, d]), as PowerInfer's converter writes it with --transpose-down (SmallThinker's sparse
    # files): the same values, quantized along the neurons' rows.
    transposed_down: bool = False


def vocabulary(n_vocab: int = 0) -> tuple[list[str], list[int], list[str]]:
    tokens = CONTROL_TOKENS + byte_level_alphabet() + ["".join(pair) for pair in MERGES]
    types = [gguf.TokenType.CONTROL] * len(CONTROL_TOKENS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    fillers = max(0, n_vocab - len(tokens))
    tokens += [f"<unused_{i}>" for i in range(fillers)]
    types += [gguf.TokenType.UNUSED] * fillers
    return tokens, [int(t) for t in types], [" ".join(pair) for pair in MERGES]


# The fp16 block scales of each type gguf-py cannot quantize, as (byte offset, count): d, and dmin where the type has
# mins.
RANDOM_BLOCK_SCALES = {GGMLQuantizationType.Q2_K: (80, 2), GGMLQuantizationType.Q3_K: (108, 1),
                       GGMLQuantizationType.Q4_K: (0, 2), GGMLQuantizationType.Q5_K: (0, 2),
                       GGMLQuantizationType.Q6_K: (208, 1), GGMLQuantizationType.IQ4_NL: (0, 1),
                       GGMLQuantizationType.IQ4_XS: (0, 1)}


def encode_tensor(values: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """f32 [rows, cols] -> what GGUF stores for `qtype` (floats for F32/F16, raw block bytes otherwise).

    gguf-py has no quantizer for K-quants and IQ types; for those the blocks are random bytes with sane scales, so the
    stored tensor is simply whatever those blocks decode to (the values argument only fixes the shape)."""
    if qtype == GGMLQuantizationType.F32:
        return values.astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    if qtype == ternary.I2_S:  # a ternary tensor: one scale, max |value| (BitNet's converter needs them ternary)
        scale = float(np.abs(values).max())
        return ternary.encode_i2_s(np.round(values / scale).astype(np.int8).reshape(-1) + 1, scale)
    if qtype in RANDOM_BLOCK_SCALES:
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_blocks = values.size // block_size
        blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
        offset, count = RANDOM_BLOCK_SCALES[qtype]  # the packed integer scales stay random
        scales = (np.abs(rng.normal(size=(n_blocks, count))) * 0.002).astype(np.float16).view(np.uint8)
        blocks[:, offset:offset + 2 * count] = scales
        return blocks.reshape(values.shape[0], -1)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def firing_frequencies(n: int, sparsity: float, power_law: float, rng: np.random.Generator) -> np.ndarray:
    """Per-neuron firing probabilities p_k = clip(C k^-power_law), C solved so their mean is 1 - sparsity; shuffled
    so hot neurons are spread over the layer, as in trained models."""
    ranks = np.arange(1, n + 1, dtype=np.float64) ** -power_law
    lo, hi = 1e-12, 1e12
    for _ in range(200):  # bisection on the log of C: mean(clip(C * ranks)) is monotonic in C
        mid = np.sqrt(lo * hi)
        if np.clip(mid * ranks, MIN_FIRING, MAX_FIRING).mean() < 1 - sparsity:
            lo = mid
        else:
            hi = mid
    return rng.permutation(np.clip(lo * ranks, MIN_FIRING, MAX_FIRING))


@dataclasses.dataclass(frozen=True)
class SparseLayer:
    """A sparse layer's gate and its exact predictor, derived together from one seed."""

    gate: np.ndarray  # [n_ff, d]
    fc1: np.ndarray  # [predictor_rank, d]
    fc2: np.ndarray  # [n_ff, predictor_rank]


def shared_width(spec: SyntheticSpec) -> int:
    """The neurons of a shared expert (Qwen2-MoE's)."""
    return spec.n_ff_shexp or 2 * spec.n_ff


def gate_rank(spec: SyntheticSpec) -> int:
    return spec.gate_rank or max(4, spec.n_embd // 16)


def predictor_rank(spec: SyntheticSpec) -> int:
    """The stored predictor's rank: 2r + 2, padded to whole blocks of a block `predictor_type`."""
    block_size = GGML_QUANT_SIZES[spec.predictor_type][0]  # 1 for the float types
    return -(-(2 * gate_rank(spec) + 2) // block_size) * block_size


def sparse_layer(spec: SyntheticSpec, rng: np.random.Generator) -> SparseLayer:
    d, f = spec.n_embd, spec.n_ff
    rank = gate_rank(spec)
    a = rng.normal(size=(f, rank)).astype(np.float32)
    b_rest = (rng.normal(size=(rank, d - 1)) / np.sqrt(rank * (d - 1))).astype(np.float32)
    rest = a @ b_rest
    p = firing_frequencies(f, spec.sparsity, spec.power_law, rng)
    bias = (np.linalg.norm(rest, axis=1) * scipy.special.ndtri(p) / BIAS_VALUE).astype(np.float32)
    b = np.concatenate([np.zeros((rank, 1), np.float32), b_rest], axis=1)
    e0 = np.eye(1, d, dtype=np.float32)
    padding = predictor_rank(spec) - (2 * rank + 2)
    return SparseLayer(
        gate=np.concatenate([bias[:, None], rest], axis=1),
        fc1=np.concatenate([b, -b, e0, -e0, np.zeros((padding, d), np.float32)]),
        fc2=np.concatenate([a, -a, bias[:, None], -bias[:, None], np.zeros((f, padding), np.float32)], axis=1),
    )


# Architectures whose checkpoints carry QKV biases.
QKV_BIAS_ARCHITECTURES = ("qwen2", "qwen2moe")


def llama3_rope_factors(n: int, factor: float = 8.0, low: float = 1.0, high: float = 4.0, context: int = 64,
                        rope_theta: float = 10000.0) -> np.ndarray:
    """The factors Llama 3.1's converter writes to rope_freqs.weight for `n` rotated pairs (HF's "llama3" rope
    scaling): 1 for short wavelengths, `factor` for long ones, smooth between; `context` stands for the original
    8192 so that a tiny model's positions reach the scaled band."""
    freqs = rope_theta ** (-np.arange(0, 2 * n, 2, dtype=np.float64) / (2 * n))
    wavelength = 2 * np.pi / freqs
    smooth = np.clip((context / wavelength - low) / (high - low), 0, 1)
    return (1 / ((1 - smooth) / factor + smooth)).astype(np.float32)


def _rng(spec: SyntheticSpec, name: str) -> np.random.Generator:
    """One generator per tensor, so any tensor can be made alone, in any order."""
    return np.random.default_rng([spec.seed, zlib.crc32(name.encode())])


def write_model(path: str, spec: SyntheticSpec = SyntheticSpec(), progress: bool = False) -> str:
    """Write a random llama-family GGUF (a PowerInfer file when `spec.sparsity` is set) and return the path. Nothing
    is checked: tests write files that must fail to load (check_loadable says whether one would load)."""
    fields, tensors = _contents(spec)
    return write_gguf(path, spec.architecture, fields, tensors, powerinfer=spec.sparsity is not None,
                      progress=progress)


def check_loadable(spec: SyntheticSpec) -> None:
    """Raise a JaxinferError naming what a run would refuse in the file write_model writes for `spec` (before any of
    it is made): the checks the loader makes, on the metadata and the tensors' shapes and types alone: the config
    the metadata gives (Config.from_metadata: heads that divide the width, an even head size, ...), every tensor's
    rows whole blocks of its type (as the reader checks), the tensors against the config (validate.check_tensors)."""
    fields, tensors = _contents(spec)
    meta = {"general.architecture": spec.architecture, **{key: value for key, value, *_ in fields}}
    n_vocab = next(t.shape[0] for t in tensors if t.name == "token_embd.weight")
    cfg = Config.from_metadata(meta, n_vocab, powerinfer=spec.sparsity is not None)
    for t in tensors:
        block_size = ternary.QUANT_SIZES[t.qtype][0]
        if t.shape[-1] % block_size:
            raise JaxinferError(f"tensor {t.name}: rows of {t.shape[-1]} values are not whole {t.qtype.name} blocks "
                                f"of {block_size}")
    layout = types.SimpleNamespace(path="the model", metadata=meta, tensors={
        t.name: types.SimpleNamespace(shape=list(reversed(t.shape)), tensor_type=t.qtype) for t in tensors})
    validate.check_tensors(layout, cfg)
    blocks.check_block_tensors(layout, cfg)


def _contents(spec: SyntheticSpec) -> tuple[list, list[PendingTensor]]:
    """The metadata fields (key, value, type, array element type) and the tensors, made when written, of `spec`."""
    sparse = spec.sparsity is not None
    if spec.expert_sparsity and not (spec.n_expert and 0 < spec.expert_sparsity < 1 and not sparse and (
            spec.gate_activation or ARCHITECTURES[spec.architecture].gate_activation) in NATURAL_ZEROS):
        raise JaxinferError(f"expert_sparsity {spec.expert_sparsity}: a share in (0, 1) of the zeros of a mixture's "
                            f"experts whose gate activation leaves zeros ({', '.join(NATURAL_ZEROS)})")
    bias_input = sparse or spec.expert_sparsity > 0  # residual dimension 0 held constant (see the module docstring)
    head_dim = spec.head_dim or spec.n_embd // spec.n_head
    known = ARCHITECTURES.get(spec.architecture)  # other names: files for unsupported-architecture tests
    tokens, token_types, merges = vocabulary(spec.n_vocab)
    n_vocab = len(tokens)
    arch = spec.architecture
    fields = [
        ("general.name", "jaxinfer synthetic model (random weights)", GGUFValueType.STRING, None),
        (f"{arch}.block_count", spec.n_layer, GGUFValueType.UINT32, None),
        (f"{arch}.context_length", spec.n_ctx, GGUFValueType.UINT32, None),
        (f"{arch}.embedding_length", spec.n_embd, GGUFValueType.UINT32, None),
        (f"{arch}.feed_forward_length", spec.n_ff, GGUFValueType.UINT32, None),
        (f"{arch}.attention.head_count", spec.n_head, GGUFValueType.UINT32, None),
        (f"{arch}.attention.head_count_kv", spec.n_head_kv, GGUFValueType.UINT32, None),
        (f"{arch}.rope.dimension_count", spec.rope_dim or head_dim, GGUFValueType.UINT32, None),
        (f"{arch}.rope.freq_base", spec.rope_theta, GGUFValueType.FLOAT32, None),
        (f"{arch}.attention.layer_norm_rms_epsilon", 1e-5, GGUFValueType.FLOAT32, None),
        (f"{arch}.vocab_size", n_vocab, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.model", "gpt2", GGUFValueType.STRING, None),
        ("tokenizer.ggml.pre", "smollm", GGUFValueType.STRING, None),
        ("tokenizer.ggml.tokens", tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        ("tokenizer.ggml.token_type", token_types, GGUFValueType.ARRAY, GGUFValueType.INT32),
        ("tokenizer.ggml.merges", merges, GGUFValueType.ARRAY, GGUFValueType.STRING),
        ("tokenizer.ggml.bos_token_id", 0, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.eos_token_id", 0, GGUFValueType.UINT32, None),
        ("tokenizer.ggml.add_bos_token", False, GGUFValueType.BOOL, None),
        ("tokenizer.chat_template", CHATML_TEMPLATE, GGUFValueType.STRING, None),
    ]
    if sparse:
        fields.append((SPARSE_THRESHOLD_KEY, 0.0, GGUFValueType.FLOAT32, None))
    if spec.head_dim:
        fields += [(f"{arch}.attention.key_length", head_dim, GGUFValueType.UINT32, None),
                   (f"{arch}.attention.value_length", head_dim, GGUFValueType.UINT32, None)]
    if spec.n_expert:
        fields += [(f"{arch}.expert_count", spec.n_expert, GGUFValueType.UINT32, None),
                   (f"{arch}.expert_used_count", spec.n_expert_used, GGUFValueType.UINT32, None)]
        if known and known.experts:  # llama.cpp's llama takes its experts' width from feed_forward_length
            fields.append((f"{arch}.expert_feed_forward_length", spec.n_ff, GGUFValueType.UINT32, None))
        if known and known.expert_gating_from_file:
            number = {name: number for number, name in EXPERT_GATINGS.items()}[spec.expert_gating]
            fields.append((f"{arch}.expert_gating_func", number, GGUFValueType.UINT32, None))
        if known and known.shared_expert:
            fields.append((f"{arch}.expert_shared_feed_forward_length", shared_width(spec), GGUFValueType.UINT32,
                           None))
    if spec.gate_activation:
        fields.append((GATE_ACTIVATION_KEY, spec.gate_activation, GGUFValueType.STRING, None))
    if spec.sliding_window:
        fields.append((f"{arch}.attention.sliding_window", spec.sliding_window, GGUFValueType.UINT32, None))
    if spec.swa_pattern:
        fields.append((f"{arch}.attention.sliding_window_pattern", spec.swa_pattern, GGUFValueType.UINT32, None))
    if spec.attn_softcap:
        fields.append((f"{arch}.attn_logit_softcapping", spec.attn_softcap, GGUFValueType.FLOAT32, None))
    if spec.final_softcap:
        fields.append((f"{arch}.final_logit_softcapping", spec.final_softcap, GGUFValueType.FLOAT32, None))

    def matrix(name, rows, cols, qtype, zero_row0=False, zero_col0=False, scale=1.0, transposed=False):
        def make():
            rng = _rng(spec, name)
            if qtype in TERNARY_TYPES:  # two thirds of the values nonzero: the same variance as the normal ones
                values = rng.integers(-1, 2, size=(rows, cols)).astype(np.float32) * np.float32(
                    scale * np.sqrt(1.5 / cols))
            else:
                values = rng.normal(size=(rows, cols)).astype(np.float32) * np.float32(scale / np.sqrt(cols))
            if zero_row0:
                values[0] = 0
            if zero_col0:
                values[:, 0] = 0
            return encode_tensor(np.ascontiguousarray(values.T) if transposed else values, qtype, rng)

        return PendingTensor(name, (cols, rows) if transposed else (rows, cols), qtype, make)

    # [n_expert, rows, cols], as GGUF stacks; `transposed`: each expert's [cols, rows] instead, the same values
    def stacked(name, rows, cols, qtype, bias_col0=False, zero_row0=False, transposed=False):
        def make():
            rng = _rng(spec, name)
            values = rng.normal(size=(spec.n_expert * rows, cols)).astype(np.float32) / np.float32(np.sqrt(cols))
            if bias_col0:  # column 0 reads the constant dimension: each row's bias, for ~1 - expert_sparsity firing
                values[:, 0] = (np.linalg.norm(values[:, 1:], axis=1) * scipy.special.ndtri(1 - spec.expert_sparsity)
                                / BIAS_VALUE)
            if zero_row0:  # no expert writes the constant dimension
                values.reshape(spec.n_expert, rows, cols)[:, 0] = 0
            if transposed:
                values = np.ascontiguousarray(values.reshape(spec.n_expert, rows, cols).transpose(0, 2, 1))
            encoded = encode_tensor(values.reshape(-1, values.shape[-1]), qtype, rng)
            return encoded.reshape(spec.n_expert, cols if transposed else rows, -1)

        return PendingTensor(name, (spec.n_expert, cols, rows) if transposed else (spec.n_expert, rows, cols), qtype,
                             make)

    def embedding(name):
        def make():
            rng = _rng(spec, name)
            values = rng.normal(size=(n_vocab, spec.n_embd)).astype(np.float32)
            if bias_input:
                values[:, 0] = BIAS_VALUE  # unit-variance other dims: the bias derivation assumes |x_rest|² ~ d-1
            else:
                values /= np.sqrt(spec.n_embd)
            return encode_tensor(values, spec.embedding_type, rng)

        return PendingTensor(name, (n_vocab, spec.n_embd), spec.embedding_type, make)

    def norm(name, ones=False, size=spec.n_embd):
        def make():
            if ones:
                return np.ones(size, np.float32)
            return (1.0 + 0.1 * _rng(spec, name).normal(size=size)).astype(np.float32)

        return PendingTensor(name, (size,), GGMLQuantizationType.F32, make)

    def bias(name, size):
        def make():
            return (0.5 * _rng(spec, name).normal(size=size)).astype(np.float32)

        return PendingTensor(name, (size,), GGMLQuantizationType.F32, make)

    def projection_scale(name):
        def make():
            return np.array([0.5 + _rng(spec, name).random()], np.float32)

        return PendingTensor(name, (1,), GGMLQuantizationType.F32, make)

    def from_sparse_layer(name, layer_index, part, qtype):
        def make():
            layer = sparse_layer(spec, _rng(spec, f"blk.{layer_index}.sparse"))
            return encode_tensor(getattr(layer, part), qtype, _rng(spec, name))

        rank = predictor_rank(spec)
        shape = {"gate": (spec.n_ff, spec.n_embd), "fc1": (rank, spec.n_embd), "fc2": (spec.n_ff, rank)}[part]
        return PendingTensor(name, shape, qtype, make)

    d, f, w = spec.n_embd, spec.n_ff, spec.weight_type
    tensors = [embedding("token_embd.weight")]
    if spec.rope_freqs:
        tensors.append(PendingTensor("rope_freqs.weight", (head_dim // 2,), GGMLQuantizationType.F32,
                                     lambda: llama3_rope_factors(head_dim // 2, rope_theta=spec.rope_theta)))
    qkv_bias = spec.architecture in QKV_BIAS_ARCHITECTURES if spec.qkv_bias is None else spec.qkv_bias
    for i in range(spec.n_layer):
        blk = f"blk.{i}"
        tensors += [
            norm(f"{blk}.attn_norm.weight"),
            matrix(f"{blk}.attn_q.weight", spec.n_head * head_dim, d, w),
            matrix(f"{blk}.attn_k.weight", spec.n_head_kv * head_dim, d, w),
            matrix(f"{blk}.attn_v.weight", spec.n_head_kv * head_dim, d, w),
            matrix(f"{blk}.attn_output.weight", d, spec.n_head * head_dim, w, zero_row0=bias_input),
            norm(f"{blk}.ffn_norm.weight", ones=bias_input),
        ]
        if spec.n_expert:
            tensors += [matrix(f"{blk}.ffn_gate_inp.weight", spec.n_expert, d, w),
                        stacked(f"{blk}.ffn_gate_exps.weight", f, d, w, bias_col0=spec.expert_sparsity > 0),
                        stacked(f"{blk}.ffn_up_exps.weight", f, d, w),
                        stacked(f"{blk}.ffn_down_exps.weight", d, f, w, zero_row0=spec.expert_sparsity > 0,
                                transposed=spec.transposed_down)]
            if known and known.shared_expert:
                shared = shared_width(spec)
                tensors += [bias(f"{blk}.ffn_gate_inp_shexp.weight", d),
                            matrix(f"{blk}.ffn_gate_shexp.weight", shared, d, w),
                            matrix(f"{blk}.ffn_up_shexp.weight", shared, d, w),
                            matrix(f"{blk}.ffn_down_shexp.weight", d, shared, w)]
        elif sparse:
            tensors += [
                matrix(f"{blk}.ffn_up.weight", f, d, w),
                from_sparse_layer(f"{blk}.ffn_gate.weight", i, "gate", w),
                matrix(f"{blk}.ffn_down_t.weight", f, d, w, zero_col0=True, scale=np.sqrt(d / f)),
                from_sparse_layer(f"{blk}.fc1.weight", i, "fc1", spec.predictor_type),
                from_sparse_layer(f"{blk}.fc2.weight", i, "fc2", spec.predictor_type),
            ]
        else:
            tensors += [matrix(f"{blk}.ffn_up.weight", f, d, w), matrix(f"{blk}.ffn_gate.weight", f, d, w),
                        matrix(f"{blk}.ffn_down.weight", d, f, w, transposed=spec.transposed_down)]
        if known and known.sub_norms:
            tensors += [norm(f"{blk}.attn_sub_norm.weight", size=spec.n_head * head_dim),
                        norm(f"{blk}.ffn_sub_norm.weight", size=f)]
        if qkv_bias:
            tensors += [bias(f"{blk}.attn_q.bias", spec.n_head * head_dim),
                        bias(f"{blk}.attn_k.bias", spec.n_head_kv * head_dim),
                        bias(f"{blk}.attn_v.bias", spec.n_head_kv * head_dim)]
        if known and known.qk_norm:
            tensors += [norm(f"{blk}.attn_q_norm.weight", size=head_dim), norm(f"{blk}.attn_k_norm.weight",
                                                                                size=head_dim)]
        if known and known.post_norms:
            tensors += [norm(f"{blk}.post_attention_norm.weight"), norm(f"{blk}.post_ffw_norm.weight")]
        if spec.projection_scales:
            tensors += [projection_scale(f"{blk}.{proj}.scale") for proj in PROJECTIONS]
    tensors.append(norm("output_norm.weight"))
    if not spec.tied_output or sparse:  # a sparse model's embedding is unit-variance: too large to tie
        tensors.append(matrix("output.weight", n_vocab, d, spec.embedding_type))
    return _as_stored(known, fields, tensors, bias) if known else (fields, tensors)


def _as_stored(known, fields: list, tensors: list[PendingTensor], bias) -> tuple[list, list[PendingTensor]]:
    """The llama block's metadata and tensors as an architecture's file holds them (Config.fused_parts): q, k and v
    fused into attn_qkv and gate and up into ffn_up [gate; up] (Phi-3), or the FFN without its gate and the block
    without ffn_norm, with LayerNorm's biases and epsilon (Falcon). `bias(name, size)` makes a bias vector."""
    if known.ffn_layout == "gated":
        return fields, tensors
    groups = {"attn_qkv": ("attn_q", "attn_k", "attn_v")}
    if known.ffn_layout == "fused":
        groups["ffn_up"] = ("ffn_gate", "ffn_up")
    dropped = ({"ffn_gate"} if known.ffn_layout == "ungated" else set()) | ({"ffn_norm"} if known.parallel_block
                                                                           else set())
    by_name = {t.name: t for t in tensors}
    stored, made = [], set()
    for t in tensors:
        layer, _, kind = t.name.removesuffix(".weight").rpartition(".")
        group = next((g for g, parts in groups.items() if kind in parts), None)
        if group is None and kind not in dropped:
            stored.append(t)
        elif group is not None and (layer, group) not in made:  # the parts' rows one after another
            made.add((layer, group))
            parts = [by_name[f"{layer}.{part}.weight"] for part in groups[group]]
            stored.append(PendingTensor(f"{layer}.{group}.weight", (sum(p.shape[0] for p in parts), t.shape[1]),
                                        t.qtype, lambda parts=parts: np.concatenate([p.make() for p in parts])))
        if known.layer_norm and kind in ("attn_norm", "output_norm"):
            stored.append(bias(t.name.replace(".weight", ".bias"), t.shape[0]))
    if known.layer_norm:
        fields = [(key.replace("layer_norm_rms_epsilon", "layer_norm_epsilon"), *rest) for key, *rest in fields]
    return fields, stored


# Types of a down projection that a dense twin quantizes again along its other axis (gguf-py quantizes them).
TWIN_DOWN_TYPES = frozenset(GGMLQuantizationType[name] for name in ("F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                                                                    "Q8_0"))


def write_dense_twin(path: str, sparse_path: str, progress: bool = False) -> str:
    """Write the dense twin of the PowerInfer file at `sparse_path` to `path` and return the path: the same weights
    as a plain GGUF that llama.cpp loads, for the dense baseline on them. Magic GGUF, no predictors (fc1/fc2, and no
    threshold), each layer's down projection as GGUF's ffn_down [d, n_ff] in its own type instead of ffn_down_t
    [n_ff, d]: a block type's blocks run along rows, so it is decoded, transposed and quantized again (one more
    rounding; float types transpose exactly). The gate activation (ReLU) is written as jaxinfer.gate_activation, so
    jaxinfer runs the twin as the same model; llama.cpp has no such key for a llama and runs SiLU there: the same
    bytes and work per token, other values."""
    g = gguf_io.open_gguf(sparse_path)
    if not g.powerinfer:
        raise JaxinferError(f"{sparse_path} is not a PowerInfer file (magic PWRI): its dense twin is itself")
    n_vocab = int(g.tensors["token_embd.weight"].shape[-1]) if "token_embd.weight" in g.tensors else 0
    cfg = Config.from_metadata(g.metadata, n_vocab, powerinfer=True)
    fields = [f for f in powerinfer.metadata_fields(g) if f[0] not in (SPARSE_THRESHOLD_KEY, GATE_ACTIVATION_KEY)]
    fields.append((GATE_ACTIVATION_KEY, cfg.gate_activation, GGUFValueType.STRING, None))
    tensors = []
    for t in powerinfer.stored_tensors(g, skip=[n for n in g.tensors if n.endswith((".fc1.weight", ".fc2.weight"))]):
        if t.name.endswith(".ffn_down_t.weight"):
            t = _untransposed_down(t, sparse_path)
        tensors.append(t)
    return write_gguf(path, cfg.arch, fields, tensors, progress=progress)


def _untransposed_down(down_t: PendingTensor, sparse_path: str) -> PendingTensor:
    """ffn_down_t [n_ff, d] -> ffn_down [d, n_ff] of the same type, made when written."""
    n_ff, d = down_t.shape
    block_size = GGML_QUANT_SIZES[down_t.qtype][0]
    if down_t.qtype not in TWIN_DOWN_TYPES or n_ff % block_size:
        raise JaxinferError(f"{sparse_path}: {down_t.name} is {down_t.qtype.name} with rows of {n_ff} neurons; a dense "
                            f"twin quantizes it again along the neurons, which needs one of "
                            f"{', '.join(sorted(t.name for t in TWIN_DOWN_TYPES))} and whole blocks of neurons")

    def make():
        values = gguf.quants.dequantize(down_t.make(), down_t.qtype).reshape(n_ff, d)
        return gguf.quants.quantize(np.ascontiguousarray(values.T), down_t.qtype)

    return PendingTensor(down_t.name.replace(".ffn_down_t.", ".ffn_down."), (d, n_ff), down_t.qtype, make)

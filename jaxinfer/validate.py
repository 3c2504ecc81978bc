"""A model's tensors checked against its Config before any is loaded, so that nothing reaches the first forward
unchecked: every tensor the model runs (and the optional ones when present) must exist with the shape the config
implies and a type jaxinfer computes with; the layers must be the config's; the vocabulary must be the embedding's.

The file's structure (types, sizes, offsets, alignment, overlaps) is checked as it is read (gguf_reader.py); the
weights' values are not scanned (that would read the whole file): NaN weights show up as NaN logits, which the
generation and perplexity loops stop on.
"""

import re

from gguf import GGMLQuantizationType

from jaxinfer import metadata
from jaxinfer.config import Config
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_reader import shown
from jaxinfer.quant import SUPPORTED_TYPES
from jaxinfer.ternary import quant_type, unsupported_type_note

LAYER_NAME = re.compile(r"blk\.(\d+)\.")
VOCABULARY_KEY = "tokenizer.ggml.tokens"


def tensor_shape(gguf, name: str, rank: int) -> tuple[int, ...]:
    """The logical (numpy order, e.g. (rows, cols)) shape of tensor `name` of `rank` dimensions; GGML's trailing
    dimensions of size 1 are dropped."""
    t = gguf.tensors.get(name)
    if t is None:
        raise JaxinferError(f"{gguf.path} lacks tensor {name}")
    dims = [int(n) for n in t.shape]  # GGML order: innermost first
    if len(dims) < rank or any(n != 1 for n in dims[rank:]):
        raise JaxinferError(f"{gguf.path}: tensor {name} has {len(dims)} dimensions {dims}, expected {rank}")
    return tuple(reversed(dims[:rank]))


def _check(gguf, name: str, shape: tuple[int, ...], types=SUPPORTED_TYPES) -> None:
    found = tensor_shape(gguf, name, len(shape))
    if found != shape:
        raise JaxinferError(f"{gguf.path}: tensor {name} has shape {list(found)}, the model's metadata implies "
                            f"{list(shape)}")
    qtype = quant_type(gguf.tensors[name].tensor_type)
    if qtype not in types:
        supported = ", ".join(sorted(q.name for q in types))
        raise JaxinferError(f"{gguf.path}: tensor {name} has type {qtype.name}{unsupported_type_note(qtype)}, which "
                            f"jaxinfer does not support here (supported: {supported})")


def down_stored_per_neuron(gguf, cfg: Config, i: int) -> bool:
    """Whether layer i stores its down projection one row per neuron under its usual name, as PowerInfer's converter
    writes it with --transpose-down (SmallThinker's sparse files): ffn_down_exps shaped as ffn_up_exps [n_expert,
    n_ff_exp, d], or ffn_down as ffn_up [n_ff, d]. The shape tells, as PowerInfer reads it; an FFN as wide as the
    model (n_ff = n_embd) reads as stored, as llama.cpp reads it."""
    d, e = cfg.n_embd, cfg.n_expert
    f = cfg.n_ff_exp if e else cfg.n_ff
    name = f"blk.{i}.ffn_down_exps.weight" if e else f"blk.{i}.ffn_down.weight"
    if f == d or name not in gguf.tensors or f"blk.{i}.ffn_down_t.weight" in gguf.tensors:
        return False
    dims = [int(n) for n in gguf.tensors[name].shape]  # GGML order: innermost first
    return dims[:3 if e else 2] == ([d, f, e] if e else [d, f])


def _check_layer(gguf, cfg: Config, i: int) -> None:
    d, q_rows, kv_rows = cfg.n_embd, cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim

    def name(tensor):
        return f"blk.{i}.{tensor}.weight"

    fused, fused_rows = cfg.fused_parts(name("attn_qkv") in gguf.tensors), {}
    for norm in ("attn_norm", "ffn_norm"):
        if norm not in fused:
            _check(gguf, name(norm), (d,), {GGMLQuantizationType.F32})
    for tensor in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        scale = f"blk.{i}.{tensor}.scale"  # llama.cpp's bitnet: one f32 multiplying the projection's result
        if scale in gguf.tensors:
            _check(gguf, scale, (1,), {GGMLQuantizationType.F32})
    if cfg.sub_norms:
        _check(gguf, name("attn_sub_norm"), (q_rows,), {GGMLQuantizationType.F32})
        _check(gguf, name("ffn_sub_norm"), (cfg.n_ff,), {GGMLQuantizationType.F32})
    # A mixture of experts: the router, and each FFN projection stacked over the experts [n_expert, rows, cols].
    e, f = cfg.n_expert, cfg.n_ff_exp
    per_neuron = down_stored_per_neuron(gguf, cfg, i)
    ffn = ((("ffn_gate_inp", (e, d)), ("ffn_gate_exps", (e, f, d)), ("ffn_up_exps", (e, f, d)),
            ("ffn_down_exps", (e, f, d) if per_neuron else (e, d, f)))
           if e else (("ffn_gate", (cfg.n_ff, d)), ("ffn_up", (cfg.n_ff, d))))
    for tensor, shape in (("attn_q", (q_rows, d)), ("attn_k", (kv_rows, d)), ("attn_v", (kv_rows, d)),
                          ("attn_output", (d, q_rows)), *ffn):
        if tensor not in fused:
            _check(gguf, name(tensor), shape)
        elif fused[tensor] is not None:  # a part of a fused tensor, which holds the parts' rows one after another
            fused_rows[fused[tensor][0]] = fused_rows.get(fused[tensor][0], 0) + shape[0]
    for tensor, rows in fused_rows.items():
        _check(gguf, name(tensor), (rows, d))
    if cfg.n_ff_shexp:  # Qwen2-MoE's shared expert: its gate's input vector and a SwiGLU FFN
        s = cfg.n_ff_shexp
        _check(gguf, name("ffn_gate_inp_shexp"), (d,), {GGMLQuantizationType.F32})
        for tensor, shape in (("ffn_gate_shexp", (s, d)), ("ffn_up_shexp", (s, d)), ("ffn_down_shexp", (d, s))):
            _check(gguf, name(tensor), shape)
    if not e and name("ffn_down_t") in gguf.tensors:  # PowerInfer: the down projection transposed, one per neuron
        _check(gguf, name("ffn_down_t"), (cfg.n_ff, d))
    elif not e:
        _check(gguf, name("ffn_down"), (cfg.n_ff, d) if per_neuron else (d, cfg.n_ff))
    has_fc1, has_fc2 = name("fc1") in gguf.tensors, name("fc2") in gguf.tensors
    if has_fc1 != has_fc2:
        raise JaxinferError(f"{gguf.path} has {name('fc1' if has_fc1 else 'fc2')} without "
                            f"{name('fc2' if has_fc1 else 'fc1')} (a predictor needs both)")
    if has_fc1:
        rank = tensor_shape(gguf, name("fc1"), 2)[0]
        _check(gguf, name("fc1"), (rank, d))
        _check(gguf, name("fc2"), (cfg.n_ff, rank))


def check_vocabulary(gguf, cfg: Config) -> None:
    """The tokenizer's vocabulary (and `{arch}.vocab_size`, when given) must have one token per embedding row, as
    llama.cpp requires."""
    n_vocab, key = cfg.n_vocab, f"{cfg.arch}.vocab_size"
    try:
        vocab_size = metadata.integer(gguf.metadata, key, n_vocab)
    except JaxinferError as e:
        raise JaxinferError(f"{gguf.path}: {e}") from None
    if vocab_size != n_vocab:
        raise JaxinferError(f"{gguf.path}: {key} is {vocab_size}, token_embd.weight has {n_vocab} rows")
    tokens = gguf.metadata.get(VOCABULARY_KEY)
    if tokens is None:
        return  # reported by the tokenizer, which needs it
    if isinstance(tokens, metadata.LongArray):
        length = tokens.length
    else:
        length = len(tokens) if isinstance(tokens, list) else None
    if length != n_vocab:
        found = "not an array" if length is None else f"{length} tokens"
        raise JaxinferError(f"{gguf.path}: {VOCABULARY_KEY} has {found}, token_embd.weight has {n_vocab} rows")


def check_tensors(gguf, cfg: Config) -> None:
    """Raise a JaxinferError naming the first tensor that does not fit `cfg` (see the module docstring)."""
    check_vocabulary(gguf, cfg)
    for name in gguf.tensors:
        layer = LAYER_NAME.match(name)
        if layer and int(layer.group(1)) >= cfg.n_layer:
            raise JaxinferError(f"{gguf.path} has tensor {shown(name)} but {cfg.arch}.block_count is {cfg.n_layer}")
    _check(gguf, "token_embd.weight", (cfg.n_vocab, cfg.n_embd))
    for i in range(cfg.n_layer):
        _check_layer(gguf, cfg, i)
    _check(gguf, "output_norm.weight", (cfg.n_embd,), {GGMLQuantizationType.F32})
    if "output.weight" in gguf.tensors:
        _check(gguf, "output.weight", (cfg.n_vocab, cfg.n_embd))

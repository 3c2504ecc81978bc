"""Synthetic GGUF models with random weights, written with gguf-py's GGUFWriter: tests and benchmarks need no
downloads. The weights are random, so the text they generate is noise; only shapes, formats and numerics matter.

The vocabulary is byte-level BPE (every byte is a token, plus a few merges and ChatML control tokens), so the
tokenizer, chat template and CLI paths run exactly as with a real model.
"""

import dataclasses

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]


def byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-in character for each byte value, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    n_layer: int = 2
    n_embd: int = 64
    n_ff: int = 128
    n_head: int = 4
    n_head_kv: int = 2
    n_ctx: int = 256
    rope_theta: float = 10000.0
    weight_type: GGMLQuantizationType = GGMLQuantizationType.F32
    embedding_type: GGMLQuantizationType = GGMLQuantizationType.F32
    tied_output: bool = True
    architecture: str = "llama"
    seed: int = 0


def vocabulary() -> tuple[list[str], list[int], list[str]]:
    tokens = CONTROL_TOKENS + byte_level_alphabet() + ["".join(pair) for pair in MERGES]
    types = [gguf.TokenType.CONTROL] * len(CONTROL_TOKENS) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    return tokens, [int(t) for t in types], [" ".join(pair) for pair in MERGES]


def encode_tensor(values: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """f32 [rows, cols] -> the bytes (or float array) GGUFWriter stores for `qtype`.

    gguf-py has no quantizer for K-quants; for those the blocks are random bytes with sane scales, so the stored
    tensor is simply whatever those blocks decode to (the values argument only fixes the shape)."""
    if qtype == GGMLQuantizationType.F32:
        return values.astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    if qtype in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K):
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_blocks = values.size // block_size
        blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
        scale = (np.abs(rng.normal(size=(n_blocks, 2))) * 0.002).astype(np.float16).view(np.uint8)
        if qtype == GGMLQuantizationType.Q4_K:
            blocks[:, 0:4] = scale  # d and dmin
        else:
            blocks[:, 208:210] = scale[:, 0:2]  # d; the int8 sub-block scales stay random
        return blocks.reshape(values.shape[0], -1)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def write_model(path: str, spec: SyntheticSpec = SyntheticSpec()) -> str:
    """Write a random llama-family GGUF described by `spec` to `path` and return the path."""
    rng = np.random.default_rng(spec.seed)
    head_dim = spec.n_embd // spec.n_head
    tokens, token_types, merges = vocabulary()
    n_vocab = len(tokens)

    writer = gguf.GGUFWriter(path, spec.architecture)
    writer.add_name("jaxinfer synthetic model (random weights)")
    writer.add_block_count(spec.n_layer)
    writer.add_context_length(spec.n_ctx)
    writer.add_embedding_length(spec.n_embd)
    writer.add_feed_forward_length(spec.n_ff)
    writer.add_head_count(spec.n_head)
    writer.add_head_count_kv(spec.n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    def matrix(name, rows, cols, qtype):
        values = rng.normal(size=(rows, cols)).astype(np.float32) / np.sqrt(cols)
        writer.add_tensor(name, encode_tensor(values, qtype, rng), raw_dtype=qtype)

    def norm(name):
        writer.add_tensor(name, (1.0 + 0.1 * rng.normal(size=spec.n_embd)).astype(np.float32))

    matrix("token_embd.weight", n_vocab, spec.n_embd, spec.embedding_type)
    for i in range(spec.n_layer):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", spec.n_head * head_dim, spec.n_embd, spec.weight_type)
        matrix(f"blk.{i}.attn_k.weight", spec.n_head_kv * head_dim, spec.n_embd, spec.weight_type)
        matrix(f"blk.{i}.attn_v.weight", spec.n_head_kv * head_dim, spec.n_embd, spec.weight_type)
        matrix(f"blk.{i}.attn_output.weight", spec.n_embd, spec.n_head * head_dim, spec.weight_type)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", spec.n_ff, spec.n_embd, spec.weight_type)
        matrix(f"blk.{i}.ffn_up.weight", spec.n_ff, spec.n_embd, spec.weight_type)
        matrix(f"blk.{i}.ffn_down.weight", spec.n_embd, spec.n_ff, spec.weight_type)
    norm("output_norm.weight")
    if not spec.tied_output:
        matrix("output.weight", n_vocab, spec.n_embd, spec.embedding_type)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path

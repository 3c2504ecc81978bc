"""Pieces of the forward that only some architectures use (config.ARCHITECTURES), kept out of model.py so that it
reads as the model: sliding-window attention, and the checks of the tensors these blocks add.

Sliding-window attention (Gemma 3's local layers): the query at position p sees the keys at positions
p - window + 1 .. p, as llama.cpp's LLAMA_SWA_TYPE_STANDARD masks them (p - p_key >= window is masked). It runs here,
in XLA, only where keys can be further apart than the window (a cache longer than it, a prompt longer than it);
closer keys are all visible, so the plan's attention kernels serve those calls unchanged.
"""

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from jaxinfer import attention
from jaxinfer.config import ARCHITECTURES
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_reader import shown
from jaxinfer.validate import LAYER_NAME, tensor_shape


def _attend(q, k, v, mask, softcap: float):
    """q [B, T, H, hd]; k, v [B, S, H_kv, hd]; mask [B, T, S] -> [B, T, H, hd]: softmax attention where mask, the
    scores soft-capped by `softcap` (attention.soft_cap)."""
    b, t, h, hd = q.shape
    n_kv = k.shape[2]
    grouped = q.reshape(b, t, n_kv, h // n_kv, hd)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k.astype(jnp.float32)) / jnp.sqrt(jnp.float32(hd))
    scores = attention.soft_cap(scores, softcap)
    probs = jax.nn.softmax(jnp.where(mask[:, None, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32)).reshape(b, t, h, hd)


def sliding_attention(q, keys, values, q_pos, window: int, layer=None, row=0, softcap: float = 0.0):
    """Causal attention of q [B, T, H, hd] at q_pos to the last `window` positions (the query's own included), as
    model.attention_kernel's arguments: keys/values the T tokens' own [B, T, H_kv, hd] at positions q_pos [T], or
    with `layer` the whole KV caches [n_layer, S, max_len, H_kv, hd], query row b against cache row row + b filled up
    to q_pos[b, -1] (q_pos [B, T]). From a cache, each row reads only the window + T - 1 positions its queries can
    see: a decode step costs the window, not the context. The scores are soft-capped by `softcap`."""
    if layer is None:
        visible = (q_pos[None, :] <= q_pos[:, None]) & (q_pos[None, :] > q_pos[:, None] - window)  # [T, S]
        return _attend(q, keys, values, jnp.broadcast_to(visible, (q.shape[0],) + visible.shape), softcap)
    b, t = q.shape[:2]
    max_len, n_kv, hd = keys.shape[2:]
    span = min(window + t - 1, max_len)
    q_pos = jnp.broadcast_to(q_pos, (b, t))
    start = jnp.clip(q_pos[:, 0] - window + 1, 0, max_len - span)  # [B]: the first position a row's queries see

    def rows(cache):
        def one(i, first):
            return jax.lax.dynamic_slice(cache, (layer, row + i, first, 0, 0), (1, 1, span, n_kv, hd))[0, 0]

        return jax.vmap(one)(jnp.arange(b), start)  # [B, span, H_kv, hd]

    k_pos = start[:, None] + jnp.arange(span)  # [B, span]
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] > q_pos[:, :, None] - window)
    return _attend(q, rows(keys), rows(values), visible, softcap)


# Tensors some blocks add, beside those validate.check_tensors checks: blk.N.<name>.weight|bias -> the config
# attribute that requires it (None: optional, used where present) and its length.
def _layer_vectors(cfg) -> dict[str, tuple[bool, int]]:
    """{tensor name within blk.N: (required, length)} of the F32 vectors a layer of `cfg` may hold."""
    q_rows, kv_rows = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    return {"attn_q.bias": (False, q_rows), "attn_k.bias": (False, kv_rows), "attn_v.bias": (False, kv_rows),
            **({"attn_q_norm.weight": (True, cfg.head_dim), "attn_k_norm.weight": (True, cfg.head_dim)}
               if cfg.qk_norm else {}),
            **({"post_attention_norm.weight": (True, cfg.n_embd), "post_ffw_norm.weight": (True, cfg.n_embd)}
               if cfg.post_norms else {}),
            **({"attn_norm.bias": (True, cfg.n_embd)} if cfg.layer_norm else {})}


def _layer_matrices(cfg) -> set[str]:
    """The llama block's tensors (within blk.N) with those of the architecture's own layout (Config.fused_parts): a
    fused attn_qkv anywhere; Phi-3's and Falcon's FFN have no ffn_gate, Falcon's parallel block no ffn_norm."""
    known = LLAMA_LAYER_TENSORS | {"attn_qkv.weight"}
    if cfg.ffn_layout != "gated":
        known -= {"ffn_gate.weight", "ffn_gate.scale"}
    return known - {"ffn_norm.weight"} if cfg.parallel_block else known


# Every other tensor a layer may hold, checked by validate.check_tensors (the llama block, PowerInfer's, BitNet's).
LLAMA_LAYER_TENSORS = {f"{name}.weight" for name in (
    "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
    "ffn_down_t", "fc1", "fc2", "attn_sub_norm", "ffn_sub_norm")} | {f"{name}.scale" for name in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
GLOBAL_TENSORS = {"token_embd.weight", "output_norm.weight", "output.weight", "rope_freqs.weight"}
# Phi-3.5/Phi-4 mini's LongRoPE: frequency factors llama.cpp picks by the context's length, with an attention factor.
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# A mixture of experts' layer holds these in place of the llama FFN's (moe.py).
DENSE_FFN_TENSORS = {f"{name}.weight" for name in ("ffn_gate", "ffn_up", "ffn_down", "ffn_down_t", "fc1", "fc2")} | {
    "ffn_gate.scale", "ffn_up.scale", "ffn_down.scale"}
EXPERT_TENSORS = {f"{name}.weight" for name in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
# A shared expert beside them (Qwen2-MoE's): its gate's input vector and its SwiGLU FFN.
SHARED_EXPERT_TENSORS = {f"{name}.weight" for name in ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp",
                                                        "ffn_down_shexp")}


def _check_vector(gguf, name: str, length: int) -> None:
    found = tensor_shape(gguf, name, 1)
    if found != (length,):
        raise JaxinferError(f"{gguf.path}: tensor {name} has shape {list(found)}, the model's metadata implies "
                            f"[{length}]")
    qtype = gguf.tensors[name].tensor_type
    if qtype != GGMLQuantizationType.F32:
        raise JaxinferError(f"{gguf.path}: tensor {name} has type {GGMLQuantizationType(qtype).name}, expected F32")


def rope_freq_factors(gguf, cfg) -> tuple[float, ...]:
    """The factors of rope_freqs.weight (Llama 3.x's RoPE scaling): one positive, finite F32 value per rotated
    pair."""
    _check_vector(gguf, "rope_freqs.weight", cfg.rope_dim // 2)
    factors = np.asarray(gguf.tensors["rope_freqs.weight"].data, np.float32).reshape(-1)
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise JaxinferError(f"{gguf.path}: tensor rope_freqs.weight holds factors that are not positive and finite")
    return tuple(float(f) for f in factors)


def unused_tensors(gguf, cfg) -> list[str]:
    """The tensors of the file that its architecture reads past (Architecture.unused_tensors)."""
    known = ARCHITECTURES.get(cfg.arch)
    return [name for name in (known.unused_tensors if known else ()) if name in gguf.tensors]


def check_block_tensors(gguf, cfg) -> None:
    """The tensors the architecture's blocks add (biases, QK-norms, post-norms, rope_freqs) against `cfg`, and
    every tensor of the file one jaxinfer computes with: a tensor it would not read could change what the model
    computes (llama.cpp's rope_freqs did before it was read), so a file with one is refused, naming it."""
    vectors = _layer_vectors(cfg)
    for i in range(cfg.n_layer):
        for name, (required, length) in vectors.items():
            if required or f"blk.{i}.{name}" in gguf.tensors:
                _check_vector(gguf, f"blk.{i}.{name}", length)
    if "rope_freqs.weight" in gguf.tensors:
        _check_vector(gguf, "rope_freqs.weight", cfg.rope_dim // 2)
    if any(name in gguf.tensors for name in LONGROPE_TENSORS):
        raise JaxinferError(f"{gguf.path} has LongRoPE factors (rope_factors_long/short.weight: Phi-3.5/Phi-4 mini's "
                            f"long-context RoPE scaling), which jaxinfer does not implement")
    global_tensors = GLOBAL_TENSORS | set(unused_tensors(gguf, cfg))
    if cfg.layer_norm:
        _check_vector(gguf, "output_norm.bias", cfg.n_embd)
        global_tensors = global_tensors | {"output_norm.bias"}
    for i in range(cfg.n_layer):
        if f"blk.{i}.attn_qkv.weight" in gguf.tensors and f"blk.{i}.attn_q.weight" in gguf.tensors:
            raise JaxinferError(f"{gguf.path}: blk.{i} has both attn_qkv and attn_q (llama.cpp reads only the fused "
                                f"one): refused as ambiguous")
    known = _layer_matrices(cfg) | set(vectors)
    if cfg.n_expert:
        known = (known - DENSE_FFN_TENSORS) | EXPERT_TENSORS | (SHARED_EXPERT_TENSORS if cfg.n_ff_shexp else set())
    for name in gguf.tensors:
        layer = LAYER_NAME.match(name)
        if (name[layer.end():] not in known) if layer else name not in global_tensors:
            raise JaxinferError(f"{gguf.path} has tensor {shown(name)}, which jaxinfer does not compute with for "
                                f"{cfg.arch}: refused rather than run without it")

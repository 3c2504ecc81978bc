"""The llama-family transformer as pure functions over registered dataclass pytrees.

    tokens -> embed -> n_layer x [ rms_norm -> attention (RoPE, GQA, KV cache) -> +residual
                                   rms_norm -> gated FFN (sparse_ffn.py)        -> +residual ] -> rms_norm -> logits

Every architecture (config.ARCHITECTURES) is this one forward with options, each read where it applies:
  * QKV biases (Qwen2) where the file holds them; per-head RMSNorm of q and k before RoPE (cfg.qk_norm: Qwen3,
    Gemma 3); a query scale other than 1/sqrt(head_dim) (cfg.query_scale);
  * BitNet's sub-norms (cfg.sub_norms): an RMSNorm of the attention's heads before attn_output and one of the FFN's
    hidden values before ffn_down; its per-projection scales are the weights' own (QuantArray.scale);
  * Gemma's embedding scale (cfg.embed_scale) and norms of the attention's and FFN's outputs (cfg.post_norms);
  * sliding-window layers (cfg.window(i)) with their own RoPE base (blocks.py); RoPE frequency factors and linear
    scaling (cfg.rope_freq_factors, cfg.rope_freq_scale); attention and final logit soft-capping (cfg.attn_softcap,
    cfg.final_softcap: Gemma 2);
  * Falcon's parallel block (cfg.parallel_block: attention and FFN read one norm and join the residual together)
    and LayerNorm with bias (cfg.layer_norm); fused tensors (attn_qkv, Phi-3's ffn_up) are cut into the fields at
    load (Config.fused_parts), and an FFN without a gate (Falcon's) has no ffn_up;
  * a mixture of experts in place of the FFN (cfg.n_expert: Qwen3-MoE, Mixtral, SmallThinker), routed inside the
    step (moe.py), by a router that reads the FFN's normed input or the layer's input (SmallThinker); layers
    without RoPE (cfg.rotates: SmallThinker's global layers).

Weights keep GGUF's [out, in] layout and storage format; `quant.matmul` hides the format. Activations are f32.
How it runs here (which kernels, where a split's parts live) is `cfg.plan`, decided once at load (plan.py).
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import attention, blocks, moe, sharding, sparse_ffn
from jaxinfer.config import CACHE_TYPES, Config
from jaxinfer.plan import SOFT_CAPPING_ATTENTION
from pallas_kernels import attention as flash_attention
from jaxinfer.quant import QuantArray, cpu_kernels, matmul, matmuls, products


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
    attn_norm: jax.Array  # [d]
    attn_q: QuantArray  # [n_head * hd, d]
    attn_k: QuantArray  # [n_head_kv * hd, d]
    attn_v: QuantArray  # [n_head_kv * hd, d]
    attn_output: QuantArray  # [d, n_head * hd]
    ffn_norm: jax.Array | None  # [d]; None in a parallel block (cfg.parallel_block: the FFN reads attn_norm's)
    ffn_gate: QuantArray | None  # [n_ff, d]; None in a mixture of experts (`experts` instead)
    ffn_up: QuantArray | None  # [n_ff, d]; None for an FFN without a gate (Falcon): h = gate_act(ffn_gate x)
    ffn_down: QuantArray | None  # [d, n_ff]; PowerInfer files store ffn_down_t instead
    ffn_down_t: QuantArray | None = None  # [n_ff, d], one row per neuron
    fc1: QuantArray | None = None  # [rank, d] activation predictor (PowerInfer), when the file has one
    fc2: QuantArray | None = None  # [n_ff, rank]
    ffn_threshold: jax.Array | None = None  # f32 []: calibrated sparsity threshold (sparse_ffn "gate"/"hidden")
    # A split model's FFN neurons in parts, hot in device memory and cold in host memory (sparse_ffn.FFNPart,
    # hybrid.py); ffn_gate, ffn_up, ffn_down and ffn_down_t are then None, and fc2's rows come part after part.
    ffn_parts: list | None = None
    attn_sub_norm: jax.Array | None = None  # [n_head * hd], BitNet (cfg.sub_norms)
    ffn_sub_norm: jax.Array | None = None  # [n_ff], BitNet
    attn_norm_b: jax.Array | None = None  # [d], LayerNorm's bias (cfg.layer_norm: Falcon)
    attn_q_bias: jax.Array | None = None  # [n_head * hd], where the file has one (Qwen2)
    attn_k_bias: jax.Array | None = None  # [n_head_kv * hd]
    attn_v_bias: jax.Array | None = None  # [n_head_kv * hd]
    attn_q_norm: jax.Array | None = None  # [hd], each head of q (cfg.qk_norm)
    attn_k_norm: jax.Array | None = None  # [hd]
    attn_post_norm: jax.Array | None = None  # [d], the attention's output (cfg.post_norms)
    ffn_post_norm: jax.Array | None = None  # [d], the FFN's output
    experts: moe.Experts | None = None  # the FFN as a mixture of experts (cfg.n_expert): router and experts


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    token_embd: QuantArray  # [n_vocab, d]
    layers: list[Layer]
    output_norm: jax.Array  # [d]
    output: QuantArray  # [n_vocab, d]; the embedding itself when the model ties them
    output_norm_b: jax.Array | None = None  # [d], LayerNorm's bias (cfg.layer_norm)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [n_layer, B, max_len, n_head_kv, hd]
    v: jax.Array  # [n_layer, B, max_len, n_head_kv, hd]
    length: jax.Array  # int32 [B]: positions filled so far, per sequence (rows may be at different depths)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def init_cache(cfg: Config, batch: int, max_len: int) -> KVCache:
    shape = (cfg.n_layer, batch, max_len, cfg.n_head_kv, cfg.head_dim)
    dtype = CACHE_TYPES[cfg.cache_type]
    cache = KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))
    return sharding.shard_cache(cache, cfg.plan)


def rms_norm(x, gamma, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * gamma


def norm(x, gamma, beta, cfg: Config):
    """A block's input norm and the final one: RMSNorm, or with cfg.layer_norm LayerNorm ((x - mean) / sqrt(var +
    eps) * gamma + beta, llama.cpp's LLM_NORM)."""
    if not cfg.layer_norm:
        return rms_norm(x, gamma, cfg.rms_eps)
    out = rms_norm(x - jnp.mean(x, axis=-1, keepdims=True), gamma, cfg.rms_eps)
    return out if beta is None else out + beta


def rope_rotation(positions, cfg: Config, sliding: bool = False):
    """(cos, sin) [(B,) T, 1, rope_dim / 2] of the angles pos * scale * theta^(-2i/rope_dim) / factor_i at positions
    [T] (every row alike) or [B, T], for the q and k of every layer, or with `sliding` of the sliding-window layers
    (their own base and scaling, no frequency factors, as llama.cpp)."""
    # Positions known when tracing (numpy: a window without a cache) give constants. Traced ones are computed in the
    # program, where XLA takes the sines again in each layer's q and k fusion (a perplexity batch of the default
    # model spent 2.7% of its time in sincosf so).
    xp = np if isinstance(positions, np.ndarray) else jnp
    theta = cfg.rope_theta_swa if sliding else cfg.rope_theta
    inv_freq = theta ** (-xp.arange(0, cfg.rope_dim, 2, dtype=np.float32) / cfg.rope_dim)
    scale = cfg.rope_freq_scale_swa
    if not sliding:
        scale = cfg.rope_freq_scale
        if cfg.rope_freq_factors is not None:
            inv_freq = inv_freq / np.asarray(cfg.rope_freq_factors, np.float32)
    angle = positions.astype(np.float32)[..., None] * np.float32(scale) * inv_freq  # [(B,) T, rope_dim / 2]
    return xp.cos(angle)[..., None, :], xp.sin(angle)[..., None, :]  # broadcast over the heads


def rope(x, rotation, cfg: Config):
    """Rotate pairs of each head's values, pair i by its angle in `rotation` (rope_rotation). llama.cpp's "NORM" RoPE
    pairs adjacent values (x[2i], x[2i+1]), which is what GGUF llama weights expect (their q/k rows are permuted at
    conversion; rotate-half gives a ~20x worse PPL); its "NEOX" RoPE (cfg.rope_type, BitNet) pairs the halves
    (x[i], x[i + rope_dim/2]). x [B, T, H, hd]; only the first rope_dim dims of each head rotate."""
    cos, sin = rotation
    rot, rest = x[..., : cfg.rope_dim], x[..., cfg.rope_dim :]
    pair_axis = -2 if cfg.rope_type == "neox" else -1  # [.., 2, rope_dim / 2] halves, or [.., rope_dim / 2, 2]
    pairs = rot.reshape(*rot.shape[:-1], 2, -1) if cfg.rope_type == "neox" else rot.reshape(*rot.shape[:-1], -1, 2)
    x1, x2 = jnp.take(pairs, 0, axis=pair_axis), jnp.take(pairs, 1, axis=pair_axis)
    rotated = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=pair_axis).reshape(rot.shape)
    return jnp.concatenate([rotated, rest], axis=-1)


def attend(q, k, v, q_pos, k_pos):
    """Causal GQA softmax attention, in one piece: the plain reference every attention kernel is tested against.
    q [B, T, H, hd]; k, v [B, S, H_kv, hd]; q_pos [T], k_pos [S] -> [B, T, H, hd]."""
    b, t, h, hd = q.shape
    n_kv = k.shape[2]
    q = q.reshape(b, t, n_kv, h // n_kv, hd)  # query head j uses KV head j // (h / n_kv)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) / jnp.sqrt(jnp.float32(hd))
    scores = jnp.where(k_pos[None, :] <= q_pos[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(b, t, h, hd)


def attention_kernel(q, keys, values, q_pos, cfg: Config, layer=None, row=0, window=None):
    """Attention as the plan says (Plan.attention); all give `attend`'s result. keys/values are the T new tokens' own
    [B, T, H_kv, hd] at positions q_pos [T] (no cache), or, with `layer`, the whole KV caches
    [n_layer, S, max_len, H_kv, hd] of which the batch is rows row .. row + B - 1, row row + b filled up to
    q_pos[b, -1] (q_pos [B, T]: each row at its own depth). A sliding-window layer (`window`) attends through cpu_ext's
    kernel, which takes the window, or where its keys can be further apart than its window through
    blocks.sliding_attention. Attention logit soft-capping (cfg.attn_softcap) is computed by cpu_ext's and XLA's
    attention, not by Pallas's kernels: a GPU plan of such a model names XLA's (plan.soft_capping)."""
    softcap, plan = cfg.attn_softcap, cfg.plan
    if window is not None and plan.attention != "cpu_ext" and keys.shape[2 if layer is not None else 1] > window:
        return blocks.sliding_attention(q, keys, values, q_pos, window, layer, row, softcap)
    if softcap and plan.attention not in SOFT_CAPPING_ATTENTION:
        raise ValueError(f"attention logit soft-capping needs one of {SOFT_CAPPING_ATTENTION}, the plan says "
                         f"{plan.attention}")
    starts = q_pos[..., 0]  # [B] with a cache, else the scalar 0
    batch = q.shape[0]
    if plan.attention in ("pallas", "pallas_interpret"):
        interpret = plan.attention == "pallas_interpret"
        if layer is not None:
            keys = jax.lax.dynamic_slice_in_dim(keys[layer], row, batch)
            values = jax.lax.dynamic_slice_in_dim(values[layer], row, batch)
        if q.shape[1] == 1:
            return flash_attention.decode_attention(q[:, 0], keys, values, starts, interpret=interpret)[:, None]
        return flash_attention.attention(q, keys, values, starts, interpret=interpret)
    if plan.attention == "cpu_ext":  # reads only the window's keys of a sliding-window layer
        options = {"window": window or 0, "softcap": softcap}
        if layer is None:  # the T tokens' own keys: a cache of one layer, T positions
            return cpu_kernels().cached_attention(q, keys[None], values[None], 0, starts, **options)
        return cpu_kernels().cached_attention(q, keys, values, layer, starts, row, **options)
    if layer is not None:
        return attention.cached_attention(q, keys, values, layer, q_pos, row=row,
                                          max_batch_mib=plan.attn_max_batch_mib, softcap=softcap)
    return attention.attention(q, keys, values, q_pos, q_pos, max_batch_mib=plan.attn_max_batch_mib, softcap=softcap)


def attention_block(x, layer: Layer, index: int, positions, rotation, cache: KVCache | None, cfg: Config,
                    written=None, row=0):
    """x [B, T, d] at `positions` ([T] without a cache, [B, T] with one; `rotation` their rope_rotation) -> ([B, T, d],
    cache with this layer's K/V written at those positions of its rows row .. row + B - 1). `written` [B, T] bool, if
    given, says which tokens' K/V are written; the others are not (a row sitting out a prefill chunk, padding)."""
    b, t, _ = x.shape
    q, k, v = matmuls(x, (layer.attn_q, layer.attn_k, layer.attn_v))
    q, k, v = (p if bias is None else p + bias for p, bias in ((q, layer.attn_q_bias), (k, layer.attn_k_bias),
                                                              (v, layer.attn_v_bias)))
    # Heads counted from the products: all of them, or one device's share under tensor parallelism (sharding.py).
    q, k, v = (p.reshape(b, t, -1, cfg.head_dim) for p in (q, k, v))
    if cfg.qk_norm:
        q, k = rms_norm(q, layer.attn_q_norm, cfg.rms_eps), rms_norm(k, layer.attn_k_norm, cfg.rms_eps)
    if rotation is not None:  # None: a NoPE layer (cfg.rotates)
        q, k = rope(q, rotation, cfg), rope(k, rotation, cfg)
    if cfg.query_scale is not None:  # every attention kernel divides q·k by sqrt(head_dim)
        q = q * np.float32(cfg.query_scale * np.sqrt(cfg.head_dim))
    window = cfg.window(index)
    if cache is None:
        out = attention_kernel(q, k, v, positions, cfg, window=window)
    else:
        # Each token's K/V goes to its row's own position, written into the whole donated cache in place (slicing
        # out a layer and writing it back copies it). Tokens not written are sent past the cache, each to its own
        # position so that the indices stay unique as promised, and dropped.
        at = positions if written is None else jnp.where(written, positions, cache.max_len + jnp.arange(t))
        rows = row + jnp.arange(b)[:, None]
        cache = dataclasses.replace(
            cache,
            k=cache.k.at[index, rows, at].set(k.astype(cache.k.dtype), mode="drop", unique_indices=True),
            v=cache.v.at[index, rows, at].set(v.astype(cache.v.dtype), mode="drop", unique_indices=True),
        )
        out = attention_kernel(q, cache.k, cache.v, positions, cfg, layer=index, row=row, window=window)
    out = out.reshape(b, t, -1)
    if layer.attn_sub_norm is not None:
        out = rms_norm(out, layer.attn_sub_norm, cfg.rms_eps)
    return sharding.all_reduce(matmul(out, layer.attn_output), cfg.plan), cache


def forward(tokens, weights: Weights, cfg: Config, cache: KVCache | None = None, observe=None, n_valid=None, row=0):
    """tokens [B, T], row b placed after its cache row's length filled positions -> (final-normed hidden [B, T, d],
    cache, observed). The batch is the cache's rows row .. row + B - 1 (row 0 and B rows: the whole cache; one row:
    a server's slot); each needs room for all T: length + T <= max_len.

    Without a cache the T tokens attend causally to each other only. The cache's `length` is left to the caller,
    which knows how many of the T positions are real (prefill pads prompts to a few compiled lengths); given
    `n_valid` [B], only the first n_valid[b] tokens of batch row b write K/V (0: the row's cache is left as it was,
    and it attends from position 0: a row sitting out costs no attention over its context).
    `observe(layer_index, sparse_ffn.FFNTrace) -> pytree`, if given, is called in every layer and `observed` is the
    list of its results: profiling and calibration see exactly what inference computes.
    With the weights cut over several devices (cfg.plan.tp) it runs on each over its shards (sharding.py)."""
    with products(cfg.plan.products):
        return sharding.forward_on_shards(_forward, tokens, weights, cfg, cache, observe, n_valid, row)


def _forward(tokens, weights: Weights, cfg: Config, cache: KVCache | None, observe, n_valid, row):
    steps = np.arange(tokens.shape[1], dtype=np.int32)
    positions, written = steps, None  # [T] without a cache, else [B, T]: each row at its own depth
    if cache is not None:
        length = jax.lax.dynamic_slice_in_dim(cache.length, row, tokens.shape[0])
        if n_valid is not None:
            written = steps < n_valid[:, None]
            length = jnp.where(n_valid > 0, length, 0)
        positions = length[:, None] + steps
    x = sharding.embed(weights.token_embd, tokens, cfg.plan)
    if cfg.embed_scale != 1.0:
        x = x * np.float32(cfg.embed_scale)
    rotations = {False: rope_rotation(positions, cfg)}
    if cfg.swa_layers:
        rotations[True] = rope_rotation(positions, cfg, sliding=True)
    observed = []
    for index, layer in enumerate(weights.layers):
        with jax.named_scope(f"layer_{index}"):
            normed = norm(x, layer.attn_norm, layer.attn_norm_b, cfg)
            rotation = rotations[cfg.window(index) is not None] if cfg.rotates(index) else None
            attn_out, cache = attention_block(normed, layer, index, positions, rotation, cache, cfg, written, row)
            router_input = x if cfg.router_reads_layer_input else None  # SmallThinker's: the layer's input
            if not cfg.parallel_block:  # Falcon's FFN reads the attention's input, both join the residual at once
                x = x + _post_norm(attn_out, layer.attn_post_norm, cfg)
                normed = rms_norm(x, layer.ffn_norm, cfg.rms_eps)
            hidden_norm = None if layer.ffn_sub_norm is None else partial(rms_norm, gamma=layer.ffn_sub_norm,
                                                                          eps=cfg.rms_eps)
            if layer.experts is not None:
                ffn_out, trace = moe.ffn(normed, layer.experts, cfg, trace=observe is not None,
                                         router_input=router_input)
            else:
                ffn_out, trace = sparse_ffn.ffn(normed, x, layer, cfg, trace=observe is not None,
                                                hidden_norm=hidden_norm)
            ffn_out = _post_norm(sharding.all_reduce(ffn_out, cfg.plan), layer.ffn_post_norm, cfg)
            x = x + (ffn_out + attn_out if cfg.parallel_block else ffn_out)
            if observe is not None:
                observed.append(observe(index, trace))
    return norm(x, weights.output_norm, weights.output_norm_b, cfg), cache, observed


def _post_norm(out, gamma, cfg: Config):
    """A block's output as it joins the residual: RMS-normed where the layer has a post-norm (cfg.post_norms)."""
    return out if gamma is None else rms_norm(out, gamma, cfg.rms_eps)


def logits(hidden, weights: Weights, cfg: Config):
    """Final-normed hidden [..., d] -> logits [..., n_vocab], soft-capped to (-c, c) where cfg.final_softcap is c."""
    with products(cfg.plan.products):
        out = sharding.head_on_shards(matmul, hidden, weights.output, cfg.plan)
    return attention.soft_cap(out, cfg.final_softcap)


@partial(jax.jit, donate_argnames=("cache",))
def prefill(tokens, n_valid, weights: Weights, cache: KVCache, cfg: Config, row=0):
    """tokens [B, T] of which the first `n_valid` ([B], or one count for every row) of each row are real, for the
    cache's rows row .. row + B - 1 -> (logits [B, n_vocab] after each row's last real one, cache with those rows
    advanced by n_valid). Rows at different depths and with different prompt lengths prefill together; padding
    writes nothing, and a row with n_valid 0 keeps its cache and length as they were (its logits mean nothing): a
    sequence that sits out a chunk. The cache's other rows are untouched: one slot of a server prefills alone."""
    batch = tokens.shape[0]
    n_valid = jnp.broadcast_to(jnp.asarray(n_valid, jnp.int32), (batch,))
    hidden, cache, _ = forward(tokens, weights, cfg, cache, n_valid=n_valid, row=row)
    last = jnp.take_along_axis(hidden, jnp.maximum(n_valid - 1, 0)[:, None, None], axis=1)[:, 0]
    length = jax.lax.dynamic_slice_in_dim(cache.length, row, batch) + n_valid
    return logits(last, weights, cfg), dataclasses.replace(
        cache, length=jax.lax.dynamic_update_slice_in_dim(cache.length, length, row, 0))


@partial(jax.jit, donate_argnames=("cache",))
def decode_step(tokens, weights: Weights, cache: KVCache, cfg: Config, active=None):
    """tokens [B] for the cache's first B rows (all of them, or a server's busy slots) -> (logits [B, n_vocab] for
    each row's next position, those rows advanced by one). Given `active` [B] bool, rows not active write nothing
    and keep their length (their logits mean nothing): a server's slots that are prefilling or done."""
    batch = tokens.shape[0]
    n_valid = jnp.ones(batch, jnp.int32) if active is None else active.astype(jnp.int32)
    hidden, cache, _ = forward(tokens[:, None], weights, cfg, cache, n_valid=None if active is None else n_valid)
    return logits(hidden[:, 0], weights, cfg), dataclasses.replace(cache, length=cache.length.at[:batch].add(n_valid))

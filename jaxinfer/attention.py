"""Causal GQA attention with a bound on the size of its K·Q scores tensor (ik_llama.cpp's `-amb`/`--attn-max-batch`).

Plain attention materialises scores of B·H·T·S·4 bytes (f32): 144 MiB per layer for a 512-token micro-batch of a
9-head model against an 8192-token cache, 2 GiB for a 64-head model at 16k. When that exceeds `max_batch_mib`,
`attention` computes it in steps, each over whole KV groups (one KV head with all of its query heads, so K/V are
never repeated) and, when even one KV group is over the limit, over chunks of the query axis too (ik_llama.cpp
splits heads only, so a single head can exceed its limit). Steps run in a `lax.fori_loop` that writes into one
preallocated output, so XLA holds one step's scores at a time.

Steps are all the same size (one compiled body). When the step count does not divide the heads (or queries), the
last step starts earlier and recomputes a few heads (queries) of the previous one, writing identical values.

The bound is on the K·Q tensor, the quantity ik_llama.cpp bounds; XLA's temporary memory for a step is a small
multiple of it (scores and probabilities; see scripts/bench_attention_memory.py).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

MIB = 2**20
SCORE_BYTES = 4  # scores are f32
# ik_llama.cpp's default `-amb` (common/common.h): at 512 queries against 8192 keys, 16 heads' scores.
IK_LLAMA_DEFAULT_MIB = 256.0


def scores_bytes(batch: int, n_head: int, n_query: int, n_key: int) -> int:
    """Bytes of the f32 K·Q scores tensor [B, H, T, S] of one attention call."""
    return batch * n_head * n_query * n_key * SCORE_BYTES


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """How `attention` splits one call: steps of `kv_heads_per_step` KV heads × `queries_per_step` queries."""

    kv_heads_per_step: int
    queries_per_step: int
    head_steps: int
    query_steps: int
    step_bytes: int  # the K·Q scores of one step
    total_bytes: int  # the K·Q scores of the unsplit call

    @property
    def steps(self) -> int:
        return self.head_steps * self.query_steps


def _even_split(n: int, most_per_step: int) -> tuple[int, int]:
    """(per_step, steps): the fewest steps of at most `most_per_step` covering n, with the smallest equal step size."""
    steps = math.ceil(n / most_per_step)
    return math.ceil(n / steps), steps


def plan_attention(batch: int, n_query: int, n_key: int, n_head: int, n_head_kv: int,
                   max_batch_mib: float | None) -> AttentionPlan:
    """The split `attention` uses for q [batch, n_query, n_head, hd] against k/v [batch, n_key, n_head_kv, hd].

    Whole KV groups first; queries are chunked only when one KV group alone exceeds the limit. The smallest step,
    one query of one KV group (batch·group·n_key·4 bytes), is the floor: a smaller limit is exceeded by that step."""
    group = n_head // n_head_kv
    total = scores_bytes(batch, n_head, n_query, n_key)
    if max_batch_mib is None or total <= max_batch_mib * MIB:
        return AttentionPlan(n_head_kv, n_query, 1, 1, total, total)
    limit = max_batch_mib * MIB
    per_kv_head = scores_bytes(batch, group, n_query, n_key)
    if per_kv_head <= limit:
        kv_per_step, head_steps = _even_split(n_head_kv, int(limit // per_kv_head))
        queries, query_steps = n_query, 1
    else:
        kv_per_step, head_steps = 1, n_head_kv
        per_query = scores_bytes(batch, group, 1, n_key)
        queries, query_steps = _even_split(n_query, max(1, int(limit // per_query)))
    step = scores_bytes(batch, kv_per_step * group, queries, n_key)
    return AttentionPlan(kv_per_step, queries, head_steps, query_steps, step, total)


def default_max_batch_mib(n_head: int, n_head_kv: int, n_ctx: int, n_ubatch: int, batch: int = 1) -> float:
    """The limit to use when the user gives none: ik_llama.cpp's 256 MiB, raised to one KV group's scores at full
    context when that is larger, so that by default attention is split by heads only, as ik_llama.cpp does, and
    never pays for query chunks (smaller matmuls, more loop steps) unless asked to.

    The default model (SmolLM2-135M: 9 heads, 3 KV heads, context 8192) with a 512-token micro-batch needs
    9·512·8192·4 B = 144 MiB, under 256 MiB: it is never split by default, so the limit costs it nothing."""
    one_group = scores_bytes(batch, n_head // n_head_kv, n_ubatch, n_ctx) / MIB
    return max(IK_LLAMA_DEFAULT_MIB, one_group)


def soft_cap(scores, cap: float):
    """cap * tanh(scores / cap), llama.cpp's logit soft-capping (Gemma 2), where cap > 0; else scores unchanged."""
    return cap * jnp.tanh(scores / cap) if cap else scores


def _attend_grouped(q, k, v, q_pos, k_pos, softcap: float = 0.0):
    """q [B, T, Hkv, G, hd]; k, v [B, S, Hkv, hd] -> [B, T, Hkv, G, hd]: model.attend on grouped query heads, the
    scores soft-capped by `softcap`."""
    scores = soft_cap(jnp.einsum("btkgd,bskd->bkgts", q, k) / jnp.sqrt(jnp.float32(q.shape[-1])), softcap)
    scores = jnp.where(k_pos[None, :] <= q_pos[:, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v)


def attention(q, k, v, q_pos, k_pos, *, max_batch_mib: float | None = None, softcap: float = 0.0):
    """Causal GQA softmax attention, as `model.attend`, with K·Q scores of at most `max_batch_mib` MiB per step
    (None: no limit), soft-capped by `softcap` (soft_cap). q [B, T, H, hd]; k, v [B, S, H_kv, hd]; q_pos [T],
    k_pos [S] -> [B, T, H, hd]."""
    b, t, h, hd = q.shape
    s, n_kv = k.shape[1], k.shape[2]
    assert h % n_kv == 0, f"{h=} query heads must be a multiple of {n_kv=} KV heads"
    plan = plan_attention(b, t, s, h, n_kv, max_batch_mib)
    grouped = q.reshape(b, t, n_kv, h // n_kv, hd)  # query head j uses KV head j // (h / n_kv)
    if plan.steps == 1:
        return _attend_grouped(grouped, k, v, q_pos, k_pos, softcap).reshape(b, t, h, hd)
    heads, queries = plan.kv_heads_per_step, plan.queries_per_step

    def step(i, out):
        # The last step of each axis is pulled back to end at the edge (see the module docstring).
        head = jnp.minimum((i // plan.query_steps) * heads, n_kv - heads)
        first = jnp.minimum((i % plan.query_steps) * queries, t - queries)
        q_step = jax.lax.dynamic_slice_in_dim(jax.lax.dynamic_slice_in_dim(grouped, head, heads, 2), first, queries, 1)
        k_step = jax.lax.dynamic_slice_in_dim(k, head, heads, 2)
        v_step = jax.lax.dynamic_slice_in_dim(v, head, heads, 2)
        pos_step = jax.lax.dynamic_slice_in_dim(q_pos, first, queries)
        o_step = _attend_grouped(q_step, k_step, v_step, pos_step, k_pos, softcap)
        return jax.lax.dynamic_update_slice(out, o_step, (0, first, head, 0, 0))

    out_dtype = jnp.promote_types(jnp.float32, v.dtype)  # what the unsplit path returns
    out = jax.lax.fori_loop(0, plan.steps, step, jnp.zeros(grouped.shape, out_dtype))
    return out.reshape(b, t, h, hd)


# Keys per step of `cached_attention` when the limit allows: a decode step within the first 256 positions reads one
# step of the cache, and longer contexts cost one more step per 256 positions.
KEY_STEP = 256
MIN_KEY_STEP = 16


def key_step(batch: int, n_query: int, n_head: int, max_len: int, max_batch_mib: float | None) -> int:
    """Keys per step of `cached_attention`: KEY_STEP, or fewer (a power of two, at least MIN_KEY_STEP) when the
    scores of KEY_STEP keys for all queries and heads would exceed `max_batch_mib`; never more than the cache."""
    keys = KEY_STEP
    if max_batch_mib is not None:
        while keys > MIN_KEY_STEP and scores_bytes(batch, n_head, n_query, keys) > max_batch_mib * MIB:
            keys //= 2
    return min(keys, max_len)


def cached_attention(q, k_cache, v_cache, layer, q_pos, *, row=0, max_batch_mib: float | None = None,
                     softcap: float = 0.0):
    """Causal GQA attention of q [B, T, H, hd] at consecutive positions q_pos [B, T] (each row at its own depth; or
    [T], every row alike) against layer `layer` (traced) of KV caches [n_layer, S, max_len, H_kv, hd], query row b
    against cache row row + b (traced; 0 when S is B), filled up to q_pos[b, -1] -> [B, T, H, hd], equal to
    `model.attend` over each row's filled positions.

    Keys are visited in steps of `key_step` positions with an online softmax (a running max, normaliser and
    weighted sum per query and head), and only the ceil((max(q_pos[:, -1]) + 1) / step) steps that hold filled
    positions of the deepest row run: a decode step costs what the context holds so far, not the cache's size, and
    each step reads its keys straight from the whole cache (no per-layer copy). The scores of one step,
    B·H·T·step·4 bytes, are what `max_batch_mib` bounds here. The scores are soft-capped by `softcap` (soft_cap)."""
    b, t, h, hd = q.shape
    max_len, n_kv = k_cache.shape[2], k_cache.shape[3]
    group = h // n_kv
    q_pos = jnp.broadcast_to(q_pos, (b, t))
    step = key_step(b, t, h, max_len, max_batch_mib)
    grouped = q.reshape(b, t, n_kv, group, hd) * (1.0 / jnp.sqrt(jnp.float32(hd)))
    n_steps = (jnp.max(q_pos[:, -1]) + step) // step

    def visit(i, carry):
        running_max, normaliser, weighted = carry
        nominal = i * step
        # The last step of a cache whose length is not a multiple of `step` is pulled back to end at the edge; the
        # keys it shares with the previous step are masked out below so none is counted twice.
        start = jnp.minimum(nominal, max_len - step)
        k = jax.lax.dynamic_slice(k_cache, (layer, row, start, 0, 0), (1, b, step, n_kv, hd))[0]
        v = jax.lax.dynamic_slice(v_cache, (layer, row, start, 0, 0), (1, b, step, n_kv, hd))[0]
        k_pos = start + jnp.arange(step, dtype=q_pos.dtype)
        visible = (k_pos <= q_pos[..., None]) & (k_pos >= nominal)  # [B, T, step]
        scores = jnp.where(visible[:, None, None], soft_cap(jnp.einsum("btkgd,bskd->bkgts", grouped, k), softcap),
                           -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=-1))
        # Every query sees key 0 in step 0, so new_max is finite from then on; before that the running max is -inf
        # and its correction exp(-inf) = 0.
        probs = jnp.exp(scores - new_max[..., None])
        correction = jnp.exp(running_max - new_max)
        normaliser = normaliser * correction + jnp.sum(probs, axis=-1)
        weighted = weighted * correction[..., None] + jnp.einsum("bkgts,bskd->bkgtd", probs, v)
        return new_max, normaliser, weighted

    init = (jnp.full((b, n_kv, group, t), -jnp.inf, jnp.float32), jnp.zeros((b, n_kv, group, t), jnp.float32),
            jnp.zeros((b, n_kv, group, t, hd), jnp.float32))
    _, normaliser, weighted = jax.lax.fori_loop(0, n_steps, visit, init)
    out = weighted / normaliser[..., None]  # [B, Hkv, G, T, hd]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, h, hd)

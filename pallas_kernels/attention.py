"""Flash attention in Pallas: causal GQA prefill against a KV cache, and split-K decode (Flash-Decoding).

Neither kernel materialises the [T, S] scores: each program walks its keys in blocks of `block_k` with an online
softmax (FlashAttention-2: running row max m, running sum l, unnormalised output acc rescaled by e^(m_old - m_new)).

    prefill  grid (T / block_q, B, H): row b's queries at positions start[b] .. start[b]+T-1 (each row at its own
             depth) against cache keys 0 .. S-1; a program stops after the last key block its queries can see
             (causality), so later cache blocks are never read.
    decode   grid (B, H_kv, num_splits): one query per head at position[b]; each program takes one KV head with all of
             its query heads (padded to block_h rows) and one contiguous split of the keys, and writes its own
             (acc, l, m); `combine_splits` merges the splits in plain jnp.

GQA is native: the K/V index_map sends query head j to KV head j // (H / H_kv); K/V are never repeated.
Lengths that are not multiples of the tiles are padded by the wrappers with zero keys (and queries): padded keys lie
after every real query's position, so the causal mask hides them, and padded query rows are sliced off. Padding
copies K/V, so a cache meant for these kernels should be allocated with a length that is a multiple of block_k
(prefill) or num_splits · block_k (decode), which makes the padding a no-op.

Only generic Pallas (BlockSpec, ref slicing, fori_loop), so the same code runs in interpret mode on a CPU and lowers
through Triton on a GPU; every in-kernel array is a power-of-two shape, as Triton requires: block_q, block_k,
block_h and head_dim (64 or 128) must be powers of two.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    block_q: int = 64  # prefill: queries per program
    block_k: int = 64  # keys per inner-loop step, both kernels
    num_splits: int = 16  # decode: key splits, i.e. programs per KV head (Flash-Decoding's parallelism)
    block_h: int = 16  # decode: rows per program, a KV group's query heads padded (Triton's dot needs >= 16)


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _online_softmax(q, k_ref, v_ref, q_pos, first_key, n_blocks, block_k):
    """q [rows, hd] (already scaled) at positions q_pos [rows] against keys first_key + (0 .. n_blocks·block_k - 1)
    of k_ref/v_ref [keys, hd] -> (acc [rows, hd] unnormalised, l [rows] softmax denominators, m [rows] row maxima).
    Each row must see a key in the first block, so that m is finite from then on."""
    rows, hd = q.shape

    def step(j, carry):
        acc, l_prev, m_prev = carry
        keys = pl.ds(j * block_k, block_k)
        scores = jax.lax.dot_general(q, k_ref[keys, :].astype(jnp.float32), (((1,), (1,)), ((), ())))  # [rows, block_k]
        k_pos = first_key + j * block_k + jnp.arange(block_k)
        scores = jnp.where(k_pos[None, :] <= q_pos[:, None], scores, -jnp.inf)
        m = jnp.maximum(m_prev, scores.max(axis=1))
        p = jnp.exp(scores - m[:, None])
        rescale = jnp.exp(m_prev - m)  # 0 on the first block, where m_prev is -inf
        acc = acc * rescale[:, None] + jnp.dot(p, v_ref[keys, :].astype(jnp.float32))  # an f16 cache: f32 math
        return acc, l_prev * rescale + p.sum(axis=1), m

    init = (jnp.zeros((rows, hd), jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32))
    return jax.lax.fori_loop(0, n_blocks, step, init)


def _prefill_kernel(start_ref, q_ref, k_ref, v_ref, o_ref, *, block_k, sm_scale):
    # start_ref []: position of this row's query 0; q_ref [block_q, hd]: this program's queries of one head;
    # k_ref, v_ref [S, hd]: the whole cache of that head's KV head; o_ref [block_q, hd]
    block_q = q_ref.shape[0]
    first_query = start_ref[()] + pl.program_id(0) * block_q
    # Key blocks up to the one holding this block's last query position, and no further than the cache.
    n_blocks = jnp.minimum(pl.cdiv(first_query + block_q, block_k), k_ref.shape[0] // block_k)
    q = q_ref[...].astype(jnp.float32) * sm_scale
    acc, l, _ = _online_softmax(q, k_ref, v_ref, first_query + jnp.arange(block_q), 0, n_blocks, block_k)
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)


def _decode_kernel(position_ref, q_ref, k_ref, v_ref, o_ref, l_ref, m_ref, *, block_k, sm_scale):
    # position_ref []: this row's query position (keys 0 .. position are seen); q_ref [block_h, hd]: one KV group's
    # query heads, padded; k_ref, v_ref [S / num_splits, hd]: this program's split of that KV head's keys;
    # o_ref [block_h, hd], l_ref, m_ref [block_h]: this split's unnormalised output, denominators and row maxima
    split_len = k_ref.shape[0]
    first_key = pl.program_id(2) * split_len
    position = position_ref[()]
    # Splits that start after the position do no step and leave (0, 0, -inf), which the combine weighs by zero.
    n_blocks = jnp.clip(pl.cdiv(position + 1 - first_key, block_k), 0, split_len // block_k)
    q = q_ref[...].astype(jnp.float32) * sm_scale
    q_pos = jnp.full((q.shape[0],), position)
    acc, l, m = _online_softmax(q, k_ref, v_ref, q_pos, first_key, n_blocks, block_k)
    o_ref[...] = acc
    l_ref[...] = l
    m_ref[...] = m


def _per_row(positions, batch):
    """int32 [batch]: one position per row, a scalar repeated."""
    return jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (batch,))


def _pad_axis(x, axis, multiple):
    missing = -x.shape[axis] % multiple
    if missing == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, missing)
    return jnp.pad(x, widths)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def attention(q, k, v, start, *, block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
    """Causal GQA flash attention. q [B, T, H, hd], row b at positions start[b] .. start[b]+T-1 (start: int32 [B],
    or one scalar for every row; may be traced); k, v [B, S, H_kv, hd], the cache, keys at positions 0 .. S-1 ->
    [B, T, H, hd] in q's dtype. Keys after a query's position are masked; start[b] + T <= S (the queries' own keys
    are in the cache)."""
    b, t, h, hd = q.shape
    n_kv = k.shape[2]
    bq, bk = block_sizes.block_q, block_sizes.block_k
    assert h % n_kv == 0, f"{h=} query heads must be a multiple of {n_kv=} KV heads"
    assert all(map(_is_power_of_two, (bq, bk, hd))), f"{bq=}, {bk=}, {hd=} must be powers of two (Triton)"
    group = h // n_kv
    q_padded, k, v = _pad_axis(q, 1, bq), _pad_axis(k, 1, bk), _pad_axis(v, 1, bk)
    t_padded, s = q_padded.shape[1], k.shape[1]
    query_block = pl.BlockSpec((None, bq, None, hd), lambda i, bi, j: (bi, i, j, 0))
    cache_of_head = pl.BlockSpec((None, s, None, hd), lambda i, bi, j: (bi, 0, j // group, 0))
    out = pl.pallas_call(
        functools.partial(_prefill_kernel, block_k=bk, sm_scale=1 / math.sqrt(hd)),
        grid=(t_padded // bq, b, h),
        in_specs=[pl.BlockSpec((None,), lambda i, bi, j: (bi,)), query_block, cache_of_head, cache_of_head],
        out_specs=query_block,
        out_shape=jax.ShapeDtypeStruct(q_padded.shape, q.dtype),
        interpret=interpret,
        name="flash_attention_prefill",
    )(_per_row(start, b), q_padded, k, v)
    return out[:, :t]


def combine_splits(o, l, m):
    """Flash-Decoding's reduction: per-split o [splits, ..., hd] (unnormalised), l, m [splits, ...] -> [..., hd].
    Each split's sums are rescaled from its own max m_s to the global max."""
    weight = jnp.exp(m - m.max(axis=0))  # 0 for splits that saw no key (m_s = -inf)
    return (o * weight[..., None]).sum(axis=0) / (l * weight).sum(axis=0)[..., None]


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def decode_attention(q, k, v, position, *, block_sizes: BlockSizes = BlockSizes(), interpret: bool = False):
    """One query per head: q [B, H, hd], row b at position[b] (int32 [B], or one scalar for every row; may be
    traced) against the cache k, v [B, S, H_kv, hd], keys 0 .. position[b] seen -> [B, H, hd] f32. Split-K over
    num_splits programs per KV head."""
    b, h, hd = q.shape
    n_kv = k.shape[2]
    bk, splits = block_sizes.block_k, block_sizes.num_splits
    assert h % n_kv == 0, f"{h=} query heads must be a multiple of {n_kv=} KV heads"
    group = h // n_kv
    rows = max(block_sizes.block_h, pl.next_power_of_2(group))
    assert all(map(_is_power_of_two, (bk, rows, hd))), f"{bk=}, block_h={rows}, {hd=} must be powers of two (Triton)"
    # [B, H_kv, rows, hd]: a KV group's query heads, then zero rows whose results are dropped.
    q_rows = _pad_axis(q.reshape(b, n_kv, group, hd), 2, rows)
    k, v = _pad_axis(k, 1, splits * bk), _pad_axis(v, 1, splits * bk)
    split_len = k.shape[1] // splits
    split_of_head = pl.BlockSpec((None, split_len, None, hd), lambda bi, j, s: (bi, s, j, 0))
    o, l, m = pl.pallas_call(
        functools.partial(_decode_kernel, block_k=bk, sm_scale=1 / math.sqrt(hd)),
        grid=(b, n_kv, splits),
        in_specs=[pl.BlockSpec((None,), lambda bi, j, s: (bi,)),
                  pl.BlockSpec((None, None, rows, hd), lambda bi, j, s: (bi, j, 0, 0)),
                  split_of_head, split_of_head],
        out_specs=[pl.BlockSpec((None, None, None, rows, hd), lambda bi, j, s: (s, bi, j, 0, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda bi, j, s: (s, bi, j, 0)),
                   pl.BlockSpec((None, None, None, rows), lambda bi, j, s: (s, bi, j, 0))],
        out_shape=[jax.ShapeDtypeStruct((splits, b, n_kv, rows, hd), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, n_kv, rows), jnp.float32),
                   jax.ShapeDtypeStruct((splits, b, n_kv, rows), jnp.float32)],
        interpret=interpret,
        name="flash_decoding",
    )(_per_row(position, b), q_rows, k, v)
    return combine_splits(o, l, m)[:, :, :group].reshape(b, h, hd)


def attention_reference(q, k, v, start):
    """Plain jnp: q [B, T, H, hd], row b at positions start[b] .. start[b]+T-1 (start [B] or a scalar); k, v
    [B, S, H_kv, hd] -> [B, T, H, hd] f32."""
    b, t, h, hd = q.shape
    n_kv = k.shape[2]
    grouped = q.reshape(b, t, n_kv, h // n_kv, hd).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k.astype(jnp.float32)) / math.sqrt(hd)
    q_pos = _per_row(start, b)[:, None] + jnp.arange(t)  # [B, T]
    causal = jnp.arange(k.shape[1]) <= q_pos[..., None]  # [B, T, S]
    probs = jax.nn.softmax(jnp.where(causal[:, None, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32)).reshape(b, t, h, hd)


def decode_attention_reference(q, k, v, position):
    """Plain jnp: q [B, H, hd], row b at position[b] (or one scalar); k, v [B, S, H_kv, hd] -> [B, H, hd] f32."""
    return attention_reference(q[:, None], k, v, position)[:, 0]

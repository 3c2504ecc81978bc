"""The mixture-of-experts FFN (llama.cpp's build_moe_ffn for qwen3moe and Mixtral-style llama files): each token's
router picks the experts that run for it, inside the compiled step.

    p = softmax(x W_routerᵀ)                        [n_expert] per token
    chosen = top-k of p, w = p[chosen]              k = cfg.n_expert_used; w / Σw where cfg.expert_weights_norm
    out = Σ_j w_j down_e(gate_act(gate_e(x)) * up_e(x)),  e = chosen_j

For Mixtral the softmax over all experts renormalized over the chosen k is the softmax of their k logits, as its
reference computes it. The experts' projections are stacked in the file ([n_expert, rows, cols]) and kept so, in
their stored format, as one QuantArray of n_expert * rows rows: expert e's rows of a projection are one contiguous
run, which a product reads in place without touching the others (expert_products.py).

Two ways to the same sum, chosen by the number of (token, expert) pairs a call has (static):
  routed       fewer pairs than experts (decode): each token's k experts' rows are multiplied for it alone, read
               where they lie (expert_products.routed_ffn): a decode step reads the router and k experts per layer,
               no other expert bytes, and copies none;
  grouped      otherwise (prompts): the pairs are sorted by expert and each expert runs over its own tokens, in
               tiles of a static number of them (grouped_ffn), reading its rows once per tile: the routed products'
               work plus the tiles' padding, where running every expert over every token was n_expert / k times it
               (16x at Qwen3-30B-A3B's 128 experts, 8 per token).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import Config
from jaxinfer.errors import JaxinferError
from jaxinfer.expert_products import expert_ffn, routed_ffn
from jaxinfer.quant import QuantArray, from_gguf_data, matmul
from jaxinfer.sparse_ffn import ACTIVATIONS

DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")  # the Layer fields a mixture of experts takes the place of
# llama.cpp clamps the sum of the chosen experts' probabilities to the smallest normal f16 before dividing by it.
MIN_WEIGHT_SUM = 6.103515625e-5


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Experts:
    """A layer's mixture of experts: its router and each projection stacked over the experts, expert e's rows
    e * rows .. (e + 1) * rows - 1 of the stacked [n_expert * rows, cols] weight (GGUF's order)."""

    router: QuantArray  # [n_expert, d] blk.N.ffn_gate_inp
    gate: QuantArray  # [n_expert * n_ff_exp, d] blk.N.ffn_gate_exps
    up: QuantArray  # [n_expert * n_ff_exp, d] blk.N.ffn_up_exps
    down: QuantArray  # [n_expert * d, n_ff_exp] blk.N.ffn_down_exps


def stacked(view: np.ndarray, qtype, shape: tuple[int, int, int]) -> QuantArray:
    """A stacked expert tensor as the reader returns it (shape [n_expert, rows, cols]) as one QuantArray of
    n_expert * rows rows, without copying."""
    n_expert, rows, cols = shape
    return from_gguf_data(view, qtype, (n_expert * rows, cols))


def route(x, router: QuantArray, cfg: Config):
    """x [N, d] -> (weights [N, k] f32, chosen [N, k] int32): the k experts of highest probability for each token
    (top_k: the first of equal ones) and their weights (see the module docstring)."""
    probs = jax.nn.softmax(matmul(x, router), axis=-1)
    weights, chosen = jax.lax.top_k(probs, cfg.n_expert_used)
    if cfg.expert_weights_norm:
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), np.float32(MIN_WEIGHT_SUM))
    return weights, chosen


def activations(cfg: Config):
    """(gate_act, up_act) of the experts' gated FFN."""
    return ACTIVATIONS[cfg.gate_activation], ACTIVATIONS[cfg.up_activation]


def ffn(x, experts: Experts, cfg: Config, trace: bool = False):
    """x [..., d] (the normed FFN input) -> [..., d]: the mixture's output. `trace`: what model.forward's `observe`
    asks of an FFN (profiling, calibration, predictor training), which no mixture computes yet."""
    if trace:
        raise JaxinferError(f"a mixture-of-experts model ({cfg.arch}, {cfg.n_expert} experts) has no per-neuron "
                            f"statistics to profile, calibrate or train predictors on yet")
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen = route(flat, experts.router, cfg)
    n_tokens, k = chosen.shape
    if n_tokens * k < cfg.n_expert:
        projections = (experts.gate, experts.up, experts.down)
        rows = [routed_ffn(flat[t:t + 1], chosen[t], weights[t], *projections, activations(cfg))
                for t in range(n_tokens)]
        return jnp.concatenate(rows).reshape(x.shape)
    out = grouped_ffn(flat, weights, chosen, experts, cfg, tile_size(n_tokens * k, cfg.n_expert))
    return out.reshape(x.shape)


# The most tokens of a tile. Measured on one layer of Qwen3-30B-A3B's width (Q4_0, 128 experts of 768, top-8, 2 busy
# cores): a tile near the mean pairs per expert did best, and beyond 16 none did better (512 tokens, 32 pairs per
# expert: 1.12 s at 8 or 16, 1.59 s at 32, 2.24 s at 64; 128 tokens: 0.33 s at 8, 0.51 s at 16; 32 tokens: 82 ms at
# 2, 269 ms at 8): the row kernels' work grows with the padding, and their speed per token not with the tile.
MAX_TILE = 16


def tile_size(pairs: int, n_expert: int) -> int:
    """The tokens of grouped_ffn's tiles for `pairs` (token, expert) pairs: the mean per expert, rounded up to a
    power of two, at most MAX_TILE."""
    mean = -(-pairs // n_expert)
    return min(MAX_TILE, 1 << (mean - 1).bit_length())


def grouped_ffn(flat, weights, chosen, experts: Experts, cfg: Config, tile: int):
    """The mixture of flat [N, d] for its routing (weights, chosen [N, k]), expert by expert: the (token, expert)
    pairs sorted by expert (stably: each expert's tokens in order), each expert's pairs cut into tiles of `tile`
    (static), and one loop over the tiles in use (a traced count, at most N k / tile + n_expert), each running its
    expert on its tokens (rows past the expert's last pair are dropped) and adding their weighted outputs. Each token
    gets its experts' outputs added in the order of the experts."""
    n, k = chosen.shape
    expert_of = chosen.reshape(-1)
    order = jnp.argsort(expert_of, stable=True)
    padding = jnp.full((tile,), n, jnp.int32)  # a tile's slice may run past the last pair: token n, dropped
    token_of = jnp.concatenate([(order // k).astype(jnp.int32), padding])
    weight_of = jnp.concatenate([weights.reshape(-1)[order], jnp.zeros((tile,), weights.dtype)])
    counts = jnp.zeros((cfg.n_expert,), jnp.int32).at[expert_of].add(1)
    first_pair = jnp.cumsum(counts) - counts
    tiles = (counts + tile - 1) // tile
    tiles_end = jnp.cumsum(tiles)  # expert e's tiles: tiles_end[e] - tiles[e] .. tiles_end[e] - 1

    def add_tile(i, out):
        e = jnp.searchsorted(tiles_end, i, side="right").astype(jnp.int32)
        part = i - (tiles_end[e] - tiles[e])
        start = first_pair[e] + part * tile
        tokens = jax.lax.dynamic_slice_in_dim(token_of, start, tile)
        tokens = jnp.where(jnp.arange(tile) < counts[e] - part * tile, tokens, n)
        y = expert_ffn(jnp.take(flat, tokens, axis=0, mode="clip"), e, experts.gate, experts.up, experts.down,
                       activations(cfg))
        return out.at[tokens].add(jax.lax.dynamic_slice_in_dim(weight_of, start, tile)[:, None] * y, mode="drop")

    return jax.lax.fori_loop(0, tiles_end[-1], add_tile, jnp.zeros_like(flat))

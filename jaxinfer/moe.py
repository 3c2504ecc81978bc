"""The mixture-of-experts FFN (llama.cpp's build_moe_ffn for qwen3moe and Mixtral-style llama files): each token's
router picks the experts that run for it, inside the compiled step.

    p = softmax(x W_routerᵀ)                        [n_expert] per token (sigmoid: cfg.expert_gating)
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

A mixture of ReLU experts (SmallThinker's) whose activation profile measured few of their neurons nonzero holds its
down projection a row per neuron (down_rows_per_neuron; engine._experts decides): each token then reads only the
rows of its routed experts' nonzero neurons, in decode and prompt tiles alike.

Experts as hot and cold parts (hybrid.py, placed by how often `profile` counted them routed to): each part holds
some experts stacked as the file stacks all of them, and a map from expert id to its place among them (-1: held
elsewhere). The routing is computed once; each part runs the pairs whose experts it holds (the others' weights 0,
their rows never read), a part in host memory under compute_on there, and the parts' outputs are summed, all in the
one compiled step. Cut over devices (--tp, sharding.py), each device is such a part of whole experts, and the
devices' outputs are summed by the FFN's all-reduce.
"""

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from jaxinfer import jax_compat, quant, sharding
from jaxinfer.config import NATURAL_ZEROS, Config
from jaxinfer.expert_products import expert_ffn, routed_ffn
from jaxinfer.quant import QuantArray, from_gguf_data, matmul
from jaxinfer.sparse_ffn import ACTIVATIONS, FFNTrace

DENSE_FFN = ("ffn_gate", "ffn_up", "ffn_down")  # the Layer fields a mixture of experts takes the place of
# llama.cpp clamps the sum of the chosen experts' probabilities to the smallest normal f16 before dividing by it.
MIN_WEIGHT_SUM = 6.103515625e-5


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ExpertPart:
    """Some of a layer's experts, stacked as the file stacks all of them (a hot/cold split, hybrid.py): `local[e]` is
    expert e's place among them, -1 for an expert held in another part."""

    gate: QuantArray  # [n_here * n_ff_exp, d]
    up: QuantArray  # [n_here * n_ff_exp, d]
    down: QuantArray  # [n_here * d, n_ff_exp]; a row per neuron [n_here * n_ff_exp, d] (down_rows_per_neuron)
    local: jax.Array | None  # int32 [n_expert]; None: every expert, in order (an unsplit mixture)
    on_host: bool = dataclasses.field(default=False, metadata=dict(static=True))  # in host memory, run there


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Experts:
    """A layer's mixture of experts: its router and each projection stacked over the experts, expert e's rows
    e * rows .. (e + 1) * rows - 1 of the stacked [n_expert * rows, cols] weight (GGUF's order). Split between
    device and host memory (hybrid.py), the projections are None and `parts` hold the experts."""

    router: QuantArray  # [n_expert, d] blk.N.ffn_gate_inp
    gate: QuantArray | None  # [n_expert * n_ff_exp, d] blk.N.ffn_gate_exps
    up: QuantArray | None  # [n_expert * n_ff_exp, d] blk.N.ffn_up_exps
    down: QuantArray | None  # [n_expert * d, n_ff_exp] blk.N.ffn_down_exps; sparse ReLU experts down_rows_per_neuron
    parts: list[ExpertPart] | None = None
    shared: "SharedExpert | None" = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SharedExpert:
    """Qwen2-MoE's shared expert: a SwiGLU FFN every token runs, its output times sigmoid(x · gate_inp), added to the
    routed experts' (llama.cpp's qwen2moe graph). It stays with the dense weights in a hot/cold split."""

    gate_inp: jax.Array  # [d] blk.N.ffn_gate_inp_shexp
    gate: QuantArray  # [n_ff_shexp, d] blk.N.ffn_gate_shexp
    up: QuantArray  # [n_ff_shexp, d] blk.N.ffn_up_shexp
    down: QuantArray  # [d, n_ff_shexp] blk.N.ffn_down_shexp


def down_rows_per_neuron(view: np.ndarray, qtype, n_expert: int, f: int, d: int) -> QuantArray:
    """A stacked down projection ([n_expert * d, f] in the file's bytes, `view`) as one weight of a row per neuron
    over every expert's neurons, [n_expert * f, d] (expert e's neurons rows e f .. (e + 1) f - 1), laid out for
    cpu_ext's down_rows kernels (quant.pack_down_rows): a ReLU expert's zero neurons are then not read. Each expert's
    projection is transposed (experts_transposed): in Q8_0, whatever the file's type, a second rounding across the
    file's blocks. In Q4_0, as PowerInfer's ffn_down_t is, the rows would be half the bytes but far from the file's
    values (a Q4_0 SmallThinker-shaped file against llama.cpp's logits: KL 9.6e-3 and 84% the same top token, in Q8_0
    1.7e-3 and 99%, whole 1.2e-4 and 98%); a file that stores them so is read as it is (gguf_io)."""
    return quant.pack_down_rows(experts_transposed(view, qtype, n_expert, d, f))


def experts_transposed(view: np.ndarray, qtype, n_expert: int, rows: int, cols: int) -> QuantArray:
    """Each expert's [rows, cols] of a stacked projection (the file's bytes `view`) transposed, as one QuantArray of
    [n_expert * cols, rows]: decoded with gguf-py and quantized again in Q8_0 (a second rounding) where `rows` is a
    whole number of its blocks, else F32; float types exactly, in their own type. An expert at a time, so that no
    more than one expert's projection is held in f32. Either way round: a file's usual down projection into rows per
    neuron (down_rows_per_neuron), or rows a file stores per neuron back into the usual one."""
    per_expert = view.reshape(n_expert, rows, -1)
    if qtype in quant.FLOAT_TYPES:
        out_type = qtype
    else:
        out_type = GGMLQuantizationType.Q8_0 if rows % 32 == 0 else GGMLQuantizationType.F32

    def one(e):
        values = np.ascontiguousarray(gguf_quants.dequantize(per_expert[e], qtype).reshape(rows, cols).T, np.float32)
        if out_type in quant.FLOAT_TYPES:
            return values.astype(quant.FLOAT_TYPES[out_type])
        return gguf_quants.quantize(values, out_type)

    return QuantArray(np.concatenate([one(e) for e in range(n_expert)]), out_type, (n_expert * cols, rows))


def stacked(view: np.ndarray, qtype, shape: tuple[int, int, int]) -> QuantArray:
    """A stacked expert tensor as the reader returns it (shape [n_expert, rows, cols]) as one QuantArray of
    n_expert * rows rows, without copying."""
    n_expert, rows, cols = shape
    return from_gguf_data(view, qtype, (n_expert * rows, cols))


def route(x, router: QuantArray, cfg: Config):
    """x [N, d] -> (weights [N, k] f32, chosen [N, k] int32): the k experts of highest probability for each token
    (top_k: the first of equal ones) and their weights (see the module docstring)."""
    logits = matmul(x, router)
    probs = jax.nn.sigmoid(logits) if cfg.expert_gating == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    weights, chosen = jax.lax.top_k(probs, cfg.n_expert_used)
    if cfg.expert_weights_norm:
        weights = weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), np.float32(MIN_WEIGHT_SUM))
    return weights, chosen


def activations(cfg: Config):
    """(gate_act, up_act) of the experts' gated FFN."""
    return ACTIVATIONS[cfg.gate_activation], ACTIVATIONS[cfg.up_activation]


def ffn(x, experts: Experts, cfg: Config, trace: bool = False, router_input=None):
    """x [..., d] (the normed FFN input) -> ([..., d], FFNTrace or None): the mixture's output, summed over the parts
    its experts are held in (one, unless split: hybrid.py), a part in host memory run there, inside the one compiled
    step. The router reads `router_input` [..., d] where given (SmallThinker's: the layer's input), else x. With
    `trace`, what model.forward's `observe` records: `active` [..., n_expert] the experts each token was routed to,
    `gate` and `hidden` their routing weights (0 elsewhere)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, chosen = route(flat if router_input is None else router_input.reshape(flat.shape), experts.router, cfg)
    routed = flat.shape[0] * cfg.n_expert_used < cfg.n_expert  # a decode step: see the module docstring
    parts = expert_parts(experts)
    if cfg.plan.tp > 1:  # inside the shard_map: this device's whole experts of a cut over devices (sharding.py)
        held = sharding.held_experts(cfg.n_expert, experts.gate.shape[0] // cfg.n_ff_exp, cfg.plan)
        parts = [dataclasses.replace(parts[0], local=held)]
    outs = []
    for part in parts:
        # Which pairs the part runs, and how, worked out in device memory: a host region takes only indexing and
        # products of arrays already there.
        work = _part_work(weights, chosen, part, routed, tile_size(chosen.size, cfg.n_expert), cfg)
        projections = (part.gate, part.up, part.down)
        if part.on_host:
            run = jax_compat.on_host(partial(_run_host_part, routed=routed, cfg=cfg))
            outs.append(run(*jax_compat.to_host((flat, work)), projections))
        else:
            outs.append(_run_part(flat, work, projections, routed=routed, cfg=cfg))
    out = outs[0] if len(outs) == 1 else sum(outs[1:], outs[0])
    if experts.shared is not None:
        out = out + shared_expert(flat, experts.shared, cfg)
    out = out.reshape(x.shape)
    if not trace:
        return out, None
    rows, shape = jnp.arange(flat.shape[0])[:, None], (*x.shape[:-1], cfg.n_expert)
    share = jnp.zeros((flat.shape[0], cfg.n_expert), jnp.float32).at[rows, chosen].set(weights).reshape(shape)
    routed_to = jnp.zeros((flat.shape[0], cfg.n_expert), bool).at[rows, chosen].set(True).reshape(shape)
    nonzero = None
    if cfg.gate_activation in NATURAL_ZEROS and experts.gate is not None:
        nonzero = jnp.where(routed_to, nonzero_neurons(flat, experts.gate, cfg).reshape(shape), 0)
    return out, FFNTrace(x, share, share, routed_to, nonzero)


def nonzero_neurons(flat, gate: QuantArray, cfg: Config):
    """[N, n_expert] int32: how many of each expert's neurons flat [N, d] leaves nonzero through the gate activation
    (a ReLU expert's zeros, which a neuron-major down projection does not read; an exact zero of up is not counted).
    Every expert's gate is multiplied: for profiling (FFNTrace.nonzero), not inference."""
    gate_act, _ = activations(cfg)
    fired = gate_act(matmul(flat, gate)) != 0
    return jnp.sum(fired.reshape(flat.shape[0], cfg.n_expert, cfg.n_ff_exp), axis=-1, dtype=jnp.int32)


def shared_expert(flat, shared: SharedExpert, cfg: Config):
    """The shared expert's output for flat [N, d]: down(gate_act(gate x) * up_act(up x)) * sigmoid(gate_inp · x)."""
    gate_act, up_act = activations(cfg)
    hidden = gate_act(matmul(flat, shared.gate)) * up_act(matmul(flat, shared.up))
    return matmul(hidden, shared.down) * jax.nn.sigmoid(flat @ shared.gate_inp)[:, None]


def expert_parts(experts: Experts) -> list[ExpertPart]:
    """The parts a layer's experts are held in: its `parts` when split, else one part of all of them (local None:
    expert e is the e-th)."""
    if experts.parts is not None:
        return experts.parts
    return [ExpertPart(experts.gate, experts.up, experts.down, None)]


def _part_work(weights, chosen, part: ExpertPart, routed: bool, tile: int, cfg: Config):
    """What `part` runs of a routing (weights, chosen [N, k], global expert ids): a decode step's (chosen, weights)
    in the part's expert ids, a prompt's expert_tiles. A pair whose expert another part holds adds nothing here: its
    expert is -1 among this part's (the routed products read no rows for it, the tiles leave it out) and its weight
    0."""
    n_here = cfg.n_expert
    if part.local is not None:
        chosen = part.local[chosen]
        weights = jnp.where(chosen >= 0, weights, 0.0)
        n_here = part.gate.shape[0] // cfg.n_ff_exp
    return (chosen, weights) if routed else expert_tiles(weights, chosen, n_here, tile)


def _run_host_part(flat, work, projections, routed: bool, cfg: Config):
    """_run_part traced for the host: its products are the Plan's host products."""
    with quant.products(cfg.plan.host_products):
        return _run_part(flat, work, projections, routed, cfg)


def _run_part(flat, work, projections, routed: bool, cfg: Config):
    """flat [N, d] through the experts of one part (their stacked projections) as `work` (_part_work) says."""
    if routed:
        chosen, weights = work
        rows = [routed_ffn(flat[t:t + 1], chosen[t], weights[t], *projections, activations(cfg), cfg.n_ff_exp)
                for t in range(flat.shape[0])]
        return jnp.concatenate(rows)
    return run_tiles(flat, *work, projections, cfg)


# The most tokens of a tile. Measured on one layer of Qwen3-30B-A3B's width (Q4_0, 128 experts of 768, top-8, 2 busy
# cores): a tile near the mean pairs per expert did best, and beyond 16 none did better (512 tokens, 32 pairs per
# expert: 1.12 s at 8 or 16, 1.59 s at 32, 2.24 s at 64; 128 tokens: 0.33 s at 8, 0.51 s at 16; 32 tokens: 82 ms at
# 2, 269 ms at 8): the row kernels' work grows with the padding, and their speed per token not with the tile. With
# gather_matmul dotting four tokens at a time, 16 stayed best (4 layers, pp512: 483 tokens/s against 413 at 32 or 64),
# and with the experts repacked, read by the dense products' kernels (1271 against 1167 at 32, 1027 at 64).
MAX_TILE = 16


def tile_size(pairs: int, n_expert: int) -> int:
    """The tokens of grouped_ffn's tiles for `pairs` (token, expert) pairs: the mean per expert, rounded up to a
    power of two, at most MAX_TILE."""
    mean = -(-pairs // n_expert)
    return min(MAX_TILE, 1 << (mean - 1).bit_length())


def grouped_ffn(flat, weights, chosen, projections, n_here: int, tile: int, cfg: Config):
    """The mixture of flat [N, d] for its routing (weights, chosen [N, k]: the part's expert ids, -1 for experts it
    does not hold), expert by expert, in tiles of `tile` tokens (expert_tiles), one loop over the tiles in use, each
    running its expert on its tokens and adding their weighted outputs. Each token gets its experts' outputs added in
    the order of the experts."""
    return run_tiles(flat, *expert_tiles(weights, chosen, n_here, tile), projections, cfg)


def expert_tiles(weights, chosen, n_here: int, tile: int):
    """The (token, expert) pairs of a routing (weights, chosen [N, k]; -1: an expert held in another part, left out)
    sorted by expert (stably: each expert's tokens in order) and cut into tiles of `tile` pairs of one expert:
    (expert [T], tokens [T, tile], weights [T, tile], the tiles in use), T = N k / tile + n_here (static, the most
    tiles there can be), a slot past an expert's last pair holding token N (dropped) with weight 0."""
    n, k = chosen.shape
    expert_of = chosen.reshape(-1) % (n_here + 1)  # -1 becomes n_here: one more bucket, sorted last
    order = jnp.argsort(expert_of, stable=True)
    token_of, weight_of = (order // k).astype(jnp.int32), weights.reshape(-1)[order]
    counts = jnp.zeros((n_here + 1,), jnp.int32).at[expert_of].add(1)
    first_pair = (jnp.cumsum(counts) - counts)[:n_here]
    counts = counts[:n_here]
    tiles = (counts + tile - 1) // tile
    tiles_end = jnp.cumsum(tiles)  # expert e's tiles: tiles_end[e] - tiles[e] .. tiles_end[e] - 1
    i = jnp.arange(n * k // tile + n_here)
    expert = jnp.minimum(jnp.searchsorted(tiles_end, i, side="right"), n_here - 1).astype(jnp.int32)
    nth = i - (tiles_end[expert] - tiles[expert])
    pair = first_pair[expert][:, None] + nth[:, None] * tile + jnp.arange(tile)
    valid = (jnp.arange(tile) < (counts[expert] - nth * tile)[:, None]) & (i < tiles_end[-1])[:, None]
    pair = jnp.minimum(pair, n * k - 1)
    return (expert, jnp.where(valid, token_of[pair], n), jnp.where(valid, weight_of[pair], 0).astype(weights.dtype),
            tiles_end[-1])


def run_tiles(flat, expert, tokens, weights, n_tiles, projections, cfg: Config):
    """Σ over the tiles i < n_tiles of weights[i] times expert[i]'s FFN of its tokens[i], added into their rows of
    a [N, d] zero (token N: dropped). Only indexing and products: it runs in host memory as it does in device."""
    def add_tile(i, out):
        rows = jax.lax.dynamic_index_in_dim(tokens, i, keepdims=False)
        y = expert_ffn(jnp.take(flat, rows, axis=0, mode="clip"), expert[i], *projections, activations(cfg),
                       cfg.n_ff_exp)
        w = jax_compat.like(y, jax.lax.dynamic_index_in_dim(weights, i, keepdims=False))
        return out.at[rows].add(jax_compat.like(out, w[:, None] * y), mode="drop")

    return jax.lax.fori_loop(0, n_tiles, add_tile, jax_compat.like(flat, jnp.zeros_like(flat)))

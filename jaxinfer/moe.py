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
  all experts  otherwise (prompts): every expert runs over all the call's tokens, its output weighted by what the
               router gave it for each (0 where it was not chosen): n_expert / k times the products' work.
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
    # Each token's weight for every expert: 0 for those not chosen.
    share = jnp.zeros((n_tokens, cfg.n_expert), jnp.float32).at[jnp.arange(n_tokens)[:, None], chosen].add(weights)

    def add_expert(total, e):
        return total + share[:, e, None] * expert_ffn(flat, e, experts.gate, experts.up, experts.down,
                                                      activations(cfg)), None

    out, _ = jax.lax.scan(add_expert, jnp.zeros_like(flat), jnp.arange(cfg.n_expert))
    return out.reshape(x.shape)


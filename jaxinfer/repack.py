"""Which weights are repacked eight rows to a group for cpu_ext's repacked kernels (quant.pack_rows_x8), once, at
load: where the plan says so (Plan.repack), every Q4_0/Q4_1/Q8_0/IQ4_NL weight that only dense products read.

    repacked    attention q/k/v/output; the FFN's gate/up/down when it runs dense and is not split between devices;
                the output head when it is not the embedding
    kept        the embedding (rows looked up, and a tied output head with it); weights marked exact (XLA's f32
                products); a sparse or split FFN (row-sparse kernels and row cuts read GGUF's rows: `ffn_rows` gives
                them back, without rounding, where a repacked model is made sparse after load)

Each repacked weight replaces its rows: the model holds it once. Under tensor parallelism a weight cut by rows is
repacked only if each device's rows are whole groups (rows a multiple of 8 tp); a cut by columns cuts every group on
whole blocks, as it cuts rows.
"""

import dataclasses

from jaxinfer import quant, sharding
from jaxinfer.plan import Plan
from jaxinfer.quant import QuantArray

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN = ("ffn_gate", "ffn_up", "ffn_down")
ROW_CUT = frozenset(name for name, axis in sharding.LAYER_CUTS.items() if axis == sharding.ROWS) | {"output"}


def _packed(name: str, w: QuantArray | None, plan: Plan) -> QuantArray | None:
    if w is None or not quant.can_pack_rows_x8(w):
        return w
    if plan.tp > 1 and name in ROW_CUT and w.shape[0] % (quant.INTERLEAVE * plan.tp):
        return w
    return quant.pack_rows_x8(w)


def repack_weights(weights, plan: Plan, ffn: bool = True):
    """`weights` (model.Weights) with the weights listed above repacked where `plan.repack`; `ffn` False keeps the
    FFN's rows (a split is made after)."""
    if not plan.repack:
        return weights
    fields = ATTENTION + (FFN if ffn and plan.ffn_sparsity == "dense" else ())
    layers = [dataclasses.replace(layer, **{name: _packed(name, getattr(layer, name), plan) for name in fields})
              for layer in weights.layers]
    output = weights.output
    if output is not weights.token_embd:
        output = _packed("output", output, plan)
    return dataclasses.replace(weights, layers=layers, output=output)


def ffn_rows(layer):
    """The layer with its FFN weights in GGUF's rows (unpacked where repacked): what a sparse FFN reads."""
    return dataclasses.replace(layer, **{name: quant.unpack_rows_x8(getattr(layer, name)) for name in FFN
                                         if getattr(layer, name) is not None
                                         and getattr(layer, name).layout == quant.ROWS_X8})

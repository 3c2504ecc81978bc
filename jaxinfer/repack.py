"""Which weights are repacked eight rows to a group for cpu_ext's repacked kernels (quant.pack_rows_x8): decided
here, made once at load, straight from the file (gguf_io.load_weights), where the plan says so (Plan.repack): every
weight of quant.REPACKED_TYPES (Q4_0/Q4_1/Q8_0/IQ4_NL, and Q4_K/Q5_K/Q6_K/IQ4_XS per 256-value super-block) that only
dense products read.

    repacked    attention q/k/v/output; the FFN weights its sparsity mode multiplies densely (DENSE_FFN: all of
                them dense, gate and up for hidden:S, gate for gate:S) when it is not split between devices; the
                predictor's fc1/fc2 (dense products every token: a quantized predictor read at the dense kernels'
                pace); the output head, and the embedding when it is the output head too (tied): the
                head is the largest product of a perplexity window, and a lookup unpacks only the groups of the
                rows it reads
    experts     a mixture's stacked expert projections, each expert's rows whole groups (packs_experts), split
                between devices or not: an expert's rows of a projection are then consecutive groups; a down
                projection whose zeros are skipped is held a row per neuron instead (holds_expert_rows)
    kept        an embedding only looked up; weights marked exact (XLA's f32 products); a sparse or split FFN
                (row-sparse kernels and row cuts read GGUF's rows: `ffn_rows` gives them back, without rounding,
                where a model loaded dense is made sparse after)

A repacked weight is read from the file into its new layout and the file's pages let go: the model holds it once.
Ternary TQ1_0 weights are held as TQ2_0 (`widens_tq1_0`), 22% more bytes for a kernel that unpacks them 1.6x faster;
Q5_0 weights that would be repacked are held as Q8_0 and repacked (`held_type`), the same values in 55% more bytes.
Under tensor parallelism a weight cut by rows is repacked only if each device's rows are whole groups (rows a
multiple of 8 tp); a cut by columns cuts every group on whole blocks, as it cuts rows.
"""

import dataclasses

import numpy as np
from gguf import GGMLQuantizationType

from jaxinfer import quant, sharding
from jaxinfer.config import Config
from jaxinfer.plan import Plan
from jaxinfer.quant import QuantArray

ATTENTION = ("attn_q", "attn_k", "attn_v", "attn_output")
FFN = ("ffn_gate", "ffn_up", "ffn_down")
PREDICTOR = ("fc1", "fc2")
OUTPUT = "output"  # the output head, of its own or the embedding
ROW_CUT = frozenset(name for name, axis in sharding.LAYER_CUTS.items() if axis == sharding.ROWS) | {OUTPUT}


# The FFN weights a sparsity mode multiplies densely, and which are repacked where the FFN is not split: the rest are
# read row by row for active neurons, in GGUF's rows (sparse_ffn.py).
DENSE_FFN = {"dense": FFN, "hidden": ("ffn_gate", "ffn_up"), "gate": ("ffn_gate",), "predictor": ()}


def packs(name: str, w: QuantArray, plan: Plan, ffn: tuple[str, ...] = FFN) -> bool:
    """Whether the weight `w` of Layer field `name` (or OUTPUT) is repacked at load (see above), the FFN's fields
    `ffn` among them."""
    if not plan.repack or not quant.can_pack_rows_x8(w):
        return False
    if name not in ATTENTION + PREDICTOR + (OUTPUT,) + tuple(ffn):
        return False
    return plan.tp == 1 or name not in ROW_CUT or w.shape[0] % (quant.INTERLEAVE * plan.tp) == 0


def packs_experts(w: QuantArray, n_expert: int, plan: Plan) -> bool:
    """Whether a projection stacked over n_expert experts (moe.py) is repacked at load: where the plan repacks, for a
    type with repacked kernels, when each expert's rows are whole groups, so that its rows are consecutive groups the
    routed and grouped products read in place (expert_products.py)."""
    return plan.repack and quant.can_pack_rows_x8(w) and (w.shape[0] // n_expert) % quant.INTERLEAVE == 0


def holds_expert_rows(w: QuantArray, layer: int, cfg: Config, stored: bool = False) -> bool:
    """Whether layer `layer`'s stacked expert down projection is held a row per neuron (moe.down_rows_per_neuron):
    where the plan holds that layer's ReLU experts so (Plan.expert_rows, decided at load: cpu_ext's down_rows kernels
    run here and few enough of its neurons were measured nonzero), so that a token reads only the rows of its routed
    experts' nonzero neurons, for a block-quantized weight (not ternary) not marked exact (cut over devices, by whole
    experts as the stacked weights are), its rows' width a whole number of Q4_0/Q8_0 blocks. `stored`: w is the
    file's own rows ([n_expert * n_ff_exp, d], PowerInfer's --transpose-down), held as they are where the down_rows
    kernels take its type."""
    if layer not in cfg.plan.expert_rows:
        return False
    if stored:
        return quant.can_pack_down_rows(w)
    return (not w.exact and w.qtype not in quant.FLOAT_TYPES and w.qtype not in quant.TERNARY_TYPES
            and (w.shape[0] // cfg.n_expert) % 32 == 0)


def widens_tq1_0(qtype, plan: Plan, exact: bool = False) -> bool:
    """Whether a weight read from the file as `qtype` is held as TQ2_0 (ternary.tq1_0_as_tq2_0: TQ1_0's values, 66
    bytes a block of 256 instead of 54) where the plan repacks: every TQ1_0 weight not marked exact, whichever product
    or lookup reads it. Its decode runs at TQ2_0's speed (7B-shaped bitnet, tg64: 84 against 54 tokens/s)."""
    return plan.repack and qtype == GGMLQuantizationType.TQ1_0 and not exact


def held_type(name: str, w: QuantArray, plan: Plan, ffn: tuple[str, ...] = FFN) -> GGMLQuantizationType:
    """The type the weight `w` of Layer field `name` (or OUTPUT), read from the file, is held as: TQ2_0 for TQ1_0
    (widens_tq1_0); Q8_0 for a Q5_0 weight that would be repacked as a Q8_0 one (`packs`), the same values in 34
    bytes a block of 32 instead of 22, since Q5_0 has no repacked kernels: in GGUF's rows its products go to XLA
    beyond 128 tokens a call, and Gemma 3 270M's Q5_0 attention, gate and up took 19% of a decode step for 17% of its
    bytes (held so, its pp512 went from 1.49x to 2.17x llama.cpp's, tg64 from 1.14x to 1.16x); else its own."""
    if widens_tq1_0(w.qtype, plan, w.exact):
        return GGMLQuantizationType.TQ2_0
    if w.qtype == GGMLQuantizationType.Q5_0 and packs(name, dataclasses.replace(w, qtype=GGMLQuantizationType.Q8_0),
                                                      plan, ffn):
        return GGMLQuantizationType.Q8_0
    return w.qtype


def q5_0_as_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks, uint8 [..., 22] -> the Q8_0 blocks [..., 34] of the same values: d kept; element j's q (its low
    nibble from qs, bit j of qh above it) - 16, an int8 in -16..15. Gemma 3 270M's 81 Q5_0 matrices in 0.3 s."""
    qh = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    qs = blocks[..., 6:]
    q = (np.concatenate([qs & 0x0F, qs >> 4], axis=-1) | high).astype(np.int16) - 16
    return np.concatenate([blocks[..., 0:2], q.astype(np.int8).view(np.uint8)], axis=-1)


def ffn_rows(layer, names: tuple[str, ...] = FFN):
    """The layer with its FFN weights `names` in GGUF's rows (unpacked where repacked): what the row-sparse kernels,
    a transposition or a split's parts read."""
    return dataclasses.replace(layer, **{name: quant.unpack_rows_x8(getattr(layer, name)) for name in names
                                         if getattr(layer, name) is not None
                                         and getattr(layer, name).layout == quant.ROWS_X8})

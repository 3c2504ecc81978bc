"""Hot neurons first: a sparse model's FFN neurons reordered at load by how often they fired in its activation
profile (python -m jaxinfer.profile), hottest first.

The FFN is a sum over its neurons, so any order of them is the same function: each layer's gate and up rows, its
down projection's rows (one per neuron: a PowerInfer file's ffn_down_t, or the transposed copy a sparse mode makes),
the predictor's fc2 rows and BitNet's ffn_sub_norm are taken in one order, and nothing else changes. Hottest first,
the rows that most tokens read sit together at the front of each matrix: a decode step reads them as one stream,
front to back, and gathers only the rarer rows after them. The values are the same; what can change is the order in
which the kernels add them (the row-sparse down projection rounds each group of 32 active neurons' coefficients
together, and the groups follow the order), so the logits agree to the kernels' rounding, and with exact products to
f32 rounding.

Ordered where it can be: a sparse mode (or the dense mode of a ReLU model, which skips natural zeros), one row per
neuron in the down projection (a neuron-major packing moves neurons 32 at a time), one device (a cut by neurons
would put the hot ones all on the first), no hot/cold split (the split orders its parts itself), and a profile of
this model's shape that reads back (a stale one is left alone, as when there is none).
"""

import dataclasses
import os

import numpy as np

from jaxinfer import activation_profile, quant
from jaxinfer.errors import JaxinferError

PER_NEURON_ROWS = ("ffn_gate", "ffn_up", "ffn_down_t", "fc2")  # Layer fields with a row per neuron
PER_NEURON_VALUES = ("ffn_sub_norm",)  # Layer fields with a value per neuron


def hottest_first(counts: np.ndarray) -> np.ndarray:
    """[n_layer, n_ff] firing counts -> [n_layer, n_ff] neuron orders, the most often fired first (ties in index
    order: the same profile gives the same order)."""
    return np.argsort(-np.asarray(counts, np.float64), axis=1, kind="stable")


def can_order(layer) -> bool:
    """Whether a layer's neurons can be taken in any order: every per-neuron matrix holds whole rows per neuron."""
    if layer.ffn_parts is not None or layer.ffn_down_t is None or layer.ffn_down_t.layout not in quant.ROW_LAYOUTS:
        return False
    return all(getattr(layer, name).layout in quant.ROW_LAYOUTS + (quant.ROWS_X8,)
               for name in PER_NEURON_ROWS if getattr(layer, name) is not None)


def ordered_layer(layer, order: np.ndarray):
    """The layer with its neurons taken in `order` (see above)."""
    fields = {name: quant.take_rows_in_layout(getattr(layer, name), order) for name in PER_NEURON_ROWS
              if getattr(layer, name) is not None}
    fields |= {name: np.asarray(getattr(layer, name))[order] for name in PER_NEURON_VALUES
               if getattr(layer, name) is not None}
    return dataclasses.replace(layer, **fields)


def profile_order(m, activation_dir: str | None) -> tuple[np.ndarray | None, str]:
    """(per-layer orders, where they came from) for loaded model `m` from its activation profile, or (None, why
    not) where there is none or it does not read back for this model."""
    directory = activation_dir or activation_profile.default_directory(m.path)
    if not os.path.isdir(directory):
        return None, "no activation profile"
    try:
        counts = activation_profile.read_profile(directory, m.path, m.config.n_layer, m.config.n_ff)
    except JaxinferError as e:
        return None, f"the activation profile in {directory} was not used: {e}"
    return hottest_first(counts), f"from the activation profile in {directory}"

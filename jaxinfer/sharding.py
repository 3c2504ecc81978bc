"""Tensor parallelism over a 1-D mesh of the process's devices (`--tp N`, `Plan.tp`): how a model's weights and KV
cache are cut into shards, and the `shard_map` that runs the one model.forward on each device's shards.

    attention   attn_q / attn_k / attn_v rows (whole heads; a device's query heads use its own KV heads), the KV
                cache by KV heads, attn_output columns                              -> partial sums, psum
    FFN         ffn_gate / ffn_up rows, ffn_down columns, ffn_down_t rows (neurons), -> partial sums, psum
                the predictor's fc2 rows (its neurons); fc1 and the thresholds replicated
    experts     a mixture's stacked expert projections by rows, whole experts: device i holds experts
                i E/N .. (i + 1) E/N - 1 and runs the tokens' pairs routed to them (the router replicated, the
                routing computed on every device), the others' weights 0 and their rows not read -> partial sums,
                psum; Qwen2-MoE's shared expert by neurons, as a dense FFN
    output      rows (the vocabulary): each device computes its slice of the logits
    token_embd  rows (the vocabulary): each device looks up the tokens it holds, psum (one per forward); a tied
                output head is the same cut array
    the rest    the norms and the activations between blocks replicated

Weights stay in their GGML formats: a shard of rows is whole rows, a shard of columns whole blocks (a row of a
[rows, cols] weight is cols / block_size consecutive blocks, so columns are cut on block boundaries, which needs
cols / N a multiple of the block size: 32, or 256 for K-quants); a neuron-major down projection is cut on its
32-neuron blocks, a weight repacked eight rows to a group (repack.py) by rows on whole groups. Inside the shard_map
each device's QuantArrays are views of its own shard (their static shapes divided), so quant.matmul runs the cpu_ext
kernels on the local shard as on a small model. What cannot be cut is a one-line JaxinferError saying why.

With one device (Plan.tp 1) nothing is cut, no mesh exists and no shard_map runs: the model runs as it always did.

The mesh may span several processes (distributed.py): its devices are every process's, process by process, and
each process places only its own devices' shards (a GGUF tensor's rows read from the file for them alone). The
arrays the host reads (sampled tokens, scores) are then made whole on every device (`readable`), since an array cut
over several processes cannot be fetched by any of them.

Data parallelism (`--dp N`, `Plan.dp`, perplexity): the windows of an evaluation batch are spread over a 1-D mesh
of N devices, each running the whole model (weights replicated) on its share (`over_windows`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxinfer import distributed
from jaxinfer.errors import JaxinferError
from jaxinfer.plan import Plan
from jaxinfer.quant import (FLOAT_TYPES, INTERLEAVE, NEURON_BLOCK, NEURON_MAJOR, ROWS_X8, QuantArray, placed_copy,
                            take_rows)
from jaxinfer.ternary import QUANT_SIZES

AXIS = "tp"
DATA_AXIS = "dp"  # the evaluation windows' axis (data parallelism)
# The shard_maps run unchecked (check_vma=False): with the check, every loop whose initial carry is built inside the
# map (the online softmax of attention.cached_attention) would need a pcast to "varying" in model code. The
# all-reduces are placed by hand (all_reduce), and the tests hold the results to the single-device run's.
ROWS, COLS = 0, 1  # the axis of a [rows, cols] weight that is cut over the devices
# Layer fields cut over the devices (the others are replicated). Rows are a layer's output features (heads,
# neurons); columns its input features, whose partial products are summed by `all_reduce`.
LAYER_CUTS = {"attn_q": ROWS, "attn_k": ROWS, "attn_v": ROWS, "attn_output": COLS, "ffn_gate": ROWS, "ffn_up": ROWS,
              "ffn_down": COLS, "ffn_down_t": ROWS, "fc2": ROWS,
              "attn_q_bias": ROWS, "attn_k_bias": ROWS, "attn_v_bias": ROWS}  # a bias with its projection's rows
# A mixture's (moe.Experts): the router replicated, the stacked projections cut by rows into whole experts; its
# shared expert's gate vector replicated, its projections as a dense FFN's.
EXPERT_CUTS = {"router": None, "gate": ROWS, "up": ROWS, "down": ROWS}
SHARED_EXPERT_CUTS = {"gate_inp": None, "gate": ROWS, "up": ROWS, "down": COLS}
CACHE_SPEC = P(None, None, None, AXIS, None)  # KV caches [n_layer, B, max_len, n_head_kv, hd]: by KV heads


@functools.cache
def mesh(tp: int) -> jax.sharding.Mesh:
    """The first `tp` devices (of every process, process by process) in a 1-D mesh. Auto axes: outside the
    shard_map (sampling the vocabulary-sharded logits) XLA decides the communication."""
    return jax.make_mesh((tp,), (AXIS,), axis_types=(AxisType.Auto,), devices=distributed.devices()[:tp])


@functools.cache
def data_mesh(dp: int) -> jax.sharding.Mesh:
    """The first `dp` devices in a 1-D mesh over which evaluation windows are spread."""
    return jax.make_mesh((dp,), (DATA_AXIS,), axis_types=(AxisType.Auto,), devices=distributed.devices()[:dp])


def plan_mesh(plan: Plan) -> jax.sharding.Mesh | None:
    """The mesh the plan runs on: the tensor-parallel or the data-parallel one; None for one device."""
    return mesh(plan.tp) if plan.tp > 1 else data_mesh(plan.dp) if plan.dp > 1 else None


def check_model(cfg, tp: int) -> None:
    """The model's heads and vocabulary can be cut `tp` ways (each weight's blocks are checked as it is cut)."""
    if tp == 1:
        return
    if cfg.n_expert % tp:
        raise JaxinferError(f"--tp {tp}: a mixture's experts are cut whole over the devices and the model has "
                            f"{cfg.n_expert}, not a multiple of {tp}")
    if cfg.sub_norms:
        raise JaxinferError(f"--tp {tp}: {cfg.arch}'s sub-norms normalize over all heads and all neurons, which a cut "
                            f"over devices would need another all-reduce for: not supported yet")
    if cfg.n_head_kv % tp:
        raise JaxinferError(f"--tp {tp}: attention is cut by KV heads and the model has {cfg.n_head_kv} "
                            f"({cfg.n_head} query heads), not a multiple of {tp}")
    if cfg.n_vocab % tp:
        raise JaxinferError(f"--tp {tp}: the output head is cut by vocabulary and the model's {cfg.n_vocab} tokens "
                            f"are not a multiple of {tp}")


def _cut_spec(name: str, w: QuantArray, axis: int, tp: int) -> QuantArray:
    """w with its data replaced by the PartitionSpec that cuts `axis` of the weight `tp` ways, checked on whole
    blocks: w's own pytree structure, so that it is a spec tree for w."""
    rows, cols = w.shape
    described = f"{name} [{rows}, {cols}] ({w.qtype.name})"
    if w.layout == NEURON_MAJOR:  # data [n_ff / 32, bytes]: one row of data per 32 neurons
        if rows % (NEURON_BLOCK * tp):
            raise JaxinferError(f"--tp {tp}: {described}, neuron-major, is cut on blocks of {NEURON_BLOCK} neurons: "
                                f"{rows} / {tp} is not a multiple of {NEURON_BLOCK}")
    elif axis == ROWS and w.layout == ROWS_X8:  # data [rows / 8, bytes]: one row of data per group of eight rows
        if rows % (INTERLEAVE * tp):
            raise JaxinferError(f"--tp {tp}: {described}, repacked, is cut on groups of {INTERLEAVE} rows: {rows} / "
                                f"{tp} is not a multiple of {INTERLEAVE}")
    elif axis == ROWS:
        if rows % tp:
            raise JaxinferError(f"--tp {tp}: {described} cannot be cut into {tp} equal row shards")
    else:
        block = 1 if w.qtype in FLOAT_TYPES else QUANT_SIZES[w.qtype][0]
        if cols % (block * tp):
            raise JaxinferError(f"--tp {tp}: {described} is cut by columns on whole {block}-value blocks: {cols} / "
                                f"{tp} is not a multiple of {block}")
    return dataclasses.replace(w, data=P(AXIS, None) if axis == ROWS else P(None, AXIS))


def _spec(name: str, value, axis: int | None, tp: int):
    """The spec tree of one field: None stays None, a cut QuantArray its _cut_spec, anything else replicated."""
    if value is None:
        return None
    if isinstance(value, list):
        raise JaxinferError(f"--tp {tp} does not combine with a hot/cold split of the FFN (--vram-budget)")
    if axis is None:
        return jax.tree.map(lambda _: P(), value)
    if not isinstance(value, QuantArray):  # a bias vector, cut as its projection's rows are
        return P(AXIS)
    return _cut_spec(name, value, axis, tp)


def _expert_specs(prefix: str, experts, tp: int):
    """The spec tree of a layer's mixture (moe.Experts; None stays None), as EXPERT_CUTS says (the experts' count is
    checked by check_model: expert e's rows of a projection are one run, the runs in expert order)."""
    if experts is None:
        return None
    if experts.parts is not None:
        raise JaxinferError(f"--tp {tp} does not combine with a hot/cold split of the experts (--vram-budget)")

    def cut(value, cuts, name):  # name: a cut field's GGUF tensor, for the errors
        return dataclasses.replace(value, **{field: _spec(f"{prefix}.{name.format(field)}", getattr(value, field),
                                                          axis, tp) for field, axis in cuts.items()})

    shared = None if experts.shared is None else cut(experts.shared, SHARED_EXPERT_CUTS, "ffn_{}_shexp")
    return cut(dataclasses.replace(experts, shared=shared), EXPERT_CUTS, "ffn_{}_exps")


def weight_specs(weights, tp: int):
    """The PartitionSpec tree of a model.Weights (see the module docstring)."""
    def field_spec(i, layer, name):
        if name == "experts":
            return _expert_specs(f"blk.{i}", layer.experts, tp)
        return _spec(f"blk.{i}.{name}", getattr(layer, name), LAYER_CUTS.get(name), tp)

    layers = [dataclasses.replace(layer, **{f.name: field_spec(i, layer, f.name) for f in dataclasses.fields(layer)})
              for i, layer in enumerate(weights.layers)]
    return dataclasses.replace(weights, token_embd=_spec("token_embd", weights.token_embd, ROWS, tp), layers=layers,
                               output_norm=P(), output=_spec("output", weights.output, ROWS, tp),
                               output_norm_b=_spec("output_norm_b", weights.output_norm_b, None, tp))


def cache_specs(cache):
    """The PartitionSpec tree of a model.KVCache (None for no cache): K and V by KV heads, lengths replicated."""
    if cache is None:
        return None
    return dataclasses.replace(cache, k=CACHE_SPEC, v=CACHE_SPEC, length=P())


def _is_spec(x) -> bool:
    return isinstance(x, P)


def _place(tree, specs, on: jax.sharding.Mesh):
    shardings = jax.tree.map(lambda spec: NamedSharding(on, spec), specs, is_leaf=_is_spec)
    if jax.process_count() == 1 or _traced(tree):
        return jax.device_put(tree, shardings)
    return jax.tree.map(distributed.global_array, tree, shardings)


def _traced(tree) -> bool:
    """Whether `tree` holds values being traced (inside jit, where placing is a sharding constraint)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def shard_weights(weights, cfg):
    """The weights placed on the plan's devices, each cut as weight_specs says (checked first: a JaxinferError
    names the tensor that cannot be cut, and why), or whole on every device of a data-parallel plan; unchanged with
    one device, but for weights made at load in numpy (a layer's neurons reordered hottest first, a part's rows):
    those are placed (quant.placed_copy), or every compiled call would take them as arguments to convert, a copy each
    time where not 64-byte aligned (hot-first decode ran 0.73-0.77x). A tied output head stays the embedding itself
    (both are cut by vocabulary)."""
    tp = cfg.plan.tp
    if cfg.plan.dp > 1:
        placed = _place(weights, jax.tree.map(lambda _: P(), weights), data_mesh(cfg.plan.dp))
    elif tp == 1:
        if jax.process_count() > 1:  # each process's own weights, views of its file (distributed.py)
            return weights
        placed = jax.tree.map(lambda a: placed_copy(a) if isinstance(a, np.ndarray) else a, weights)
    else:
        check_model(cfg, tp)
        placed = _place(weights, weight_specs(weights, tp), mesh(tp))
    return dataclasses.replace(placed, output=placed.token_embd) if weights.output is weights.token_embd else placed


def shard_cache(cache, plan: Plan):
    """A new KV cache placed on the plan's devices by KV heads (inside a jitted function: constrained so)."""
    return cache if plan.tp == 1 else _place(cache, cache_specs(cache), mesh(plan.tp))


def on_mesh(tree, plan: Plan, spec: P = P()):
    """The arrays of `tree` that this process holds whole (numpy or its own jax.Arrays; the inputs of a compiled
    step) as arrays on the plan's mesh, placed by `spec` (default: whole on every device), when the mesh spans
    several processes: a compiled program over their devices takes only such global arrays. Unchanged in a single
    process (JAX places them itself) and for arrays already spanning the processes."""
    on = plan_mesh(plan)
    if jax.process_count() == 1 or on is None:
        return tree

    def put(value):
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            return value
        return distributed.global_array(value, NamedSharding(on, spec))

    return jax.tree.map(put, tree)


def readable(tree, plan: Plan):
    """Inside jit: the arrays of `tree` made whole on every device of the plan's mesh when it spans several processes,
    so that each process can read them (sampled tokens, scores): an array cut over processes cannot be fetched.
    Unchanged in a single process."""
    on = plan_mesh(plan)
    if jax.process_count() == 1 or on is None:
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(on, P())), tree)


def over_windows(scores, plan: Plan):
    """scores(windows [B, ...], base (a tuple of [B, ...] arrays), weights) run on every device of the data mesh
    over its B / dp windows, the weights whole on each (shard_map); each result gathered back whole on every device
    (all_gather over the batch axis), so that any process reads all of it."""
    def shard(windows, base, weights):
        return jax.tree.map(lambda x: jax.lax.all_gather(x, DATA_AXIS, tiled=True), scores(windows, base, weights))

    return jax.shard_map(shard, mesh=data_mesh(plan.dp), in_specs=(P(DATA_AXIS), P(DATA_AXIS), P()), out_specs=P(),
                         check_vma=False)


def _local_view(tree, specs, tp: int):
    """Inside the shard_map: each cut QuantArray's static shape divided to its local shard's."""
    def local(value, spec):
        if not isinstance(value, QuantArray):
            return value
        axis = ROWS if spec.data == P(AXIS, None) else COLS if spec.data == P(None, AXIS) else None
        if axis is None:
            return value
        shape = list(value.shape)
        shape[axis] //= tp
        return dataclasses.replace(value, shape=tuple(shape))

    return jax.tree.map(local, tree, specs, is_leaf=lambda x: isinstance(x, QuantArray))


def all_reduce(x, plan: Plan):
    """Inside the shard_map: the sum over the devices of their partial results (after attn_output, after the FFN's
    down projection); x itself with one device."""
    return x if plan.tp == 1 else jax.lax.psum(x, AXIS)


def held_experts(n_expert: int, n_held: int, plan: Plan):
    """Inside the shard_map: int32 [n_expert], each expert's place among the n_held this device holds, -1 for
    another device's (moe.ExpertPart.local); None with one device."""
    if plan.tp == 1:
        return None
    place = jnp.arange(n_expert, dtype=jnp.int32) - jax.lax.axis_index(AXIS) * n_held
    return jnp.where((place >= 0) & (place < n_held), place, -1)


def embed(table: QuantArray, tokens, plan: Plan):
    """The embedding rows of `tokens` -> f32 [*tokens.shape, d] (quant.take_rows). Inside the shard_map the table is
    cut by vocabulary: each device gives the rows it holds and zeros for the others, and their sum is every row,
    exactly."""
    if plan.tp == 1:
        return take_rows(table, tokens)
    held_rows = table.shape[0]
    local = tokens - jax.lax.axis_index(AXIS) * held_rows
    held = (local >= 0) & (local < held_rows)
    rows = take_rows(table, jnp.where(held, local, 0))
    return jax.lax.psum(jnp.where(held[..., None], rows, 0.0), AXIS)


def forward_on_shards(body, tokens, weights, cfg, cache, observe, n_valid, row):
    """body(tokens, weights, cfg, cache, observe, n_valid, row) (model._forward) run on every device over its
    shards of the weights and the cache (shard_map), its hidden states coming out replicated and its cache cut by
    KV heads; body itself with one device. A Python `row` stays static."""
    tp = cfg.plan.tp
    if tp == 1:
        return body(tokens, weights, cfg, cache, observe, n_valid, row)
    if observe is not None:
        raise JaxinferError(f"observing the FFNs (profile, calibrate, train_predictor) runs on one device, not "
                            f"--tp {tp}")
    w_specs, c_specs = weight_specs(weights, tp), cache_specs(cache)
    static_row = isinstance(row, int)

    def shard(tokens, weights, cache, n_valid, row_arg):
        return body(tokens, _local_view(weights, w_specs, tp), cfg, cache, None, n_valid,
                    row if static_row else row_arg)

    run = jax.shard_map(shard, mesh=mesh(tp), in_specs=(P(), w_specs, c_specs, P(), P()),
                        out_specs=(P(), c_specs, P()), check_vma=False)
    return run(tokens, weights, cache, n_valid, None if static_row else row)


def head_on_shards(product, hidden, head: QuantArray, plan: Plan):
    """product(hidden [..., d], head) -> logits [..., n_vocab], each device computing the logits of its rows of the
    head (the vocabulary cut `plan.tp` ways; the result is cut so too); product itself with one device."""
    if plan.tp == 1:
        return product(hidden, head)
    spec = _cut_spec("output", head, ROWS, plan.tp)
    lead = hidden.shape[:-1]

    def shard(hidden, head):
        return product(hidden, _local_view(head, spec, plan.tp))

    run = jax.shard_map(shard, mesh=mesh(plan.tp), in_specs=(P(), spec), out_specs=P(None, AXIS), check_vma=False)
    return run(hidden.reshape(-1, hidden.shape[-1]), head).reshape(*lead, -1)

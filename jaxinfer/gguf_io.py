"""GGUF files -> `Config` + `Weights`, through gguf-py's memory-mapped `GGUFReader`.

Tensors go to JAX in their stored format (quantized blocks stay blocks). On the CPU backend each weight is copied
once: those of 4 MiB or more into huge pages (`place`), those the plan repacks (repack.py) into their new layout; a
small one that is 64-byte aligned is served straight from the file mapping (`jax.device_put` of such a read-only
view is zero-copy). The pages of the mapping a weight was copied or repacked from are then let go: the process holds
each weight once, not twice. Loaded `on_host`, the weights stay numpy views of
the file mapping, read only where they are placed: a process of a run over several reads just its own shards
(sharding.shard_weights, distributed.global_array).
"""

import dataclasses
import os

import jax
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from jaxinfer import blocks, distributed, moe, quant, repack, ternary
from jaxinfer.config import Config
from jaxinfer.errors import JaxinferError, not_a_model_file
from jaxinfer.gguf_reader import GGUF_MAGIC, POWERINFER_MAGIC, Reader, array_length, shown
from jaxinfer.metadata import LongArray
from jaxinfer.model import Layer, Weights
from jaxinfer.quant import QuantArray, from_gguf_data
from jaxinfer.ternary import QUANT_SIZES, quant_type
from jaxinfer.validate import check_tensors, down_stored_per_neuron, tensor_shape

LAYER_TENSORS = {  # Layer field -> GGUF tensor name within blk.N
    "attn_norm": "attn_norm",
    "attn_q": "attn_q",
    "attn_k": "attn_k",
    "attn_v": "attn_v",
    "attn_output": "attn_output",
    "ffn_norm": "ffn_norm",
    "ffn_gate": "ffn_gate",
    "ffn_up": "ffn_up",
    "ffn_down": "ffn_down",
}
SMALL_ARRAY = 64  # metadata arrays longer than this (vocabularies, merges) are read on demand, not into `metadata`
# GGUF value types of the Python values `GGUFFile.array` returns, by the kind asked for.
ARRAY_ITEM_TYPES = {
    str: {GGUFValueType.STRING},
    int: {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16, GGUFValueType.UINT32,
          GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64},
    float: {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64},
}


@dataclasses.dataclass
class GGUFFile:
    """An open GGUF file: its reader, scalar metadata and tensors by name."""

    path: str
    reader: GGUFReader
    metadata: dict
    tensors: dict
    powerinfer: bool  # PWRI magic: PowerInfer's sparse-model format

    def array(self, key: str, item: type = str) -> list | None:
        """A metadata array (e.g. `tokenizer.ggml.tokens`) of `item`s (str, int or float) as a Python list, or None
        when absent; a JaxinferError naming the key when it is not such an array or a string in it is not UTF-8."""
        field = self.reader.get_field(key)
        if field is None:
            return None
        if field.types[0] != GGUFValueType.ARRAY or (len(field.types) > 1 and
                                                      field.types[1] not in ARRAY_ITEM_TYPES[item]):
            found = "/".join(t.name for t in field.types)
            raise JaxinferError(f"metadata {key} must be an array of {item.__name__}, found {found}")
        return _contents(key, field)


def _contents(key: str, field):
    try:
        return field.contents()
    except UnicodeDecodeError as e:
        raise JaxinferError(f"metadata {shown(key)} is not UTF-8 ({e.reason} at byte {e.start})") from None


def open_gguf(path: str, reader: type[Reader] = Reader) -> GGUFFile:
    """Open a GGUF file and check its structure; every way it can be unusable is a one-line JaxinferError. `reader`:
    the Reader class (gguf_reader.TolerantReader keeps the tensors that pass their checks, for inspection)."""
    if not os.path.isfile(path):
        raise not_a_model_file(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic not in (GGUF_MAGIC, POWERINFER_MAGIC):
            raise JaxinferError(f"{path} is not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r} or "
                                f"{POWERINFER_MAGIC!r})")
        reader = reader(path)
    except OSError as e:
        raise JaxinferError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, IndexError, KeyError, EOFError) as e:  # CorruptGGUF, and gguf-py's own (e.g. alignment)
        raise JaxinferError(f"{path} is truncated or corrupt: {e}") from None
    metadata = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] == GGUFValueType.ARRAY and array_length(field) > SMALL_ARRAY:
            metadata[key] = LongArray(array_length(field))
        else:
            try:
                metadata[key] = _contents(key, field)
            except JaxinferError as e:
                raise JaxinferError(f"{path}: {e}") from None
    return GGUFFile(path, reader, metadata, {t.name: t for t in reader.tensors}, magic == POWERINFER_MAGIC)


HUGE_PAGE_COPY_BYTES = 2 * quant.HUGE_PAGE_BYTES  # quant.aligned_empty gives huge pages from there


def load_vector(gguf: GGUFFile, name: str, on_host: bool = False):
    """An F32 vector (checked by validate.check_tensors); with `on_host` the file's numpy view."""
    data = gguf.tensors[name].data.reshape(-1)
    return data if on_host else place(data)


def place(view: np.ndarray) -> jax.Array:
    """A view of the file mapping on the default device. Where that copied it (not 64-byte aligned, or not a CPU),
    the view's pages leave resident memory: JAX holds the copy, and the file's pages would otherwise stay counted
    beside it (a 7B-shaped Q4_0 file of 638 MiB took 1295 MiB to load). On the CPU a weight of 4 MiB or more is
    copied into huge pages (quant.aligned_empty), which JAX then holds without a second copy: read a row at a time
    from scattered places, as a sparse FFN's active rows are, it streams faster than from the file's 4 KiB pages."""
    if view.nbytes >= HUGE_PAGE_COPY_BYTES and jax.default_backend() == "cpu":
        placed = quant.placed_copy(view).block_until_ready()
        distributed.release_pages(view)
        return placed
    placed = jax.device_put(view).block_until_ready()
    if placed.unsafe_buffer_pointer() != view.ctypes.data:
        distributed.release_pages(view)
    return placed


def load_matrix(gguf: GGUFFile, name: str, exact: bool = False, on_host: bool = False,
                packs=lambda w: False, held_as=lambda w: w.qtype, rows: slice | None = None) -> QuantArray:
    """A matrix of a supported type (checked by validate.check_tensors); with `on_host` its data the file's numpy
    view; repacked (quant.pack_rows_x8) where `packs(w)` says (repack.packs); held as the type `held_as(w)` names
    where it is not its own (repack.held_type: TQ1_0 as TQ2_0; Q5_0 as Q8_0, then repacked, not on the host). A
    `NAME.scale` tensor beside `NAME.weight` (llama.cpp's bitnet: one f32 multiplying the projection's result)
    becomes part of its scale. `rows`: only those rows, a part of a fused tensor (Config.fused_parts)."""
    t = gguf.tensors[name]
    view = np.asarray(t.data)
    w = from_gguf_data(view, quant_type(t.tensor_type), tensor_shape(gguf, name, 2))
    if rows is not None:  # blocks run along rows: a part's rows are still a view of the file, its pages its own
        view = w.data[rows]
        w = dataclasses.replace(w, data=view, shape=(view.shape[0], w.shape[1]))
    scale_name = name.removesuffix(".weight") + ".scale"
    scale = w.scale * float(gguf.tensors[scale_name].data[0]) if scale_name in gguf.tensors else w.scale
    w = dataclasses.replace(w, exact=exact, scale=scale)
    held = held_as(w)
    if held == GGMLQuantizationType.TQ2_0 and w.qtype == GGMLQuantizationType.TQ1_0:
        tq2_0 = jax.block_until_ready(ternary.tq1_0_as_tq2_0(view))
        distributed.release_pages(view)
        return dataclasses.replace(w, data=np.asarray(tq2_0) if on_host else tq2_0, qtype=held)
    if held == GGMLQuantizationType.Q8_0 and w.qtype == GGMLQuantizationType.Q5_0 and not on_host:
        blocks = view.reshape(*view.shape[:-1], -1, QUANT_SIZES[w.qtype][1])
        q8_0 = repack.q5_0_as_q8_0(blocks).reshape(*view.shape[:-1], -1)
        distributed.release_pages(view)
        return _held(dataclasses.replace(w, data=q8_0, qtype=held), q8_0, quant.pack_rows_x8)
    return w if on_host else _held(w, view, quant.pack_rows_x8 if packs(w) else None)


def _held(w: QuantArray, view: np.ndarray, pack=None) -> QuantArray:
    """w (its data the file's `view`) as the model holds it: placed (place), or laid out anew by `pack` (QuantArray
    -> QuantArray: quant.pack_rows_x8, moe.down_rows_per_neuron) and the file's pages let go."""
    if pack is None:
        return dataclasses.replace(w, data=place(w.data))
    packed = pack(w)
    jax.block_until_ready(packed.data)  # the new layout has read the mapping: its pages are not needed again
    distributed.release_pages(view)
    return packed


# Layer field -> F32 vector within blk.N, loaded where the file has it (blocks.check_block_tensors says when it must).
LAYER_VECTORS = {"attn_q_bias": "attn_q.bias", "attn_k_bias": "attn_k.bias", "attn_v_bias": "attn_v.bias",
                 "attn_q_norm": "attn_q_norm.weight", "attn_k_norm": "attn_k_norm.weight",
                 "attn_post_norm": "post_attention_norm.weight", "ffn_post_norm": "post_ffw_norm.weight",
                 "attn_norm_b": "attn_norm.bias"}


def _down_stored_per_neuron(w: QuantArray, view: np.ndarray, i: int, on_host: bool, cfg: Config) -> QuantArray:
    """Layer i's stacked expert down projection that the file stores a row per neuron ([n_expert * n_ff_exp, d]:
    PowerInfer's --transpose-down) as the model holds it: so, laid out for cpu_ext's down_rows kernels (the same
    bytes), where the plan holds the layer's experts' down projection a row per neuron (repack.holds_expert_rows);
    else transposed back to GGUF's usual [n_expert * d, n_ff_exp] (moe.experts_transposed), repacked where the plan
    repacks experts."""
    if not on_host and repack.holds_expert_rows(w, i, cfg, stored=True):
        return _held(w, view, quant.pack_down_rows)
    f, d = cfg.n_ff_exp, cfg.n_embd
    whole = dataclasses.replace(moe.experts_transposed(view, w.qtype, cfg.n_expert, f, d), exact=w.exact)
    distributed.release_pages(view)  # read: the new array holds its values
    if on_host:
        return whole
    return _held(whole, whole.data, quant.pack_rows_x8 if repack.packs_experts(whole, cfg.n_expert, cfg.plan) else None)


def _load_experts(gguf: GGUFFile, i: int, exact: bool, on_host: bool, packs, cfg: Config) -> moe.Experts:
    """Layer i's mixture of experts: its router, and its stacked projections each as one QuantArray (moe.stacked),
    repacked where repack.packs_experts says, the down projection a row per neuron where its zeros are skipped
    (repack.holds_expert_rows); a shared expert's as the FFN's are (`packs`)."""
    def stacked(tensor):
        name = f"blk.{i}.{tensor}.weight"
        t = gguf.tensors[name]
        view = np.asarray(t.data)
        w = dataclasses.replace(moe.stacked(view, quant_type(t.tensor_type), tensor_shape(gguf, name, 3)), exact=exact)
        if tensor == "ffn_down_exps" and down_stored_per_neuron(gguf, cfg, i):
            return _down_stored_per_neuron(w, view, i, on_host, cfg)
        if on_host:
            return w
        if tensor == "ffn_down_exps" and repack.holds_expert_rows(w, i, cfg):
            return _held(w, view, lambda w: moe.down_rows_per_neuron(view, w.qtype, cfg.n_expert, cfg.n_ff_exp,
                                                                     cfg.n_embd))
        return _held(w, view, quant.pack_rows_x8 if repack.packs_experts(w, cfg.n_expert, cfg.plan) else None)

    shared = None
    if f"blk.{i}.ffn_gate_inp_shexp.weight" in gguf.tensors:  # Qwen2-MoE (validate.check_tensors: all or none)
        shared = moe.SharedExpert(load_vector(gguf, f"blk.{i}.ffn_gate_inp_shexp.weight", on_host),
                                  *(load_matrix(gguf, f"blk.{i}.{t}_shexp.weight", exact, on_host,
                                                lambda w, field=t: packs(field, w))
                                    for t in ("ffn_gate", "ffn_up", "ffn_down")))
    return moe.Experts(load_matrix(gguf, f"blk.{i}.ffn_gate_inp.weight", exact, on_host),
                       *(stacked(t) for t in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")), shared=shared)


def _load_layer(gguf: GGUFFile, i: int, exact: bool, on_host: bool, packs, held_as, cfg: Config) -> Layer:
    def name(tensor):
        return f"blk.{i}.{tensor}.weight"

    def matrix(tensor, field=None, rows=None):
        return load_matrix(gguf, name(tensor), exact, on_host, lambda w: packs(field, w),
                           lambda w: held_as(field, w), rows)

    def optional(tensor, field=None):
        return matrix(tensor, field) if name(tensor) in gguf.tensors else None

    skipped = moe.DENSE_FFN if cfg.n_expert else ("ffn_down",)  # a mixture of experts has none of the FFN's
    fused = cfg.fused_parts(name("attn_qkv") in gguf.tensors)
    tensors = {field: load_vector(gguf, name(tensor), on_host) if field.endswith("_norm") else matrix(tensor, field)
               for field, tensor in LAYER_TENSORS.items() if field not in fused and field not in skipped}
    tensors |= {field: None if part is None else matrix(part[0], field, part[1]) for field, part in fused.items()}
    down_t = optional("ffn_down_t")  # PowerInfer stores the down projection transposed, one row per neuron
    if down_t is None and not cfg.n_expert and down_stored_per_neuron(gguf, cfg, i):  # or so under its usual name
        down_t = matrix("ffn_down", "ffn_down_t")
    down = None if down_t is not None or cfg.n_expert else matrix("ffn_down", "ffn_down")
    if cfg.n_expert:
        tensors |= dict(ffn_gate=None, ffn_up=None, experts=_load_experts(gguf, i, exact, on_host, packs, cfg))
    norms = {field: load_vector(gguf, name(field), on_host) for field in ("attn_sub_norm", "ffn_sub_norm")
             if cfg.sub_norms}
    norms |= {field: load_vector(gguf, f"blk.{i}.{tensor}", on_host) for field, tensor in LAYER_VECTORS.items()
              if f"blk.{i}.{tensor}" in gguf.tensors}
    return Layer(**tensors, ffn_down=down, ffn_down_t=down_t, fc1=optional("fc1", "fc1"), fc2=optional("fc2", "fc2"),
                 **norms)


def load_weights(gguf: GGUFFile, cfg: Config, exact: bool = False, on_host: bool = False,
                 repack_ffn: tuple[str, ...] = repack.FFN) -> Weights:
    """`exact`: every matmul multiplies by the dequantized weight, never through 8-bit-activation kernels. Every
    tensor is checked against `cfg` first. `on_host`: the arrays are the file's numpy views, for the caller to
    place (nothing is read yet). Weights are repacked where cfg.plan says (repack.packs; the FFN's only with
    `repack_ffn` among the FFN's: those a sparsity mode multiplies densely, none for a model about to be split)."""
    check_tensors(gguf, cfg)
    blocks.check_block_tensors(gguf, cfg)

    def packs(field, w):
        return repack.packs(field, w, cfg.plan, repack_ffn)

    def held_as(field, w):
        return repack.held_type(field, w, cfg.plan, repack_ffn)

    tied = "output.weight" not in gguf.tensors
    embedding = repack.OUTPUT if tied else "token_embd"  # only looked up unless it is the output head too
    token_embd = load_matrix(gguf, "token_embd.weight", exact, on_host, lambda w: tied and packs(repack.OUTPUT, w),
                             lambda w: held_as(embedding, w))
    layers = [_load_layer(gguf, i, exact, on_host, packs, held_as, cfg) for i in range(cfg.n_layer)]
    output = token_embd if tied else load_matrix(gguf, "output.weight", exact, on_host,
                                                 lambda w: packs(repack.OUTPUT, w),
                                                 lambda w: held_as(repack.OUTPUT, w))
    norm_bias = load_vector(gguf, "output_norm.bias", on_host) if cfg.layer_norm else None
    return Weights(token_embd, layers, load_vector(gguf, "output_norm.weight", on_host), output, norm_bias)


def load_config(gguf: GGUFFile) -> Config:
    """The config of the file's metadata, with llama's rope_freqs.weight (Llama 3.x's RoPE frequency factors) read
    into it where the file has one."""
    n_vocab = tensor_shape(gguf, "token_embd.weight", 2)[0]
    try:
        cfg = Config.from_metadata(gguf.metadata, n_vocab=n_vocab, powerinfer=gguf.powerinfer)
    except JaxinferError as e:
        raise JaxinferError(f"{gguf.path}: {e}") from None
    if "rope_freqs.weight" not in gguf.tensors:
        return cfg
    return dataclasses.replace(cfg, rope_freq_factors=blocks.rope_freq_factors(gguf, cfg))

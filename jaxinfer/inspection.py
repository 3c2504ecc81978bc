"""What a GGUF file is and how jaxinfer would run it on this machine, read from its metadata and tensor infos alone
(the file stays memory-mapped; no weight is read): the library behind `python -m jaxinfer.inspect` and the kernel
columns of run receipts (receipt.py).

Everything is derived from the tables the engine itself runs on, so that a new architecture, tensor type or kernel
shows up here without a change: config.ARCHITECTURES and Config.from_metadata, quant's decoders and CPU kernel types,
the Plan of this machine (plan.make_plan), cpu_ext's ISA, the Pallas kernel's types (hybrid.kernel_takes),
sparse_ffn's activations, and the checks a run makes (the bounded reader, validate.check_tensors, the tokenizer).
"""

import bisect
import collections
import dataclasses
import os
import re
import struct

import numpy as np
from gguf import GGMLQuantizationType

from jaxinfer import (activation_profile, blocks, config, hybrid, metadata, placement, quant, repack, sidecar,
                      sparsity, ternary, validate)
from jaxinfer.errors import JaxinferError, not_a_model_file
from jaxinfer.gguf_io import GGUFFile, open_gguf
from jaxinfer.gguf_reader import GGUF_MAGIC, POWERINFER_MAGIC, TolerantReader
from jaxinfer.plan import Plan, accelerator_plan, make_plan, soft_capping
from jaxinfer.sparse_ffn import ACTIVATIONS
from jaxinfer.tokenizer import load_tokenizer

MIB = 2**20
RUNS, LIMITED, DOES_NOT_RUN = "runs", "runs with limitations", "does not run"
PREDICTOR_TENSORS = ("fc1", "fc2")
SPLIT_TENSORS = ("ffn_gate", "ffn_up", "ffn_down", "ffn_down_t")  # what a hot/cold split cuts by neuron (hybrid.py)
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # what it cuts by expert in a mixture
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)\.weight")
GPU_PRODUCTS = {"xla_fused": "XLA on dequantized weights, decode fused with the dequantization"}  # Plan.products


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor as its info reads, whether or not its type is known."""

    name: str
    type_id: int
    dims: tuple[int, ...]  # GGML order, innermost first
    offset: int  # of its data in the file
    nbytes: int | None  # as the reader sized it; None where it could not read the tensor

    @property
    def type_name(self) -> str:
        return type_name(self.type_id)


def _types_by_id(types) -> dict[int, object]:
    """{type id: type} of a set of types. Keyed by id, not by gguf's enum: a type jaxinfer adds that gguf-py lacks
    (Microsoft's I2_S, id 36) joins quant's tables with its own id and name, and is found here the same way."""
    return {int(q): q for q in types}


def known_types() -> dict[int, object]:
    """Every type that gguf-py or jaxinfer names, by id."""
    return _types_by_id(GGMLQuantizationType) | _types_by_id(quant.SUPPORTED_TYPES)


def type_name(type_id: int) -> str:
    known = known_types().get(type_id)
    return known.name if known is not None else f"type id {type_id}"


def cpu_ext_status() -> dict:
    """The cpu_ext kernels of this machine: available, the ISA they run with, whether the neuron-major kernel is a
    fast one; or why they cannot load."""
    kernels = quant.cpu_kernels()
    if kernels is None:
        return {"available": False, "isa": None, "fast_neuron_major": False,
                "reason": "libjaxinfer_cpu.so not built or not loadable"}
    return {"available": True, "isa": kernels.isa(), "fast_neuron_major": kernels.fast_neuron_major(),
            "library": str(kernels.LIBRARY_PATH)}


def kernel_route(type_id: int, plan: Plan, isa: str | None) -> str:
    """How a weight of type `type_id` is multiplied under `plan` (quant._kernels' decision, for products in device
    memory)."""
    type_id = int(type_id)
    if type_id not in _types_by_id(quant.SUPPORTED_TYPES):
        why = "jaxinfer has no decoder for it" if type_id in known_types() else "unknown type id"
        return f"unsupported ({why}){ternary.unsupported_type_note(type_id)}"
    if repack.widens_tq1_0(type_id, plan):
        return "held as TQ2_0 (repack.py): " + kernel_route(GGMLQuantizationType.TQ2_0, plan, isa)
    if plan.repack and type_id == GGMLQuantizationType.Q5_0:
        return ("held as Q8_0 and repacked where a Q8_0 weight would be (repack.py): "
                + kernel_route(GGMLQuantizationType.Q8_0, plan, isa))
    if plan.products == "cpu_ext" and type_id in _types_by_id(quant.CPU_KERNEL_TYPES):
        dots = "f32 dots" if type_id in _types_by_id(quant.FLOAT_TYPES) else "8-bit activations"
        if type_id in _types_by_id(quant.CPU_KERNEL_UNBOUNDED_TYPES):
            return f"cpu_ext {isa} ({dots}) for any number of tokens"
        if plan.repack and type_id in _types_by_id(quant.REPACKED_TYPES):
            return (f"cpu_ext {isa} ({dots}), repacked eight rows to a group for dense products at any number of "
                    f"tokens (repack.py); in GGUF's rows up to {quant.CPU_KERNEL_MAX_TOKENS} tokens a call, XLA beyond")
        return f"cpu_ext {isa} ({dots}) up to {quant.CPU_KERNEL_MAX_TOKENS} tokens a call, XLA beyond"
    if type_id == GGMLQuantizationType.F32:
        return "XLA f32"
    if plan.products == "cpu_ext":
        return "XLA on dequantized weights (no cpu_ext kernel for this type)"
    return "XLA on dequantized weights" + (" (cpu_ext unavailable)" if plan.backend == "cpu" else "")


def kernel_routes(qtypes, plan: Plan | None = None) -> dict[str, str]:
    """{type name: kernel_route} for the types of a file, under `plan` (default: this machine's)."""
    plan = plan or make_plan()
    isa = cpu_ext_status()["isa"]
    return {type_name(int(q)): kernel_route(int(q), plan, isa) for q in sorted({int(q) for q in qtypes})}


def read_header(path: str) -> dict:
    """Magic, version and size from the first bytes, for files that fail before gguf-py can read them."""
    with open(path, "rb") as f:
        head = f.read(8)
    magic = head[:4]
    kind = {GGUF_MAGIC: "GGUF", POWERINFER_MAGIC: "PowerInfer (PWRI)"}.get(magic)
    version = struct.unpack("<I", head[4:8])[0] if kind and len(head) == 8 else None
    return {"path": os.path.abspath(path), "size_bytes": os.path.getsize(path),
            "magic": magic.decode("latin-1") if kind else repr(magic), "format": kind or "not GGUF",
            "version": version}


def check_readable(path: str) -> None:
    """A JaxinferError (a usage error: exit 2) when `path` is not a file this process can read."""
    if not os.path.isfile(path):
        raise not_a_model_file(path)
    if not os.access(path, os.R_OK):
        raise JaxinferError(f"cannot read {path}: permission denied")


class Inspection:
    """Builds the report of one file (see `inspect_model`); each section reads what the ones before found."""

    def __init__(self, path: str):
        self.path = path
        self.problems: list[str] = []
        self.limitations: list[str] = []
        self.notes: list[str] = []  # what could not be checked, because of a problem found before
        self.gguf: GGUFFile | None = None
        self.cfg: config.Config | None = None
        self.infos: list[TensorInfo] = []
        self.layers: dict[int, dict[str, TensorInfo]] = collections.defaultdict(dict)  # blk.N.<kind>.weight
        self.plan = make_plan()
        self.cpu_ext = cpu_ext_status()

    def report(self) -> dict:
        report = {"file": self.file_section()}
        if self.gguf is not None:
            report["architecture"] = self.architecture_section()
            report["tensor_types"] = self.types_section()
            report["kernels"] = self.kernels_section()
            report["powerinfer"] = self.powerinfer_section()
            report["sparsity"] = self.sparsity_section()
            report["hybrid_split"] = self.split_section()
            report["gpu"] = self.gpu_section()
            self.validate()
        report["problems"] = self.problems
        report["notes"] = self.notes
        report["verdict"] = self.verdict()
        return report

    # -------------------------------------------------------------------------------------------------- the file

    def file_section(self) -> dict:
        section = read_header(self.path)
        try:
            self.gguf = open_gguf(self.path, TolerantReader)
        except JaxinferError as e:
            self.problems.append(str(e))
            return section
        reader = self.gguf.reader
        self.problems += [f"{self.path}: {problem}" for problem in reader.tensor_problems]
        sizes = {t.name: int(t.n_bytes) for t in reader.tensors}  # the reader's own size rule, for every type it reads
        self.infos = [TensorInfo(name, type_id, tuple(dims), offset, sizes.get(name))
                      for name, type_id, dims, offset in reader.tensor_infos]
        for t in self.infos:  # by the names present: block_count may claim any number of layers
            if layer := LAYER_TENSOR.fullmatch(t.name):
                self.layers[int(layer.group(1))][layer.group(2)] = t
        section.update(version=int(reader.fields["GGUF.version"].parts[0][0]), alignment=int(reader.alignment),
                       data_offset=int(reader.data_offset), tensors=len(self.infos),
                       metadata_keys=sum(not key.startswith("GGUF.") for key in reader.fields))  # not gguf-py's own
        return section

    # ---------------------------------------------------------------------------------------- architecture, shapes

    def architecture_section(self) -> dict:
        arch = self.gguf.metadata.get("general.architecture")
        arch = arch if isinstance(arch, str) else None  # the config's error says what was found instead
        section = {"name": arch, "known": arch in config.ARCHITECTURES,
                   "supported_architectures": sorted(config.ARCHITECTURES), "config": None}
        embedding = self.info("token_embd.weight")
        try:
            if embedding is None:
                raise JaxinferError("lacks tensor token_embd.weight (the vocabulary size comes from it)")
            n_vocab = embedding.dims[1] if len(embedding.dims) > 1 else 0
            self.cfg = config.Config.from_metadata(self.gguf.metadata, n_vocab=n_vocab, powerinfer=self.gguf.powerinfer)
        except JaxinferError as e:
            section["config_error"] = str(e)
            self.problems.append(f"{self.path}: {e}")
            return section
        fields = dataclasses.asdict(self.cfg)
        fields.pop("plan")
        fields.pop("cache_type")
        section["config"] = fields
        section["rope_freqs"] = self.info("rope_freqs.weight") is not None
        section["fused_qkv"] = any(t.name.endswith(".attn_qkv.weight") for t in self.infos)
        return section

    def info(self, name: str) -> TensorInfo | None:
        return next((t for t in self.infos if t.name == name), None)

    # ------------------------------------------------------------------------------------------ types and kernels

    def types_section(self) -> list[dict]:
        size = os.path.getsize(self.path)
        ends = sorted(t.offset for t in self.infos) + [size]
        rows = {}
        for t in self.infos:
            nbytes = t.nbytes
            if nbytes is None:  # unreadable: up to the next tensor's data (its padding included)
                following = ends[bisect.bisect_right(ends, t.offset):]
                nbytes = following[0] - t.offset if following else 0
            row = rows.setdefault(t.type_id, {"type": t.type_name, "type_id": t.type_id, "tensors": 0, "bytes": 0,
                                              "bytes_exact": True})
            row["tensors"] += 1
            row["bytes"] += nbytes
            row["bytes_exact"] &= t.nbytes is not None
        isa = self.cpu_ext["isa"]
        for row in rows.values():
            row["share"] = row["bytes"] / size if size else 0.0
            row["supported"] = row["type_id"] in _types_by_id(quant.SUPPORTED_TYPES)
            row["kernel"] = kernel_route(row["type_id"], self.plan, isa)
        return sorted(rows.values(), key=lambda r: -r["bytes"])

    def _softcapped(self) -> bool:
        """Whether the model soft-caps its attention scores, which Pallas's kernels do not compute
        (plan.soft_capping)."""
        return self.cfg is not None and bool(self.cfg.attn_softcap)

    def _for_model(self, plan: Plan) -> Plan:
        """`plan` as this model runs it: XLA's attention where the plan's kernels do not soft-cap its scores."""
        return soft_capping(plan, self.cfg.attn_softcap if self.cfg else 0.0)

    def kernels_section(self) -> dict:
        section = {"backend": self.plan.backend, "products": self.plan.products,
                   "attention": self._for_model(self.plan).attention,
                   "cpu_ext": self.cpu_ext}
        if self.plan.backend != "cpu":
            return section
        if not self.cpu_ext["available"]:
            self.limitations.append("cpu_ext kernels unavailable: every product dequantizes its weights to f32")
        elif self.cpu_ext["isa"] == "scalar":
            self.limitations.append("cpu_ext runs its portable (scalar) kernels: this CPU has neither AVX2 nor "
                                    "AVX-512")
        if self.plan.products == "cpu_ext":
            without_kernel = set(_types_by_id(quant.SUPPORTED_TYPES)) - set(_types_by_id(quant.CPU_KERNEL_TYPES)) \
                - {int(GGMLQuantizationType.F32)}
            slow = sorted({t.type_name for t in self.infos if sum(n > 1 for n in t.dims) > 1
                           and t.type_id in without_kernel})
            if slow:
                self.limitations.append(f"no cpu_ext kernel for {', '.join(slow)}: those weights are dequantized to "
                                        f"f32 for XLA in every product")
        return section

    # --------------------------------------------------------------------------------------- sparsity and layouts

    def layers_with(self, *tensors: str) -> int:
        """How many layers hold all of `tensors` (blk.N.<tensor>.weight)."""
        return sum(all(t in layer for t in tensors) for layer in self.layers.values())

    def powerinfer_section(self) -> dict:
        threshold = self.gguf.metadata.get(config.SPARSE_THRESHOLD_KEY)
        gate = self.gguf.metadata.get(config.GATE_ACTIVATION_KEY)
        return {"pwri_magic": self.gguf.powerinfer, "layers_with_ffn_down_t": self.layers_with("ffn_down_t"),
                "layers_with_predictor": self.layers_with(*PREDICTOR_TENSORS),
                "sparse_threshold": threshold if isinstance(threshold, float) and np.isfinite(threshold) else None,
                "gate_activation_key": gate if gate is None or isinstance(gate, str) else metadata.describe(gate)}

    def sparsity_section(self) -> dict:
        section = {"modes": list(sparsity.SPARSITY_MODES)}
        if self.cfg is not None:
            natural = [name for name in {self.cfg.gate_activation, self.cfg.up_activation} if _zero_below(name)]
            section["activations"] = {"gate": self.cfg.gate_activation, "up": self.cfg.up_activation}
            section["dense_skips_natural_zeros"] = bool(natural)
        predictor = self.layers_with(*PREDICTOR_TENSORS)
        section["predictor"] = bool(predictor) and (self.cfg is None or predictor == self.cfg.n_layer)
        path = sparsity.thresholds_path(self.path)
        thresholds = {"path": path, "present": os.path.isfile(path)}
        if thresholds["present"]:
            try:
                tables = sidecar.read_json(path, self.path).get("thresholds", {})
                thresholds["levels"] = {method: sorted(levels) for method, levels in tables.items()
                                        if isinstance(levels, dict)}
            except JaxinferError as e:
                thresholds["error"] = str(e)
        section["calibrated_thresholds"] = thresholds
        return section

    def split_section(self) -> dict:
        directory = activation_profile.default_directory(self.path)
        present = [t for t in SPLIT_TENSORS + EXPERT_TENSORS if self.layers_with(t)]
        split_bytes = sum(t.nbytes or 0 for layer in self.layers.values() for kind, t in layer.items()
                          if kind in present)
        section = {"activation_profile": directory, "profile_present": os.path.isdir(directory),
                   "tensors": present, "tensor_bytes": split_bytes,
                   "gpu_index_present": os.path.isfile(placement.gpuidx_path(self.path))}
        if section["profile_present"] and self.cfg is not None:
            try:
                activation_profile.read_profile(directory, self.path, self.cfg.n_layer,
                                                self.cfg.n_expert or self.cfg.n_ff)
                section["profile_valid"] = True
            except JaxinferError as e:
                section["profile_valid"], section["profile_error"] = False, str(e)
        section["applies"] = bool(section["profile_present"] and section.get("profile_valid") and present)
        if self.cfg is not None and self.cfg.sub_norms:  # engine.split_model refuses them
            section["applies"], section["not_applicable"] = False, "BitNet's ffn_sub_norm needs all neurons in one part"
        return section

    def gpu_section(self) -> dict:
        supported = _types_by_id(quant.SUPPORTED_TYPES)
        unsupported = sorted({t.type_name for t in self.infos if t.type_id not in supported})
        gpu = self._for_model(accelerator_plan("gpu"))
        attention = {"pallas": "Pallas flash kernels",
                     "xla": "XLA attention" + (" (soft-capped)" if self._softcapped() else "")}[gpu.attention]
        section = {"backend_here": self.plan.backend, "types_supported": not unsupported,
                   "products": GPU_PRODUCTS[gpu.products], "attention": attention}
        if unsupported:
            section["unsupported_types"] = unsupported
        down = "ffn_down_t" if self.layers_with("ffn_down_t") else "ffn_down"
        kinds = set()
        for layer in self.layers.values():
            weights = [layer.get(t) for t in ("ffn_gate", "ffn_up", down)]
            stand_ins = [None if w is None or w.type_id not in supported else
                         quant.QuantArray(None, supported[w.type_id], (0, 0)) for w in weights]
            kinds.add(None if None in stand_ins else hybrid.kernel_takes(*stand_ins))
        takes = bool(kinds) and None not in kinds
        section["pallas_sparse_ffn"] = takes and self.layers_with(*PREDICTOR_TENSORS) > 0
        section["pallas_sparse_ffn_note"] = (
            "the hot part of a --vram-budget split with --sparsity predictor" if section["pallas_sparse_ffn"] else
            "needs predictors (fc1/fc2) and FFN weights of types the kernel takes")
        return section

    # ---------------------------------------------------------------------------------------- validation, verdict

    def validate(self) -> None:
        """The checks a run makes before its first forward: tensors against the config, and the tokenizer."""
        if self.cfg is None:
            self.notes.append("the tensors were not checked against a config: none could be built")
        else:
            if self.gguf.reader.unreadable:
                self.notes.append(f"the tensors were not checked against the config: "
                                  f"{len(self.gguf.reader.unreadable)} could not be read")
            else:
                try:
                    validate.check_tensors(self.gguf, self.cfg)
                    blocks.check_block_tensors(self.gguf, self.cfg)
                except JaxinferError as e:
                    self.problems.append(str(e))
        try:
            load_tokenizer(self.gguf)
        except JaxinferError as e:
            self.problems.append(str(e))

    def verdict(self) -> dict:
        """{status, reason, limitations}: does not run on any problem (the first is the reason), runs with
        limitations where it runs slower than it could here, else runs."""
        if self.problems:
            more = f" (+{len(self.problems) - 1} more problems)" if len(self.problems) > 1 else ""
            status, reason = DOES_NOT_RUN, self.problems[0] + more
        elif self.limitations:
            status, reason = LIMITED, "; ".join(self.limitations)
        else:
            isa = f" ({self.cpu_ext['isa']})" if self.plan.products == "cpu_ext" else ""
            status, reason = RUNS, (f"{self.cfg.arch}, every check passed; products by {self.plan.products}{isa} on "
                                    f"the {self.plan.backend} backend")
        return {"status": status, "reason": reason, "limitations": self.limitations}


def _zero_below(activation: str) -> bool:
    """Whether an activation is 0 for negative inputs (ReLU-family): a dense FFN then skips the rows of the neurons
    it zeroes (sparse_ffn.py), so naturally sparse models run sparse without predictors or thresholds."""
    return float(ACTIVATIONS[activation](np.float32(-1.0))) == 0.0


def inspect_model(path: str) -> dict:
    """The report of the GGUF file at `path` (a JSON-ready dict: file, architecture, tensor_types, kernels,
    powerinfer, sparsity, hybrid_split, gpu, problems, notes, verdict). A file that is missing or unreadable is a
    JaxinferError; every other way a file can fail is a problem in the report, and its verdict says it does not run."""
    check_readable(path)
    return Inspection(path).report()


# ------------------------------------------------------------------------------------------- the report as text


def _mib(n: int) -> str:
    return f"{n / MIB:.2f} MiB"


def _yes(value) -> str:
    return "yes" if value else "no"


def _file_lines(f: dict) -> list[str]:
    line = f"file: {f['path']}, {_mib(f['size_bytes'])} ({f['size_bytes']} bytes), {f['format']}"
    if f.get("version") is not None:
        line += f" v{f['version']}"
    if "alignment" in f:
        line += f", alignment {f['alignment']}, {f['metadata_keys']} metadata keys, {f['tensors']} tensors"
    return [line]


def _architecture_lines(a: dict) -> list[str]:
    known = "" if a["known"] else f" (not one jaxinfer runs: {', '.join(a['supported_architectures'])})"
    lines = [f"architecture: {a['name']}{known}"]
    c = a["config"]
    if c is None:
        lines.append(f"  shapes: unknown, no config: {a['config_error']}")
        return lines
    lines.append(f"  {c['n_layer']} layers, d={c['n_embd']}, ffn={c['n_ff']}, heads={c['n_head']}/{c['n_head_kv']} kv "
                 f"of {c['head_dim']}, vocab={c['n_vocab']}, context {c['n_ctx_train']}, rope theta "
                 f"{c['rope_theta']:g} on {c['rope_dim']} dims, {'layer norm' if c['layer_norm'] else 'rms'} eps "
                 f"{c['rms_eps']:g}, FFN " + (f"{c['gate_activation']}(up)" if c["ffn_layout"] == "ungated" else
                                              f"{c['gate_activation']}(gate) * {c['up_activation']}(up)"))
    options = _block_options(c, a.get("rope_freqs", False))
    options += [name for name, on in (("fused QKV (attn_qkv)", a.get("fused_qkv")),
                                      ("fused gate-up (ffn_up [gate; up])", c["ffn_layout"] == "fused"),
                                      ("FFN without a gate", c["ffn_layout"] == "ungated"),
                                      ("LayerNorm with bias", c["layer_norm"]),
                                      ("parallel attention and FFN", c["parallel_block"])) if on]
    if options:
        lines.append(f"  block: {', '.join(options)}")
    return lines


def _block_options(c: dict, rope_freqs: bool) -> list[str]:
    """What the architecture's block adds to the llama block, as the config (and the file's rope_freqs) say."""
    options = [name for name, on in (("sub-norms", c["sub_norms"]), ("QK-norm", c["qk_norm"]),
                                     ("post-attention and post-FFN norms", c["post_norms"])) if on]
    if c["embed_scale"] != 1.0:
        options.append(f"embeddings x {c['embed_scale']:g}")
    if c["query_scale"] is not None:
        options.append(f"query scale {c['query_scale']:g}")
    if c["swa_layers"]:
        options.append(f"sliding window {c['sliding_window']} in {sum(c['swa_layers'])} of {c['n_layer']} layers "
                       f"(rope theta {c['rope_theta_swa']:g})")
    if any(c["nope_layers"]):
        options.append(f"no RoPE in {sum(c['nope_layers'])} of {c['n_layer']} layers")
    if c["rope_freq_scale"] != 1.0:
        options.append(f"linear RoPE scaling x {c['rope_freq_scale']:g}")
    if rope_freqs:
        options.append("RoPE frequency factors (rope_freqs.weight)")
    if c["attn_softcap"]:
        options.append(f"attention logit soft-cap {c['attn_softcap']:g}")
    if c["final_softcap"]:
        options.append(f"final logit soft-cap {c['final_softcap']:g}")
    if c["n_expert"]:
        options.append(f"mixture of {c['n_expert']} experts of {c['n_ff_exp']} neurons, {c['n_expert_used']} per token"
                       f"{'' if c['expert_weights_norm'] else ' (weights not renormalized)'}"
                       f"{', a shared expert of ' + str(c['n_ff_shexp']) + ' neurons' if c['n_ff_shexp'] else ''}"
                       f", {c['expert_gating']} gating"
                       f"{', the router before the attention' if c['router_reads_layer_input'] else ''}")
    return options


def _type_lines(rows: list[dict], kernels: dict) -> list[str]:
    cpu_ext = kernels["cpu_ext"]
    isa = f"cpu_ext {cpu_ext['isa']}" if cpu_ext["available"] else f"cpu_ext unavailable ({cpu_ext['reason']})"
    lines = [f"tensor types (backend {kernels['backend']}, products {kernels['products']}, {isa}):"]
    width = max((len(r["type"]) for r in rows), default=4)
    for r in rows:
        approx = "" if r["bytes_exact"] else "~"
        tensors = f"{r['tensors']:>5} tensor{'s' if r['tensors'] != 1 else ' '}"
        lines.append(f"  {r['type']:<{width}} {tensors} {approx}{_mib(r['bytes']):>12} "
                     f"{100 * r['share']:5.1f}%  {r['kernel']}")
    return lines


def _feature_lines(report: dict) -> list[str]:
    p, s, h, g = report["powerinfer"], report["sparsity"], report["hybrid_split"], report["gpu"]
    n_layer = (report["architecture"]["config"] or {}).get("n_layer", "?")
    threshold = "absent" if p["sparse_threshold"] is None else format(p["sparse_threshold"], "g")
    lines = [(f"powerinfer: magic PWRI {_yes(p['pwri_magic'])}, ffn_down_t in {p['layers_with_ffn_down_t']}/{n_layer} "
              f"layers, fc1/fc2 predictors in {p['layers_with_predictor']}/{n_layer}, sparse_threshold {threshold}")]
    dense = s.get("dense_skips_natural_zeros")
    dense_text = "unknown (no config)" if dense is None else (
        "yes (ReLU-family activation: natural zeros skipped)" if dense else "no (no natural zeros to skip)")
    t = s["calibrated_thresholds"]
    if t["present"]:
        levels = t.get("levels")
        thresholds = f"unusable ({t['error']})" if "error" in t else \
            ", ".join(f"{m}:{','.join(v)}" for m, v in levels.items()) or "none calibrated"
    else:
        thresholds = "none (python -m jaxinfer.calibrate)"
    lines.append(f"sparsity: --sparsity dense skips zeros {dense_text}; predictor {_yes(s['predictor'])}; "
                 f"calibrated gate/hidden thresholds: {thresholds}")
    if h["profile_present"]:
        profile = "valid" if h.get("profile_valid") else f"unusable ({h.get('profile_error', 'no config')})"
    else:
        profile = "absent (python -m jaxinfer.profile)"
    why_not = f" ({h['not_applicable']})" if "not_applicable" in h else ""
    lines.append(f"hybrid split (--vram-budget): {_yes(h['applies'])}{why_not}; activation profile {profile} at "
                 f"{h['activation_profile']}; splits {', '.join(h['tensors']) or 'no FFN tensors'} "
                 f"({_mib(h['tensor_bytes'])}); GPU index {'present' if h['gpu_index_present'] else 'absent'}")
    types = "all types supported" if g["types_supported"] else f"unsupported {', '.join(g['unsupported_types'])}"
    lines.append(f"gpu path: {types} ({g['products']}, {g['attention']}); Pallas sparse FFN "
                 f"{_yes(g['pallas_sparse_ffn'])} ({g['pallas_sparse_ffn_note']}); this machine: {g['backend_here']}")
    return lines


def format_report(report: dict) -> str:
    lines = _file_lines(report["file"])
    if "architecture" in report:
        lines += _architecture_lines(report["architecture"])
        lines += _type_lines(report["tensor_types"], report["kernels"])
        lines += _feature_lines(report)
    lines.append(f"problems: {len(report['problems'])}")
    lines += [f"  - {problem}" for problem in report["problems"]]
    lines += [f"note: {note}" for note in report["notes"]]
    verdict = report["verdict"]
    lines.append(f"verdict: {verdict['status']}: {verdict['reason']}")
    return "\n".join(lines)

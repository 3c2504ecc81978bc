"""Fuzz jaxinfer's loader with corrupt GGUF files: seeded mutations of tiny synthetic models, each loaded and run.

    python scripts/fuzz_gguf.py --cases 5000 --seed 1 [--workers 2] [--model extra.gguf [--no_synthetic]] [--json]

Each case is (seed, index) -> one base model (synthetic llama / bamboo / PowerInfer with predictors, several weight
types, or --model files) and one mutation aimed with gguf-py's offsets at a field: byte flips in the header, metadata
and tensor infos, truncations (random and at region boundaries), huge counts and lengths, bad value and tensor type
ids, tensor offsets past the end / misaligned / overlapping / wrapping, wrong shapes, NaN or infinite weights,
invalid UTF-8, and metadata values replaced by values of the wrong type or range. A case is run as a user would:
engine.load_model, then a few greedy tokens with engine.generate_tokens (predictor sparsity for models that have
predictors), and the logits the first new token came from are checked to be finite, independently of the engine.

Outcomes: error (a JaxinferError with a one-line message), ok (ran; finite logits), and the failures: traceback (any
other exception), multiline (a JaxinferError of several lines), nan (ran with NaN or infinite logits), crash (the
worker died), hang (a case ran past --timeout), memory (MemoryError, or the worker died over its address-space
limit). Cases run in worker subprocesses, each looping over many cases in-process under RLIMIT_AS, reporting JSON
lines; a dead or stuck worker is replaced and the case it was running is the one blamed.
"""

import argparse
import collections
import dataclasses
import json
import math
import os
import resource
import selectors
import struct
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType

from jaxinfer.errors import how_it_ended

FAILURES = ("traceback", "multiline", "nan", "crash", "hang", "memory")
OUTCOMES = ("error", "ok") + FAILURES
Q = GGMLQuantizationType
VARIANTS = {  # name -> SyntheticSpec fields: small enough that a forward compiles in about a second
    "llama_f32": dict(n_layer=2, n_embd=32, n_ff=64, n_head=4, n_head_kv=2, n_ctx=64),
    "llama_q8_0_untied": dict(n_layer=2, n_embd=64, n_ff=64, n_head=4, n_head_kv=4, n_ctx=64, weight_type=Q.Q8_0,
                              embedding_type=Q.Q8_0, tied_output=False),
    "bamboo_q4_0": dict(n_layer=1, n_embd=64, n_ff=128, n_head=2, n_head_kv=1, n_ctx=64, weight_type=Q.Q4_0,
                        architecture="bamboo"),
    "powerinfer_q8_0": dict(n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_ctx=64, weight_type=Q.Q8_0,
                            sparsity=0.8),
    "llama_q4_k_f16": dict(n_layer=1, n_embd=256, n_ff=256, n_head=4, n_head_kv=2, n_ctx=64, weight_type=Q.Q4_K,
                           embedding_type=Q.F16),
}
PROMPT = "hello the"
N_PREDICT = 3
CONTEXT = 16
SCALAR_FORMATS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
                  GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
                  GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
                  GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
HUGE = (2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1)
# Where each block type keeps its fp16 scale d (a NaN there poisons the block); 0 for the rest.
SCALE_OFFSETS = {Q.Q2_K: 80, Q.Q3_K: 108, Q.Q6_K: 208}


# ---------------------------------------------------------------------------------------------------- file layout

@dataclasses.dataclass
class Field:
    """A metadata key/value as it sits in the file: `parts` are (offset, size) of gguf-py's ReaderField parts."""

    key: str
    start: int
    end: int
    types: list
    parts: list


@dataclasses.dataclass
class Tensor:
    name: str
    info_start: int
    info_end: int
    parts: list  # (offset, size) of: name length, name, n_dims, dims, type, offset
    qtype: GGMLQuantizationType
    dims: list
    data_start: int
    data_end: int


@dataclasses.dataclass
class Base:
    """A valid model file and where its pieces are, to aim mutations at them."""

    name: str
    data: bytes
    fields: list
    tensors: list
    info_start: int  # first tensor info (end of the metadata)
    info_end: int
    data_offset: int
    alignment: int


def _parts(start: int, arrays) -> list:
    spans, offset = [], start
    for a in arrays:
        spans.append((offset, int(a.nbytes)))
        offset += int(a.nbytes)
    return spans


def read_base(name: str, path: str) -> Base:
    data = open(path, "rb").read()
    plain = data if data[:4] == b"GGUF" else b"GGUF" + data[4:]  # gguf-py reads PowerInfer's PWRI as GGUF
    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
        f.write(plain)
        f.flush()
        reader = GGUFReader(f.name)
        fields = [Field(key, f_.offset, f_.offset + sum(int(p.nbytes) for p in f_.parts), list(f_.types),
                        _parts(f_.offset, f_.parts))
                  for key, f_ in reader.fields.items() if not key.startswith("GGUF.")]
        tensors = []
        for t in reader.tensors:
            parts = _parts(t.field.offset, t.field.parts)
            tensors.append(Tensor(t.name, t.field.offset, parts[-1][0] + parts[-1][1], parts, t.tensor_type,
                                  [int(n) for n in t.shape], t.data_offset, t.data_offset + t.n_bytes))
        info_start = max(f_.end for f_ in fields)
        return Base(name, data, fields, tensors, info_start, max(t.info_end for t in tensors), reader.data_offset,
                    int(reader.alignment))


def build_bases(directory: str, extra_models=(), synthetic: bool = True) -> dict:
    """Write the synthetic variants (unless not `synthetic`) into `directory` (once) and read their layouts;
    `extra_models` join them."""
    from jaxinfer.synthetic import SyntheticSpec, write_model

    bases = {}
    for name, fields in VARIANTS.items() if synthetic else ():
        path = os.path.join(directory, f"{name}.gguf")
        if not os.path.exists(path):
            write_model(path, SyntheticSpec(**fields))
        bases[name] = read_base(name, path)
    for path in extra_models:
        bases[os.path.basename(path)] = read_base(os.path.basename(path), path)
    return bases


# ------------------------------------------------------------------------------------------------------- encoding

def encode_value(vtype: GGUFValueType, value, item_type: GGUFValueType | None = None) -> bytes:
    """GGUF's little-endian encoding of a value of `vtype` (strings may be bytes, to write invalid UTF-8)."""
    if vtype == GGUFValueType.STRING:
        raw = value if isinstance(value, bytes) else value.encode()
        return struct.pack("<Q", len(raw)) + raw
    if vtype == GGUFValueType.ARRAY:
        return struct.pack("<IQ", item_type, len(value)) + b"".join(encode_value(item_type, v) for v in value)
    return struct.pack(SCALAR_FORMATS[vtype], value)


def encode_field(key: str, vtype: GGUFValueType, value, item_type: GGUFValueType | None = None) -> bytes:
    return encode_value(GGUFValueType.STRING, key) + struct.pack("<I", vtype) + encode_value(vtype, value, item_type)


def rebuild(base: Base, fields: dict) -> bytes:
    """The base file with metadata `fields` ({key: encoded field bytes, or None to drop}; new keys are appended):
    tensor infos and data are kept, the data re-aligned after the new metadata."""
    data = base.data
    chunks = [data[f.start:f.end] if f.key not in fields else fields[f.key] for f in base.fields]
    known = {f.key for f in base.fields}
    chunks += [encoded for key, encoded in fields.items() if key not in known]
    chunks = [c for c in chunks if c is not None]
    header = data[:8] + struct.pack("<QQ", len(base.tensors), len(chunks))
    head = header + b"".join(chunks) + data[base.info_start:base.info_end]
    return head + bytes(-len(head) % base.alignment) + data[base.data_offset:]


def pick(rng, options):
    """One of `options` (a list; unlike rng.choice, Python integers of any size come back as they are)."""
    return options[int(rng.integers(len(options)))]


def patch(data: bytes, offset: int, raw: bytes) -> bytes:
    return data[:offset] + raw + data[offset + len(raw):]


# ------------------------------------------------------------------------------------------------------ mutations
# Each takes (rng, base) and returns (mutated bytes, description).

def _flip(rng, base, lo, hi, region):
    data = bytearray(base.data)
    offsets = rng.integers(lo, hi, size=int(rng.integers(1, 4)))
    for offset in offsets:
        data[offset] ^= int(rng.integers(1, 256))
    return bytes(data), f"flip {region} bytes at {sorted(int(o) for o in offsets)}"


def flip_header(rng, base):
    return _flip(rng, base, 4, 24, "header")


def flip_metadata(rng, base):
    field = base.fields[rng.integers(len(base.fields))]
    offset, size = field.parts[rng.integers(min(len(field.parts), 6))]  # key, type, array header: the structure
    return _flip(rng, base, offset, offset + max(size, 1), f"metadata {field.key}")


def flip_tensor_info(rng, base):
    tensor = base.tensors[rng.integers(len(base.tensors))]
    offset, size = tensor.parts[rng.integers(len(tensor.parts))]
    return _flip(rng, base, offset, offset + max(size, 1), f"tensor info {tensor.name}")


def flip_anywhere(rng, base):
    return _flip(rng, base, 0, len(base.data), "file")


def truncate(rng, base):
    boundaries = [24, base.info_start, base.info_end, base.data_offset, len(base.data) - 1]
    boundaries += [f.end for f in base.fields] + [t.data_start + 1 for t in base.tensors] + [t.data_end - 1
                                                                                           for t in base.tensors]
    at = pick(rng, boundaries) if rng.random() < 0.6 else int(rng.integers(0, len(base.data)))
    at = max(0, at + int(rng.integers(-2, 3)))
    return base.data[:at], f"truncate at {at} of {len(base.data)}"


def _huge(rng, original: int) -> int:
    choice = rng.integers(4)
    if choice == 0:
        return pick(rng, HUGE)
    if choice == 1:
        return original + int(rng.integers(1, 1000))
    if choice == 2:
        return original * 2 + 1
    return int(rng.integers(0, 2**63))


def huge_count(rng, base):
    targets = [("tensor_count", 8, 8), ("kv_count", 16, 8)]
    for f in base.fields:
        targets.append((f"key length of {f.key}", f.parts[0][0], 8))
        if f.types[0] == GGUFValueType.ARRAY:
            targets.append((f"array length of {f.key}", f.parts[4][0], 8))
        elif f.types[0] == GGUFValueType.STRING:
            targets.append((f"string length of {f.key}", f.parts[3][0], 8))
    for t in base.tensors:
        targets += [(f"name length of {t.name}", t.parts[0][0], 8), (f"n_dims of {t.name}", t.parts[2][0], 4)]
    what, offset, size = targets[rng.integers(len(targets))]
    original = int.from_bytes(base.data[offset:offset + size], "little")
    value = _huge(rng, original) % 2**(8 * size)
    return patch(base.data, offset, value.to_bytes(size, "little")), f"{what}: {original} -> {value}"


def bad_value_type(rng, base):
    field = base.fields[rng.integers(len(base.fields))]
    arrays = field.types[0] == GGUFValueType.ARRAY
    offset = field.parts[3][0] if arrays and rng.random() < 0.5 else field.parts[2][0]  # item type or value type
    value = int(rng.integers(0, 13)) if rng.random() < 0.7 else pick(rng, [13, 255, 2**31, 2**32 - 1])
    return patch(base.data, offset, struct.pack("<I", value)), f"type id at {offset} ({field.key}) -> {value}"


def bad_tensor_type(rng, base):
    tensor = base.tensors[rng.integers(len(base.tensors))]
    value = int(rng.integers(0, 42)) if rng.random() < 0.8 else pick(rng, [2**31, 2**32 - 1])
    return (patch(base.data, tensor.parts[4][0], struct.pack("<I", value)),
            f"tensor {tensor.name} type {tensor.qtype.name} -> {value}")


def bad_tensor_offset(rng, base):
    tensor = base.tensors[rng.integers(len(base.tensors))]
    offset = tensor.data_start - base.data_offset
    other = base.tensors[rng.integers(len(base.tensors))].data_start - base.data_offset
    value = pick(rng, [len(base.data), 2 * len(base.data), 2**64 - 1, 2**64 - base.data_offset,
                       offset + int(rng.integers(1, base.alignment)), other, other + base.alignment,
                       2**64 - base.alignment])
    return (patch(base.data, tensor.parts[5][0], struct.pack("<Q", value)),
            f"tensor {tensor.name} offset {offset} -> {value}")


def wrong_shape(rng, base):
    tensor = base.tensors[rng.integers(len(base.tensors))]
    dims = list(tensor.dims)
    block = GGML_QUANT_SIZES[tensor.qtype][0]
    if len(dims) == 2 and rng.random() < 0.4:
        dims = dims[::-1]
    else:
        i = int(rng.integers(len(dims)))
        step = block if i == 0 else 1
        dims[i] = pick(rng, [0, 1, dims[i] * 2, dims[i] // 2, dims[i] + step, dims[i] - step, 2**32 + dims[i]])
    dims_offset = tensor.parts[3][0]
    raw = b"".join(struct.pack("<Q", n % 2**64) for n in dims)
    return patch(base.data, dims_offset, raw), f"tensor {tensor.name} shape {tensor.dims} -> {dims}"


NONFINITE = {Q.F32: (np.float32(np.nan), np.float32(np.inf), np.float32(-np.inf)),
             Q.F16: (np.float16(np.nan), np.float16(np.inf), np.float16(-np.inf))}


def nonfinite_weights(rng, base):
    tensor = base.tensors[rng.integers(len(base.tensors))]
    data = bytearray(base.data)
    kind = int(rng.integers(3))
    if tensor.qtype in NONFINITE:
        value = NONFINITE[tensor.qtype][kind]
        step, raw = value.itemsize, value.tobytes()
        skip = 0
    else:
        step = GGML_QUANT_SIZES[tensor.qtype][1]
        raw = NONFINITE[Q.F16][kind].tobytes()
        skip = SCALE_OFFSETS.get(tensor.qtype, 0)
    n = (tensor.data_end - tensor.data_start) // step
    where = range(n) if rng.random() < 0.3 else rng.integers(0, n, size=int(rng.integers(1, 4)))
    for i in where:
        at = tensor.data_start + int(i) * step + skip
        data[at:at + len(raw)] = raw
    return bytes(data), f"tensor {tensor.name}: {'nan inf -inf'.split()[kind]} at {len(where)} of {n} places"


def invalid_utf8(rng, base):
    strings = [(f.key, f.parts[1]) for f in base.fields]  # keys
    strings += [(f.key, f.parts[4]) for f in base.fields if f.types[0] == GGUFValueType.STRING]
    strings += [(t.name, t.parts[1]) for t in base.tensors]
    tokens = next(f for f in base.fields if f.key == "tokenizer.ggml.tokens")
    strings += [("token", part) for part in tokens.parts[6::2][::37]]  # every 37th token's text
    what, (offset, size) = strings[rng.integers(len(strings))]
    at = offset + int(rng.integers(max(size, 1)))
    byte = pick(rng, [0xFF, 0xC0, 0x80, 0xED])
    return patch(base.data, at, bytes([byte])), f"string of {what}: byte {at} -> {byte:#x}"


def _replacements(key: str):
    """Wrong-typed and out-of-range values for `key`: (value type, value, array item type)."""
    A, S, U32, I32, F32, B = (GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.INT32,
                              GGUFValueType.FLOAT32, GGUFValueType.BOOL)
    wrong_types = [(S, "7", None), (F32, 2.5, None), (B, True, None), (A, [1, 2, 3], I32), (A, ["a"], S),
                   (S, b"\xff\xfe", None), (GGUFValueType.UINT64, 2**64 - 1, None)]
    if key.endswith(("_length", "block_count", "head_count", "head_count_kv", "dimension_count", "vocab_size",
                     "token_id")):
        return wrong_types + [(U32, v, None) for v in (0, 1, 3, 5, 7, 100, 2**31, 2**32 - 1)] + [(I32, -4, None)]
    if key.endswith(("freq_base", "epsilon", "threshold")):
        return wrong_types + [(F32, v, None) for v in (math.nan, math.inf, -math.inf, 0.0, -1.0, 1e30, 1e-30)]
    if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        return wrong_types + [(A, ["a", "b"], S), (A, [], S), (A, ["x y z", "nospace"], S), (A, [b"\xff"], S)]
    if key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        return wrong_types + [(A, [1], I32), (A, [], I32), (A, [0.5] * 3, F32)]
    if key == "general.alignment":
        return wrong_types + [(U32, v, None) for v in (0, 3, 16, 64, 2**31)]
    return wrong_types + [(S, v, None) for v in ("gelu", "", "llama", "bamboo", "gpt2", "none", "linear")]


def metadata_value(rng, base):
    offset, size = next(f for f in base.fields if f.key == "general.architecture").parts[4]
    arch = base.data[offset:offset + size].decode()
    keys = [f.key for f in base.fields] + ["general.alignment", "jaxinfer.gate_activation",
                                          f"{arch}.attention.key_length", f"{arch}.rope.scaling.type",
                                          "tokenizer.ggml.eot_token_id", "tokenizer.ggml.scores"]
    key = keys[rng.integers(len(keys))]
    options = _replacements(key)
    vtype, value, item_type = options[rng.integers(len(options))]
    if rng.random() < 0.1:
        return rebuild(base, {key: None}), f"drop {key}"
    encoded = encode_field(key, vtype, value, item_type)
    return rebuild(base, {key: encoded}), f"{key} = {vtype.name} {value!r}"[:200]


MUTATIONS = {  # name -> (weight, mutation)
    "flip_header": (1, flip_header),
    "flip_metadata": (3, flip_metadata),
    "flip_tensor_info": (3, flip_tensor_info),
    "flip_anywhere": (1, flip_anywhere),
    "truncate": (2, truncate),
    "huge_count": (3, huge_count),
    "bad_value_type": (2, bad_value_type),
    "bad_tensor_type": (2, bad_tensor_type),
    "bad_tensor_offset": (2, bad_tensor_offset),
    "wrong_shape": (2, wrong_shape),
    "nonfinite_weights": (3, nonfinite_weights),
    "invalid_utf8": (1, invalid_utf8),
    "metadata_value": (5, metadata_value),
}


def make_case(bases: dict, seed: int, index: int) -> tuple[str, str, bytes, str]:
    """Case `index` of campaign `seed`: (base name, mutation name, mutated bytes, description)."""
    rng = np.random.default_rng([seed, index])
    names = sorted(MUTATIONS)
    weights = np.array([MUTATIONS[n][0] for n in names], np.float64)
    kind = names[rng.choice(len(names), p=weights / weights.sum())]
    base = bases[pick(rng, sorted(bases))]
    data, description = MUTATIONS[kind][1](rng, base)
    return base.name, kind, data, description


# ------------------------------------------------------------------------------------------------------- running

def run_model(path: str) -> tuple[str, str]:
    """Load and run `path` as a user would: (outcome, message); see the module docstring for outcomes."""
    import jax
    import jax.numpy as jnp

    from jaxinfer import engine, sparsity
    from jaxinfer.errors import JaxinferError, is_interrupt
    from jaxinfer.sampling import SamplingParams

    try:
        m = engine.load_model(path)
        if m.weights.layers[0].fc1 is not None:
            m = sparsity.apply(m, sparsity.parse_spec("predictor"))
        prompt = m.tokenizer.encode(PROMPT)
        tokens = list(engine.generate_tokens(m, prompt, N_PREDICT, min(CONTEXT, m.config.n_ctx_train),
                                             SamplingParams(temperature=0), seed=0))
        # Independently of the engine's own check: the logits the first new token was sampled from. (Earlier
        # positions may be non-finite while the last is not: a one-layer model's NaN stays at its position.)
        logits = _prompt_logits(jnp.asarray([prompt], jnp.int32), m.weights, m.config)[:, -1]
        if not bool(jax.device_get(jnp.all(jnp.isfinite(logits)))):
            return "nan", f"generated {tokens} from non-finite logits"
        return "ok", f"generated {tokens}"
    except JaxinferError as e:
        message = str(e)
        return ("multiline" if "\n" in message or not message else "error"), message
    except MemoryError as e:
        return "memory", f"MemoryError: {e}"
    except BaseException as e:  # noqa: BLE001 (everything else is a failure to report, PanicException included)
        if is_interrupt(e):
            raise
        frames = traceback.extract_tb(e.__traceback__)[-3:]
        where = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(frames))
        return "traceback", f"{type(e).__name__}: {str(e)[:300]} at {where}"


def _forward_logits(tokens, weights, cfg):
    from jaxinfer import model

    hidden, _, _ = model.forward(tokens, weights, cfg)
    return model.logits(hidden, weights, cfg)


_prompt_logits_jit = None


def _prompt_logits(tokens, weights, cfg):
    global _prompt_logits_jit
    if _prompt_logits_jit is None:
        import jax

        _prompt_logits_jit = jax.jit(_forward_logits, static_argnums=2)
    return _prompt_logits_jit(tokens, weights, cfg)


def worker(bases_dir: str, extra_models: list, synthetic: bool, seed: int, memory_limit_mib: int) -> None:
    """Read case indices (one per line) on stdin; for each print {"start": i} then its result, as JSON lines."""
    import jax

    from jaxinfer import engine, runtime, sparsity  # noqa: F401 (imported before the memory limit is set)

    runtime.enable_compilation_cache()
    jax.numpy.zeros(1).block_until_ready()
    bases = build_bases(bases_dir, extra_models, synthetic)  # imports all a case runs, before the limit
    if memory_limit_mib:
        used = int(open("/proc/self/status").read().split("VmSize:")[1].split()[0]) * 1024
        limit = used + memory_limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    with tempfile.TemporaryDirectory(prefix="fuzz_gguf_") as scratch:
        for line in sys.stdin:
            index = int(line)
            print(json.dumps({"start": index}), flush=True)
            base, kind, data, description = make_case(bases, seed, index)
            path = os.path.join(scratch, f"case_{index}.gguf")  # a new name: the last case's mapping may be alive
            with open(path, "wb") as f:
                f.write(data)
            start = time.perf_counter()
            outcome, message = run_model(path)
            os.unlink(path)
            print(json.dumps({"case": index, "base": base, "mutation": kind, "description": description,
                              "outcome": outcome, "message": message,
                              "seconds": round(time.perf_counter() - start, 3)}), flush=True)


# ------------------------------------------------------------------------------------------------------ campaign

@dataclasses.dataclass
class _Worker:
    process: subprocess.Popen
    pending: collections.deque  # case indices sent, not yet reported
    stderr: object  # a temporary file
    started: float | None = None  # when its current case began (None: between cases)
    buffer: bytes = b""

    def last_words(self) -> str:
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1][:300] if lines else ""


MEMORY_WORDS = ("MemoryError", "bad_alloc", "Cannot allocate memory", "out of memory", "Resource exhausted")


def run_campaign(n_cases: int, seed: int, workers: int = 2, timeout: float = 120.0, memory_limit_mib: int = 3072,
                 extra_models=(), synthetic: bool = True, start: int = 0, progress=None) -> list[dict]:
    """Run cases start .. start+n_cases-1 of campaign `seed` in `workers` subprocesses; a result dict per case,
    `progress(result)` called as each comes in."""
    with tempfile.TemporaryDirectory(prefix="fuzz_gguf_bases_") as bases_dir:
        build_bases(bases_dir, extra_models, synthetic)  # once here, so workers only read them
        models = [a for m in extra_models for a in ("--model", m)] + ([] if synthetic else ["--no_synthetic"])
        return _run_cases(bases_dir, range(start, start + n_cases), seed, workers, timeout, memory_limit_mib,
                          models, progress)


def _run_cases(bases_dir, cases, seed, workers, timeout, memory_limit_mib, model_args, progress) -> list[dict]:
    results = {}
    selector = selectors.DefaultSelector()
    active = []

    def spawn(indices):
        command = [sys.executable, os.path.abspath(__file__), "--worker", "--bases", bases_dir, "--seed", str(seed),
                   "--memory_limit_mib", str(memory_limit_mib)] + model_args
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        err, todo = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        todo.write("".join(f"{i}\n" for i in indices).encode())  # a file, not a pipe: no write ever blocks
        todo.seek(0)
        process = subprocess.Popen(command, stdin=todo, stdout=subprocess.PIPE, stderr=err, env=env)
        todo.close()
        w = _Worker(process, collections.deque(indices), err)
        selector.register(process.stdout, selectors.EVENT_READ, w)
        active.append(w)

    def retire(w, outcome=None, message=""):
        """Stop worker `w`; blame its current case with `outcome`, if given; the rest of its cases go to a new one."""
        selector.unregister(w.process.stdout)
        if w.process.poll() is None:
            w.process.kill()
        w.process.wait()
        active.remove(w)
        words = w.last_words()
        w.stderr.close()
        if outcome is not None:
            index = w.pending.popleft()
            results[index] = {"case": index, "outcome": outcome, "message": message}
            if progress:
                progress(results[index])
        elif w.pending:
            raise RuntimeError(f"a fuzz worker died outside any case: {words}")
        if w.pending:
            spawn(list(w.pending))

    cases = list(cases)
    for i in range(workers):
        if cases[i::workers]:
            spawn(cases[i::workers])
    while active:
        for key, _ in selector.select(timeout=1.0):
            w = key.data
            chunk = os.read(w.process.stdout.fileno(), 1 << 16)
            if not chunk:  # the worker exited: done, or killed by the case it was running
                w.process.wait()
                if w.started is None:
                    retire(w)
                else:
                    words = w.last_words()
                    memory = w.process.returncode == -9 or any(word in words for word in MEMORY_WORDS)
                    retire(w, "memory" if memory else "crash", f"worker {how_it_ended(w.process.returncode)}: {words}")
                continue
            w.buffer += chunk
            *lines, w.buffer = w.buffer.split(b"\n")
            for line in lines:
                report = json.loads(line)
                if "start" in report:
                    w.started = time.monotonic()
                    continue
                w.pending.popleft()
                w.started = None
                results[report["case"]] = report
                if progress:
                    progress(report)
        for w in list(active):
            if w.started is not None and time.monotonic() - w.started > timeout:
                retire(w, "hang", f"no result within {timeout:.0f} s")
    return [results[i] for i in sorted(results)]


def summarize(results: list[dict]) -> dict:
    counts = collections.Counter(r["outcome"] for r in results)
    return {outcome: counts.get(outcome, 0) for outcome in OUTCOMES}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start", type=int, default=0, help="first case index (rerun a single case with --cases 1)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a case may take before it is a hang")
    parser.add_argument("--memory_limit_mib", type=int, default=3072, help="address space a worker may add (MiB)")
    parser.add_argument("--model", action="append", default=[], help="another base model (e.g. the default model)")
    parser.add_argument("--no_synthetic", action="store_true", help="only the --model files as bases")
    parser.add_argument("--json", action="store_true", help="print every case as a JSON line, then the counts")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bases", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, low in (("cases", 1), ("workers", 1), ("seed", 0), ("start", 0), ("memory_limit_mib", 0)):
        if getattr(args, name) < low:
            parser.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if not 0 < args.timeout < math.inf:
        parser.error(f"--timeout must be a finite number > 0, got {args.timeout}")
    if args.worker:
        return worker(args.bases, args.model, not args.no_synthetic, args.seed, args.memory_limit_mib)
    start = time.perf_counter()
    results = run_campaign(args.cases, args.seed, args.workers, args.timeout, args.memory_limit_mib, args.model,
                           not args.no_synthetic, args.start)
    counts = summarize(results)
    if args.json:
        for r in results:
            print(json.dumps(r))
    for r in results:
        if r["outcome"] in FAILURES:
            print(f"{r['outcome']}: case {r['case']} {r.get('base', '')} {r.get('mutation', '')} "
                  f"{r.get('description', '')}: {r['message']}", file=sys.stderr)
    print(json.dumps({"cases": len(results), "seed": args.seed, "seconds": round(time.perf_counter() - start, 1),
                      **counts}))
    return 1 if any(counts[f] for f in FAILURES) else 0


if __name__ == "__main__":
    sys.exit(main())

import importlib.util
import os
import pathlib
import struct
import subprocess
import sys
import textwrap
import time

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType

from jaxinfer import quant
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_io import load_config, load_weights, open_gguf


def test_config_and_weights_follow_the_file(make_model):
    path = make_model(n_layer=3, n_embd=64, n_ff=96, n_head=8, n_head_kv=2, weight_type=Q.Q8_0, tied_output=False)
    g = open_gguf(path)
    cfg = load_config(g)
    assert (cfg.n_layer, cfg.n_embd, cfg.n_ff, cfg.n_head, cfg.n_head_kv, cfg.head_dim) == (3, 64, 96, 8, 2, 8)
    w = load_weights(g, cfg)
    assert len(w.layers) == 3 and w.output is not w.token_embd
    layer = w.layers[2]
    assert layer.attn_k.shape == (16, 64) and layer.ffn_down.shape == (64, 96) and layer.attn_q.qtype == Q.Q8_0
    reference = gguf.GGUFReader(path)
    expected = next(t for t in reference.tensors if t.name == "blk.2.ffn_down.weight")
    np.testing.assert_array_equal(np.asarray(quant.dequantize(layer.ffn_down)),
                                  gguf.quants.dequantize(expected.data, expected.tensor_type))


def test_tied_output_reuses_the_embedding(make_model):
    g = open_gguf(make_model(tied_output=True))
    w = load_weights(g, load_config(g))
    assert w.output is w.token_embd


def test_reader_shim_reads_the_same_metadata_as_gguf_py(make_model):
    """Arrays are read whole (one part for the items, strings decoded on demand), with gguf-py's contents, types,
    offsets and sizes."""
    path = make_model()
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert ours.array("tokenizer.ggml.tokens") == theirs.get_field("tokenizer.ggml.tokens").contents()
    assert ours.metadata["llama.block_count"] == theirs.get_field("llama.block_count").contents()
    assert list(ours.reader.fields) == list(theirs.fields)
    arrays = 0
    for key, field in theirs.fields.items():
        mine = ours.reader.fields[key]
        assert (mine.offset, mine.types, mine.contents()) == (field.offset, field.types, field.contents()), key
        assert sum(p.nbytes for p in mine.parts) == sum(p.nbytes for p in field.parts), key
        if field.types[0] == GGUFValueType.ARRAY:
            arrays += 1
            assert mine.contents(slice(2, 5)) == field.contents(slice(2, 5)) and mine.contents(3) == field.contents(3)
    assert arrays >= 2  # strings (tokens) and numbers (token types)


@pytest.mark.parametrize("endianness", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_reader_shim_reads_arrays_of_either_byte_order(tmp_path, endianness):
    path = str(tmp_path / "arrays.gguf")
    writer = gguf.GGUFWriter(path, "llama", endianess=endianness)
    writer.add_array("a.strings", ["x", "héllo", "", "z z"])
    writer.add_array("a.ints", [1, -2, 3])
    writer.add_array("a.floats", [0.5, 1.5])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = open_gguf(path)
    assert (ours.array("a.strings"), ours.array("a.ints", int), ours.array("a.floats", float)) == (
        ["x", "héllo", "", "z z"], [1, -2, 3], [0.5, 1.5])


def test_missing_tensor_is_reported(make_model, tmp_path):
    g = open_gguf(make_model())
    del g.tensors["blk.1.ffn_up.weight"]
    with pytest.raises(JaxinferError, match="lacks tensor blk.1.ffn_up.weight"):
        load_weights(g, load_config(g))


def load_peak(path: str | None) -> tuple[int, int]:
    """Measured in a fresh process: RSS growth from before loading `path` (None: the default model) to the peak, and
    the file's size, in bytes."""
    script = textwrap.dedent(f"""
        import os, jax.numpy as jnp
        jnp.zeros(1).block_until_ready()
        def status(key):
            return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
        base = status("VmRSS")
        from jaxinfer import engine
        path = {path!r} or engine.default_model_path()
        engine.load_model(path)
        print(status("VmHWM") - base, os.path.getsize(path))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    peak, size = map(int, out.stdout.strip().splitlines()[-1].split())
    return peak, size


def test_loading_the_default_model_peaks_near_its_file_size(default_model):
    """1.61x measured (151 MiB for a 94 MiB file): every weight repacked into anonymous memory, once (the file's pages
    let go), the tied embedding and output head too (28.7 MiB that were served from the mapping before, 1.30x), plus
    jaxinfer's imports (12 MiB) and its 49k-token vocabulary and merges read into the tokenizer (~20 MiB of transient
    buffers); loaded with repack=False, 0.58x."""
    peak, size = load_peak(None)
    assert peak < 1.7 * size


@pytest.mark.slow
def test_weights_copied_out_of_the_file_are_in_memory_once(make_model):
    """GGUF aligns tensors to 32 bytes, so placing them copies most (zero-copy needs 64): the file's pages they were
    read from are let go, so loading peaks at the file's size and the reader's and tokenizer's ~20 MiB, not at twice
    the file (here 56 MiB against 92 MiB for a 38 MiB file; a 7B-shaped file of 640 MiB: 658 MiB against 1295)."""
    path = make_model(n_embd=1024, n_ff=4096, n_head=8, n_head_kv=8, n_vocab=4096, weight_type=Q.Q8_0,
                      embedding_type=Q.Q8_0)
    peak, size = load_peak(path)
    assert size > 30 * 2**20
    assert peak < size + 24 * 2**20


def _huge_kib_at(address: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds `address`."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(a, 16) for a in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_large_weights_are_placed_in_huge_pages(make_model):
    """A weight of 4 MiB or more is copied out of the file into huge pages, which JAX holds without a further copy: a
    sparse FFN reads its active rows from scattered places, and from XLA's own 4 KiB pages a 7B-shaped predictor
    model decoded 1.08x slower. Smaller weights are placed as before."""
    thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text():
        pytest.skip("this kernel gives no transparent huge pages")
    from jaxinfer import gguf_io
    path = make_model(n_embd=1024, n_ff=4096, n_head=8, n_head_kv=8, n_vocab=256, weight_type=Q.Q8_0)
    g = open_gguf(path)
    view = g.tensors["blk.0.ffn_gate.weight"].data
    assert view.nbytes >= gguf_io.HUGE_PAGE_COPY_BYTES
    placed = gguf_io.place(view)
    assert placed.unsafe_buffer_pointer() % 64 == 0
    assert _huge_kib_at(placed.unsafe_buffer_pointer()) >= 2048
    np.testing.assert_array_equal(np.asarray(placed), view)
    small = g.tensors["blk.0.attn_norm.weight"].data
    np.testing.assert_array_equal(np.asarray(gguf_io.place(small)), small)


# Corrupt files: each is a one-line JaxinferError naming the key or tensor (before: hangs, unbounded memory,
# tracebacks, wrapped-around offsets read as weights). Files are mutated with scripts/fuzz_gguf.py's helpers.

def _fuzz_module():
    spec = importlib.util.spec_from_file_location("fuzz_gguf", pathlib.Path(__file__).parent.parent / "scripts" /
                                                  "fuzz_gguf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fuzz = _fuzz_module()


def corrupt(make_model, tmp_path, mutate, **spec):
    """Write a synthetic model, mutate its bytes with `mutate(base) -> bytes`, return the mutated file's path."""
    base = fuzz.read_base("tiny", make_model(**spec))
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(mutate(base))
    return str(path)


def field(base, key):
    return next(f for f in base.fields if f.key == key)


def tensor(base, name):
    return next(t for t in base.tensors if t.name == name)


def load(path):
    g = open_gguf(path)
    return load_weights(g, load_config(g))


def assert_error(path, *fragments):
    with pytest.raises(JaxinferError) as error:
        from jaxinfer import engine

        engine.load_model(path)
    message = str(error.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_an_array_count_past_the_end_is_refused_before_reading(make_model, tmp_path):
    """gguf-py looped 2^31 times over empty reads past the end (a hang, ~100 MB/s of memory)."""
    path = corrupt(make_model, tmp_path, lambda base: fuzz.patch(
        base.data, field(base, "tokenizer.ggml.token_type").parts[4][0], struct.pack("<Q", 2**31)))
    started = time.perf_counter()
    assert_error(path, "truncated or corrupt", "tokenizer.ggml.token_type", "2147483648 INT32 array items",
                 "need at least 8589934592 bytes")
    assert time.perf_counter() - started < 5


def test_a_vocabulary_string_past_the_end_is_refused(make_model, tmp_path):
    """A token's length is checked as the array is read, though its text is decoded only when asked for."""
    path = corrupt(make_model, tmp_path, lambda base: fuzz.patch(
        base.data, field(base, "tokenizer.ggml.tokens").parts[7][0], struct.pack("<Q", 2**40)))
    assert_error(path, "truncated or corrupt", "metadata tokenizer.ggml.tokens", "1099511627776 x 1 bytes",
                 "run past the end of the file")


def test_an_array_where_a_string_belongs_is_refused(make_model, tmp_path):
    """A value type of ARRAY where a string belongs reads the string's length as item type and count."""
    path = corrupt(make_model, tmp_path, lambda base: fuzz.patch(
        base.data, field(base, "tokenizer.ggml.model").parts[2][0], struct.pack("<I", GGUFValueType.ARRAY)))
    assert_error(path, "metadata tokenizer.ggml.model", "array items", "need at least")


def test_huge_tensor_and_key_counts_are_refused(make_model, tmp_path):
    for offset, fragment in ((8, "tensor infos at offset"), (16, "metadata key/value pairs at offset 24")):
        path = corrupt(make_model, tmp_path, lambda base: fuzz.patch(base.data, offset, struct.pack("<Q", 2**40)))
        assert_error(path, "1099511627776 " + fragment, "need at least")


def test_metadata_strings_must_be_utf8(make_model, tmp_path):
    def mutate(base):
        offset, _ = field(base, "tokenizer.ggml.pre").parts[4]
        return fuzz.patch(base.data, offset, b"\xff")

    assert_error(corrupt(make_model, tmp_path, mutate), "metadata tokenizer.ggml.pre is not UTF-8")


def test_a_tensor_offset_that_wraps_around_is_refused(make_model, tmp_path):
    """2^64 - data_offset wrapped to 0 in gguf-py's uint64 sum: the header was read as the embedding."""
    def mutate(base):
        info = tensor(base, "token_embd.weight")
        return fuzz.patch(base.data, info.parts[5][0], struct.pack("<Q", 2**64 - base.data_offset))

    assert_error(corrupt(make_model, tmp_path, mutate), "tensor token_embd.weight", "past the end of the file")


def test_tensor_offsets_must_be_aligned_and_disjoint(make_model, tmp_path):
    def shift(base):
        info = tensor(base, "blk.0.attn_k.weight")
        return fuzz.patch(base.data, info.parts[5][0], struct.pack("<Q", info.data_start - base.data_offset + 4))

    def overlap(base):
        target = tensor(base, "blk.0.attn_q.weight")
        return fuzz.patch(base.data, tensor(base, "blk.0.attn_k.weight").parts[5][0],
                          struct.pack("<Q", target.data_start - base.data_offset))

    assert_error(corrupt(make_model, tmp_path, shift), "blk.0.attn_k.weight's data offset",
                 "not a multiple of the alignment 32")
    assert_error(corrupt(make_model, tmp_path, overlap), "tensors blk.0.attn_k.weight and blk.0.attn_q.weight overlap")


def test_tensor_shapes_must_match_the_config(make_model, tmp_path):
    """A [d, kv] key projection stored as [kv, d] has the right size but would have been run transposed."""
    def swap(base):
        info = tensor(base, "blk.1.attn_k.weight")
        return fuzz.patch(base.data, info.parts[3][0], struct.pack("<QQ", *info.dims[::-1]))

    assert_error(corrupt(make_model, tmp_path, swap), "tensor blk.1.attn_k.weight has shape [64, 32]",
                 "implies [32, 64]")


def test_block_count_must_match_the_tensors(make_model, tmp_path):
    path = corrupt(make_model, tmp_path, lambda base: fuzz.rebuild(base, {"llama.block_count": fuzz.encode_field(
        "llama.block_count", GGUFValueType.UINT32, 1)}), n_layer=2)
    assert_error(path, "has tensor blk.1.", "llama.block_count is 1")
    path = corrupt(make_model, tmp_path, lambda base: fuzz.rebuild(base, {"llama.block_count": fuzz.encode_field(
        "llama.block_count", GGUFValueType.UINT32, 3)}), n_layer=2)
    assert_error(path, "lacks tensor blk.2.attn_norm.weight")


def test_norms_must_be_f32_and_predictors_come_in_pairs(make_model, tmp_path):
    def f16_norm(base):
        return fuzz.patch(base.data, tensor(base, "output_norm.weight").parts[4][0], struct.pack("<I", Q.F16))

    def no_fc2(base):  # renamed, so the layer has fc1 without fc2
        offset, size = tensor(base, "blk.0.fc2.weight").parts[1]
        return fuzz.patch(base.data, offset, b"blk.0.fcX.weight")

    assert_error(corrupt(make_model, tmp_path, f16_norm), "output_norm.weight", "type F16")
    assert_error(corrupt(make_model, tmp_path, no_fc2, sparsity=0.8), "blk.0.fc1.weight without blk.0.fc2.weight")


def test_vocabulary_must_match_the_embedding(make_model, tmp_path):
    def fewer_tokens(base):
        tokens = ["<|endoftext|>"] * 200
        return fuzz.rebuild(base, {"tokenizer.ggml.tokens": fuzz.encode_field(
            "tokenizer.ggml.tokens", GGUFValueType.ARRAY, tokens, GGUFValueType.STRING)})

    assert_error(corrupt(make_model, tmp_path, fewer_tokens), "tokenizer.ggml.tokens has 200 tokens",
                 "token_embd.weight has 263 rows")
    path = corrupt(make_model, tmp_path, lambda base: fuzz.rebuild(base, {"llama.vocab_size": fuzz.encode_field(
        "llama.vocab_size", GGUFValueType.INT32, -4)}))
    assert_error(path, "llama.vocab_size is -4, token_embd.weight has 263 rows")


def test_wrong_typed_metadata_names_the_file_and_key(make_model, tmp_path):
    path = corrupt(make_model, tmp_path, lambda base: fuzz.rebuild(base, {"llama.block_count": fuzz.encode_field(
        "llama.block_count", GGUFValueType.STRING, "2")}))
    assert_error(path, path, "llama.block_count must be an integer, found str '2'")


def test_names_read_from_the_file_stay_on_one_line(make_model, tmp_path):
    """Found by the fuzzer: a key length grown over the following fields made a key of binary lengths and
    vocabulary, newlines included, which the error printed raw."""
    path = corrupt(make_model, tmp_path, lambda base: fuzz.patch(
        base.data, field(base, "tokenizer.ggml.model").parts[0][0], struct.pack("<Q", 262)))
    assert_error(path, "metadata tokenizer.ggml.model\\x", "unknown value type id")


@pytest.mark.parametrize("key, vtype, value, item_type, fragment", [
    ("tokenizer.ggml.bos_token_id", GGUFValueType.UINT32, 263, None, "bos_token_id is 263, past the vocabulary of 263"),
    ("tokenizer.ggml.eos_token_id", GGUFValueType.STRING, "0", None, "eos_token_id must be an integer, found str"),
    ("tokenizer.ggml.add_bos_token", GGUFValueType.UINT8, 1, None, "add_bos_token must be a bool, found int 1"),
    ("tokenizer.ggml.merges", GGUFValueType.ARRAY, ["Ġt"], GGUFValueType.STRING,
     "merges has 'Ġt', not two tokens separated by a space"),
    ("tokenizer.ggml.merges", GGUFValueType.ARRAY, ["Ġ zzz"], GGUFValueType.STRING, "the tokenizer cannot be built"),
    ("tokenizer.ggml.token_type", GGUFValueType.ARRAY, [1, 1], GGUFValueType.INT32, "token_type has 2 entries for 263"),
    ("tokenizer.ggml.tokens", GGUFValueType.ARRAY, list(range(263)), GGUFValueType.INT32,
     "tokenizer.ggml.tokens must be an array of str, found ARRAY/INT32"),
    ("tokenizer.chat_template", GGUFValueType.ARRAY, ["{{ x }}"], GGUFValueType.STRING,
     "tokenizer.chat_template must be a string, found an array of 1 items"),
    ("tokenizer.ggml.model", GGUFValueType.STRING, "bert", None, "unsupported tokenizer model 'bert'"),
])
def test_tokenizer_metadata_is_checked(make_model, tmp_path, key, vtype, value, item_type, fragment):
    """Before, these reached the tokenizers library (a TypeError or Rust exception) or the model (a BOS id past
    the embedding)."""
    path = corrupt(make_model, tmp_path, lambda base: fuzz.rebuild(base, {key: fuzz.encode_field(
        key, vtype, value, item_type)}))
    assert_error(path, path, fragment)

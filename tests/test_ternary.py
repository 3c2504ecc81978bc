"""The ternary formats (ternary.py): TQ1_0 and TQ2_0 against gguf-py bit for bit, I2_S against a decoder written
here from Microsoft's layout, files with them read back, and I2_S's per-token int8 activations."""

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine, quant, ternary
from jaxinfer.gguf_io import load_matrix, open_gguf
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_reader import CorruptGGUF, Reader
from jaxinfer.synthetic import SyntheticSpec, write_model


def ternary_values(rng, rows, cols, scale=0.37):
    return (rng.integers(-1, 2, size=(rows, cols)) * scale).astype(np.float32)


@pytest.mark.parametrize("qtype", [Q.TQ1_0, Q.TQ2_0], ids=lambda q: q.name)
def test_tq_dequantize_is_gguf_py_bit_for_bit(qtype):
    """Quantized ternary weights (stored exactly, up to the f16 scale) and random bytes (every code, 3 included)."""
    rng = np.random.default_rng(int(qtype))
    values = ternary_values(rng, 6, 512)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    for blocks in (gguf.quants.quantize(values, qtype), rng.integers(0, 256, (6, 2 * type_size), np.uint8)):
        blocks[..., type_size - 2::type_size] &= 0x3B  # finite f16 scales: a random exponent may be NaN
        expected = gguf.quants.dequantize(blocks, qtype)
        w = quant.from_gguf_data(blocks, qtype, (6, 512))
        np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), expected)
    np.testing.assert_allclose(gguf.quants.dequantize(gguf.quants.quantize(values, qtype), qtype), values,
                               rtol=1e-3)


def i2_s_decoded(data: bytes, n_values: int) -> np.ndarray:
    """Microsoft's x86 I2_S, element by element as its packer writes it: element j of 128-value group g is bits
    6 - 2 (j // 32) of byte 32 g + j % 32; code 0, 1, 2 is -1, 0, +1; the f32 scale follows the n / 4 bytes."""
    scale = np.frombuffer(data[n_values // 4:n_values // 4 + 4], np.float32)[0]
    out = np.empty(n_values, np.float32)
    for e in range(n_values):
        group, j = divmod(e, 128)
        code = (data[32 * group + j % 32] >> (6 - 2 * (j // 32))) & 3
        out[e] = scale * (code - 1)
    return out


def test_tq1_0_as_tq2_0_keeps_every_value():
    """Random bytes (every trit pattern, d kept) and quantized ternary rows: TQ2_0's values are TQ1_0's, by gguf-py."""
    rng = np.random.default_rng(4)
    blocks = rng.integers(0, 256, size=(3, 7 * 54), dtype=np.uint8)
    blocks.reshape(3, 7, 54)[..., 52:54] = rng.integers(0, 0x3c, size=(3, 7, 2))  # finite f16 scales
    quantized = gguf.quants.quantize(ternary_values(rng, 5, 512), Q.TQ1_0)
    for data in (blocks, quantized):
        widened = np.asarray(ternary.tq1_0_as_tq2_0(data))
        assert widened.shape == (data.shape[0], data.shape[1] // 54 * 66)
        np.testing.assert_array_equal(gguf.quants.dequantize(widened, Q.TQ2_0),
                                      gguf.quants.dequantize(data, Q.TQ1_0))


def test_i2_s_encodes_and_decodes_microsofts_layout():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 3, 4 * 128).astype(np.uint8)
    data = ternary.encode_i2_s(codes, 0.25)
    assert data.size == ternary.i2_s_nbytes(codes.size) == codes.size // 4 + 32
    assert not data[codes.size // 4 + 4:].any()  # the tail: the scale, then zeros
    expected = i2_s_decoded(data.tobytes(), codes.size)
    np.testing.assert_array_equal(expected, 0.25 * (codes.astype(np.float32) - 1))
    w = quant.from_gguf_data(data, ternary.I2_S, (4, 128))
    assert (w.data.shape, w.scale) == ((4, 32), 0.25)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(w)).reshape(-1), expected)


def test_i2_s_tensors_in_a_file_read_back_with_their_scales(tmp_path):
    """A synthetic BitNet file with I2_S weights and per-projection scales: each matrix is its I2_S scale times its
    `.scale` tensor times the stored codes (decoded here), the file's extents include the 32-byte tails."""
    path = write_model(str(tmp_path / "i2s.gguf"), SyntheticSpec(architecture="bitnet-b1.58", n_embd=128, n_ff=256,
                                                                 weight_type=ternary.I2_S, projection_scales=True))
    g = open_gguf(path)
    t = g.tensors["blk.1.ffn_down.weight"]
    assert t.tensor_type == ternary.I2_S and t.n_bytes == 128 * 256 // 4 + 32
    w = load_matrix(g, "blk.1.ffn_down.weight")
    projection_scale = float(g.tensors["blk.1.ffn_down.scale"].data[0])
    decoded = i2_s_decoded(np.asarray(t.data).tobytes(), 128 * 256).reshape(128, 256)
    np.testing.assert_allclose(np.asarray(quant.dequantize(w)), projection_scale * decoded, rtol=1e-6)
    assert set(np.unique(np.round(decoded / np.abs(decoded).max()))) <= {-1.0, 0.0, 1.0}


def test_unknown_type_ids_and_short_i2_s_tensors_are_refused(tmp_path):
    path = write_model(str(tmp_path / "i2s.gguf"), SyntheticSpec(architecture="bitnet", n_embd=128, n_ff=256,
                                                                 weight_type=ternary.I2_S,
                                                                 embedding_type=ternary.I2_S, tied_output=False))
    assert Reader(path).tensors[-1].name == "output.weight"
    data = bytearray(open(path, "rb").read())
    truncated = tmp_path / "short.gguf"
    truncated.write_bytes(data[:-20])  # all of the last tensor's groups, and part of its tail (zeros after the scale)
    with pytest.raises(CorruptGGUF, match="past the end of the file"):
        Reader(str(truncated))
    info = Reader(path).tensors[-1].field
    type_offset = info.offset + sum(int(p.nbytes) for p in info.parts[:4])
    data[type_offset:type_offset + 4] = (37).to_bytes(4, "little")
    unknown = tmp_path / "unknown.gguf"
    unknown.write_bytes(data)
    with pytest.raises(CorruptGGUF, match=r"unknown type id 37$"):
        Reader(str(unknown))
    data[type_offset:type_offset + 4] = (38).to_bytes(4, "little")  # bitnet.cpp's TL1: named
    unknown.write_bytes(data)
    with pytest.raises(CorruptGGUF, match=r"unknown type id 38 \(in bitnet.cpp's files: its TL1 lookup-table layout"):
        Reader(str(unknown))


def test_bitnet_forks_layouts_are_named_where_their_ids_are_refused(tmp_path):
    """Type 39 is llama.cpp's MXFP4 and bitnet.cpp's TL2: a model with it is refused, naming both readings."""
    path = write_model(str(tmp_path / "q8.gguf"), SyntheticSpec(architecture="bitnet", n_embd=128, n_ff=256,
                                                                weight_type=Q.Q8_0))
    data = bytearray(open(path, "rb").read())
    info = next(t for t in Reader(path).tensors if t.name == "blk.0.attn_q.weight").field
    type_offset = info.offset + sum(int(p.nbytes) for p in info.parts[:4])
    data[type_offset:type_offset + 4] = (39).to_bytes(4, "little")  # 17 bytes a block of 32: within Q8_0's extent
    patched = tmp_path / "tl2.gguf"
    patched.write_bytes(data)
    with pytest.raises(JaxinferError, match=r"blk.0.attn_q.weight has type MXFP4 \(in bitnet.cpp's files: its TL2 "
                                            r"lookup-table layout, which jaxinfer does not read; convert the model to "
                                            r"I2_S, TQ1_0 or TQ2_0\), which jaxinfer does not support"):
        engine.load_model(str(patched))
    assert ternary.unsupported_type_note(Q.Q8_0) == ""


def test_absmax_int8_rounds_each_token_to_127_steps_of_its_largest_value():
    x = np.array([[0.5, -1.0, 0.25, 0.0031], [3.0, 0.0, -0.7, 1.2]], np.float32)
    steps = np.abs(x).max(axis=-1, keepdims=True) / 127
    np.testing.assert_allclose(np.asarray(ternary.absmax_int8(jnp.asarray(x))), np.round(x / steps) * steps,
                               rtol=1e-6)


def test_i2_s_products_quantize_activations_per_token_unless_exact(tmp_path):
    """BitNet's reference: an I2_S product sees its input rounded to int8 per token; an exact weight multiplies the
    f32 input (the KL-divergence base), and TQ types, whose llama.cpp reference differs, multiply it as it is."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(3, 256)).astype(np.float32))
    codes = rng.integers(0, 3, 64 * 256).astype(np.uint8)
    w = quant.from_gguf_data(ternary.encode_i2_s(codes, 0.5), ternary.I2_S, (64, 256))
    values = np.asarray(quant.dequantize(w))
    np.testing.assert_allclose(np.asarray(quant.matmul(x, w)), np.asarray(ternary.absmax_int8(x)) @ values.T,
                               rtol=1e-5, atol=1e-5)
    exact = quant.QuantArray(w.data, w.qtype, w.shape, exact=True, scale=w.scale)
    np.testing.assert_allclose(np.asarray(quant.matmul(x, exact)), np.asarray(x) @ values.T, rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(quant.matmul(x, w)), np.asarray(x) @ values.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qtype", [Q.TQ1_0, Q.TQ2_0, ternary.I2_S], ids=lambda q: q.name)
def test_ternary_models_describe_their_types(tmp_path, qtype):
    path = write_model(str(tmp_path / "m.gguf"), SyntheticSpec(architecture="bitnet", n_embd=256, n_ff=512,
                                                               weight_type=qtype))
    assert f"types F32/{qtype.name}" in engine.load_model(path).describe()

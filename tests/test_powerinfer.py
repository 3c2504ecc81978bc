import pathlib

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

from jaxinfer import powerinfer, quant, torch_format
from jaxinfer.gguf_io import load_config, load_weights, open_gguf

DATA = pathlib.Path(__file__).parent / "data"


def test_powerinfer_file_round_trip(make_model, tmp_path):
    path = make_model(n_embd=64, n_ff=128, sparsity=0.8, weight_type=Q.Q8_0)
    assert pathlib.Path(path).read_bytes()[:4] == b"PWRI"
    g = open_gguf(path)
    cfg = load_config(g)
    assert g.powerinfer and cfg.gate_activation == "relu" and cfg.sparse_threshold == 0.0
    w = load_weights(g, cfg)
    layer = w.layers[1]
    assert layer.ffn_down is None and layer.ffn_down_t.shape == (128, 64)
    assert layer.fc1.qtype == Q.F16 and layer.fc2.shape[0] == 128 and layer.fc1.shape[0] == layer.fc2.shape[1]

    copy = str(tmp_path / "copy.gguf")
    powerinfer.write_gguf(copy, "llama", powerinfer.metadata_fields(g), powerinfer.stored_tensors(g), powerinfer=True)
    h = open_gguf(copy)
    assert h.powerinfer and h.metadata == g.metadata
    for name, t in g.tensors.items():
        np.testing.assert_array_equal(np.asarray(h.tensors[name].data), np.asarray(t.data))


def test_reader_agrees_with_gguf_py_on_the_unpatched_bytes(make_model, tmp_path):
    """Our PWRI-aware reader must see exactly what gguf-py sees once the magic is GGUF again."""
    path = make_model(sparsity=0.8)
    plain = tmp_path / "plain.gguf"
    plain.write_bytes(b"GGUF" + pathlib.Path(path).read_bytes()[4:])
    ours, theirs = open_gguf(path), gguf.GGUFReader(str(plain))
    for t in theirs.tensors:
        np.testing.assert_array_equal(np.asarray(ours.tensors[t.name].data), np.asarray(t.data))
    assert ours.metadata["powerinfer.sparse_threshold"] == theirs.get_field("powerinfer.sparse_threshold").contents()


def test_synthetic_predictor_is_the_gate(make_model):
    """fc2(relu(fc1 v)) reproduces the (unquantized) gate pre-activation of the synthetic construction."""
    g = open_gguf(make_model(n_embd=64, n_ff=128, sparsity=0.9, predictor_type=Q.F32))
    w = load_weights(g, load_config(g))
    v = np.random.default_rng(0).normal(size=(5, 64)).astype(np.float32)
    layer = w.layers[0]
    predicted = np.maximum(v @ np.asarray(quant.dequantize(layer.fc1)).T, 0) @ np.asarray(
        quant.dequantize(layer.fc2)).T
    np.testing.assert_allclose(predicted, v @ np.asarray(quant.dequantize(layer.ffn_gate)).T, rtol=1e-4, atol=1e-4)


def test_torch_tensor_files(tmp_path):
    values = np.array([5, 0, 2**40, 7], np.int64)
    path = tmp_path / "activation_12.pt"
    torch_format.save_tensor(str(path), values)
    np.testing.assert_array_equal(torch_format.load_tensor(str(path)), values)
    # A file written by torch.save itself (torch 2.13) reads back, and ours has the same archive layout.
    np.testing.assert_array_equal(torch_format.load_tensor(str(DATA / "torch_2.13_int64_arange.pt")),
                                  np.arange(6) * 7 - 3)
    import zipfile

    theirs = {n.split("/", 1)[1] for n in zipfile.ZipFile(DATA / "torch_2.13_int64_arange.pt").namelist()}
    ours = {n.split("/", 1)[1] for n in zipfile.ZipFile(path).namelist()}
    assert ours <= theirs and {"data.pkl", "data/0", "byteorder", "version"} <= ours

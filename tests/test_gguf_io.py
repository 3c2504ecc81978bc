import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

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
    path = make_model()
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert ours.array("tokenizer.ggml.tokens") == theirs.get_field("tokenizer.ggml.tokens").contents()
    assert ours.metadata["llama.block_count"] == theirs.get_field("llama.block_count").contents()


def test_missing_tensor_is_reported(make_model, tmp_path):
    g = open_gguf(make_model())
    del g.tensors["blk.1.ffn_up.weight"]
    with pytest.raises(JaxinferError, match="lacks tensor blk.1.ffn_up.weight"):
        load_weights(g, load_config(g))


def test_loading_the_default_model_peaks_under_twice_its_file_size(default_model):
    """Measured in a fresh process: RSS growth from before loading to the peak, against the file's size."""
    script = textwrap.dedent("""
        import os, jax.numpy as jnp
        jnp.zeros(1).block_until_ready()
        def status(key):
            return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
        base = status("VmRSS")
        from jaxinfer import engine
        path = engine.default_model_path()
        engine.load_model(path)
        print((status("VmHWM") - base) / os.path.getsize(path))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert float(out.stdout.strip().splitlines()[-1]) < 2.0

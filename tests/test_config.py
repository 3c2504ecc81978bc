"""Config.from_metadata: every hyperparameter is checked for its type and range, and a bad one is a one-line
JaxinferError naming the key (before, a string block_count or a zero head count surfaced as a TypeError,
ZeroDivisionError or NaN logits)."""

import math

import pytest

from jaxinfer.config import GATE_ACTIVATION_KEY, Config
from jaxinfer.errors import JaxinferError
from jaxinfer.metadata import LongArray

GOOD = {
    "general.architecture": "llama",
    "llama.block_count": 2,
    "llama.context_length": 256,
    "llama.embedding_length": 64,
    "llama.feed_forward_length": 128,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 10000.0,
}


def config(**changes):
    meta = dict(GOOD)
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    return Config.from_metadata(meta, n_vocab=263)


def test_good_metadata():
    cfg = config()
    assert (cfg.n_layer, cfg.n_embd, cfg.head_dim, cfg.n_group, cfg.rope_dim, cfg.gate_activation) == \
        (2, 64, 16, 2, 16, "silu")


@pytest.mark.parametrize("key, value, fragment", [
    ("llama.block_count", "2", "llama.block_count must be an integer, found str '2'"),
    ("llama.block_count", 2.0, "llama.block_count must be an integer, found float"),
    ("llama.block_count", True, "llama.block_count must be an integer, found bool"),
    ("llama.block_count", [2, 2], "llama.block_count must be an integer, found an array of 2 items"),
    ("llama.feed_forward_length", LongArray(100), "llama.feed_forward_length must be an integer, found an array"),
    ("llama.block_count", 0, "llama.block_count must be >= 1, found 0"),
    ("llama.attention.head_count", 0, "llama.attention.head_count must be >= 1, found 0"),
    ("llama.attention.head_count_kv", -2, "llama.attention.head_count_kv must be >= 1, found -2"),
    ("llama.embedding_length", 0, "llama.embedding_length must be >= 1"),
    ("llama.feed_forward_length", -1, "llama.feed_forward_length must be >= 1"),
    ("llama.context_length", 0, "llama.context_length must be >= 1"),
    ("llama.attention.head_count", 6, "head_count 6 does not divide llama.embedding_length 64"),
    ("llama.attention.head_count_kv", 3, "head_count 4 is not a multiple of llama.attention.head_count_kv 3"),
    ("llama.attention.layer_norm_rms_epsilon", math.nan, "layer_norm_rms_epsilon must be finite, found nan"),
    ("llama.attention.layer_norm_rms_epsilon", 0.0, "layer_norm_rms_epsilon must be > 0, found 0.0"),
    ("llama.attention.layer_norm_rms_epsilon", -1e-5, "layer_norm_rms_epsilon must be > 0"),
    ("llama.attention.layer_norm_rms_epsilon", "1e-5", "layer_norm_rms_epsilon must be a float, found str"),
    ("llama.rope.freq_base", 10000, "llama.rope.freq_base must be a float, found int 10000"),
    ("llama.rope.freq_base", math.inf, "llama.rope.freq_base must be finite, found inf"),
    ("llama.rope.freq_base", -10000.0, "llama.rope.freq_base must be > 0"),
    ("llama.rope.dimension_count", 7, "rope.dimension_count must be even and at most the head size 16, found 7"),
    ("llama.rope.dimension_count", 32, "at most the head size 16, found 32"),
    ("llama.rope.scaling.type", ["linear"], "llama.rope.scaling.type must be a string"),
    ("powerinfer.sparse_threshold", math.nan, "powerinfer.sparse_threshold must be finite"),
    (GATE_ACTIVATION_KEY, "gelu", f"{GATE_ACTIVATION_KEY} is 'gelu', expected one of: gelu_tanh, relu, relu_sqr, silu"),
    (GATE_ACTIVATION_KEY, 1, f"{GATE_ACTIVATION_KEY} must be a string"),
    ("general.architecture", ["llama"], "unsupported architecture ['llama']"),
    ("llama.attention.layer_norm_rms_epsilon", None, "GGUF metadata lacks llama.attention.layer_norm_rms_epsilon"),
])
def test_bad_metadata_is_a_one_line_error_naming_the_key(key, value, fragment):
    with pytest.raises(JaxinferError) as error:
        config(**{key.replace(".", "__"): value})
    assert fragment in str(error.value) and "\n" not in str(error.value)


def test_the_gate_activation_key_overrides_the_architecture():
    assert config(**{GATE_ACTIVATION_KEY.replace(".", "__"): "relu"}).gate_activation == "relu"

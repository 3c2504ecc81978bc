"""cpu_ext's handlers given buffers that no well-behaved caller makes (found by fuzzing): bool masks holding bytes
other than 0/1, empty layer/start scalars, index entries beyond int32, outputs of the wrong shape, dims whose product
overflows. Each gives a result or a clean error, never a write out of bounds.

The cases that crashed the interpreter run in one subprocess, so that a regression fails a test instead of killing
pytest; the others run here."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

import cpu_ext
from test_cpu_ext import random_weight

REPO = pathlib.Path(__file__).resolve().parents[1]

# Prints one "name: ..." line per case; exits 0 only if the process survived them all.
_CRASH_CASES = r"""
import jax
jax.config.update("jax_enable_x64", True)  # for an int64 index that jnp.asarray does not narrow
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType as Q
import cpu_ext
from jaxinfer import quant
from jaxinfer.synthetic import encode_tensor

def case(name, run):
    try:
        print(f"{name}: {run()}", flush=True)
    except Exception as e:
        print(f"{name}: raised {str(e).splitlines()[0]}", flush=True)

rng = np.random.default_rng(0)
rows, cols = 64, 64
# Bytes 0, 1, 2 and 255 viewed as bool: XLA never makes the last two, a caller can.
raw = rng.choice(np.array([0, 1, 2, 255], np.uint8), size=(3, rows))
odd_mask, mask = raw.view(bool), raw != 0
w = encode_tensor(rng.normal(size=(rows, cols)).astype(np.float32), Q.Q8_0, rng)
x, h = rng.normal(size=(3, cols)).astype(np.float32), rng.normal(size=(3, rows)).astype(np.float32)
kw = dict(qtype=Q.Q8_0, rows=rows, cols=cols)
for tokens in (1, 3):  # one token reads the mask directly, several OR its rows first
    case(f"masked_matmul {tokens}", lambda: np.array_equal(
        cpu_ext.masked_matmul(x[:tokens], w, odd_mask[:tokens], **kw),
        cpu_ext.masked_matmul(x[:tokens], w, mask[:tokens], **kw)))
    case(f"masked_axpy {tokens}", lambda: np.array_equal(
        cpu_ext.masked_axpy(h[:tokens], w, odd_mask[:tokens], **kw),
        cpu_ext.masked_axpy(h[:tokens], w, mask[:tokens], **kw)))
packed = quant.pack_neuron_major(quant.QuantArray(jnp.asarray(w), Q.Q8_0, (rows, cols)))
case("neuron_major_axpy", lambda: np.array_equal(
    cpu_ext.neuron_major_axpy(h, packed.data, odd_mask, **kw, span=quant.neuron_span(cols, Q.Q8_0)),
    cpu_ext.neuron_major_axpy(h, packed.data, mask, **kw, span=quant.neuron_span(cols, Q.Q8_0))))

k = np.zeros((2, 1, 8, 1, 16), np.float32)
q = np.zeros((1, 2, 2, 16), np.float32)
empty = np.zeros(0, np.int32)
case("attention empty layer", lambda: cpu_ext.cached_attention(q, k, k, empty, 0).block_until_ready())
case("attention empty start", lambda: cpu_ext.cached_attention(q, k, k, 0, empty).block_until_ready())
case("attention empty row", lambda: cpu_ext.cached_attention(q, k, k, 0, 0, empty).block_until_ready())
k2, q2 = np.zeros((2, 2, 8, 1, 16), np.float32), np.zeros((2, 2, 2, 16), np.float32)
case("attention start for one of two rows", lambda: cpu_ext.cached_attention(
    q2, k2, k2, 0, np.array([3], np.int32)).block_until_ready())
case("attention small output", lambda: jax.ffi.ffi_call("jaxinfer_cached_attention", jax.ShapeDtypeStruct(
    (1, 1, 2, 16), jnp.float32))(q, k, k, jnp.int32(0), jnp.int32(0), jnp.int32(0),
                                 window=np.int64(0), softcap=np.float32(0)).block_until_ready())

for dtype in (jnp.int64, jnp.uint64):
    case(f"gather_matmul {dtype.__name__}", lambda: cpu_ext.gather_matmul(
        x, w, jnp.array([3, 2**32 + 3], dtype), **kw).block_until_ready())
case("gather_axpy int64", lambda: cpu_ext.gather_axpy(
    h[:, :2], w, jnp.array([2**32 + 3, 5], jnp.int64), **kw).block_until_ready())
in_range = np.array([5, -1, 3, rows], np.int64)
case("gather int64 in range", lambda: np.array_equal(cpu_ext.gather_matmul(x, w, jnp.asarray(in_range), **kw),
                                                      cpu_ext.gather_matmul(x, w, in_range.astype(np.int32), **kw)))
"""


@pytest.mark.slow
def test_crashing_inputs_give_results_or_errors():
    """A mask byte of 2 or 255 counts as active, as numpy reads it; it was added to the count of active rows and
    wrote past the row list. Empty layer/start arrays had their element 0 read, and a smaller output was written
    past (and start must now hold one position per batch row: fewer would be read past). Wide index entries were
    cast to int32, 2**32 + 3 wrapping to row 3."""
    run = subprocess.run([sys.executable, "-c", _CRASH_CASES], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    got = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    for name in ("masked_matmul 1", "masked_axpy 1", "masked_matmul 3", "masked_axpy 3", "neuron_major_axpy",
                 "gather int64 in range"):
        assert got[name] == "True", (name, got)
    one_each = "layer and row must be single int32 values and start one int32 per batch row"
    for name, message in (("attention empty layer", one_each + " (1), got 0, 1 and 1"),
                          ("attention empty start", one_each + " (1), got 1, 1 and 0"),
                          ("attention empty row", one_each + " (1), got 1, 0 and 1"),
                          ("attention start for one of two rows", one_each + " (2), got 1, 1 and 1"),
                          ("attention small output", "the output must have q's shape"),
                          ("gather_matmul int64", "outside the int32 range"),
                          ("gather_matmul uint64", "outside the int32 range"),
                          ("gather_axpy int64", "outside the int32 range")):
        assert got[name].startswith("raised") and message in got[name], (name, got)


def test_index_entries_beyond_int32_raise():
    """With x64 off, jnp.asarray wraps a NumPy int64 array into int32 (2**32 + 3 -> 3): checked before. A uint32
    entry past int32's range reaches the handler, which rejects it."""
    rows, cols = 8, 32
    w = random_weight(Q.Q8_0, rows, cols, np.random.default_rng(1))
    x, kw = np.ones((1, cols), np.float32), dict(qtype=Q.Q8_0, rows=rows, cols=cols)
    for op, first in ((cpu_ext.gather_matmul, x), (cpu_ext.gather_axpy, np.ones((1, 2), np.float32))):
        for index in (np.array([2**32 + 3, 1]), [1, -2**32 + 3]):
            with pytest.raises(ValueError, match="index entries must fit in int32"):
                op(first, w, index, **kw)
        with pytest.raises(Exception, match="outside the int32 range"):
            jax.block_until_ready(op(first, w, jnp.array([1, 2**32 - 1], jnp.uint32), **kw))
    # In range, a uint32 or int8 index gives the int32 index's result; past rows, padding as before.
    index = np.array([7, 0, 8], np.int32)
    expected = cpu_ext.gather_matmul(x, w, index, **kw)
    for dtype in (jnp.uint32, jnp.int8):
        np.testing.assert_array_equal(cpu_ext.gather_matmul(x, w, jnp.asarray(index, dtype), **kw), expected)
    assert float(expected[0, 2]) == 0.0


def test_an_output_count_that_overflows_raises():
    """An empty h [2^60 + 1, 0] (k = 0 index entries) has 2^60 + 1 tokens: times 16 columns, 16 modulo 2^64, which
    a [1, 16] output matched. NumPy refuses such an array; XLA makes one inside jit."""
    attrs = dict(qtype=np.int64(int(Q.F32)), rows=np.int64(2), cols=np.int64(16))

    @jax.jit
    def gather_axpy(w, index):
        h = jnp.zeros((2**60 + 1, 0), jnp.float32)
        out = jax.ShapeDtypeStruct((1, 16), jnp.float32)
        return jax.ffi.ffi_call("jaxinfer_gather_axpy", out)(h, w, index, **attrs)

    with pytest.raises(Exception, match=r"output must be \[\.\.\., 16\]"):
        jax.block_until_ready(gather_axpy(np.ones((2, 16), np.float32), np.zeros(0, np.int32)))

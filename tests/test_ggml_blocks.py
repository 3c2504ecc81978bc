"""ggml_blocks: every block type's jnp decoding bit for bit against gguf-py's (the ternary ones: test_ternary.py)."""

import gguf
import jax
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from test_quant import random_blocks

from jaxinfer import ggml_blocks, quant


@pytest.mark.parametrize("qtype", sorted(set(ggml_blocks.BLOCK_DEQUANTIZERS) - quant.TERNARY_TYPES, key=int),
                         ids=lambda q: q.name)
@pytest.mark.parametrize("rows,n_blocks", [(1, 1), (5, 3)])
def test_block_dequantize_is_bit_exact_with_gguf(qtype, rows, n_blocks):
    rng = np.random.default_rng(int(qtype))
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = random_blocks(qtype, rows, block_size * n_blocks, rng)
    expected = gguf.quants.dequantize(blocks, qtype)
    got = jax.jit(ggml_blocks.BLOCK_DEQUANTIZERS[qtype])(blocks.reshape(rows, n_blocks, type_size))
    np.testing.assert_array_equal(np.asarray(got).reshape(expected.shape), expected)
    whole = jax.jit(quant.dequantize)(quant.from_gguf_data(blocks, qtype, (rows, block_size * n_blocks)))
    np.testing.assert_array_equal(np.asarray(whole), expected)

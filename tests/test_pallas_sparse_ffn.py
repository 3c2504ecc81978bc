import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sparse_ffn import BlockSizes, RowWeights, repack_q8_0, sparse_ffn, sparse_ffn_reference

N_FF, D = 96, 256


def weights(rng, quantized):
    mats = [rng.normal(size=(N_FF, D)).astype(np.float32) / 16 for _ in range(3)]
    if not quantized:
        return [RowWeights(jnp.asarray(m)) for m in mats], mats
    blocks = [gguf.quants.quantize(m, gguf.GGMLQuantizationType.Q8_0) for m in mats]
    dense = [gguf.quants.dequantize(b, gguf.GGMLQuantizationType.Q8_0) for b in blocks]
    return [repack_q8_0(jnp.asarray(b), D) for b in blocks], dense


def index_sets(rng):
    return {
        "random_unsorted": np.concatenate([rng.permutation(N_FF)[:40], -np.ones(8)]).astype(np.int32),
        "all": np.arange(N_FF, dtype=np.int32),
        "empty": -np.ones(32, np.int32),
    }


class SparseFfnTest:
    INTERPRET = False

    def setup_method(self):
        if not self.INTERPRET and jax.default_backend() != "gpu":
            pytest.skip("compiled Pallas kernels need a GPU; the interpret subclass runs them on CPU")

    @pytest.mark.slow
    @pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0"])
    @pytest.mark.parametrize("batch", [1, 3])
    def test_matches_reference_and_dense_numpy(self, quantized, batch):
        rng = np.random.default_rng(batch)
        (gate, up, down_t), dense = weights(rng, quantized)
        x = rng.normal(size=(batch, D)).astype(np.float32)
        for name, idx in index_sets(rng).items():
            got = sparse_ffn(x, idx, gate, up, down_t, gate_act="relu", block_sizes=BlockSizes(8, 128),
                             interpret=self.INTERPRET)
            reference = sparse_ffn_reference(x, idx, gate, up, down_t, gate_act="relu")
            np.testing.assert_allclose(np.asarray(got), np.asarray(reference), rtol=1e-5, atol=1e-5, err_msg=name)
            active = idx[idx >= 0]  # independent numpy: the FFN over the listed neurons only
            h = np.maximum(x @ dense[0][active].T, 0) * (x @ dense[1][active].T)
            np.testing.assert_allclose(np.asarray(got), h @ dense[2][active], rtol=1e-4, atol=1e-4, err_msg=name)

    def test_all_active_equals_the_dense_ffn(self):
        rng = np.random.default_rng(7)
        (gate, up, down_t), dense = weights(rng, False)
        x = rng.normal(size=(2, D)).astype(np.float32)
        got = sparse_ffn(x, np.arange(N_FF, dtype=np.int32), gate, up, down_t, gate_act="silu",
                         block_sizes=BlockSizes(32, 128), interpret=self.INTERPRET)
        g = x @ dense[0].T
        expected = (g / (1 + np.exp(-g)) * (x @ dense[1].T)) @ dense[2]
        np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4)


class TestSparseFfnInterpret(SparseFfnTest):
    INTERPRET = True


class TestSparseFfnCompiled(SparseFfnTest):
    INTERPRET = False


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0"])
def test_kernels_lower_for_an_nvidia_gpu(quantized):
    """Without a GPU, check that the kernels lower for CUDA through Triton, which is how JAX 0.11 compiles a
    generic pallas_call on the GPU machine (JAX 0.10 defaults to Mosaic GPU: switch it off for the check)."""
    previous = getattr(jax.config, "jax_pallas_use_mosaic_gpu", None)
    if previous is not None:
        jax.config.update("jax_pallas_use_mosaic_gpu", False)
    try:
        values = jnp.zeros((N_FF, D), jnp.int8 if quantized else jnp.float32)
        w = RowWeights(values, jnp.zeros((N_FF, D // 32)) if quantized else None)
        lowered = jax.jit(lambda x, i: sparse_ffn(x, i, w, w, w)).trace(
            jnp.zeros((1, D)), jnp.zeros((32,), jnp.int32)).lower(lowering_platforms=("cuda",))
        assert lowered.as_text().count("triton") >= 2  # both kernels
    finally:
        if previous is not None:
            jax.config.update("jax_pallas_use_mosaic_gpu", previous)

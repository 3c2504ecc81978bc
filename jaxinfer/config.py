"""The model's shape and hyperparameters, read once from GGUF metadata into a frozen, hashable `Config`."""

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer import metadata
from jaxinfer.errors import JaxinferError
from jaxinfer.plan import Plan


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What differs between GGUF architectures that share the llama block (norm -> attention -> norm -> FFN):
    the FFN is down(gate_act(gate(x)) * up_act(up(x)))."""

    gate_activation: str  # "silu" (SwiGLU), "relu" (ReGLU) or "relu_sqr" (squared ReLU, BitNet b1.58)
    up_activation: str = "identity"  # "relu" for dReLU (Bamboo, TurboSparse)
    # BitNet's sub-norms: RMSNorm of the attention's heads before attn_output, of the FFN's hidden h before ffn_down
    # (blk.N.attn_sub_norm [n_head * head_dim], blk.N.ffn_sub_norm [n_ff]).
    sub_norms: bool = False
    # llama.cpp's RoPE type for the architecture: "norm" rotates adjacent pairs (x[2i], x[2i+1]), "neox" the halves
    # (x[i], x[i + rope_dim / 2]) (llama_model_rope_type).
    rope_type: str = "norm"
    # PowerInfer's sparse graph runs a PWRI file of this architecture with ReLU on the gate: a `llama` PWRI file is
    # a ReLU-fied model (ReluLLaMA, ProSparse), whatever plain llama.cpp would assume.
    powerinfer_gate_activation: str | None = None


# GGUF `general.architecture` -> block variant. Falcon (no gate, LayerNorm) slots in here next.
ARCHITECTURES = {
    "llama": Architecture(gate_activation="silu", powerinfer_gate_activation="relu"),
    "bamboo": Architecture(gate_activation="relu", up_activation="relu", powerinfer_gate_activation="relu"),
    # llama.cpp's build_bitnet: the llama block with sub-norms and optional per-projection `*.scale` tensors.
    "bitnet": Architecture(gate_activation="silu", sub_norms=True, rope_type="neox"),
    # BitNet b1.58 2B-4T (ik_llama.cpp's bitnet-b1.58): the same block with a squared-ReLU GLU, natively sparse.
    "bitnet-b1.58": Architecture(gate_activation="relu_sqr", sub_norms=True, rope_type="neox"),
}
CACHE_TYPES = {"f32": jnp.float32, "f16": jnp.float16}  # Config.cache_type -> the KV cache's dtype
# Written by jaxinfer when it exports a model whose gate activation PowerInfer's convention would misread (a SwiGLU
# model with predictors saved as PWRI); jaxinfer honours it, PowerInfer ignores it.
GATE_ACTIVATION_KEY = "jaxinfer.gate_activation"
GATE_ACTIVATIONS = ("silu", "relu", "relu_sqr")
SPARSE_THRESHOLD_KEY = "powerinfer.sparse_threshold"  # PowerInfer's predictor threshold (f32)


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class Config:
    arch: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    gate_activation: str
    up_activation: str
    sub_norms: bool = False  # Architecture.sub_norms
    rope_type: str = "norm"  # Architecture.rope_type
    sparse_threshold: float = 0.0  # predictor logits >= this run (PowerInfer's powerinfer.sparse_threshold)
    # How it runs on this machine: kernels and placement, decided once at load (plan.py).
    plan: Plan = Plan()
    # The KV cache's element type, one of CACHE_TYPES: "f16" halves its memory and the bytes a decode step reads
    # deep into a context (llama.cpp's default); attention math stays f32.
    cache_type: str = "f32"

    def replan(self, **changes) -> "Config":
        """This config with its plan changed."""
        return dataclasses.replace(self, plan=dataclasses.replace(self.plan, **changes))

    @property
    def n_group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_head // self.n_head_kv

    @classmethod
    def from_metadata(cls, meta: dict, n_vocab: int, powerinfer: bool = False) -> "Config":
        """Build from GGUF key/values (`{"llama.block_count": 30, ...}`) and the embedding's row count; `powerinfer`
        for a PWRI file. Every value is checked for its type and range (a JaxinferError names the key)."""
        arch = meta.get("general.architecture")
        if not isinstance(arch, str) or arch not in ARCHITECTURES:
            raise JaxinferError(f"unsupported architecture {arch!r} (supported: {', '.join(sorted(ARCHITECTURES))})")

        def count(name, default=metadata.REQUIRED):
            return metadata.integer(meta, f"{arch}.{name}", default, minimum=1)

        spec = ARCHITECTURES[arch]
        scaling = metadata.string(meta, f"{arch}.rope.scaling.type", "none")
        if scaling != "none":
            raise JaxinferError(f"unsupported RoPE scaling type {scaling!r}")
        n_embd = count("embedding_length")
        n_head = count("attention.head_count")
        n_head_kv = count("attention.head_count_kv", n_head)
        if n_head % n_head_kv:
            raise JaxinferError(f"{arch}.attention.head_count {n_head} is not a multiple of "
                                f"{arch}.attention.head_count_kv {n_head_kv}")
        if f"{arch}.attention.key_length" not in meta and n_embd % n_head:
            raise JaxinferError(f"{arch}.attention.head_count {n_head} does not divide {arch}.embedding_length "
                                f"{n_embd}")
        head_dim = count("attention.key_length", n_embd // n_head)
        rope_dim = count("rope.dimension_count", head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise JaxinferError(f"{arch}.rope.dimension_count must be even and at most the head size {head_dim}, "
                                f"found {rope_dim}")
        gate_activation = metadata.string(meta, GATE_ACTIVATION_KEY, None, choices=GATE_ACTIVATIONS) \
            or (spec.powerinfer_gate_activation if powerinfer else None) or spec.gate_activation
        return cls(
            arch=arch,
            n_layer=count("block_count"),
            n_embd=n_embd,
            n_ff=count("feed_forward_length"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=count("context_length"),
            rms_eps=metadata.number(meta, f"{arch}.attention.layer_norm_rms_epsilon", positive=True),
            rope_theta=metadata.number(meta, f"{arch}.rope.freq_base", 10000.0, positive=True),
            rope_dim=rope_dim,
            gate_activation=gate_activation,
            up_activation=spec.up_activation,
            sub_norms=spec.sub_norms,
            rope_type=spec.rope_type,
            sparse_threshold=metadata.number(meta, SPARSE_THRESHOLD_KEY, 0.0),
        )

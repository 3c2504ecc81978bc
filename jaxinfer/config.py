"""The model's shape and hyperparameters, read once from GGUF metadata into a frozen, hashable `Config`."""

import dataclasses

import jax

from jaxinfer.errors import JaxinferError


@dataclasses.dataclass(frozen=True)
class Architecture:
    """What differs between GGUF architectures that share the llama block (norm -> attention -> norm -> FFN)."""

    ffn_activation: str  # applied to the gate projection: "silu" (SwiGLU) or "relu" (ReGLU)


# GGUF `general.architecture` -> block variant. ReLU variants (ReluLLaMA/ProSparse, Bamboo) and Falcon slot in here.
ARCHITECTURES = {
    "llama": Architecture(ffn_activation="silu"),
}


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
    ffn_activation: str

    @property
    def n_group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.n_head // self.n_head_kv

    @classmethod
    def from_metadata(cls, meta: dict, n_vocab: int) -> "Config":
        """Build from GGUF key/values (`{"llama.block_count": 30, ...}`) and the embedding's row count."""
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise JaxinferError(
                f"unsupported architecture {arch!r} (supported: {', '.join(sorted(ARCHITECTURES))})"
            )

        def key(name, default=None):
            value = meta.get(f"{arch}.{name}", default)
            if value is None:
                raise JaxinferError(f"GGUF metadata lacks {arch}.{name}")
            return value

        scaling = meta.get(f"{arch}.rope.scaling.type", "none")
        if scaling != "none":
            raise JaxinferError(f"unsupported RoPE scaling type {scaling!r}")
        n_embd = int(key("embedding_length"))
        n_head = int(key("attention.head_count"))
        n_head_kv = int(key("attention.head_count_kv", n_head))
        head_dim = int(key("attention.key_length", n_embd // n_head))
        if n_head % n_head_kv:
            raise JaxinferError(f"head_count {n_head} is not a multiple of head_count_kv {n_head_kv}")
        return cls(
            arch=arch,
            n_layer=int(key("block_count")),
            n_embd=n_embd,
            n_ff=int(key("feed_forward_length")),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=int(key("context_length")),
            rms_eps=float(key("attention.layer_norm_rms_epsilon")),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_dim=int(key("rope.dimension_count", head_dim)),
            ffn_activation=ARCHITECTURES[arch].ffn_activation,
        )

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
    # Per-head RMSNorm of q and k before RoPE (blk.N.attn_q_norm / attn_k_norm [head_dim]): Qwen3, Gemma 3.
    qk_norm: bool = False
    # RMSNorms of the attention's and the FFN's outputs before each joins the residual (blk.N.post_attention_norm,
    # blk.N.post_ffw_norm [d]): Gemma 2/3's four norms a layer.
    post_norms: bool = False
    embed_scale: bool = False  # the token embeddings times sqrt(n_embd) (Gemma)
    # With `{arch}.attention.sliding_window` set, layer i attends to its last `sliding_window` positions only unless
    # i % period == period - 1 (llama.cpp's set_swa_pattern), with RoPE base `{arch}.rope.freq_base_swa` (10000
    # when absent) and no RoPE scaling; 0: the architecture has no sliding-window layers.
    swa_period: int = 0
    # Layer counts at which llama.cpp scales queries by 1/sqrt(n_embd / n_head) instead of 1/sqrt(head_dim)
    # (Gemma 3 27B: its query_pre_attn_scalar).
    query_scale_by_width: tuple[int, ...] = ()
    # How the file stores the FFN's input projections (as llama.cpp's graphs read them): "gated" ffn_gate and ffn_up;
    # "fused" (Phi-3) one ffn_up of 2 n_ff rows, the gate's then the up's; "ungated" (Falcon) ffn_up alone, the FFN
    # then being down(gate_act(up(x))). Attention's may be one fused attn_qkv (q's rows, k's, v's) in any file.
    ffn_layout: str = "gated"
    layer_norm: bool = False  # LayerNorm with a bias (blk.N.attn_norm.bias, output_norm.bias) instead of RMSNorm
    # Attention and FFN both read the layer's normed input and join the residual together (Falcon; no ffn_norm).
    parallel_block: bool = False
    # `{arch}.attention.sliding_window` is read and ignored, as llama.cpp does (Phi-3: its SWA is disabled there).
    ignores_sliding_window: bool = False
    # The FFN is a mixture of experts in every layer (moe.py): `{arch}.expert_count` must be given. Any architecture
    # whose file gives one runs its FFN so (a llama file with experts is Mixtral's layout).
    experts: bool = False
    # Each layer also runs one shared expert for every token, gated by sigmoid(x · ffn_gate_inp_shexp)
    # (blk.N.ffn_{gate,up,down}_shexp, `{arch}.expert_shared_feed_forward_length` neurons: Qwen2-MoE).
    shared_expert: bool = False
    # The chosen experts' weights renormalized over them (llama.cpp's build_moe_ffn norm_w, which its graphs fix per
    # architecture: true for llama and qwen3moe, false for qwen2moe); `{arch}.expert_weights_norm` overrides it.
    expert_weights_norm: bool = True
    # How router logits become expert weights is `{arch}.expert_gating_func` (required): the softmax or the sigmoid,
    # as llama.cpp's smallthinker graph reads it (its llama and qwen3moe graphs take the softmax whatever the file
    # says). False: the softmax.
    expert_gating_from_file: bool = False
    # The router reads the layer's input, before the attention, instead of the FFN's normed input (SmallThinker: the
    # experts a token needs are known before its attention runs).
    router_reads_layer_input: bool = False
    # Tensors a file may hold that the model computes the same without, read past: SmallThinker's lm_head_profiler,
    # PowerInfer's predictor of which head rows to compute (a sparse head, an approximation: the head is computed
    # whole, as PowerInfer does with its predictor turned off).
    unused_tensors: tuple[str, ...] = ()
    # Sliding-window layers where the file has a window: every layer but the first of each period slides, and the
    # global layers rotate nothing (NoPE), as llama.cpp's smallthinker graph; the period
    # `{arch}.attention.sliding_window_pattern` or swa_period.
    swa_global_first_nope: bool = False
    # llama.cpp's soft-caps when the file gives none: attention scores (q·k times the query scale) -> c * tanh(s / c)
    # before the softmax, with c `{arch}.attn_logit_softcapping` (0: the architecture has none, and a file giving
    # one is refused), and the logits so with `{arch}.final_logit_softcapping` (0: none).
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    default_sliding_window: int = 0  # the sliding window when `{arch}.attention.sliding_window` is absent (Gemma 2)
    # The sliding-window layers take the global RoPE base (unless `{arch}.rope.freq_base_swa` is given) and the global
    # RoPE scaling (Gemma 2), rather than base 10000 and no scaling (Gemma 3).
    swa_rope_global: bool = False


# GGUF `general.architecture` -> block variant. QKV biases (blk.N.attn_q.bias, ...) and llama's rope_freqs.weight
# are used wherever a file holds them, as llama.cpp does.
ARCHITECTURES = {
    "llama": Architecture(gate_activation="silu", powerinfer_gate_activation="relu"),
    "bamboo": Architecture(gate_activation="relu", up_activation="relu", powerinfer_gate_activation="relu"),
    # llama.cpp's build_bitnet: the llama block with sub-norms and optional per-projection `*.scale` tensors.
    "bitnet": Architecture(gate_activation="silu", sub_norms=True, rope_type="neox"),
    # BitNet b1.58 2B-4T (ik_llama.cpp's bitnet-b1.58): the same block with a squared-ReLU GLU, natively sparse.
    "bitnet-b1.58": Architecture(gate_activation="relu_sqr", sub_norms=True, rope_type="neox"),
    # Qwen2/2.5 and the DeepSeek-R1 Qwen distills: the llama block with QKV biases, NEOX RoPE.
    "qwen2": Architecture(gate_activation="silu", rope_type="neox"),
    # Qwen3 dense: QK-norm, no biases; the head size (attention.key_length) need not be n_embd / n_head.
    "qwen3": Architecture(gate_activation="silu", rope_type="neox", qk_norm=True),
    # Gemma 3: sqrt(d) embedding scale, four norms a layer (llama.cpp's converter stores Gemma's 1 + w), QK-norm,
    # GeGLU with tanh-approximated GELU, five sliding-window layers to one global one.
    "gemma3": Architecture(gate_activation="gelu_tanh", rope_type="neox", qk_norm=True, post_norms=True,
                           embed_scale=True, swa_period=6, query_scale_by_width=(62,)),
    # Gemma 2: Gemma 3's block without QK-norm, with attention logit soft-capping (50 by default) and final logit
    # soft-capping (30 by default); every other layer slides (window 4096 by default) on the global RoPE base.
    "gemma2": Architecture(gate_activation="gelu_tanh", rope_type="neox", post_norms=True, embed_scale=True,
                           swa_period=2, query_scale_by_width=(46,), attn_softcap=50.0, final_softcap=30.0,
                           default_sliding_window=4096, swa_rope_global=True),
    # Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, a mixture of SwiGLU experts in place of the FFN.
    "qwen3moe": Architecture(gate_activation="silu", rope_type="neox", qk_norm=True, experts=True),
    # Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (QKV biases), a mixture of SwiGLU experts
    # whose weights are not renormalized, and a shared expert gated per token.
    "qwen2moe": Architecture(gate_activation="silu", rope_type="neox", experts=True, shared_expert=True,
                             expert_weights_norm=False),
    # SmallThinker (PowerInfer's MoE models): llama attention with NEOX RoPE, ReGLU experts whose router reads the
    # layer's input before the attention, softmax or sigmoid gating from the file; with a sliding window (21B-A3B),
    # three sliding layers with RoPE after each global layer without.
    "smallthinker": Architecture(gate_activation="relu", rope_type="neox", experts=True, expert_gating_from_file=True,
                                 router_reads_layer_input=True, swa_period=4, swa_global_first_nope=True,
                                 swa_rope_global=True, unused_tensors=("lm_head_profiler.weight",)),
    # Phi-3/Phi-4 mini: fused QKV and gate-up, NEOX RoPE on rope.dimension_count dims (Phi-4 mini: 3/4 of a head).
    "phi3": Architecture(gate_activation="silu", rope_type="neox", ffn_layout="fused", ignores_sliding_window=True),
    # Falcon 7B/40B: parallel attention and FFN, LayerNorm with bias, fused QKV (multi-query for 7B), GELU FFN
    # without a gate (ggml's tanh-approximated GELU).
    "falcon": Architecture(gate_activation="gelu_tanh", rope_type="neox", ffn_layout="ungated", layer_norm=True,
                           parallel_block=True),
}
# RoPE scaling types (`{arch}.rope.scaling.type`) jaxinfer computes: llama.cpp's default "linear" divides positions
# by `{arch}.rope.scaling.factor` (none when absent).
ROPE_SCALING_TYPES = ("none", "linear")
# Metadata that changes the computation in ways jaxinfer does not implement: a file with any of them is refused.
# Attention logit soft-capping is computed for the architectures that have it (Architecture.attn_softcap) only.
UNSUPPORTED_KEYS = {"attn_logit_softcapping": "attention logit soft-capping (Gemma 2)"}
CACHE_TYPES = {"f32": jnp.float32, "f16": jnp.float16}  # Config.cache_type -> the KV cache's dtype
# Written by jaxinfer when it exports a model whose gate activation PowerInfer's convention would misread (a SwiGLU
# model with predictors saved as PWRI); jaxinfer honours it, PowerInfer ignores it.
GATE_ACTIVATION_KEY = "jaxinfer.gate_activation"
GATE_ACTIVATIONS = ("silu", "relu", "relu_sqr", "gelu_tanh")
# Gate activations whose zeros the dense mode skips (sparse_ffn: `active` is h != 0; a mixture's experts: moe.py).
NATURAL_ZEROS = ("relu", "relu_sqr")
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
    qk_norm: bool = False  # Architecture.qk_norm
    post_norms: bool = False  # Architecture.post_norms
    embed_scale: float = 1.0  # what token embeddings are multiplied by (Architecture.embed_scale: sqrt(n_embd))
    query_scale: float | None = None  # what q·k is multiplied by; None: 1 / sqrt(head_dim)
    rope_freq_scale: float = 1.0  # positions are multiplied by this (linear RoPE scaling: 1 / factor)
    # llama's rope_freqs.weight [rope_dim / 2] (Llama 3.x's "llama3" scaling): rotation frequency i is divided by
    # factor i. Read from the tensor at load (gguf_io.load_config); a tuple so that the Config stays static.
    rope_freq_factors: tuple[float, ...] | None = None
    sliding_window: int = 0  # the positions a sliding-window layer attends to (its own included); 0: none
    swa_layers: tuple[bool, ...] = ()  # per layer: whether it is a sliding-window one (Architecture.swa_period)
    rope_theta_swa: float = 10000.0  # the RoPE base of the sliding-window layers
    final_softcap: float = 0.0  # logits -> c * tanh(logits / c) when > 0 ({arch}.final_logit_softcapping)
    # Attention scores -> c * tanh(scores / c) before the softmax when > 0 ({arch}.attn_logit_softcapping): only
    # XLA's attention computes it, so a model with one runs that (engine.py sets its plan so).
    attn_softcap: float = 0.0
    rope_freq_scale_swa: float = 1.0  # rope_freq_scale of the sliding-window layers (Architecture.swa_rope_global)
    sparse_threshold: float = 0.0  # predictor logits >= this run (PowerInfer's powerinfer.sparse_threshold)
    ffn_layout: str = "gated"  # Architecture.ffn_layout
    layer_norm: bool = False  # Architecture.layer_norm: rms_eps is then LayerNorm's epsilon
    parallel_block: bool = False  # Architecture.parallel_block
    # A mixture of experts (moe.py) when n_expert > 0: each token runs the n_expert_used experts (of n_ff_exp neurons)
    # its router rates highest, their outputs weighted by the router's softmax, renormalized over those chosen when
    # expert_weights_norm.
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    expert_weights_norm: bool = True
    n_ff_shexp: int = 0  # the shared expert's neurons (Architecture.shared_expert; 0: none)
    expert_gating: str = "softmax"  # router logits -> expert probabilities, one of EXPERT_GATINGS
    router_reads_layer_input: bool = False  # Architecture.router_reads_layer_input
    nope_layers: tuple[bool, ...] = ()  # per layer: whether it rotates nothing (Architecture.swa_global_first_nope)
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

    def rotates(self, layer: int) -> bool:
        """Whether layer `layer` applies RoPE to q and k (all do but the NoPE layers, cfg.nope_layers)."""
        return not (self.nope_layers and self.nope_layers[layer])

    def window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None when it attends to every position before it."""
        return self.sliding_window if self.swa_layers and self.swa_layers[layer] else None

    def fused_parts(self, fused_qkv: bool) -> dict[str, tuple[str, slice | None] | None]:
        """Layer fields a layer holds otherwise than the llama block's tensors, as {field: (tensor within blk.N,
        its rows: None for all)} or {field: None} where it has none: q, k and v from a fused attn_qkv [q; k; v]
        (where a layer has one: llama.cpp's build_qkv), Phi-3's gate and up from its ffn_up [gate; up] (ggml_swiglu's
        halves), Falcon's ungated FFN from its ffn_up held as ffn_gate (what the activation reads, the sparsity
        modes' gate), and no ffn_norm in a parallel block."""
        q, kv, f = self.n_head * self.head_dim, self.n_head_kv * self.head_dim, self.n_ff
        parts = {}
        if fused_qkv:
            parts |= {"attn_q": ("attn_qkv", slice(0, q)), "attn_k": ("attn_qkv", slice(q, q + kv)),
                      "attn_v": ("attn_qkv", slice(q + kv, q + 2 * kv))}
        if self.ffn_layout == "fused":
            parts |= {"ffn_gate": ("ffn_up", slice(0, f)), "ffn_up": ("ffn_up", slice(f, 2 * f))}
        elif self.ffn_layout == "ungated":
            parts |= {"ffn_gate": ("ffn_up", None), "ffn_up": None}
        if self.parallel_block:
            parts["ffn_norm"] = None
        return parts

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
        for key, what in UNSUPPORTED_KEYS.items():
            if f"{arch}.{key}" in meta and not (key == "attn_logit_softcapping" and spec.attn_softcap):
                raise JaxinferError(f"{arch}.{key}: {what} is not implemented")
        scaling = metadata.string(meta, f"{arch}.rope.scaling.type", "linear")
        if scaling not in ROPE_SCALING_TYPES:
            raise JaxinferError(f"unsupported RoPE scaling type {scaling!r} (supported: "
                                f"{', '.join(ROPE_SCALING_TYPES)})")
        factor = metadata.number(meta, f"{arch}.rope.scaling.factor", 0.0)
        if factor < 0:
            raise JaxinferError(f"GGUF metadata {arch}.rope.scaling.factor must be >= 0, found {factor}")
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
        value_length = count("attention.value_length", head_dim)
        if value_length != head_dim:
            raise JaxinferError(f"{arch}.attention.value_length {value_length} differs from the key length {head_dim}: "
                                f"not supported")
        rope_dim = count("rope.dimension_count", head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise JaxinferError(f"{arch}.rope.dimension_count must be even and at most the head size {head_dim}, "
                                f"found {rope_dim}")
        gate_activation = metadata.string(meta, GATE_ACTIVATION_KEY, None, choices=GATE_ACTIVATIONS) \
            or (spec.powerinfer_gate_activation if powerinfer else None) or spec.gate_activation
        n_layer = count("block_count")
        window = 0 if spec.ignores_sliding_window else metadata.integer(
            meta, f"{arch}.attention.sliding_window", spec.default_sliding_window, minimum=0)
        if window and not spec.swa_period:
            raise JaxinferError(f"{arch}.attention.sliding_window is {window}: sliding-window attention is not "
                                f"implemented for {arch}")
        swa_layers = _swa_layers(meta, f"{arch}.attention.sliding_window_pattern", spec.swa_period, n_layer,
                                 spec.swa_global_first_nope) if window else ()
        query_width = n_embd // n_head if n_layer in spec.query_scale_by_width else head_dim
        rope_theta = metadata.number(meta, f"{arch}.rope.freq_base", 10000.0, positive=True)
        rope_freq_scale = 1.0 / factor if scaling == "linear" and factor else 1.0
        return cls(
            arch=arch,
            n_layer=n_layer,
            n_embd=n_embd,
            n_ff=count("feed_forward_length"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_vocab=n_vocab,
            n_ctx_train=count("context_length"),
            rms_eps=metadata.number(meta, f"{arch}.attention.layer_norm_{'' if spec.layer_norm else 'rms_'}epsilon",
                                    positive=True),
            rope_theta=rope_theta,
            rope_dim=rope_dim,
            gate_activation=gate_activation,
            up_activation=spec.up_activation,
            sub_norms=spec.sub_norms,
            rope_type=spec.rope_type,
            qk_norm=spec.qk_norm,
            post_norms=spec.post_norms,
            embed_scale=float(n_embd) ** 0.5 if spec.embed_scale else 1.0,
            query_scale=None if query_width == head_dim else query_width ** -0.5,
            rope_freq_scale=rope_freq_scale,
            sliding_window=window,
            swa_layers=swa_layers,
            rope_theta_swa=metadata.number(meta, f"{arch}.rope.freq_base_swa",
                                           rope_theta if spec.swa_rope_global else 10000.0, positive=True),
            rope_freq_scale_swa=rope_freq_scale if spec.swa_rope_global else 1.0,
            final_softcap=metadata.number(meta, f"{arch}.final_logit_softcapping", spec.final_softcap),
            attn_softcap=metadata.number(meta, f"{arch}.attn_logit_softcapping", spec.attn_softcap,
                                         positive=True) if spec.attn_softcap else 0.0,
            sparse_threshold=metadata.number(meta, SPARSE_THRESHOLD_KEY, 0.0),
            ffn_layout=spec.ffn_layout,
            layer_norm=spec.layer_norm,
            parallel_block=spec.parallel_block,
            router_reads_layer_input=spec.router_reads_layer_input,
            nope_layers=tuple(not flag for flag in swa_layers) if spec.swa_global_first_nope else (),
            **_experts(meta, arch, spec, count("feed_forward_length")),
        )


# How llama.cpp's build_moe_ffn turns router logits into expert probabilities ({arch}.expert_gating_func): those
# jaxinfer computes, by their number there.
EXPERT_GATINGS = {1: "softmax", 2: "sigmoid"}
EXPERT_GATING_SOFTMAX = 1


def _experts(meta: dict, arch: str, spec: Architecture, n_ff: int) -> dict:
    """Config's mixture-of-experts fields from `{arch}.expert_*` (none when the file has no expert_count), checked:
    what jaxinfer does not compute (shared experts beside Qwen2-MoE's one, another gating function, a weight scale)
    is refused."""
    required = spec.experts
    n_expert = metadata.integer(meta, f"{arch}.expert_count", 0, minimum=0)
    if not n_expert:
        if required:
            raise JaxinferError(f"GGUF metadata lacks {arch}.expert_count (a {arch} model is a mixture of experts)")
        return {}
    used = metadata.integer(meta, f"{arch}.expert_used_count", minimum=1)
    if used > n_expert:
        raise JaxinferError(f"{arch}.expert_used_count {used} exceeds {arch}.expert_count {n_expert}")
    if metadata.integer(meta, f"{arch}.expert_shared_count", 0, minimum=0) > int(spec.shared_expert):
        raise JaxinferError(f"{arch}.expert_shared_count: shared experts are not implemented"
                            + (" beyond one" if spec.shared_expert else ""))
    key = f"{arch}.expert_gating_func"
    gating = metadata.integer(meta, key, metadata.REQUIRED if spec.expert_gating_from_file else EXPERT_GATING_SOFTMAX,
                              minimum=0)
    allowed = EXPERT_GATINGS if spec.expert_gating_from_file else {EXPERT_GATING_SOFTMAX: "softmax"}
    if gating not in allowed:
        raise JaxinferError(f"{key} {gating}: not implemented for {arch} (implemented: "
                            f"{', '.join(f'{number} {name}' for number, name in allowed.items())})")
    if metadata.number(meta, f"{arch}.expert_weights_scale", 1.0) not in (0.0, 1.0):
        raise JaxinferError(f"{arch}.expert_weights_scale: scaled expert weights are not implemented")
    # llama.cpp's qwen3moe: the experts' width, or the FFN's shared among those used; its llama: the FFN's.
    width = metadata.integer(meta, f"{arch}.expert_feed_forward_length", n_ff // used if required else n_ff,
                             minimum=1)
    # llama.cpp's qwen2moe: the shared expert's width, or the FFN's.
    shared = (metadata.integer(meta, f"{arch}.expert_shared_feed_forward_length", n_ff, minimum=1)
              if spec.shared_expert else 0)
    return dict(n_expert=n_expert, n_expert_used=used, n_ff_exp=width, n_ff_shexp=shared, expert_gating=allowed[gating],
                expert_weights_norm=metadata.boolean(meta, f"{arch}.expert_weights_norm", spec.expert_weights_norm))


def _swa_layers(meta: dict, key: str, period: int, n_layer: int, global_first: bool = False) -> tuple[bool, ...]:
    """Which layers slide, as llama.cpp's load_swa_pattern reads them: `key` as one flag per layer, or as a period
    (the architecture's when absent) of which every layer but the last (with `global_first`, the first) slides."""
    flags = meta.get(key)
    if isinstance(flags, list):
        if len(flags) != n_layer or not all(isinstance(flag, bool) for flag in flags):
            raise JaxinferError(f"GGUF metadata {key} must be a period or {n_layer} bools, found "
                                f"{metadata.describe(flags)}")
        return tuple(flags)
    period = metadata.integer(meta, key, period, minimum=1)
    if global_first:
        return tuple(i % period != 0 for i in range(n_layer))
    return tuple(i % period < period - 1 for i in range(n_layer))

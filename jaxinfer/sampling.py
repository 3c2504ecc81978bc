"""Token sampling as pure functions of (logits, recent tokens, key), in llama.cpp's sampler order:
repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw. Temperature <= 0 means greedy."""

import dataclasses

import jax
import jax.numpy as jnp

from jaxinfer.errors import JaxinferError


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0 keeps the whole vocabulary
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repeat_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = 64  # how many recent tokens the penalty looks at

    def validate(self):
        checks = [
            (self.temperature >= 0, f"--temp must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"--top_k must be >= 0, got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"--top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"--min_p must be in [0, 1], got {self.min_p}"),
            (self.repeat_penalty > 0, f"--repeat_penalty must be > 0, got {self.repeat_penalty}"),
            (self.repeat_last_n >= 0, f"--repeat_last_n must be >= 0, got {self.repeat_last_n}"),
        ]
        for ok, message in checks:
            if not ok:
                raise JaxinferError(message)
        return self


def apply_repeat_penalty(logits, recent, penalty):
    """logits [B, V]; recent [B, N] token ids, -1 for empty slots. Seen tokens' positive logits are divided by the
    penalty and negative ones multiplied (llama.cpp's rule)."""
    vocab = logits.shape[-1]
    slots = jnp.where(recent >= 0, recent, vocab)  # empty slots fall outside the vocabulary and are dropped
    seen = jax.vmap(lambda s: jnp.zeros(vocab, bool).at[s].set(True, mode="drop"))(slots)
    penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalized, logits)


def sample(logits, recent, key, params: SamplingParams):
    """logits [B, V] -> token ids [B] (int32)."""
    logits = logits.astype(jnp.float32)
    if params.repeat_penalty != 1.0 and params.repeat_last_n > 0:
        logits = apply_repeat_penalty(logits, recent, params.repeat_penalty)
    if params.temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    k = params.top_k if 0 < params.top_k < logits.shape[-1] else logits.shape[-1]
    values, ids = jax.lax.top_k(logits, k)  # sorted, largest first
    probs = jax.nn.softmax(values, axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first candidate always survives).
    keep = jnp.cumsum(probs, axis=-1) - probs < params.top_p
    # min-p: drop candidates less likely than min_p times the most likely one.
    keep &= probs >= params.min_p * probs[..., :1]
    values = jnp.where(keep, values / params.temperature, -jnp.inf)
    choice = jax.random.categorical(key, values, axis=-1)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)

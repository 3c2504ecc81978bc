"""Token sampling as pure functions of (logits, recent tokens, key), in llama.cpp's sampler order:
repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw. Temperature <= 0 means greedy.

The sampling values are traced, not baked into the program: one compiled step serves every --temp, --top_k,
--top_p, --min_p and --repeat_penalty (a new value used to cost a compilation, ~8 s for the default model). Only
repeat_last_n is static: it sizes the window of recent tokens."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.errors import JaxinferError

INT32_MAX = 2**31 - 1
# top_k up to this many ranks the candidates with lax.top_k of this size (~0.1 ms for a 49k vocabulary on 2 cores);
# a larger top_k, or none, ranks the whole vocabulary (~10 ms), as lax.top_k over it always did.
FAST_TOP_K = 128
FLAGS = {"temperature": "--temp"}  # generate's flag for a field, where it is not --FIELD


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40  # 0 keeps the whole vocabulary
    top_p: float = 0.95  # 1.0 disables
    min_p: float = 0.05  # 0.0 disables
    repeat_penalty: float = 1.0  # 1.0 disables
    repeat_last_n: int = dataclasses.field(default=64, metadata={"static": True})  # recent tokens penalized

    def validate(self, name=lambda field: FLAGS.get(field, f"--{field}")):
        """Raise a JaxinferError naming the first value out of range (NaN and infinities included), by its flag or, with
        `name(field)`, as its caller spells it (the server: the request's field)."""
        checks = [  # field, in range, the range in words
            ("temperature", self.temperature >= 0, "a finite number >= 0"),
            ("top_k", 0 <= self.top_k <= INT32_MAX, f"in [0, {INT32_MAX}]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("repeat_penalty", self.repeat_penalty > 0, "a finite number > 0"),
            ("repeat_last_n", 0 <= self.repeat_last_n <= INT32_MAX, f"in [0, {INT32_MAX}]"),
        ]
        for field, in_range, allowed in checks:
            value = getattr(self, field)
            if not (in_range and math.isfinite(value)):
                raise JaxinferError(f"{name(field)} must be {allowed}, got {value}")
        return self

    def as_arrays(self) -> "SamplingParams":
        """The traced values as fixed-dtype scalars, so that every value (an int temperature as much as a float one)
        runs the same compiled program. top_k beyond int32 keeps the whole vocabulary either way."""
        return dataclasses.replace(
            self, temperature=np.float32(self.temperature), top_k=np.int32(min(self.top_k, INT32_MAX)),
            top_p=np.float32(self.top_p), min_p=np.float32(self.min_p),
            repeat_penalty=np.float32(self.repeat_penalty))


def apply_repeat_penalty(logits, recent, penalty):
    """logits [B, V]; recent [B, N] token ids, -1 for empty slots. Seen tokens' positive logits are divided by the
    penalty and negative ones multiplied (llama.cpp's rule); a penalty of 1 leaves every logit exactly as it was."""
    vocab = logits.shape[-1]
    slots = jnp.where(recent >= 0, recent, vocab)  # empty slots fall outside the vocabulary and are dropped
    seen = jax.vmap(lambda s: jnp.zeros(vocab, bool).at[s].set(True, mode="drop"))(slots)
    penalized = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalized, logits)


def _greedy(logits, key, params: SamplingParams):
    del key, params
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _draw(n_candidates: int, logits, key, params: SamplingParams):
    """Draw from the `n_candidates` largest logits (sorted, largest first), of which ranks >= top_k are masked out:
    the same candidates, probabilities and draw as lax.top_k with k = top_k, since the Gumbel noise of
    jax.random.categorical at a position does not depend on how many positions follow it."""
    values, ids = jax.lax.top_k(logits, n_candidates)
    top_k = jnp.where(params.top_k > 0, params.top_k, n_candidates)
    values = jnp.where(jnp.arange(n_candidates) < top_k, values, -jnp.inf)
    probs = jax.nn.softmax(values, axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first candidate always survives).
    keep = jnp.cumsum(probs, axis=-1) - probs < params.top_p
    # min-p: drop candidates less likely than min_p times the most likely one.
    keep &= probs >= params.min_p * probs[..., :1]
    values = jnp.where(keep, values / params.temperature, -jnp.inf)
    choice = jax.random.categorical(key, values, axis=-1)
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def sample(logits, recent, key, params: SamplingParams):
    """logits [B, V] -> token ids [B] (int32). Greedy or not, and how many candidates to rank, are decided by the
    traced values inside the program; only the chosen branch runs."""
    logits = logits.astype(jnp.float32)
    if params.repeat_last_n > 0:
        logits = apply_repeat_penalty(logits, recent, params.repeat_penalty)
    vocab = logits.shape[-1]
    fast = min(FAST_TOP_K, vocab)
    few = (params.top_k > 0) & (params.top_k <= fast)
    branch = jnp.where(params.temperature <= 0, 0, jnp.where(few, 1, 2))
    return jax.lax.switch(branch, [_greedy, lambda *a: _draw(fast, *a), lambda *a: _draw(vocab, *a)],
                          logits, key, params)

"""Token sampling as pure functions of (logits, recent tokens, keys), in llama.cpp's sampler order:
repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw. Temperature <= 0 means greedy.

The sampling values are traced, not baked into the program: one compiled step serves every --temp, --top_k,
--top_p, --min_p and --repeat_penalty (a new value used to cost a compilation, ~8 s for the default model). Only
repeat_last_n is static: it sizes the window of recent tokens. The traced values may also be given per row ([B]),
so that one program samples for a server's slots, each with its own request's values and key."""

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
    # OpenAI's penalties as llama.cpp applies them, over the same recent tokens: minus frequency_penalty times a
    # token's count there, minus presence_penalty once if it is there at all. 0 disables.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

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
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
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
            repeat_penalty=np.float32(self.repeat_penalty), frequency_penalty=np.float32(self.frequency_penalty),
            presence_penalty=np.float32(self.presence_penalty))


def apply_penalties(logits, recent, repeat, frequency=0.0, presence=0.0):
    """logits [B, V]; recent [B, N] token ids, -1 for empty slots; each penalty one value or a [B, 1] column.
    llama.cpp's penalties sampler: a seen token's positive logit is divided by `repeat` and a negative one multiplied,
    then `frequency` times its count among the recent tokens and `presence` are subtracted. Neutral values (1, 0, 0)
    leave every logit exactly as it was."""
    vocab = logits.shape[-1]
    slots = jnp.where(recent >= 0, recent, vocab)  # empty slots fall outside the vocabulary and are dropped
    counts = jax.vmap(lambda s: jnp.zeros(vocab, jnp.float32).at[s].add(1.0, mode="drop"))(slots)
    penalized = jnp.where(logits > 0, logits / repeat, logits * repeat) - counts * frequency - presence
    return jnp.where(counts > 0, penalized, logits)


def _rows(value, batch: int):
    """A sampling value given once or per row, as a [B, 1] column against [B, candidates]."""
    return jnp.broadcast_to(jnp.asarray(value), (batch,))[:, None]


def _draw(n_candidates: int, logits, keys, params: SamplingParams):
    """Draw each row from its `n_candidates` largest logits (sorted, largest first), of which ranks >= its top_k are
    masked out: the same candidates, probabilities and draw as lax.top_k with k = top_k, since the Gumbel noise of
    jax.random.categorical at a position does not depend on how many positions follow it."""
    batch = logits.shape[0]
    values, ids = jax.lax.top_k(logits, n_candidates)
    top_k = _rows(params.top_k, batch)
    values = jnp.where(jnp.arange(n_candidates) < jnp.where(top_k > 0, top_k, n_candidates), values, -jnp.inf)
    probs = jax.nn.softmax(values, axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the first candidate always survives).
    keep = jnp.cumsum(probs, axis=-1) - probs < _rows(params.top_p, batch)
    # min-p: drop candidates less likely than min_p times the most likely one.
    keep &= probs >= _rows(params.min_p, batch) * probs[..., :1]
    temperature = _rows(params.temperature, batch)  # <= 0 in greedy rows, whose draw is not used
    values = jnp.where(keep, values / jnp.where(temperature > 0, temperature, 1.0), -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, values)  # each row from its own key
    return jnp.take_along_axis(ids, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def first_argmax(logits):
    """jnp.argmax(logits, axis=-1) as int32 (the first of equal maxima; the first NaN where there is one), as two plain
    reductions: XLA:CPU runs argmax's reduction over (value, index) pairs an element at a time, 160 us for a
    32,000-token vocabulary against 20 us for a max and a min (3% of a decode step of a 4-layer mixture)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    at_top = (logits == top) | jnp.isnan(logits)
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(at_top, ids, logits.shape[-1]), axis=-1)


def unpack_allowed(bits, vocab: int):
    """llguidance's bitmask int32 [B, ceil(V / 32)] (bit t % 32 of word t // 32: token t allowed) -> bool [B, V]."""
    unpacked = (bits[:, :, None] >> jnp.arange(32, dtype=bits.dtype)) & 1
    return unpacked.reshape(bits.shape[0], -1)[:, :vocab].astype(bool)


def sample(logits, recent, keys, params: SamplingParams, allowed=None):
    """logits [B, V], recent [B, N], keys [B] (one PRNG key per row) -> token ids [B] (int32). `allowed` (bool [B, V],
    optional): the tokens each row may take (a grammar's, structured_output.py); the others' logits are -inf after the
    penalties, and a row allowing every token samples exactly as without it. Each sampling value is
    one for every row or one per row ([B]: a server's slots, each with its request's values); a row's token depends
    only on its own logits, window, key and values. Greedy or not, and how many candidates to rank, are decided by
    the traced values inside the program, for the whole batch (only the branch the rows need runs); a row's draw is
    the same in either drawing branch (see `_draw`), and a greedy row takes the argmax whatever the others do."""
    logits = logits.astype(jnp.float32)
    batch, vocab = logits.shape
    if params.repeat_last_n > 0:
        penalties = (_rows(params.repeat_penalty, batch), _rows(params.frequency_penalty, batch),
                     _rows(params.presence_penalty, batch))
        # Counting the window over the vocabulary costs a pass over it, and the penalties are neutral by default: a
        # batch whose rows are all neutral skips them (Gemma's 262,144 words: greedy 598 -> 404 us a token, the
        # default sampler 1201 -> 692 us). In a batch with other rows, the neutral ones come out of them unchanged.
        neutral = jnp.all(penalties[0] == 1) & jnp.all(penalties[1] == 0) & jnp.all(penalties[2] == 0)
        logits = jax.lax.cond(neutral, lambda x: x, lambda x: apply_penalties(x, recent, *penalties), logits)
    if allowed is not None:
        logits = jnp.where(allowed, logits, -jnp.inf)
    fast = min(FAST_TOP_K, vocab)
    greedy = _rows(params.temperature, batch)[:, 0] <= 0
    top_k = _rows(params.top_k, batch)[:, 0]
    few = greedy | ((top_k > 0) & (top_k <= fast))
    best = first_argmax(logits)
    branch = jnp.where(jnp.all(greedy), 0, jnp.where(jnp.all(few), 1, 2))
    drawn = jax.lax.switch(branch, [lambda *a: best, lambda *a: _draw(fast, *a), lambda *a: _draw(vocab, *a)],
                           logits, keys, params)
    return jnp.where(greedy, best, drawn)

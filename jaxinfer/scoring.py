"""Log-probabilities of a token sequence under the model, for the server's `logprobs` and `echo` (OpenAI's legacy
completions shape, which lm-evaluation-harness reads for its loglikelihood tasks): one forward over the whole
sequence without a cache, then, a piece of positions at a time (the logits of every position at once would be
T x n_vocab floats), each position's log-softmax, the log-probability of the token that follows it and the TOP most
likely tokens. Sequences are padded to a power of two (one compiled program per size); padding comes last and,
attention being causal, changes nothing before it."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import model

TOP = 20  # most likely tokens kept per position: OpenAI's chat top_logprobs allows up to 20 (legacy logprobs 5)
PIECE = 256  # positions whose logits are computed together
MIN_LENGTH = 16


@partial(jax.jit, static_argnames=("piece",))
def _score(tokens, weights: model.Weights, cfg, piece: int):
    """tokens int32 [T] -> (log p(tokens[i + 1] | tokens[:i + 1]) [T] (the last one means nothing), the TOP most
    likely next tokens' log-probabilities [T, TOP] and ids [T, TOP])."""
    hidden, _, _ = model.forward(tokens[None], weights, cfg)
    hidden = hidden[0].reshape(-1, piece, hidden.shape[-1])
    following = jnp.roll(tokens, -1).reshape(-1, piece)

    def positions(args):
        h, nxt = args
        logprobs = jax.nn.log_softmax(model.logits(h, weights, cfg).astype(jnp.float32), axis=-1)
        top_logprobs, top_ids = jax.lax.top_k(logprobs, TOP)
        return jnp.take_along_axis(logprobs, nxt[:, None], axis=-1)[:, 0], top_logprobs, top_ids

    chosen, top_logprobs, top_ids = jax.lax.map(positions, (hidden, following))
    return chosen.reshape(-1), top_logprobs.reshape(-1, TOP), top_ids.reshape(-1, TOP)


def padded_length(n: int) -> int:
    return max(MIN_LENGTH, 1 << (n - 1).bit_length())


def score(m, ids: list[int]) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    """For each token of `ids`: its log-probability given the ones before (None for the first, which nothing
    predicts), and the TOP most likely tokens at its position with theirs ([] for the first)."""
    n = len(ids)
    length = padded_length(n)
    tokens = np.zeros(length, np.int32)
    tokens[:n] = ids
    chosen, top_logprobs, top_ids = (np.asarray(a) for a in _score(tokens, m.weights, m.config, min(length, PIECE)))
    token_logprobs = [None] + chosen[:n - 1].tolist()
    tops = [[]] + [list(zip(top_ids[i].tolist(), top_logprobs[i].tolist())) for i in range(n - 1)]
    return token_logprobs, tops

"""Perplexity and KL divergence of a loaded model over a text, evaluated in jitted batches of windows: the library
behind `python -m jaxinfer.perplexity`, whose docstring states the convention (llama-perplexity's) and the
logits file format.
"""

import dataclasses
import math
import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from jaxinfer import model, quant, sharding
from jaxinfer.cli import MIN_WINDOW  # the least -c a logits file can have been written with
from jaxinfer.config import Config
from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import first_argmax

LOGITS_MAGIC = b"_logits_"
VOCABULARY_PIECE = 8192  # words of the output head a piece, in hidden_nll
KL_LOG_PROB_FLOOR = -16.0  # llama.cpp ignores base probabilities below e^-16 in the KL sum
# A logits file's records span at most this many nats below each top logit: lower log-probs are stored clamped to that
# floor (llama.cpp's format), so a base PPL read from them, as llama-perplexity reads it, counts a target beneath it at
# the floor: lower than the base run's own PPL.
STORED_RANGE = 16.0


def scored_positions(n_ctx: int) -> tuple[int, int]:
    """(first, count): logits at positions first .. first+count-1 predict the next token."""
    first = n_ctx // 2
    return first, n_ctx - first - 1


TOKENIZE_MARGIN = 64  # tokens past those needed that a prefix of the text must give (see leading_tokens)


def leading_tokens(encode, text: str, n_tokens: int) -> np.ndarray:
    """encode(text)[:n_tokens] as int32, tokenizing only a prefix of the text: one that ends at a line break and
    gives TOKENIZE_MARGIN tokens more than asked for (the prefix doubles until it does, or is the whole text).
    BPE merges within the pieces that pre-tokenization cuts at spaces and line breaks, so only the prefix's last few
    tokens can differ from the whole text's. A perplexity run of 20 windows of 512 needs 10,240 of WikiText-2's
    303,415 tokens (0.7 s to tokenize them all here)."""
    chars = max(4096, 8 * n_tokens)
    while chars < len(text):
        cut = text.find("\n", chars)
        if cut < 0:
            break
        tokens = encode(text[:cut + 1])
        if len(tokens) >= n_tokens + TOKENIZE_MARGIN:
            return np.asarray(tokens[:n_tokens], np.int32)
        chars = 2 * cut
    return np.asarray(encode(text)[:n_tokens], np.int32)


def make_windows(tokens: np.ndarray, n_ctx: int, n_chunks: int, bos_id: int | None) -> np.ndarray:
    """Non-overlapping windows [n_chunk, n_ctx]; the first token of each replaced by BOS when given."""
    if len(tokens) < 2 * n_ctx:
        raise JaxinferError(f"the text has {len(tokens)} tokens; perplexity with a context of {n_ctx} needs at "
                            f"least {2 * n_ctx}")
    n_max = len(tokens) // n_ctx
    n = n_max if n_chunks < 0 else min(n_chunks, n_max)
    if n < 1:
        raise JaxinferError(f"--chunks must be >= 1 or -1 for all, got {n_chunks}")
    windows = np.asarray(tokens[: n * n_ctx], np.int32).reshape(n, n_ctx).copy()
    if bos_id is not None:
        windows[:, 0] = bos_id
    return windows


def _window_hidden(windows, weights, cfg: Config, ubatch: int):
    """Final hidden states [B, n_ctx, d]; with ubatch < n_ctx the window goes through the model in micro-batches of
    ubatch tokens that attend to the earlier ones through a KV cache (bounded activation and attention memory)."""
    b, n_ctx = windows.shape
    if ubatch >= n_ctx:
        return model.forward(windows, weights, cfg)[0]
    cache = model.init_cache(cfg, b, n_ctx)
    pieces = []
    for start in range(0, n_ctx, ubatch):
        hidden, cache, _ = model.forward(windows[:, start:start + ubatch], weights, cfg, cache)
        cache = dataclasses.replace(cache, length=cache.length + hidden.shape[1])
        pieces.append(hidden)
    return jnp.concatenate(pieces, axis=1)


def _logits_and_nll(hidden, windows, weights, cfg: Config):
    """(logits [B, count, V], nll of the next token [B, count]) at the scored positions of windows [B, n_ctx], from
    their final hidden states [B, n_ctx, d]: the scorers below all start here. nll = logsumexp(logits) - the target's
    logit, in two reductions over the logits (max and min, then the sum of exponentials) that XLA fuses: no log-probs
    [B, count, V] are made (at the default model's 49152 words, 200 MB a batch of four windows of 512)."""
    first, count = scored_positions(windows.shape[1])
    logits = model.logits(hidden[:, first:first + count], weights, cfg)
    high, low = jnp.max(logits, axis=-1), jnp.min(logits, axis=-1)
    log_sum_exp = jnp.log(jnp.sum(jnp.exp(logits - high[..., None]), axis=-1)) + high
    return logits, _nll(log_sum_exp, low, jnp.take_along_axis(logits, windows[:, first + 1:, None], axis=-1)[..., 0])


def _nll(log_sum_exp, low, target_logit):
    """log_sum_exp - target_logit, NaN where a row's logits were not all finite (corrupt weights), which
    evaluate_windows stops on: no logits copied to the host. NaN propagates through the max into log_sum_exp; an
    infinity shows in it or in the row's least logit, `low`."""
    return jnp.where(jnp.isfinite(log_sum_exp) & jnp.isfinite(low), log_sum_exp - target_logit, jnp.nan)


def hidden_nll(hidden, windows, weights, cfg: Config):
    """Negative log-likelihood of each scored token: [B, count] f32, as _logits_and_nll's but with the output head
    taken in a loop over pieces of VOCABULARY_PIECE words (the last starting early enough to be whole, its words
    already seen masked out): log-sum-exp is merged over the pieces, the target's logit taken from the piece that
    holds it. XLA gives each call its temporaries afresh and the kernels touch each of their pages first: the whole
    logits of a batch and their exponentials (400 MB for four windows of 512 and 49152 words) cost ~0.2 s of page
    faults a call; a piece's, reused by the loop, 1/6 of that. Whole with a head cut over devices, or smaller than a
    piece."""
    head = weights.output
    n_vocab = head.shape[0]
    if cfg.plan.tp > 1 or n_vocab <= VOCABULARY_PIECE or head.layout not in (quant.ROW_BLOCKS, quant.ROWS_X8):
        return _logits_and_nll(hidden, windows, weights, cfg)[1]
    first, count = scored_positions(windows.shape[1])
    scored, targets = hidden[:, first:first + count], windows[:, first + 1:]
    held_rows = head.data.shape[0] * (quant.INTERLEAVE if head.layout == quant.ROWS_X8 else 1)  # padded groups too
    last_start = held_rows - VOCABULARY_PIECE  # a multiple of 8 for a repacked head: both terms are

    def piece(i, carry):
        high, total, low, target_logit = carry
        start = jnp.minimum(i * VOCABULARY_PIECE, last_start)
        rows = quant.dynamic_row_range(head, start, VOCABULARY_PIECE)
        logits = model.logits(scored, dataclasses.replace(weights, output=rows), cfg)
        word = start + jnp.arange(VOCABULARY_PIECE)
        new = (word >= i * VOCABULARY_PIECE) & (word < n_vocab)  # not in an earlier piece, nor padding
        piece_high = jnp.max(jnp.where(new, logits, -jnp.inf), axis=-1)
        merged = jnp.maximum(high, piece_high)
        total = (total * jnp.exp(high - merged)
                 + jnp.sum(jnp.where(new, jnp.exp(logits - merged[..., None]), 0.0), axis=-1))
        low = jnp.minimum(low, jnp.min(jnp.where(new, logits, jnp.inf), axis=-1))
        at = jnp.clip(targets - start, 0, VOCABULARY_PIECE - 1)
        held = (targets >= i * VOCABULARY_PIECE) & (targets - start < VOCABULARY_PIECE)
        picked = jnp.take_along_axis(logits, at[..., None], axis=-1)[..., 0]
        return merged, total, low, target_logit + jnp.where(held, picked, 0.0)

    zeros = jnp.zeros(targets.shape, jnp.float32)
    initial = (zeros - jnp.inf, zeros, zeros + jnp.inf, zeros)  # max, sum of exponentials, min, target's logit
    high, total, low, target_logit = jax.lax.fori_loop(0, -(-n_vocab // VOCABULARY_PIECE), piece, initial)
    return _nll(high + jnp.log(total), low, target_logit)


def hidden_logits(hidden, windows, weights, cfg: Config):
    """(logits [B, count, V], nll [B, count]) of the scored tokens, for saving a KL-divergence base."""
    return _logits_and_nll(hidden, windows, weights, cfg)


def hidden_kl(hidden, windows, base_q, base_scale, base_min, weights, cfg: Config):
    """Per scored token against a base run's quantized log-probs: (nll, base nll, KL(base || this), same top-1,
    nll as the base stores it: at most STORED_RANGE nats below the top log-prob)."""
    targets = windows[:, scored_positions(windows.shape[1])[0] + 1:]
    logits, nll = _logits_and_nll(hidden, windows, weights, cfg)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    base_log_probs = base_min[..., None] + base_scale[..., None] * base_q.astype(jnp.float32)
    base_nll = -jnp.take_along_axis(base_log_probs, targets[..., None], axis=-1)[..., 0]
    terms = jnp.exp(base_log_probs) * (base_log_probs - log_probs)
    kl = jnp.sum(jnp.where(base_log_probs > KL_LOG_PROB_FLOOR, terms, 0.0), axis=-1)
    same_top = first_argmax(logits) == first_argmax(base_log_probs)
    return nll, base_nll, kl, same_top, _stored_nll(logits, targets)


def _stored_nll(logits, targets):
    """The targets' nll [B, count] from their log-probs as a logits file stores them: quantize_log_probs' clamp and
    16-bit rounding, in f32 (its log-sum-exp is summed in f64), so that a run against its own base gets its base
    PPL."""
    high = jnp.max(logits, axis=-1, keepdims=True)
    low = jnp.maximum(jnp.min(logits, axis=-1, keepdims=True), high - STORED_RANGE)
    min_log_prob = low - high - jnp.log(jnp.sum(jnp.exp(logits - high), axis=-1, keepdims=True))
    scale = (high - low) / 65535
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)
    q = jnp.where((target > low) & (scale > 0), jnp.round((target - low) * (1 / scale)), 0)
    return -(min_log_prob + scale * q)[..., 0]


@partial(jax.jit, static_argnames=("score", "ubatch"))
def window_scores(windows, base: tuple, weights, cfg: Config, score, ubatch: int):
    """score(final hidden states, windows, *base, weights, cfg) of windows [B, n_ctx], in one compiled call; with a
    data-parallel plan each device scores B / dp of the windows (sharding.over_windows). The scores come out whole on
    every device, for the host of any process to read."""
    def scores(windows, base, weights):
        return score(_window_hidden(windows, weights, cfg, ubatch), windows, *base, weights, cfg)

    if cfg.plan.dp > 1:
        return sharding.over_windows(scores, cfg.plan)(windows, base, weights)
    return sharding.readable(scores(windows, base, weights), cfg.plan)


def quantize_log_probs(logits: np.ndarray) -> np.ndarray:
    """logits [N, V] f32 -> llama.cpp's uint16 records [N, nv] (see the module docstring)."""
    logits = logits.astype(np.float32)
    n, vocab = logits.shape
    nv = 2 * ((vocab + 1) // 2) + 4
    max_logit = logits.max(axis=1, keepdims=True)
    min_logit = np.maximum(logits.min(axis=1, keepdims=True), max_logit - np.float32(STORED_RANGE))
    log_sum_exp = np.log(np.exp((logits - max_logit).astype(np.float64)).sum(axis=1, keepdims=True))
    min_log_prob = (min_logit - max_logit - log_sum_exp.astype(np.float32)).astype(np.float32)
    scale = ((max_logit - min_logit) / np.float32(65535)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(logits > min_logit, np.rint((logits - min_logit) * (1 / scale)), 0)
    q = np.where(scale > 0, q, 0)
    records = np.zeros((n, nv), np.uint16)
    records[:, 0:4] = np.concatenate([scale, min_log_prob], axis=1).view(np.uint16)
    records[:, 4:4 + vocab] = q.astype(np.uint16)
    return records


def write_logits_header(f, n_ctx: int, n_vocab: int, tokens: np.ndarray):
    """`tokens` are the original text tokens of all evaluated windows (BOS substitution is not stored)."""
    n_chunk = len(tokens) // n_ctx
    f.write(LOGITS_MAGIC)
    f.write(np.array([n_ctx, n_vocab, n_chunk], np.int32).tobytes())
    f.write(np.asarray(tokens[: n_chunk * n_ctx], np.int32).tobytes())


@dataclasses.dataclass
class LogitsFile:
    n_ctx: int
    n_vocab: int
    tokens: np.ndarray  # [n_chunk * n_ctx] int32
    records: np.ndarray  # [n_chunk, count, nv] uint16, memory-mapped

    @property
    def n_chunk(self) -> int:
        return len(self.tokens) // self.n_ctx


def read_logits_file(path: str) -> LogitsFile:
    """A llama.cpp logits file, checked: its header, its exact size, its tokens within the vocabulary and each
    record's scale and minimum log-probability (the quantized values themselves are any uint16)."""
    if not os.path.isfile(path):
        raise JaxinferError(f"KL-divergence base file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(8)
        header = np.frombuffer(f.read(12), np.int32)
    if magic != LOGITS_MAGIC or len(header) != 3:
        raise JaxinferError(f"{path} is not a llama.cpp logits file (magic {magic!r})")
    n_ctx, n_vocab, n_chunk = (int(v) for v in header)
    if n_ctx < MIN_WINDOW or n_vocab < 1 or n_chunk < 1:
        raise JaxinferError(f"{path} has an impossible header: n_ctx {n_ctx}, n_vocab {n_vocab}, n_chunk {n_chunk}")
    _, count = scored_positions(n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    tokens_end = 20 + 4 * n_ctx * n_chunk
    expected = tokens_end + 2 * n_chunk * count * nv
    size = os.path.getsize(path)
    if size != expected:
        raise JaxinferError(f"{path} is {'truncated' if size < expected else 'too long'}: {size} bytes, expected "
                            f"{expected} for {n_chunk} chunks of {n_ctx} tokens over {n_vocab}")
    tokens = np.fromfile(path, np.int32, count=n_ctx * n_chunk, offset=20)
    if tokens.min() < 0 or tokens.max() >= n_vocab:
        raise JaxinferError(f"{path} holds a token outside its vocabulary of {n_vocab}")
    records = np.memmap(path, np.uint16, "r", offset=tokens_end, shape=(n_chunk, count, nv))
    scale, min_log_prob = np.ascontiguousarray(records[..., 0:4]).view(np.float32).reshape(-1, 2).T
    if not (np.all(np.isfinite(scale) & (scale >= 0)) and np.all(np.isfinite(min_log_prob) & (min_log_prob <= 0))):
        raise JaxinferError(f"{path} holds a record whose scale or minimum log-probability is impossible")
    return LogitsFile(n_ctx, n_vocab, tokens, records)


@dataclasses.dataclass
class KLDivergence:
    mean: float  # at least 0: the base's 16-bit rounding can take a mean of equal distributions just below it
    error: float
    same_top: float  # share of tokens whose top-1 agrees with the base run
    base_ppl: float  # from the base's stored log-probs, as llama-perplexity computes it (see STORED_RANGE)
    stored_ppl: float  # this run's PPL with its log-probs clamped as the base's are stored: the like of base_ppl


@dataclasses.dataclass
class PerplexityResult:
    ppl: float
    error: float
    n_chunks: int
    n_ctx: int
    nll: np.ndarray  # [n_scored] float64, per scored token in window order
    seconds: float  # evaluation, compile excluded
    compile_seconds: float
    kl: KLDivergence | None = None

    @property
    def n_scored(self) -> int:
        return len(self.nll)

    @property
    def tokens_per_second(self) -> float:
        return self.n_chunks * self.n_ctx / self.seconds if self.seconds else 0.0

    def summary(self) -> str:
        line = (f"PPL = {self.ppl:.4f} +/- {self.error:.5f} | {self.n_scored} tokens scored in {self.n_chunks} "
                f"chunks of {self.n_ctx} | {self.seconds:.1f} s, {self.tokens_per_second:.1f} tokens/s "
                f"(+{self.compile_seconds:.1f} s compile)")
        if self.kl:
            line += (f" | KL-divergence {self.kl.mean:.6f} +/- {self.kl.error:.6f}, same top-1 "
                     f"{100 * self.kl.same_top:.2f}%, base PPL {self.kl.base_ppl:.4f} from its stored log-probs, "
                     f"which llama.cpp's format clamps at {STORED_RANGE:g} nats below the top one (this run's PPL "
                     f"clamped so: {self.kl.stored_ppl:.4f})")
        return line


def ppl_with_error(nll: np.ndarray) -> tuple[float, float]:
    mean = float(nll.mean())
    ppl = math.exp(mean)
    variance = float((nll * nll).mean()) - mean * mean
    return ppl, ppl * math.sqrt(max(variance, 0.0) / max(len(nll) - 1, 1))


def _batches(windows: np.ndarray, n_seq: int):
    """Yield (start, batch) with every batch exactly n_seq windows (the last padded by repeating its final window),
    so a single compiled program serves the whole run."""
    for start in range(0, len(windows), n_seq):
        batch = windows[start:start + n_seq]
        if len(batch) < n_seq:
            batch = np.concatenate([batch, np.repeat(batch[-1:], n_seq - len(batch), axis=0)])
        yield start, batch


def evaluate_windows(weights: model.Weights, cfg: Config, windows: np.ndarray, *, n_seq: int = 4, ubatch: int = 512,
                     base: LogitsFile | None = None, save_logits=None, progress: bool = True) -> PerplexityResult:
    """Score `windows` [n_chunk, n_ctx] (see `make_windows`) in jitted batches of `n_seq` windows, split between
    device and host memory or not (the one forward). With `base`, also KL divergence against it; with `save_logits`
    (an open binary file, header written), append llama.cpp records. With a data-parallel plan (`Plan.dp`) a batch
    holds a multiple of dp windows, n_seq rounded up."""
    n_chunk, n_ctx = windows.shape
    dp = cfg.plan.dp
    n_seq = -(-n_seq // dp) * dp
    batch_spec = P(sharding.DATA_AXIS) if dp > 1 else P()
    _, count = scored_positions(n_ctx)
    nll = np.zeros((n_chunk, count), np.float64)
    kl_parts = {name: np.zeros_like(nll) for name in ("base_nll", "kl", "same_top", "stored_nll")}

    def base_inputs(rows, n_real):
        records = np.asarray(base.records[rows])
        records = np.concatenate([records, np.repeat(records[-1:], n_seq - n_real, axis=0)])
        header = records[..., 0:4].copy().view(np.float32)
        return records[..., 4:4 + cfg.n_vocab], header[..., 0], header[..., 1]

    score = hidden_kl if base is not None else hidden_logits if save_logits is not None else hidden_nll
    start_time = time.perf_counter()
    first_inputs = base_inputs(slice(0, 1), 1) if base is not None else ()
    first = sharding.on_mesh((windows[:1].repeat(n_seq, axis=0), first_inputs), cfg.plan, batch_spec)
    compiled = window_scores.lower(*first, weights, cfg, score=score, ubatch=ubatch).compile()
    compile_seconds = time.perf_counter() - start_time

    def step(batch, *inputs):  # over several processes, the batch's arrays on the plan's mesh (on_mesh)
        return compiled(*sharding.on_mesh((batch, inputs), cfg.plan, batch_spec), weights, cfg)

    start_time = time.perf_counter()
    # The bar closes its line however the loop ends (an error, Ctrl-C), before the line that says so.
    with tqdm(total=n_chunk, unit="chunk", disable=not progress, desc="perplexity") as bar:
        for start, batch in _batches(windows, n_seq):
            n_real = min(n_seq, n_chunk - start)
            rows = slice(start, start + n_real)
            if base is not None:
                out = step(batch, *base_inputs(rows, n_real))
                batch_nll, *parts = (np.asarray(a)[:n_real] for a in out)
                for name, part in zip(("base_nll", "kl", "same_top", "stored_nll"), parts):
                    kl_parts[name][rows] = part
            elif save_logits is not None:
                logits, batch_nll = (np.asarray(a)[:n_real] for a in step(batch))
                save_logits.write(quantize_log_probs(logits.reshape(-1, logits.shape[-1])).tobytes())
            else:
                batch_nll = np.asarray(step(batch))[:n_real]
            if not np.isfinite(batch_nll).all():
                chunk = start + 1 + int(np.argwhere(~np.isfinite(batch_nll))[0, 0])
                raise JaxinferError(f"the model's logits are NaN or infinite in chunk {chunk} (corrupt weights?)")
            nll[rows] = batch_nll
            bar.update(n_real)
            bar.set_postfix(ppl=f"{math.exp(nll[: start + n_real].mean()):.4f}")
    seconds = time.perf_counter() - start_time
    flat = nll.reshape(-1)
    ppl, error = ppl_with_error(flat)
    kl = None
    if base is not None:
        kl_values = kl_parts["kl"].reshape(-1)
        kl = KLDivergence(
            mean=max(float(kl_values.mean()), 0.0),  # a KL divergence is never negative: no "-0.000000"
            error=float(kl_values.std() / math.sqrt(max(len(kl_values) - 1, 1))),
            same_top=float(kl_parts["same_top"].mean()),
            base_ppl=math.exp(float(kl_parts["base_nll"].mean())),
            stored_ppl=math.exp(float(kl_parts["stored_nll"].mean())),
        )
    return PerplexityResult(ppl, error, n_chunk, n_ctx, flat, seconds, compile_seconds, kl)


def evaluate(m, tokens, *, n_ctx: int = 512, n_chunks: int = -1, n_seq: int = 4, progress: bool = False,
             **kwargs) -> PerplexityResult:
    """Perplexity of a loaded model (`engine.LoadedModel`, split between accelerator and host or not) over a token
    sequence, llama-perplexity style."""
    if n_ctx > m.config.n_ctx_train:
        raise JaxinferError(f"-c {n_ctx} exceeds the model's training context {m.config.n_ctx_train}")
    bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
    windows = make_windows(np.asarray(tokens), n_ctx, n_chunks, bos)
    return evaluate_windows(m.weights, m.config, windows, n_seq=n_seq, progress=progress, **kwargs)

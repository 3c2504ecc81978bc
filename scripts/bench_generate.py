"""Prompt-processing and generation speed, measured like llama-bench: pp = prefill of N prompt tokens,
tg = N greedy decode steps after a one-token prompt, through `generate`'s own decode loop, into a KV cache of
--ctx_size positions as `generate` allocates. Compile time is excluded.

    python scripts/bench_generate.py [-m MODEL] [--pp 128,512] [--tg 64] [--depth 0] [--repetitions 3] [--json]
        [--sparsity hidden:0.5 [--down_t_type same] [--compare_dense]]
        [--vram-budget GIB [--activation-dir DIR]] [--compare_whole_experts]
        [--llama_bench path/to/llama-bench [--threads 2] [--rounds 1]] [--norepack]

With --json the last line is one JSON object with prompt_tokens_per_s and generation_tokens_per_s (the best
repetition of the largest pp and of tg; prompt_tokens_per_s is null without a prompt test, --pp 0), and with
--llama_bench llama.cpp's numbers and the ratios (llama_cpp_pp512, ratio_pp512, ...). --norepack keeps the weights
in GGUF's rows (no repacked kernels), to compare. With --llama_bench
(a llama.cpp build you have; nothing is downloaded or built here) llama-bench runs the same tests on the same model
right after, and the ratios are printed: absolute numbers on shared machines are noisy, ratios measured in one run
much less so. Where the machine's memory bandwidth drifts by more than the difference to measure (decode on a VM
whose memory is shared moved ±15% within minutes here, both engines alike), --rounds N alternates the two N times
and reports each test's median speeds, the median of the rounds' ratios and their range. With --compare_dense, tg
of the dense model and of the --sparsity one are timed alternately, and the speed-up is set against the share of
weight bytes a decode step skips (counted from the neurons active on the generated tokens). With --depth D both pp
and tg run after D tokens are already in the KV cache (llama-bench's -d, which --llama_bench passes on): the speed
deep into a long context, where attention reads the cache. With --vram-budget the model is also split between
device and host memory as generate splits it (its activation profile is needed: python -m jaxinfer.profile), and
tg of the unsplit and the split model are timed alternately and compared. With --compare_whole_experts, a mixture
of ReLU experts is timed alternately with its zero neurons skipped (its down projection held a row per neuron,
whatever its profile says) and with each expert's down projection read whole.
"""

import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging

from jaxinfer import cli, decode_bytes, engine, model, moe, quant, receipt, runtime, sparsity
from jaxinfer.cli import parse_flags
from jaxinfer.errors import JaxinferError, exit_on_error, how_it_ended

flags.DEFINE_string("model", None, "GGUF model (default: the built-in SmolLM2 Q4_1)", short_name="m")
flags.DEFINE_list("pp", ["128", "512"], "prompt lengths to time; 0 (or none given): no prompt test, as "
                  "llama-bench's -p 0")
flags.DEFINE_integer("tg", 64, "tokens to generate")
flags.DEFINE_integer("repetitions", 3, "timed repetitions of each test (after one untimed warm-up)")
flags.DEFINE_bool("json", False, "print a JSON summary as the last line")
flags.DEFINE_integer("ctx_size", 4096, "KV cache positions for tg (generate's default)", short_name="c")
flags.DEFINE_string("cache_type", "f32", "KV cache element type, f32 or f16 (llama-bench keeps its default, f16)")
flags.DEFINE_integer("depth", 0, "tokens already in the KV cache when pp and tg are timed (llama-bench's -d)")
flags.DEFINE_string("sparsity", "dense", "FFN activation sparsity, as generate's --sparsity")
flags.DEFINE_string("down_t_type", "same", "as generate's --down_t_type")
flags.DEFINE_string("llama_bench", None, "path to llama.cpp's llama-bench: run it on the same model and report ratios")
flags.DEFINE_integer("threads", 2, "llama-bench threads (-t)")
flags.DEFINE_integer("rounds", 1, "with --llama_bench: rounds of our tests then llama-bench's, alternating; each "
                     "test's speeds and ratio are then the medians over the rounds")
flags.DEFINE_bool("compare_dense", False, "with --sparsity: time tg of the dense and the sparse model alternately "
                  "(--repetitions each) and compare the speed-up with the share of weight bytes not read")
flags.DEFINE_bool("compare_whole_experts", False, "for a mixture of ReLU experts: time tg of the model with its "
                  "experts' down projection whole and with their zero neurons skipped (a row per neuron) alternately")
flags.DEFINE_float("vram_budget", None, "also split the model under this device memory budget (GiB), as generate "
                   "--vram-budget, and compare its tg with the unsplit model's")
flags.DEFINE_string("activation_dir", None, "activation profile for --vram-budget (default: beside the model)")
cli.define_receipt_flag()
flags.DEFINE_bool("repack", True, "repack weights eight rows to a group where the plan does (repack.py); "
                  "--norepack keeps GGUF's rows, to compare")
cli.check_list("pp", 0, empty=True)
cli.check_range("tg", 1)
cli.check_range("repetitions", 1)
cli.check_range("ctx_size", 1)
cli.check_range("depth", 0)
cli.check_range("threads", 1)
cli.check_range("rounds", 1)
cli.check_range("vram_budget", 0, cli.MAX_VRAM_GIB)
flags.adopt_module_key_flags(cli)
FLAGS = flags.FLAGS


def prompt_lengths() -> list[int]:
    """The --pp prompt tests: their lengths, 0 (no test) left out."""
    return [n for n in map(int, FLAGS.pp) if n]


def context_tokens(m) -> np.ndarray:
    """The --depth tokens in the cache before a timed test (random, as llama-bench's)."""
    return np.random.default_rng(1).integers(0, m.config.n_vocab, size=FLAGS.depth).astype(np.int32)


def time_prefill(m, n_tokens, repetitions):
    tokens = np.random.default_rng(0).integers(0, m.config.n_vocab, size=(1, n_tokens)).astype(np.int32)
    context = context_tokens(m)
    times = []
    for _ in range(repetitions + 1):
        cache = model.init_cache(m.config, 1, FLAGS.depth + n_tokens)
        if FLAGS.depth:
            _, cache = model.prefill(context[None], jnp.int32(FLAGS.depth), m.weights, cache, m.config)
            jax.block_until_ready(cache.k)
        start = time.perf_counter()
        logits, cache = model.prefill(tokens, jnp.int32(n_tokens), m.weights, cache, m.config)
        jax.block_until_ready(logits)
        times.append(time.perf_counter() - start)
    return n_tokens / min(times[1:])


def decode_rates(m, n_tokens, repetitions) -> tuple[list[float], list[int]]:
    """generate's own decode loop (greedy, stop tokens ignored) after a prompt of one token and the --depth ones:
    n_tokens decode steps, `repetitions` timed runs after an untimed one -> (tokens/s of each timed run, the tokens
    generated)."""
    prompt = [m.tokenizer.bos_id or 0] + context_tokens(m).tolist()
    return decode_bytes.decode_rates(m, prompt, n_tokens, repetitions, FLAGS.ctx_size)


def alternating_tg(first, second) -> tuple[float, float, int, list[int]]:
    """tg (FLAGS.tg steps) of two models timed alternately, --repetitions runs each, so that load from other processes
    hits both alike -> (first's median tokens/s, second's, the runs each, the tokens the second generated)."""
    first_rates, second_rates = [], []
    for _ in range(FLAGS.repetitions):
        first_rates += decode_rates(first, FLAGS.tg, 1)[0]
        rates, tokens = decode_rates(second, FLAGS.tg, 1)
        second_rates += rates
    return float(np.median(first_rates)), float(np.median(second_rates)), len(second_rates), tokens


def compare_with_dense(dense, sparse, spec) -> dict[str, float]:
    """tg of the dense and the sparse model, timed alternately, against the share of weight bytes the sparse model
    does not read."""
    n = FLAGS.tg
    dense_tg, sparse_tg, runs, tokens = alternating_tg(dense, sparse)
    # Each model's bytes with its own active neurons on the same tokens: the dense mode of a ReLU model skips the
    # down projection's rows of its natural zeros, and reads no predictor (decode_bytes).
    dense_step = decode_bytes.step_bytes(dense, decode_bytes.active_shares(dense, tokens))
    sparse_step = decode_bytes.step_bytes(sparse, decode_bytes.active_shares(sparse, tokens))
    dense_bytes, sparse_bytes, active = dense_step.total, sparse_step.total, sparse_step.active_share
    saved, lines_saved = 1 - sparse_bytes / dense_bytes, 1 - sparse_step.total_lines / dense_step.total_lines
    print(f"tg{n}: dense {dense_tg:.2f} / --sparsity {spec} {sparse_tg:.2f} tokens/s (medians of "
          f"{runs} alternating runs) = {sparse_tg / dense_tg:.3f}x", flush=True)
    print(f"weights read per decode step: dense {dense_bytes / 2**20:.1f} MiB, sparse {sparse_bytes / 2**20:.1f} MiB "
          f"({100 * active:.1f}% of FFN neurons active on these tokens): {100 * saved:.1f}% fewer bytes, "
          f"{1 / (1 - saved):.3f}x if speed followed bytes; in whole 64-byte lines (neurons firing independently) "
          f"{100 * lines_saved:.1f}% fewer, {1 / (1 - lines_saved):.3f}x", flush=True)
    return {"dense_generation_tokens_per_s": dense_tg, "sparse_generation_tokens_per_s": sparse_tg,
            "sparse_speedup": sparse_tg / dense_tg, "bytes_saved_share": saved, "lines_saved_share": lines_saved,
            "active_share": active, "dense_active_share": dense_step.active_share}


def compare_with_whole_experts(m) -> dict[str, float]:
    """tg of a mixture of ReLU experts with their zero neurons skipped (down projection a row per neuron) and with
    each expert's down projection read whole, timed alternately."""
    whole = engine.load_model(FLAGS.model, cache_type=FLAGS.cache_type, repack=FLAGS.repack, expert_rows=False)
    whole_tg, sparse_tg, runs, _ = alternating_tg(whole, m)
    print(f"tg{FLAGS.tg}: experts whole {whole_tg:.2f} / zero neurons skipped {sparse_tg:.2f} tokens/s (medians of "
          f"{runs} alternating runs) = {sparse_tg / whole_tg:.3f}x", flush=True)
    return {"whole_experts_generation_tokens_per_s": whole_tg, "sparse_experts_generation_tokens_per_s": sparse_tg,
            "sparse_experts_speedup": sparse_tg / whole_tg}


def compare_with_split(m) -> dict[str, float]:
    """tg of the unsplit model and of the model split under --vram-budget, timed alternately."""
    split = engine.split_model(m, FLAGS.vram_budget, min(FLAGS.ctx_size, m.config.n_ctx_train), FLAGS.activation_dir,
                               reset=False)
    print(split.split.summary, file=sys.stderr)
    unsplit_tg, split_tg, runs, _ = alternating_tg(m, split)
    print(f"tg{FLAGS.tg}: unsplit {unsplit_tg:.2f} / split under {FLAGS.vram_budget:g} GiB {split_tg:.2f} tokens/s "
          f"(medians of {runs} alternating runs) = {split_tg / unsplit_tg:.3f}x", flush=True)
    return {"unsplit_generation_tokens_per_s": unsplit_tg, "split_generation_tokens_per_s": split_tg,
            "split_speed_ratio": split_tg / unsplit_tg,
            "split_hot_neuron_share": split.split.plan.hot_share(m.config.n_ff)}


def run_llama_bench(path, pp: list[int], tg) -> dict[str, float]:
    """llama-bench's best repetition of each test, in tokens/s, keyed like ours (pp128, tg64); no prompt lengths:
    its -p 0, no prompt test."""
    command = [FLAGS.llama_bench, "-m", path, "-t", str(FLAGS.threads), "-p", ",".join(map(str, pp)) or "0", "-n",
               str(tg), "-r", str(FLAGS.repetitions), "-o", "json"]
    if FLAGS.depth:  # -d only when asked: builds from before llama-bench had it reject even "-d 0"
        command += ["-d", str(FLAGS.depth)]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
    except OSError as e:
        raise JaxinferError(f"llama-bench could not run: {e}") from None
    if done.returncode != 0:
        said = " | ".join(done.stderr.strip().splitlines()[-4:]) or "nothing on stderr"
        raise JaxinferError(f"llama-bench {how_it_ended(done.returncode)}: {said}")
    results = {}
    for row in json.loads(done.stdout):
        test = f"pp{row['n_prompt']}" if row["n_gen"] == 0 else f"tg{row['n_gen']}"
        results[test] = max(row["samples_ts"])
        print(f"llama.cpp {test}: {results[test]:.1f} tokens/s (best of {len(row['samples_ts'])})", flush=True)
    return results


def time_tests(m) -> dict[str, float]:
    """Each --pp prefill and the tg decode, best of --repetitions, in tokens/s (printed as they come)."""
    results = {}
    for n in prompt_lengths():
        results[f"pp{n}"] = time_prefill(m, n, FLAGS.repetitions)
        print(f"pp{n}: {results[f'pp{n}']:.1f} tokens/s", flush=True)
    results[f"tg{FLAGS.tg}"] = max(decode_rates(m, FLAGS.tg, FLAGS.repetitions)[0])
    print(f"tg{FLAGS.tg}: {results[f'tg{FLAGS.tg}']:.2f} tokens/s", flush=True)
    return results


def median_rounds(rounds: list[dict]) -> dict[str, float]:
    """Each test's median speed over the rounds."""
    return {test: float(np.median([r[test] for r in rounds])) for test in rounds[0]}


def compare_with_llama(ours_rounds: list[dict], llama_rounds: list[dict]) -> dict[str, float]:
    """Per test in both: the median speeds over the rounds and the median of the rounds' ratios (with their range
    when there are several rounds)."""
    comparison = {}
    ours_medians, llama_medians = median_rounds(ours_rounds), median_rounds(llama_rounds)
    for test, ours in ours_medians.items():
        if test not in llama_medians:
            continue
        llama = llama_medians[test]
        ratios = [o[test] / l[test] for o, l in zip(ours_rounds, llama_rounds)]
        ratio = float(np.median(ratios))
        spread = (f" (median of {len(ratios)} alternating rounds, {min(ratios):.2f}-{max(ratios):.2f}x)"
                  if len(ratios) > 1 else "")
        print(f"{test}: jaxinfer {ours:.1f} / llama.cpp {llama:.1f} tokens/s = {ratio:.2f}x{spread}", flush=True)
        comparison |= {f"llama_cpp_{test}": llama, f"ratio_{test}": ratio}
        if len(ratios) > 1:
            comparison |= {f"ratio_{test}_min": min(ratios), f"ratio_{test}_max": max(ratios)}
    return comparison


@exit_on_error
def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    runtime.enable_compilation_cache()
    spec = sparsity.parse_spec(FLAGS.sparsity)
    if FLAGS.depth and FLAGS.compare_dense:
        raise JaxinferError("--compare_dense counts the neurons of the generated tokens: use it without --depth")
    if FLAGS.compare_dense and spec.mode == "dense":
        raise JaxinferError("--compare_dense needs a --sparsity other than dense")
    if FLAGS.rounds > 1 and not FLAGS.llama_bench:
        raise JaxinferError(f"--rounds {FLAGS.rounds}: more than one round only with --llama_bench")
    receipt.check_path(FLAGS.receipt)
    # Compared with their whole down projection, ReLU experts are held a row per neuron whatever their profile says.
    dense = engine.load_model(FLAGS.model, cache_type=FLAGS.cache_type, repack=FLAGS.repack,
                              expert_rows=True if FLAGS.compare_whole_experts else None)
    m = sparsity.apply(dense, spec, sparsity.parse_down_t_type(FLAGS.down_t_type))
    print(m.describe() + f", --sparsity {spec}", file=sys.stderr)
    if FLAGS.compare_whole_experts and not (m.config.n_expert and any(
            p.down.layout == quant.DOWN_ROWS for layer in m.weights.layers for p in moe.expert_parts(layer.experts))):
        raise JaxinferError("--compare_whole_experts needs a mixture of ReLU experts whose down projection the plan "
                            "holds a row per neuron (a gate activation with zeros, cpu_ext's down_rows kernels)")
    runtime.freeze_loaded_objects()  # as generate and the server do after loading
    ours_rounds, llama_rounds = [], []
    for _ in range(FLAGS.rounds):
        ours_rounds.append(time_tests(m))
        if FLAGS.llama_bench:
            llama_rounds.append(run_llama_bench(m.path, prompt_lengths(), FLAGS.tg))
    results = median_rounds(ours_rounds)
    comparison = compare_with_dense(dense, m, spec) if FLAGS.compare_dense else {}
    if FLAGS.compare_whole_experts:
        comparison |= compare_with_whole_experts(m)
    if FLAGS.vram_budget is not None:
        comparison |= compare_with_split(m)
    if llama_rounds:
        comparison |= compare_with_llama(ours_rounds, llama_rounds)
    receipt.write(FLAGS.receipt, m, {"load_seconds": dense.load_seconds, "repetitions": FLAGS.repetitions,
                                     "rounds": FLAGS.rounds,
                                     **{f"{test}_tokens_per_s": rate for test, rate in results.items()}, **comparison})
    if FLAGS.json:
        largest_pp = max(prompt_lengths(), default=None)
        print(json.dumps({"model": m.path, "backend": m.config.plan.backend,
                          "prompt_tokens_per_s": round(results[f"pp{largest_pp}"], 2) if largest_pp else None,
                          "generation_tokens_per_s": round(results[f"tg{FLAGS.tg}"], 2), **{
                              k: round(v, 2) for k, v in results.items()},
                          **{k: round(v, 4) for k, v in comparison.items()}}))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

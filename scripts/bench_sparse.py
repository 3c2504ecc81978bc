"""Sparse decoding against dense decoding on the same weights, set against the weight bytes each reads, and against
PowerInfer and llama.cpp.

Synthetic mode (the default): for each --levels sparsity level, a 7B-shaped PowerInfer file with exact predictors
(made on demand in --models_dir by scripts/make_sparse_model.py, named sparse-7b-8l-Q4_0-q8_0-0.9.gguf for --shape,
--n_layer, --weight_type, --predictor_type and the level, or given with --sparse_files, one per level):

    python scripts/bench_sparse.py --models_dir DIR [--levels 0.8,0.9,0.95] [--n_layer 8] [--weight_type Q4_0]
        [--predictor_type q8_0] [--tg 64] [--repetitions 3] [--rounds 1] [--powerinfer PATH/main]
        [--llama_bench PATH/llama-bench] [--threads 2] [--json]

Per level: the share of FFN neurons active on the generated tokens, the MiB of weights a decode step reads
(jaxinfer/decode_bytes.py: dense mode, predictor mode, and all of them without the predictor, as a dense engine reads
the dense twin), jaxinfer's tg of the dense and the predictor mode (--repetitions runs each per round, the two
alternating run by run in this process, after one untimed run of each; medians over all rounds), the speed-up, the
speed-up the bytes promise (dense bytes / predictor bytes) and the fraction of it reached (speed-up / promised). In the
dense mode a ReLU model already skips the down projection's rows of its zeros, so the bytes it reads are fewer than the
file's; all the weights / the predictor mode's bytes is the promise against a dense engine that reads them all
(twin_byte_ideal), to set against predictor ÷ llama.cpp, and against jaxinfer's own tg of the dense twin (timed
with the other two, alternating; --notwin leaves it out). With --powerinfer (PowerInfer's `main`), its tg on the same
file, one run per --powerinfer_threads -t value per round (-n TG --temp 0 --repeat-penalty 1.0 --ignore-eos, from its
`eval time` line); with --llama_bench, llama.cpp's tg on the file's dense twin (make_sparse_model.py --dense_twin, made
beside the level's file or in --models_dir), one llama-bench call per round (-n TG -p 0 -r --repetitions, each --threads
-t value): the dense baseline a user would otherwise run on these weights. A peer's speed is that of its best -t: the
median of its runs over all rounds. On a loaded machine a peer's spinning threads can stall (PowerInfer -t 2 ran 2000x
slower than -t 1 on a tiny model at load average 8 here), hence several -t. A peer that fails is one line on stderr and
a null in the table; without its flag it is not run (null). --rounds N alternates jaxinfer's runs and the peers' N
times, for a machine whose speed drifts.

Real-model mode (--specs): a model's dense decode against each training-free sparsity spec, with each one's
perplexity on -f TEXT (--chunks windows of --ppl_ctx_size); thresholds missing from the model's sidecar (or from
--thresholds FILE) are calibrated first on the same windows and saved there:

    python scripts/bench_sparse.py [-m MODEL] --specs hidden:0.3,hidden:0.5,gate:0.5 -f wiki.test.raw [--chunks 4]

The machine's load average is printed at the start and the end; with --json the last line is a JSON object of
everything in the table.
"""

import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np
from absl import app, flags, logging

from jaxinfer import cli, decode_bytes, engine, evaluation, runtime, sparsity, synthetic
from jaxinfer.cli import check_list, check_range, parse_flags
from jaxinfer.errors import JaxinferError, exit_on_error, how_it_ended
from jaxinfer.sampling import SamplingParams

flags.DEFINE_list("levels", ["0.8", "0.9", "0.95"], "synthetic mode: sparsity levels (make_sparse_model --sparsity)")
flags.DEFINE_string("models_dir", None, "synthetic mode: where the level's files and dense twins are made (reused "
                    "when already there)")
flags.DEFINE_list("sparse_files", None, "synthetic mode: PowerInfer files to use instead, one per --levels level")
flags.DEFINE_string("shape", "7b", "synthetic mode: make_sparse_model --shape of the files made")
flags.DEFINE_integer("n_layer", 8, "synthetic mode: layers of the files made")
flags.DEFINE_string("weight_type", "Q4_0", "synthetic mode: make_sparse_model --weight_type of the files made")
flags.DEFINE_enum("predictor_type", "q8_0", ["f16", "q8_0", "q4_0"], "synthetic mode: make_sparse_model "
                  "--predictor_type of the files made")
flags.DEFINE_string("model", None, "real-model mode: GGUF model (default: the built-in SmolLM2 Q4_1)", short_name="m")
flags.DEFINE_list("specs", None, "real-model mode: sparsity specs to compare with dense, e.g. hidden:0.3,gate:0.5")
flags.DEFINE_string("file", None, "real-model mode: text for the perplexity (and calibration)", short_name="f")
flags.DEFINE_integer("chunks", 4, "real-model mode: perplexity windows")
flags.DEFINE_integer("ppl_ctx_size", 512, "real-model mode: tokens per perplexity window")
flags.DEFINE_string("thresholds", None, "real-model mode: calibrated thresholds file to read, and to calibrate missing "
                    "ones into (default: the model's sidecar, as calibrate writes)")
flags.DEFINE_integer("tg", 64, "decode steps per timed run (and the peers' -n)")
flags.DEFINE_integer("pp", 512, "synthetic mode: prompt tokens whose prefill (generate's, micro-batches of 512) is "
                     "timed in the dense and the predictor mode, alternating; the first ones of -f when given, else "
                     "random ones as llama-bench's (0: no prompts)")
flags.DEFINE_integer("pp_repetitions", 6, "timed prefills of each model, alternating (--pp)")
flags.DEFINE_integer("repetitions", 3, "timed runs of each model per round, alternating (and llama-bench's -r)")
flags.DEFINE_integer("rounds", 1, "rounds of jaxinfer's runs then the peers' (the machine's load drifts): the speeds "
                     "are medians over all rounds' runs, a peer's of each -t")
flags.DEFINE_integer("ctx_size", 4096, "KV cache positions for decode (generate's default)", short_name="c")
flags.DEFINE_string("powerinfer", None, "path to PowerInfer's main: its tg on the same files")
flags.DEFINE_list("powerinfer_threads", ["1", "2"], "PowerInfer's -t values; the best is reported")
flags.DEFINE_string("llama_bench", None, "path to llama.cpp's llama-bench: its tg on the dense twins (synthetic "
                    "mode) or the model")
flags.DEFINE_list("threads", ["2"], "llama-bench's -t values; the best is reported")
flags.DEFINE_integer("peer_timeout", 1800, "seconds a peer's run may take")
flags.DEFINE_bool("twin", True, "synthetic mode: also time jaxinfer's decode of the dense twin (the same weights as a "
                  "plain GGUF, every row read: the dense model a user without predictors runs), alternating with the "
                  "other two")
flags.DEFINE_bool("json", False, "print a JSON summary as the last line")
check_range("tg", 2)
check_range("repetitions", 1)
check_range("pp_repetitions", 1)
check_range("rounds", 1)
check_range("chunks", 1)
check_range("ppl_ctx_size", 8)
check_range("peer_timeout", 1)
check_range("pp", 0)
check_range("n_layer", 1)
check_range("ctx_size", 1)
check_list("levels", 0, 1, low_open=True, high_open=True, number=float)
check_list("powerinfer_threads", 1)
check_list("threads", 1)
flags.adopt_module_key_flags(cli)
FLAGS = flags.FLAGS
MAKE_SPARSE_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_sparse_model.py")
MIB = 2**20
POWERINFER_KEYS = ("powerinfer_tg", "powerinfer_threads", "powerinfer_build")
LLAMA_CPP_KEYS = ("llama_cpp_tg", "llama_cpp_threads", "llama_cpp_build")


def loads() -> str:
    return "load average " + ", ".join(f"{v:.2f}" for v in os.getloadavg())


def checked_peer(path: str | None, flag: str) -> str | None:
    if path is not None and not (os.path.isfile(path) and os.access(path, os.X_OK)):
        raise JaxinferError(f"--{flag} {path}: not an executable file")
    return path


def peer_failure(done: subprocess.CompletedProcess) -> str:
    """What a failed peer's run said last, in one line."""
    said = [line.strip()[:200] for line in (done.stderr or "").splitlines() if line.strip()][-2:]
    return f"{how_it_ended(done.returncode)}: {' | '.join(said) or 'nothing on stderr'}"


def run_peer(command: list[str]) -> tuple[subprocess.CompletedProcess | None, str | None]:
    """(the finished run, None), or (None, why it failed) for a run that could not start, timed out or failed."""
    try:
        with tempfile.TemporaryDirectory() as cwd:  # PowerInfer writes main.log into its working directory
            done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=FLAGS.peer_timeout,
                                  cwd=cwd, stdin=subprocess.DEVNULL)
    except OSError as e:
        return None, f"could not run: {e}"
    except subprocess.TimeoutExpired:
        return None, f"took more than --peer_timeout {FLAGS.peer_timeout} s"
    return (done, None) if done.returncode == 0 else (None, peer_failure(done))


EVAL_LINE = re.compile(r"^llama_print_timings:\s+eval time\s*=.*?([\d.]+)\s+tokens per second", re.MULTILINE)
BUILD_LINE = re.compile(r"^main: build = (\d+) \((\w+)\)", re.MULTILINE)


class Peer:
    """A peer's runs on one file over the rounds: tokens/s by -t, its build, and what failed (said once, at the
    end)."""

    def __init__(self, name: str, path: str):
        self.name, self.path = name, path
        self.samples: dict[int, list[float]] = {}
        self.build = None
        self.failures: dict[str, list[str]] = {}  # what it said -> the -t values (or calls) that said it

    def add(self, threads, rates: list[float]):
        self.samples.setdefault(int(threads), []).extend(rates)
        for rate in rates:
            print(f"{self.name} -t {threads}: tg{FLAGS.tg} {rate:.2f} tokens/s", flush=True)

    def failed(self, what: str, failure: str):
        self.failures.setdefault(failure, []).append(what)

    def result(self, prefix: str) -> dict:
        """{PREFIX_tg, PREFIX_threads, PREFIX_build}: the best -t by its median, None where nothing ran; a failure
        is one line on stderr."""
        medians = {threads: statistics.median(rates) for threads, rates in self.samples.items()}
        threads = max(medians, key=medians.get) if medians else None
        if self.failures:
            said = "; ".join(f"{', '.join(dict.fromkeys(whats))}: {failure}"
                             for failure, whats in self.failures.items())
            print(f"{self.name} on {self.path} failed ({said})" + ("" if medians else ": reported as null"),
                  file=sys.stderr, flush=True)
        return {f"{prefix}_tg": medians.get(threads), f"{prefix}_threads": threads, f"{prefix}_build": self.build}


def powerinfer_round(peer: Peer):
    """One PowerInfer run per --powerinfer_threads value (its `eval time` line)."""
    for threads in FLAGS.powerinfer_threads:
        done, failure = run_peer([FLAGS.powerinfer, "-m", peer.path, "-n", str(FLAGS.tg), "--temp", "0",
                                  "--repeat-penalty", "1.0", "--ignore-eos", "-t", threads, "-p", "a"])
        found = EVAL_LINE.search(done.stderr + done.stdout) if done else None
        if done and not found:
            failure = "printed no 'llama_print_timings: eval time' line"
        if failure:
            peer.failed(f"-t {threads}", failure)
            continue
        peer.add(threads, [float(found.group(1))])
        if m := BUILD_LINE.search(done.stderr):
            peer.build = f"build {m.group(1)} ({m.group(2)})"


def llama_bench_round(peer: Peer):
    """One llama-bench call: -r --repetitions runs per --threads value."""
    done, failure = run_peer([FLAGS.llama_bench, "-m", peer.path, "-t", ",".join(FLAGS.threads), "-n", str(FLAGS.tg),
                              "-p", "0", "-r", str(FLAGS.repetitions), "-o", "json"])
    rows = []
    if done:
        try:
            rows = [row for row in json.loads(done.stdout) if row["n_gen"] == FLAGS.tg]
        except (ValueError, KeyError, TypeError):
            failure = "printed no JSON results"
        if not rows and not failure:
            failure = f"reported no tg{FLAGS.tg}"
    if failure:
        peer.failed(f"-t {','.join(FLAGS.threads)}", failure)
        return
    for row in rows:
        peer.add(row.get("n_threads", 0), row["samples_ts"])
    peer.build = f"{rows[0].get('build_commit')} ({rows[0].get('build_number')})"


def measure(models: dict, peers: list[tuple[Peer, object]]) -> tuple[dict[str, float], list[int]]:
    """--rounds rounds of: each model's decode --repetitions times, alternating run by run, then each peer's round
    -> ({name: median tokens/s over all the runs}, the tokens the last run generated)."""
    prompt = [next(iter(models.values())).tokenizer.bos_id or 0]
    rates = {name: [] for name in models}
    tokens = []
    for index in range(FLAGS.rounds):
        if FLAGS.rounds > 1:
            print(f"round {index + 1} of {FLAGS.rounds} ({loads()})", flush=True)
        round_rates, tokens = decode_bytes.alternate_decode(
            models, prompt, FLAGS.tg, FLAGS.repetitions, FLAGS.ctx_size, warm_up=index == 0,
            on_run=lambda name, rate: print(f"  {name}: tg{FLAGS.tg} {rate:.2f} tokens/s", flush=True))
        for name, r in round_rates.items():
            rates[name] += r
        for peer, run_round in peers:
            run_round(peer)
    return {name: float(np.median(r)) for name, r in rates.items()}, tokens


def prompt_tokens(m) -> list[int]:
    """--pp tokens: the first of -f's text, else random ones (as llama-bench's)."""
    if FLAGS.file:
        text = cli.read_text_file(FLAGS.file, "")
        tokens = evaluation.leading_tokens(m.tokenizer.encode, text, FLAGS.pp).tolist()
        if len(tokens) < FLAGS.pp:
            raise JaxinferError(f"-f {FLAGS.file}: {len(tokens)} tokens, fewer than --pp {FLAGS.pp}")
        return tokens
    return np.random.default_rng(0).integers(0, m.config.n_vocab, FLAGS.pp).tolist()


def alternate_prefill(models: dict, prompt: list[int]) -> tuple[dict[str, float], float]:
    """Each model's prefill of `prompt` as generate runs it, --pp_repetitions times after an untimed run, the models
    alternating run by run -> ({name: median tokens/s}, the median over the runs of the predictor's speed over the
    dense one's run beside it: a prompt takes seconds, and this machine's pace drifts more than that between runs)."""
    rates = {name: [] for name in models}
    for run in range(FLAGS.pp_repetitions + 1):
        for name, m in models.items():
            stats = engine.GenerationStats()
            list(engine.generate_tokens(m, prompt, 1, len(prompt) + 1, SamplingParams(temperature=0), 0, stats,
                                        stop_ids=frozenset()))
            if run:
                rates[name].append(stats.prompt_tokens_per_s)
                print(f"  {name}: pp{len(prompt)} {stats.prompt_tokens_per_s:.1f} tokens/s", flush=True)
    paired = np.median(np.array(rates["predictor"]) / np.array(rates["dense"]))
    return {name: float(np.median(r)) for name, r in rates.items()}, float(paired)


def byte_row(m, tokens, shares=None) -> tuple[decode_bytes.StepBytes, np.ndarray]:
    shares = decode_bytes.active_shares(m, tokens) if shares is None else shares
    return decode_bytes.step_bytes(m, shares), shares


def compared(dense_tg: float, tg: float, dense_bytes: float, nbytes: float) -> dict:
    """The speed-up, the one the bytes promise and the fraction of it reached."""
    speedup, promised = tg / dense_tg, dense_bytes / nbytes
    return {"speedup": speedup, "byte_ideal": promised, "fraction_of_ideal": speedup / promised}


def level_files(levels: list[float]) -> list[str]:
    """The PowerInfer file of each level: given, or made (or found) in --models_dir."""
    if FLAGS.sparse_files:
        if len(FLAGS.sparse_files) != len(levels):
            raise JaxinferError(f"--sparse_files gives {len(FLAGS.sparse_files)} files for {len(levels)} --levels")
        for path in FLAGS.sparse_files:
            if not os.path.isfile(path):
                raise JaxinferError(f"--sparse_files: {path} not found")
        return list(FLAGS.sparse_files)
    if not FLAGS.models_dir:
        raise JaxinferError("give --models_dir DIR (where the files are made, 1.4 GiB each for 8 layers of 7B shape) "
                            "or --sparse_files")
    os.makedirs(FLAGS.models_dir, exist_ok=True)
    paths = []
    for level in levels:
        name = f"sparse-{FLAGS.shape}-{FLAGS.n_layer}l-{FLAGS.weight_type}-{FLAGS.predictor_type}-{level:g}.gguf"
        path = os.path.join(FLAGS.models_dir, name)
        if not os.path.isfile(path):
            command = [sys.executable, MAKE_SPARSE_MODEL, "--shape", FLAGS.shape, "--n_layer", str(FLAGS.n_layer),
                       "--weight_type", FLAGS.weight_type, "--predictor_type", FLAGS.predictor_type, "--sparsity",
                       f"{level:g}", "-o", path]
            print(f"making {path}: {' '.join(command[1:])}", file=sys.stderr, flush=True)
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                said = (done.stderr.strip().splitlines() or ["nothing on stderr"])[-1]
                raise JaxinferError(f"make_sparse_model.py failed for --sparsity {level:g}: {said}")
        paths.append(path)
    return paths


def twin_path(path: str) -> str:
    """The dense twin of `path`, made when missing: in --models_dir, else beside it."""
    name = os.path.basename(path).removesuffix(".gguf") + ".dense.gguf"
    twin = os.path.join(FLAGS.models_dir or os.path.dirname(os.path.abspath(path)), name)
    if not os.path.isfile(twin):
        print(f"making the dense twin {twin}", file=sys.stderr, flush=True)
        synthetic.write_dense_twin(twin, path)
    return twin


def bench_level(level: float, path: str) -> dict:
    print(f"--- sparsity {level:g}: {path} ({loads()})", flush=True)
    m = engine.load_model(path, repack=True)
    if m.weights.layers[0].fc1 is None:
        raise JaxinferError(f"{path} has no predictors (blk.N.fc1/fc2): give PowerInfer files")
    # The predictor mode last: the bytes are counted on the tokens of the last model run (alternate_decode).
    models = {"twin": engine.load_model(twin_path(path), repack=True)} if FLAGS.twin else {}
    models |= {"dense": sparsity.apply(m, sparsity.SparsitySpec("dense")),
               "predictor": sparsity.apply(m, sparsity.SparsitySpec("predictor"))}
    del m
    peers = []
    if FLAGS.powerinfer:
        peers.append((Peer("PowerInfer", path), powerinfer_round))
    if FLAGS.llama_bench:
        peers.append((Peer("llama-bench", twin_path(path)), llama_bench_round))
    runtime.freeze_loaded_objects()  # as generate does after loading
    rates, tokens = measure(models, peers)
    pair = {name: models[name] for name in ("dense", "predictor")}
    prompts, pp_speedup = alternate_prefill(pair, prompt_tokens(models["dense"])) if FLAGS.pp else ({}, None)
    dense, dense_shares = byte_row(models["dense"], tokens)
    sparse, _ = byte_row(models["predictor"], tokens)
    twin, _ = byte_row(models["dense"], tokens, np.ones_like(dense_shares))  # every row, no predictor
    del models
    gc.unfreeze()
    gc.collect()
    row = {"level": level, "file": path, "active_share": sparse.active_share,
           "dense_active_share": dense.active_share, "dense_mib": dense.total / MIB,
           "sparse_mib": sparse.total / MIB, "twin_mib": twin.total / MIB,
           "twin_byte_ideal": twin.total / sparse.total,
           "sparse_mib_by_class": {k: v / MIB for k, v in sparse.read.items()},
           "dense_tg": rates["dense"], "sparse_tg": rates["predictor"], "twin_tg": rates.get("twin"),
           **compared(rates["dense"], rates["predictor"], dense.total, sparse.total),
           "dense_pp": prompts.get("dense"), "sparse_pp": prompts.get("predictor"),
           "pp_speedup": pp_speedup}
    found = {peer.name: peer for peer, _ in peers}
    row |= found["PowerInfer"].result("powerinfer") if FLAGS.powerinfer else dict.fromkeys(POWERINFER_KEYS)
    row |= found["llama-bench"].result("llama_cpp") if FLAGS.llama_bench else dict.fromkeys(LLAMA_CPP_KEYS)
    for peer in ("twin_tg", "powerinfer_tg", "llama_cpp_tg"):
        row[f"sparse_over_{peer}"] = row[peer] and row["sparse_tg"] / row[peer]
    # What the predictor mode would run at its byte ideal (the dense mode's speed times the ideal), over PowerInfer.
    at_ideal = row["dense_tg"] * row["byte_ideal"]
    row["ideal_over_powerinfer_tg"] = row["powerinfer_tg"] and at_ideal / row["powerinfer_tg"]
    return row


def runs() -> str:
    """How many runs each jaxinfer speed is the median of."""
    return f"{FLAGS.repetitions * FLAGS.rounds} alternating runs" + (f" in {FLAGS.rounds} rounds" if FLAGS.rounds > 1
                                                                     else "")


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_levels(rows: list[dict]):
    print(f"\ntg{FLAGS.tg}, tokens/s (jaxinfer: medians of {runs()}); MiB of weights a decode step reads; ideal = "
          f"dense MiB / predictor MiB; reached = speed-up / ideal; all ÷ predictor MiB: the ideal against a dense "
          f"engine that reads every weight (jaxinfer or llama.cpp on the twin); ideal ÷ PowerInfer: the predictor "
          f"mode at its byte ideal (dense × ideal) over PowerInfer")
    print("| sparsity | active | MiB dense / predictor / all | jaxinfer dense | predictor | speed-up | ideal | reached "
          "| jaxinfer on the twin | predictor ÷ twin | PowerInfer (-t) | llama.cpp on the twin (-t) "
          "| predictor ÷ PowerInfer | ideal ÷ PowerInfer | predictor ÷ llama.cpp | all ÷ predictor MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        threads = f" ({r['powerinfer_threads']})" if r["powerinfer_threads"] else ""
        llama_threads = f" ({r['llama_cpp_threads']})" if r["llama_cpp_threads"] else ""
        print(f"| {r['level']:g} | {100 * r['active_share']:.1f}% | {r['dense_mib']:.1f} / {r['sparse_mib']:.1f} / "
              f"{r['twin_mib']:.1f} | {r['dense_tg']:.2f} | {r['sparse_tg']:.2f} | {r['speedup']:.3f}x | "
              f"{r['byte_ideal']:.3f}x | {100 * r['fraction_of_ideal']:.0f}% | {fmt(r['twin_tg'])} | "
              f"{fmt(r['sparse_over_twin_tg'], '.3f')} | {fmt(r['powerinfer_tg'])}{threads} | "
              f"{fmt(r['llama_cpp_tg'])}{llama_threads} | {fmt(r['sparse_over_powerinfer_tg'], '.3f')} | "
              f"{fmt(r['ideal_over_powerinfer_tg'], '.3f')} | {fmt(r['sparse_over_llama_cpp_tg'], '.3f')} | "
              f"{r['twin_byte_ideal']:.3f}x |", flush=True)
    if FLAGS.pp:
        source = f"the first tokens of {FLAGS.file}" if FLAGS.file else "random tokens"
        print(f"\npp{FLAGS.pp} ({source}, prefilled as generate does), tokens/s: medians of {FLAGS.pp_repetitions} "
              f"alternating runs; predictor ÷ dense: the median of each run's ratio to the dense run beside it")
        print("| sparsity | jaxinfer dense | predictor | predictor ÷ dense |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['level']:g} | {r['dense_pp']:.1f} | {r['sparse_pp']:.1f} | {r['pp_speedup']:.3f}x |",
                  flush=True)


def synthetic_mode() -> dict:
    levels = [float(v) for v in FLAGS.levels]
    rows = [bench_level(level, path) for level, path in zip(levels, level_files(levels))]
    print_levels(rows)
    return {"mode": "synthetic", "levels": rows}


def thresholds_ready(m, spec: sparsity.SparsitySpec, windows: np.ndarray, source: str):
    """Calibrate `spec`'s thresholds on the windows into --thresholds (or the model's sidecar) where they are
    missing."""
    try:
        sparsity.load_thresholds(m.path, spec.mode, spec.level, m.config.n_layer, FLAGS.thresholds)
        return
    except JaxinferError:
        pass
    from jaxinfer import calibrate  # its CLI's flags are defined only by its main()

    values = calibrate.calibrate(m, windows, spec.mode, [spec.level])
    saved = sparsity.save_thresholds(m.path, spec.mode, values, source, FLAGS.thresholds)
    print(f"calibrated {spec} on {source}: saved to {saved}", file=sys.stderr, flush=True)


def real_mode() -> dict:
    specs = [sparsity.parse_spec(s) for s in FLAGS.specs]
    if any(s.mode not in sparsity.THRESHOLD_METHODS and s.mode != "predictor" for s in specs):
        raise JaxinferError(f"--specs compares sparse modes with dense: gate:S, hidden:S or predictor, got "
                            f"{','.join(FLAGS.specs)}")
    text = cli.read_text_file(FLAGS.file, "-f/--file is required with --specs (the text of the perplexities)")
    m = engine.load_model(FLAGS.model, repack=True)
    print(m.describe(), file=sys.stderr)
    n_ctx = cli.capped_context(FLAGS.ppl_ctx_size, m.config.n_ctx_train)
    tokens = evaluation.leading_tokens(m.tokenizer.encode, text, max(FLAGS.chunks, 2) * n_ctx)  # make_windows: 2+
    bos = m.tokenizer.bos_id if m.tokenizer.add_bos else None
    windows = evaluation.make_windows(tokens, n_ctx, FLAGS.chunks, bos)
    for spec in specs:
        if spec.mode in sparsity.THRESHOLD_METHODS:
            thresholds_ready(m, spec, windows, f"{FLAGS.file} ({windows.size} tokens)")
    models = {"dense": sparsity.apply(m, sparsity.SparsitySpec("dense"))}
    models |= {str(spec): sparsity.apply(m, spec, thresholds_file=FLAGS.thresholds if spec.mode in
                                         sparsity.THRESHOLD_METHODS else None) for spec in specs}
    path = m.path
    del m
    peer = Peer("llama-bench", path)
    runtime.freeze_loaded_objects()
    print(f"decode ({loads()})", flush=True)
    rates, generated = measure(models, [(peer, llama_bench_round)] if FLAGS.llama_bench else [])
    rows = []
    steps = {name: byte_row(sm, generated)[0] for name, sm in models.items()}
    for name, sm in models.items():
        step = steps[name]
        result = evaluation.evaluate(sm, tokens, n_ctx=n_ctx, n_chunks=FLAGS.chunks)
        print(f"  {name}: PPL {result.ppl:.4f} +/- {result.error:.4f}", flush=True)
        rows.append({"spec": name, "active_share": step.active_share, "mib": step.total / MIB, "tg": rates[name],
                     "ppl": result.ppl, "ppl_error": result.error,
                     **compared(rates["dense"], rates[name], steps["dense"].total, step.total)})
    llama = peer.result("llama_cpp") if FLAGS.llama_bench else dict.fromkeys(LLAMA_CPP_KEYS)
    print(f"\n{os.path.basename(path)}: tg{FLAGS.tg}, tokens/s (medians of {runs()}); "
          f"PPL over {FLAGS.chunks} windows of {n_ctx} of {FLAGS.file}; llama.cpp tg{FLAGS.tg} "
          f"{fmt(llama['llama_cpp_tg'])}")
    print("| sparsity | active | MiB read | tg | speed-up | ideal | reached | PPL |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['spec']} | {100 * r['active_share']:.1f}% | {r['mib']:.1f} | {r['tg']:.2f} | {r['speedup']:.3f}x "
              f"| {r['byte_ideal']:.3f}x | {100 * r['fraction_of_ideal']:.0f}% | {r['ppl']:.4f} ± "
              f"{r['ppl_error']:.4f} |", flush=True)
    return {"mode": "real", "model": path, "rows": rows, **llama}


@exit_on_error
def main(argv):
    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    checked_peer(FLAGS.powerinfer, "powerinfer")
    checked_peer(FLAGS.llama_bench, "llama_bench")
    if FLAGS.model and not FLAGS.specs:
        raise JaxinferError("-m/--model is for the real-model mode: give --specs (e.g. hidden:0.3,hidden:0.5,gate:0.5)")
    runtime.enable_compilation_cache()
    start = loads()
    print(start, flush=True)
    summary = real_mode() if FLAGS.specs else synthetic_mode()
    end = loads()
    print(f"{end} (at the start: {start.removeprefix('load average ')})", flush=True)
    if FLAGS.json:
        print(json.dumps({**summary, "tg": FLAGS.tg, "repetitions": FLAGS.repetitions, "load_start": start,
                          "load_end": end}))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

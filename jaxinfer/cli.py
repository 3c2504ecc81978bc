"""Shared command-line plumbing: llama.cpp-style flag spellings, flag values checked as the command line is parsed,
one-line flag errors, --help, and the notes every CLI prints the same way."""

import contextlib
import logging as std_logging
import os
import shutil
import sys
import textwrap

from absl import flags, logging

from jaxinfer.errors import JaxinferError

INT32_MAX = 2**31 - 1  # counts reach the compiled programs as int32
MAX_VRAM_GIB = 2.0**20  # 1 PiB: far beyond any accelerator; larger budgets are typos
MIN_WINDOW = 8  # least -c of the CLIs that cut a text into windows (perplexity scores their second half)
HELP_ARGS = ("-h", "-?", "--help", "--helpshort", "--helpfull")

# Help of the flags that more than one CLI defines.
THRESHOLDS_HELP = ("calibrated thresholds file for --sparsity gate:S / hidden:S, as calibrate -o wrote it (default: "
                   "MODEL.sparsity.json, where calibrate writes without -o)")
DOWN_T_TYPE_HELP = ("type of the down projection transposed for a sparse --sparsity (one row per neuron, so inactive "
                    "rows are skipped): same (the model's own; a second rounding), q8_0 (near-lossless, 1.7x the "
                    "bytes of Q4_1), q4_0, q4_1, q5_0 or q5_1")
SPLIT_ONLY_FLAGS = ("reset_gpu_index", "disable_gpu_index", "activation_dir")
JOIN_GRACE_S = 5  # jax.distributed's own join timeout runs this much past --join_timeout: ours gives the error line


def read_text_file(path: str | None, missing: str) -> str:
    """The text of a -f/--file flag's file, decoded as UTF-8 (bad bytes replaced); a JaxinferError with `missing`
    when no file is given, or naming the file when it cannot be read."""
    if not path:
        raise JaxinferError(missing)
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError as e:
        raise JaxinferError(f"cannot read {path}: {e.strerror}") from None


def parse_shape(shape: str, form: str, example: str) -> tuple[int, int]:
    """A --shapes item `AxB` (the kernel benchmarks) -> (A, B), two positive integers; a JaxinferError naming the
    `form` expected (e.g. "ROWSxCOLS") and an `example` otherwise."""
    try:
        first, second = map(int, shape.split("x"))
    except ValueError:
        raise JaxinferError(f"--shapes: {shape!r} is not {form} (e.g. {example})") from None
    if first < 1 or second < 1:
        raise JaxinferError(f"--shapes: {shape!r} needs positive sizes")
    return first, second


def check_range(name: str, low: float | None = None, high: float | None = None, *, low_open: bool = False,
                high_open: bool = False, sentinel: float | None = None, flag_values: flags.FlagValues = flags.FLAGS):
    """Check flag `name` as the command line is parsed: a finite number in [low, high] (low excluded with
    `low_open`, high with `high_open`), or exactly `sentinel` (a value meaning off, all or random). Integer flags are
    also bounded by INT32_MAX. A failure is parse_flags' one-line error naming the flag and the range."""
    is_float = flag_values[name].flag_type() == "float"
    if high is None and not is_float:
        high = INT32_MAX
    allowed = ("a finite number " if is_float else "") + _range(low, high, low_open, high_open)
    if sentinel is not None:
        allowed = f"{_plain(sentinel)} or {allowed}"

    def valid(value) -> bool:
        return value is None or value == sentinel or _in_range(value, low, high, low_open, high_open)

    flags.register_validator(name, valid, message=f"must be {allowed}", flag_values=flag_values)


def check_list(name: str, low: float | None = None, high: float | None = None, *, low_open: bool = False,
               high_open: bool = False, number: type = int, words: tuple[str, ...] = (), empty: bool = False,
               flag_values: flags.FlagValues = flags.FLAGS):
    """Check list flag `name` as the command line is parsed: every item one of `words` or a `number` (int or
    float, finite) in the range check_range takes, and at least one item unless `empty`. A failure is parse_flags'
    one-line error naming the flag; the items are then read with `number` without another check."""
    if high is None and number is int:
        high = INT32_MAX
    allowed = (f"{'' if empty else 'one or more '}comma-separated {'integers' if number is int else 'finite numbers'} "
               f"{_range(low, high, low_open, high_open)}" + (f" (or {', '.join(words)})" if words else ""))

    def valid(item: str) -> bool:
        if item in words:
            return True
        try:
            return _in_range(number(item), low, high, low_open, high_open)
        except ValueError:
            return False

    flags.register_validator(name, lambda items: (empty or bool(items)) and all(map(valid, items)),
                             message=f"must be {allowed}", flag_values=flag_values)


def _range(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    """The range of check_range or check_list as the user reads it: `in [0, 1)`, `> 0`, `<= 10`."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{_plain(low)}, {_plain(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_plain(low)}"
    return f"{'<' if high_open else '<='} {_plain(high)}"


def _in_range(value: float, low: float | None, high: float | None, low_open: bool, high_open: bool) -> bool:
    above = low is None or (value > low if low_open else value >= low)
    below = high is None or (value < high if high_open else value <= high)
    return above and below and abs(value) != float("inf")  # NaN already fails both comparisons


def _plain(number: float) -> str:
    """2147483647 rather than 2.14748e+09 in a range the user reads."""
    return str(int(number)) if float(number).is_integer() else f"{number:g}"


def define_split_flags():
    """The flags of a hot/cold split between accelerator and host (generate, perplexity). The calling CLI adopts them
    (flags.adopt_module_key_flags) so that its --help lists them."""
    flags.DEFINE_float("vram_budget", -1.0, "GiB of accelerator memory: place hot FFN neurons there and the rest on "
                       "the host CPU (needs an activation profile, python -m jaxinfer.profile); -1: no split")
    flags.DEFINE_bool("reset_gpu_index", False, "solve the hot/cold split again instead of reusing "
                      "MODEL.generated.gpuidx")
    flags.DEFINE_bool("disable_gpu_index", False, "run without a hot/cold split even when --vram-budget is given")
    flags.DEFINE_string("activation_dir", None, "activation profile folder (default: MODEL.activation/, where the "
                        "profile CLI writes it)")
    check_range("vram_budget", 0, MAX_VRAM_GIB, sentinel=-1)


def define_receipt_flag():
    """--receipt (generate, perplexity, the benchmarks): receipt.check_path before the run, receipt.write after."""
    flags.DEFINE_string("receipt", None, "write a JSON receipt of the run to this file: model fingerprint and types, "
                        "backend, devices, cpu_ext ISA and the kernel of each weight type, threads, flags, times and "
                        "tokens/s, versions")


def define_tp_flag():
    """--tp, tensor parallelism (generate, perplexity); read by request_devices before JAX starts."""
    flags.DEFINE_integer("tp", 1, "tensor parallelism: cut the model's weights over this many devices (attention by "
                         "heads, the FFN by neurons, the output head by vocabulary); on a CPU, as many virtual CPU "
                         "devices sharing its cores")
    check_range("tp", 1)


def define_dp_flag():
    """--dp, data parallelism of an evaluation (perplexity); read by join_processes before JAX starts."""
    flags.DEFINE_integer("dp", 1, "data parallelism: spread the windows of each batch over this many devices, the "
                         "model whole on each (default over several processes: all their devices); not with --tp")
    check_range("dp", 1)


def define_process_flags():
    """The flags of a run over several processes, on one host or several (generate, perplexity)."""
    flags.DEFINE_string("coordinator", None, "HOST:PORT where process 0 serves the coordinator of a run over several "
                        "processes (jax.distributed; every process gives the same); default: $JAX_COORDINATOR_ADDRESS")
    flags.DEFINE_integer("num_processes", 1, "processes running the model together, each started with the same "
                         "flags and its own --process_id; --tp (--dp) then counts all their devices")
    flags.DEFINE_integer("process_id", 0, "this process's rank, 0 to --num_processes - 1; process 0 serves the "
                         "coordinator and prints the results")
    flags.DEFINE_integer("join_timeout", 45, "seconds a process waits for the coordinator and every process to join "
                         "before it gives up with an error")
    check_range("num_processes", 1)
    check_range("process_id", 0)
    check_range("join_timeout", 1, 3600)


def join_processes(evaluates: bool = False) -> tuple[int, int]:
    """Start JAX for --tp (and --dp, for an evaluation): -> (tp, dp), the devices the model is cut over and the
    devices evaluation windows are spread over. With --num_processes N this process joins the others first
    (distributed.initialize), --tp and --dp count all their devices, and without either the model is cut over
    (an evaluation's windows spread over) one device of every process. On a CPU each process gets its share of
    the devices as virtual CPU devices."""
    f = flags.FLAGS
    processes = f.num_processes
    tp, dp = f.tp, f.dp if evaluates else 1
    if processes == 1:
        if f["coordinator"].present or f["process_id"].present:
            raise JaxinferError("--coordinator and --process_id are for a run over several processes: give "
                                "--num_processes too")
        request_devices(tp * dp)
        return tp, dp
    coordinator = f.coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not coordinator:
        raise JaxinferError(f"--num_processes {processes} needs --coordinator HOST:PORT (where process 0 serves)")
    if f.process_id >= processes:
        raise JaxinferError(f"--process_id {f.process_id} is not below --num_processes {processes}")
    if tp == 1 and dp == 1:
        tp, dp = (1, processes) if evaluates else (processes, 1)
    if (tp * dp) % processes:
        flag, count = ("--dp", dp) if dp > 1 else ("--tp", tp)
        raise JaxinferError(f"{flag} {count} devices cannot be shared equally by {processes} processes")
    request_devices(tp * dp // processes)
    from jaxinfer import distributed

    waited = (f"the other {processes - 1} processes did not all join" if f.process_id == 0 else
              f"the coordinator at {coordinator} (process 0) could not be reached")
    with _exit_after(f.join_timeout, f"process {f.process_id} of {processes}: {waited} within {f.join_timeout} s"):
        distributed.initialize(coordinator, processes, f.process_id, f.join_timeout + JOIN_GRACE_S)
    return tp, dp


def _native_output_aside(stack: contextlib.ExitStack, shown: bool):
    """Until `stack` closes, what native code writes to the standard output (gloo's "Rank k is connected to n peer
    ranks" lines) goes to stderr when `shown`, nowhere otherwise: -> the stream for Python's own output, the real
    standard output. Native code's stderr (a fatal error's message) is left alone."""
    sys.stdout.flush()
    real = os.dup(1)
    if shown:
        os.dup2(2, 1)
    else:
        nowhere = os.open(os.devnull, os.O_WRONLY)
        os.dup2(nowhere, 1)
        os.close(nowhere)

    def restore():
        os.dup2(real, 1)
        os.close(real)

    stack.callback(restore)
    return stack.enter_context(open(real, "w", closefd=False))


@contextlib.contextmanager
def _exit_after(seconds: float, message: str):
    """Within: after `seconds`, print `error: message` and end the process (status 2). For jax.distributed's join,
    whose own timeout aborts the process with a C++ stack trace (it releases the GIL while it waits, so this
    watchdog thread runs)."""
    import threading

    done = threading.Event()

    def watch():
        if not done.wait(seconds):
            print(f"error: {message}", file=sys.stderr, flush=True)
            os._exit(2)

    threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    finally:
        done.set()


def request_devices(count: int):
    """On a CPU backend, `count` devices for this process (--tp, --dp): JAX's jax_num_cpu_devices, which must be set
    before JAX runs its first operation (the CLIs call this first thing in main). GPUs are counted as they are."""
    if count > 1:
        import jax

        jax.config.update("jax_num_cpu_devices", count)


@contextlib.contextmanager
def leader_prints():
    """Within: only process 0 of a run over several processes prints (the others' stdout and stderr go nowhere);
    an error leaving the block still comes out of every process, after the streams are back. Native writes to the
    standard output (gloo's connection lines) are shown, on stderr, only with --verbosity. A failure of the
    distributed runtime (a peer process died) ends the process with an `error:` line naming it (status 2)."""
    import jax

    from jaxinfer import distributed

    if jax.process_count() == 1:
        yield
        return
    try:
        with contextlib.ExitStack() as stack:
            python_stdout = _native_output_aside(stack, shown=flags.FLAGS["verbosity"].present)
            stack.enter_context(contextlib.redirect_stdout(python_stdout))
            if jax.process_index() != 0:
                quiet = stack.enter_context(open(os.devnull, "w"))
                stack.enter_context(contextlib.redirect_stdout(quiet))
                stack.enter_context(contextlib.redirect_stderr(quiet))
            yield
    except (jax.errors.JaxRuntimeError, distributed.ProcessLost) as e:
        exit_lost_process(e)


def exit_lost_process(error: Exception):
    """End this process of a run over several processes, whose collective failed with `error` (a peer process died),
    with an `error:` line naming it (status 2). Not by exit_on_error: JAX's shutdown at exit would wait for the dead
    process, then abort with a C++ stack trace. Process 0's progress bar may have left its line unfinished."""
    import jax

    from jaxinfer import distributed

    newline = "\n" if jax.process_index() == 0 else ""
    print(f"{newline}error: process {jax.process_index()} of {jax.process_count()}: the run failed, a process "
          f"probably died ({distributed.one_line(error)})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)


def split_requested() -> bool:
    """Whether the parsed flags ask for a hot/cold split. The split's other flags without --vram-budget do nothing,
    which a warning line says rather than ignoring them silently."""
    f = flags.FLAGS
    if f.vram_budget < 0:
        given = ["--" + name.replace("_", "-") for name in SPLIT_ONLY_FLAGS if f[name].present]
        if given:
            print(f"warning: {', '.join(given)} ignored without --vram-budget (no hot/cold split)", file=sys.stderr)
        return False
    return not f.disable_gpu_index


def build_model(tp: int):
    """The model that the flags generate and the server share ask for (-m, --sparsity, --thresholds, --down_t_type,
    -amb, --cache_type, -c, the split's flags), cut over `tp` devices, saying on stderr what was loaded, the plan
    and the split. The compilation cache is on in a single process (over several, JAX stores process 0's programs
    only and keys the others' by their own devices: they would compile every run while process 0 waits for them)."""
    from jaxinfer import engine, runtime, sparsity

    f = flags.FLAGS
    spec = sparsity.parse_spec(f.sparsity)
    down_t_type = sparsity.parse_down_t_type(f.down_t_type)
    split = split_requested()
    if f.num_processes == 1:
        runtime.enable_compilation_cache()
    m = engine.build_model(f.model, sparsity_spec=spec, down_t_type=down_t_type,
                           attn_max_batch_mib=f.attn_max_batch or None, cache_type=f.cache_type,
                           vram_budget_gib=f.vram_budget if split else None, ctx=f.ctx_size,
                           activation_dir=f.activation_dir, reset_gpu_index=f.reset_gpu_index,
                           thresholds_file=f.thresholds, tp=tp, hot_first=True,
                           loaded=lambda m: print(f"{m.describe()}\n{m.describe_plan(split)}", file=sys.stderr))
    if m.split is not None:
        print(m.split.summary, file=sys.stderr)
    runtime.freeze_loaded_objects()
    return m


def capped_context(n_ctx: int, n_ctx_train: int) -> int:
    """-c beyond the model's training context is capped to it, with a note (as llama.cpp warns), in every CLI."""
    if n_ctx > n_ctx_train:
        print(f"note: -c {n_ctx} exceeds the model's training context; using {n_ctx_train}", file=sys.stderr)
        return n_ctx_train
    return n_ctx


def windows_per_batch(batch_size: int, n_ctx: int, n_windows: int) -> int:
    """Windows of n_ctx tokens per compiled call for -b tokens: at least one, and never more than there are (a huge
    -b would otherwise pad every batch with copies)."""
    return max(1, min(batch_size // n_ctx, n_windows))


def _underscore(arg: str) -> str:
    """`--kl-divergence-base=x` -> `--kl_divergence_base=x`: llama.cpp spells flags with dashes, absl with
    underscores; both spellings work."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return "--" + name[2:].replace("-", "_") + sep + value


def _describe(flag: flags.Flag, width: int) -> str:
    """One flag's help, wrapped at spaces only (absl's wrapping also breaks at hyphens: "llm-" / "smollm2")."""
    names = (f"-{flag.short_name}," if flag.short_name else "") + ("--[no]" if flag.boolean else "--") + flag.name
    default = flag.default
    if isinstance(default, list):
        default = ",".join(map(str, default))
    shown = "" if default is None else f" (default: {str(default).lower() if flag.boolean else default})"
    return textwrap.fill(f"{names}: {flag.help}{shown}", width=width, initial_indent="  ", subsequent_indent="      ",
                         break_on_hyphens=False, break_long_words=False)


def print_help(full: bool):
    """The program's docstring, printed as written (absl's own usage %-formats it: "50% a" turns into the program's
    path), then its flags; `full` adds the flags of every library (absl, JAX)."""
    width = max(60, min(shutil.get_terminal_size().columns, 120))
    doc = (sys.modules["__main__"].__doc__ or f"usage: {sys.argv[0]} [flags]").strip()
    if full:
        sections = sorted(flags.FLAGS.flags_by_module_dict().items())
    else:
        sections = [("flags", flags.FLAGS.get_key_flags_for_module(sys.argv[0]))]
    parts = [doc]
    for module, module_flags in sections:
        unique = {flag.name: flag for flag in module_flags}
        parts.append(f"{module}:\n" + "\n".join(_describe(unique[name], width) for name in sorted(unique)))
    if not full:
        parts.append("--helpfull also lists the flags of absl and JAX.")
    sys.stdout.write("\n\n".join(parts) + "\n")


def parse_flags(argv):
    """absl `flags_parser`: -h/--help/--helpfull print the help and exit 0; a bad flag or flag value is one
    `error: ...` line and exit status 2. Libraries' INFO/WARNING log lines stay off the terminal unless
    --verbosity asks for them."""
    asked = [a for a in argv[1:] if a in HELP_ARGS]
    if asked:
        print_help(full="--helpfull" in asked)
        sys.exit(0)
    try:
        rest = flags.FLAGS([_underscore(a) for a in argv])
    except flags.Error as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(2)
    if not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
        std_logging.getLogger("jax").setLevel(std_logging.ERROR)  # backend probing ("Unable to initialize ...")
    return rest

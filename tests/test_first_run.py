"""What a new user meets on a first run: Ctrl-C, an error after streamed text, the compile notice, the plan line."""

import os
import pathlib
import signal
import subprocess
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine, sparsity
from jaxinfer.errors import INTERRUPTED, INTERRUPTED_LINE, exit_on_error
from jaxinfer.sampling import SamplingParams

WIKITEXT = pathlib.Path(__file__).parent / "data" / "wiki.test.head.raw"


def env(**extra):
    return dict(os.environ, JAX_PLATFORMS="cpu", **extra)


def interrupted(module: str, args: list[str], trigger: bytes, in_stdout: bool = False):
    """Run `python -m jaxinfer.MODULE ARGS`, send it SIGINT once `trigger` came out on its stderr (or stdout) ->
    (exit status, stdout, stderr)."""
    process = subprocess.Popen([sys.executable, "-m", f"jaxinfer.{module}", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env())
    watched = process.stdout if in_stdout else process.stderr
    seen = b""
    while trigger not in seen:
        chunk = os.read(watched.fileno(), 4096)
        assert chunk, f"{module} ended before {trigger!r} came out: {seen.decode()[-2000:]}"
        seen += chunk
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    if in_stdout:
        out = seen + out
    else:
        err = seen + err
    return process.returncode, out.decode(), err.decode()


@pytest.mark.slow
def test_ctrl_c_ends_generate_with_its_summary_and_status_130():
    """Before: a KeyboardInterrupt traceback of ~20 lines, the text's line left open."""
    prompt = "The capital of France is"
    status, out, err = interrupted("generate", ["-p", prompt, "-n", "2000", "--temp", "0"], b"Paris", in_stdout=True)
    assert status == INTERRUPTED and "Traceback" not in err, err
    assert out.startswith(f"{prompt} Paris") and out.endswith("\n") and not out.endswith("\n\n"), out
    summary = err.strip().splitlines()[-1]
    assert summary.startswith("load ") and "| stop: interrupted |" in summary, err
    generated = int(summary.split("generated ")[1].split(" tokens")[0])
    assert 1 <= generated < 2000


@pytest.mark.parametrize("module, args, trigger", [  # once the bar moved: the loop runs
    ("perplexity", ["-f", str(WIKITEXT), "-c", "128"], b"ppl="),
    ("calibrate", ["-f", str(WIKITEXT), "-c", "128", "-b", "256", "--chunks", "-1"], b"| 1/"),  # 2 windows a bar step
])
@pytest.mark.slow
def test_ctrl_c_under_a_progress_bar_is_one_line_of_its_own_and_status_130(tmp_path, module, args, trigger):
    """Interrupted while the bar runs (its line on stderr left open): the bar's line is ended, then one line."""
    status, out, err = interrupted(module, [*args, "-o", str(tmp_path / "t.json")] if module == "calibrate" else args,
                                   trigger)
    assert status == INTERRUPTED and "Traceback" not in err, err
    assert err.endswith(f"\n{INTERRUPTED_LINE}\n"), err[-500:]
    assert out == ""


def test_every_cli_main_turns_ctrl_c_into_one_line(capsys):
    """The wrapper of every CLI's main (inspect's too, which is over before a signal could be timed)."""
    from jaxinfer import inspect

    def main(argv):
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as stopped:
        exit_on_error(main)(["prog"])
    assert stopped.value.code == INTERRUPTED
    assert capsys.readouterr().err == f"{INTERRUPTED_LINE}\n"
    assert inspect.main.__wrapped__  # exit_on_error's functools.wraps


# A CLI main whose first KeyboardInterrupt lands where Python drops it (a garbage-collector callback prints it as
# "Exception ignored") or where native code wraps it in another exception, then works on for a minute.
LOST_INTERRUPT = """
import gc, sys, time
from jaxinfer.errors import exit_on_error

def main():
    def collecting(phase, info):
        time.sleep(1)  # the Ctrl-C arrives in here
    print("working", file=sys.stderr, flush=True)
    if sys.argv[1] == "dropped":
        gc.callbacks.append(collecting)
        gc.collect()
        gc.callbacks.remove(collecting)
    else:
        try:
            time.sleep(5)
        except KeyboardInterrupt as e:
            raise ValueError("an equality check raised") from e
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        sum(range(1000))
    print("finished", file=sys.stderr)

exit_on_error(main)()
"""


@pytest.mark.parametrize("where", ["dropped", "wrapped"])
def test_ctrl_c_that_python_drops_or_native_code_wraps_still_ends_the_cli(where):
    """Python runs a signal handler wherever the main thread is, garbage-collector callbacks included (JAX's
    _xla_gc_callback drops a KeyboardInterrupt raised in it): the interrupt is raised again until taken. One raised
    under native code can come back wrapped in another exception (JAX's pytree comparisons): still an interrupt."""
    process = subprocess.Popen([sys.executable, "-c", LOST_INTERRUPT, where], stderr=subprocess.PIPE, text=True)
    assert process.stderr.readline() == "working\n"
    process.send_signal(signal.SIGINT)
    try:
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == INTERRUPTED and "finished" not in err, err
    assert err.strip().splitlines()[-1] == INTERRUPTED_LINE and "ValueError" not in err, err


def test_a_cli_started_with_sigint_ignored_keeps_ignoring_it():
    """A shell's background job starts with SIGINT ignored, so that a Ctrl-C meant for the shell does not reach it:
    the CLI keeps it so."""
    script = ("import sys, time\nfrom jaxinfer.errors import exit_on_error\n"
              "def main():\n    print('working', file=sys.stderr, flush=True)\n    time.sleep(1)\n"
              "    print('finished', file=sys.stderr)\nexit_on_error(main)()\n")
    ignoring = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "os.execv(sys.argv[1], sys.argv[1:])")
    process = subprocess.Popen([sys.executable, "-c", ignoring, sys.executable, "-c", script], stderr=subprocess.PIPE,
                               text=True)  # an ignored signal stays ignored across exec, as a shell starts a job
    assert process.stderr.readline() == "working\n"
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 0 and err == "finished\n", err


@pytest.mark.slow
def test_an_error_after_streamed_text_starts_a_line_of_its_own(make_model):
    """The embedding row of the first generated token is NaN (a corrupt file): the prefill gives that token, whose
    text is streamed, and feeding it back makes the logits NaN. Before: `...<text>error: ...` on one line."""
    path = make_model(tied_output=False, seed=1)
    m = engine.load_model(path)
    for prompt in ("hello the", "the quick brown fox", "abc abc", "once upon a time"):  # one whose first token shows
        ids = m.tokenizer.encode(prompt)
        token = next(engine.generate_tokens(m, ids, 1, 64, SamplingParams(temperature=0), 0))
        text = m.tokenizer.decode([token])
        if token not in ids and text.isprintable() and text.isascii() and text.strip():
            break
    else:
        pytest.fail("no prompt's first token is printable text")
    reader = gguf.GGUFReader(path, "r+")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    embedding.data[token] = np.nan
    reader.data.flush()
    del reader, embedding
    result = subprocess.run([sys.executable, "-m", "jaxinfer.generate", "-m", path, "-p", prompt, "-n", "8", "--temp",
                             "0", "-c", "64"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
                            timeout=300)
    assert result.returncode == 2 and "Traceback" not in result.stdout, result.stdout
    position = len(ids) + 1
    assert result.stdout.endswith(f"\n{prompt}{text}\nerror: {path}: the model's logits are NaN or infinite at "
                                  f"position {position} (corrupt weights?)\n"), result.stdout


@pytest.mark.slow
def test_a_first_run_says_it_compiles_and_a_second_does_not(make_model, tmp_path):
    """The line comes before the compile, on stderr, only while the programs are not stored (JAXINFER_CACHE_DIR).
    The second run reaches the same cache through links from another folder: its compiles hit that cache all the same,
    writing no new entry (XLA's cache keys once held the folder's path)."""
    cache, linked = tmp_path / "cache", tmp_path / "linked"
    args = [sys.executable, "-m", "jaxinfer.generate", "-m", make_model(), "-p", "hello the", "-n", "12", "--temp",
            "0", "-c", "64"]
    first = subprocess.run(args, capture_output=True, text=True, env=env(JAXINFER_CACHE_DIR=str(cache)), timeout=300)
    linked.mkdir()
    for kind in ("xla", "programs"):
        (linked / kind).symlink_to(cache / kind)
    steps = sorted(path.name for path in (cache / "xla").glob("jit_call-*"))  # the prefill and decode programs
    second = subprocess.run(args, capture_output=True, text=True, env=env(JAXINFER_CACHE_DIR=str(linked)), timeout=300)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    notice = (f"compiling the prefill and decode programs (first run with these shapes; cached in {cache} for the "
              f"next)")
    assert first.stderr.splitlines()[2] == notice, first.stderr
    assert "compiling" not in second.stderr, second.stderr
    assert len(steps) == 2 and sorted(path.name for path in (cache / "xla").glob("jit_call-*")) == steps  # both hit
    assert first.stdout == second.stdout and first.stdout.startswith("hello the") and "compiling" not in first.stdout


def test_the_plan_line_names_what_a_dense_run_uses(make_model):
    """Before: a split, a sparse down projection, eight repacked types and TQ1_0's route on every line."""
    m = engine.build_model(make_model(weight_type=Q.Q8_0))
    assert m.describe_plan() == ("plan: cpu backend, FFN dense, products cpu_ext, attention cpu_ext, Q8_0 weights "
                                 "repacked eight rows to a group")
    exact = engine.build_model(make_model(weight_type=Q.Q4_0), exact=True)
    assert exact.describe_plan() == "plan: cpu backend, FFN dense, products cpu_ext, attention cpu_ext"
    ternary = engine.build_model(make_model(architecture="bitnet", n_embd=256, n_ff=512, weight_type=Q.TQ1_0))
    assert ternary.describe_plan() == ("plan: cpu backend, FFN dense, products cpu_ext, attention cpu_ext, TQ1_0 held "
                                       "as TQ2_0")


@pytest.mark.slow
def test_the_plan_line_of_a_sparse_split_run(make_model):
    from test_hybrid import write_profile

    path = make_model(n_embd=64, n_ff=256, sparsity=0.85, n_ctx=64, weight_type=Q.Q8_0)
    write_profile(sparsity.apply(engine.load_model(path), sparsity.SparsitySpec("predictor")))
    m = engine.build_model(path, sparsity_spec=sparsity.SparsitySpec("predictor"), vram_budget_gib=1.0, ctx=32)
    assert m.split is not None
    # The file's ffn_down_t rows, whatever this machine's neuron-major kernel would do (it named that before).
    assert m.describe_plan() == ("plan: cpu backend, FFN predictor, products cpu_ext, attention cpu_ext, split FFN "
                                 "hot xla / cold cpu_ext in pinned_host, down projection rows per neuron, Q8_0 weights "
                                 "repacked eight rows to a group")

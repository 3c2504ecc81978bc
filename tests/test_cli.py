"""Flag behaviour shared by the six CLIs (jaxinfer/cli.py). Each test starts one Python process that imports JAX
once and forks a child per CLI run (as `python -m MODULE ARGS` would run it), so dozens of runs cost seconds."""

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
from importlib.util import find_spec

import pytest
from absl import flags

from jaxinfer import cli, engine, sparsity

CLIS = ("jaxinfer.generate", "jaxinfer.perplexity", "jaxinfer.calibrate", "jaxinfer.profile",
        "jaxinfer.train_predictor", "jaxinfer.server")
TAKES_NO_TEXT_FILE = ("jaxinfer.generate", "jaxinfer.server")  # the others need -f before they would load

DRIVER = r"""
import json, os, runpy, sys, tempfile, traceback
import jax  # once, before the forks, with what the CLIs import (not the CLIs: runpy runs them afresh)
import jaxinfer.engine, jaxinfer.powerinfer, jaxinfer.sparsity, optax

results = []
for module, args in json.loads(sys.argv[1]):
    out, err, key_flags = tempfile.TemporaryFile(), tempfile.TemporaryFile(), tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.argv = [module, *args]
        code = 0
        try:
            if module == "-c":
                exec(args[0], {"__name__": "__main__"})
            elif module.endswith(".py"):  # a script, run as `python SCRIPT ARGS`: its folder first on sys.path
                sys.path.insert(0, os.path.dirname(module))
                runpy.run_path(module, run_name="__main__")
            else:
                runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        if module != "-c":
            from absl import flags
            from importlib.util import find_spec
            # python -m names the flags of __main__ after its file; a script's are named after sys.argv[0]
            main_file = module if module.endswith(".py") else find_spec(module).origin
            helps = {f.name: f.help for f in flags.FLAGS.get_key_flags_for_module(main_file)}
            key_flags.write(json.dumps(helps).encode())
            key_flags.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    for f in (out, err, key_flags):
        f.seek(0)
    results.append({"rc": os.waitstatus_to_exitcode(status), "stdout": out.read().decode(),
                    "stderr": err.read().decode(), "flags": json.loads(key_flags.read() or b"{}")})
print(json.dumps(results))
"""


def run_all(runs):
    """[(module or script path, args)] -> one {rc, stdout, stderr, flags (the module's own flags' help)} per run.
    JAX picks its platform itself, as for a user (no JAX_PLATFORMS), so its probing would show if it leaked."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(runs)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def words(text: str) -> str:
    """absl wraps help text to the terminal: compare word sequences."""
    return " ".join(text.split())


def assert_one_line_error(result, fragment):
    assert result["rc"] == 2 and "Traceback" not in result["stderr"], result["stderr"]
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], result["stderr"]
    assert result["stdout"] == ""


@pytest.mark.slow
def test_help_exits_0_and_shows_every_flags_full_help_and_the_docstring_as_written():
    runs = [(module, [arg]) for module in CLIS for arg in ("--help", "-h", "--helpfull")]
    for (module, (arg,)), result in zip(runs, run_all(runs)):
        assert result["rc"] == 0 and result["stderr"] == "", (module, arg, result["stderr"])
        shown = words(result["stdout"])
        doc = words(ast.get_docstring(ast.parse(pathlib.Path(find_spec(module).origin).read_text()), clean=False))
        assert shown.startswith(doc), (module, arg)  # absl's usage %-formatted it: "50% a" became argv[0]
        assert len(result["flags"]) >= 5
        for name, help_text in result["flags"].items():
            assert words(help_text) in shown, (module, arg, name)
        if arg == "--helpfull":
            assert "--verbosity" in shown  # absl's own flags too
        if module in ("jaxinfer.generate", "jaxinfer.perplexity"):
            assert all(t in words(result["flags"]["down_t_type"]) for t in sparsity.DOWN_T_TYPES)
            assert "--vram_budget" in shown  # adopted from cli.py
    generate = run_all([("jaxinfer.generate", ["--help"])])[0]
    assert words(generate["flags"]["ctx_size"]).endswith("capped at the model's training context")


BAD_FLAGS = [
    ("jaxinfer.generate", ["-c", "0"], "--ctx_size"),
    ("jaxinfer.generate", ["-n", "-2"], "--n_predict"),
    ("jaxinfer.generate", ["-ub", "0"], "--ubatch_size"),
    ("jaxinfer.generate", ["-amb", "nan"], "--attn_max_batch"),
    ("jaxinfer.generate", ["-amb", "-1"], "--attn_max_batch"),
    ("jaxinfer.generate", ["--vram-budget", "inf"], "--vram_budget"),
    ("jaxinfer.generate", ["--vram-budget", "1e30"], "--vram_budget"),
    ("jaxinfer.generate", ["--vram-budget", "nan"], "--vram_budget"),
    ("jaxinfer.generate", ["--vram-budget", "-0.5"], "--vram_budget"),
    ("jaxinfer.generate", ["--seed", str(2**70)], "--seed"),
    ("jaxinfer.generate", ["--seed", "-2"], "--seed"),
    ("jaxinfer.generate", ["--repeat_last_n", str(2**40)], "--repeat_last_n"),
    ("jaxinfer.generate", ["--repeat_last_n", "-1"], "--repeat_last_n"),
    ("jaxinfer.generate", ["--top_k", str(2**40)], "--top_k"),
    ("jaxinfer.generate", ["--temp", "nan"], "--temp"),
    ("jaxinfer.generate", ["--temp", "inf"], "--temp"),
    ("jaxinfer.generate", ["--top_p", "nan"], "--top_p"),
    ("jaxinfer.generate", ["--min_p", "nan"], "--min_p"),
    ("jaxinfer.generate", ["--repeat_penalty", "inf"], "--repeat_penalty"),
    ("jaxinfer.perplexity", ["-c", "4"], "--ctx_size"),
    ("jaxinfer.perplexity", ["-b", "0"], "--batch_size"),
    ("jaxinfer.perplexity", ["--chunks", "-3"], "--chunks"),
    ("jaxinfer.perplexity", ["-amb", "inf"], "--attn_max_batch"),
    ("jaxinfer.perplexity", ["-ub", "-1"], "--ubatch_size"),
    ("jaxinfer.perplexity", ["--vram-budget", "nan"], "--vram_budget"),
    ("jaxinfer.calibrate", ["-c", "0"], "--ctx_size"),
    ("jaxinfer.calibrate", ["--chunks", "0"], "--chunks"),
    ("jaxinfer.calibrate", ["-b", "-1"], "--batch_size"),
    ("jaxinfer.calibrate", ["--levels", "nan"], "--levels"),
    ("jaxinfer.profile", ["-c", "0"], "--ctx_size"),
    ("jaxinfer.profile", ["--chunks", "-5"], "--chunks"),
    ("jaxinfer.profile", ["-b", "0"], "--batch_size"),
    ("jaxinfer.train_predictor", ["-c", "0"], "--ctx_size"),
    ("jaxinfer.train_predictor", ["--learning_rate", "nan"], "--learning_rate"),
    ("jaxinfer.train_predictor", ["--learning_rate", "0"], "--learning_rate"),
    ("jaxinfer.train_predictor", ["--learning_rate", "-1e-3"], "--learning_rate"),
    ("jaxinfer.train_predictor", ["--minibatch", "0"], "--minibatch"),
    ("jaxinfer.train_predictor", ["--steps", "0"], "--steps"),
    ("jaxinfer.train_predictor", ["--budget", "nan"], "--budget"),
    ("jaxinfer.train_predictor", ["--positive_weight", "-1"], "--positive_weight"),
    ("jaxinfer.train_predictor", ["--train_chunks", "0"], "--train_chunks"),
    ("jaxinfer.train_predictor", ["--heldout_chunks", "-1"], "--heldout_chunks"),
    ("jaxinfer.server", ["-c", "0"], "--ctx_size"),
    ("jaxinfer.server", ["--port", "70000"], "--port"),
    ("jaxinfer.server", ["--queue", "0"], "--queue"),
]


@pytest.mark.slow
def test_bad_flag_values_are_one_line_errors_before_anything_loads():
    """No -m: a bad value must be reported before a model would be needed (none is installed for -m's default)."""
    results = run_all([(module, args + ["-f", "/no/such.txt"] * (module not in TAKES_NO_TEXT_FILE))
                       for module, args, _ in BAD_FLAGS])
    for (module, args, fragment), result in zip(BAD_FLAGS, results):
        assert_one_line_error(result, fragment)


@pytest.mark.slow
def test_normal_runs_print_only_the_projects_own_lines(make_model, tmp_path):
    model = make_model(n_ctx=64, sparsity=0.8)
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    # What a library might log while JAX probes platforms, as a CLI's main would meet it after the flags parse.
    probe = ("import logging; from absl import app; from jaxinfer.cli import parse_flags\n"
             "app.run(lambda argv: logging.getLogger('jax._src.xla_bridge').warning("
             "'Unable to initialize backend probe'), flags_parser=parse_flags)")
    results = run_all([
        ("jaxinfer.generate", ["-m", model, "-p", "hello the", "-n", "4", "--temp", "0.7", "-c", "32"]),
        ("jaxinfer.generate", ["-m", model, "-p", "hello the", "-n", "2", "-c", "100000", "--reset-gpu-index",
                               "--activation-dir", str(tmp_path)]),
        ("jaxinfer.generate", ["-m", model, "-p", "hello the " * 40, "-c", "32"]),
        ("jaxinfer.train_predictor", ["-m", model, "-f", str(text), "-c", "32", "--train_chunks", "4",
                                      "--heldout_chunks", "1", "--steps", "30"]),
        ("-c", [probe]),
    ])
    generate, capped, too_long, train, probed = results
    assert generate["rc"] == 0 and generate["stdout"].startswith("hello the"), generate["stderr"]
    lines = [line for line in generate["stderr"].strip().splitlines()
             if line != engine.compile_notice()]  # there while the cache does not hold the programs
    assert len(lines) == 3 and lines[0].startswith("loaded tiny.gguf"), lines
    assert lines[1].startswith("plan: cpu backend"), lines
    assert lines[2].startswith("load "), lines

    assert capped["rc"] == 0, capped["stderr"]
    assert "warning: --reset-gpu-index, --activation-dir ignored without --vram-budget" in capped["stderr"]
    assert "note: -c 100000 exceeds the model's training context; using 64" in capped["stderr"]

    assert too_long["stdout"] == ""  # nothing echoed before the error
    assert too_long["rc"] == 2 and too_long["stderr"].strip().splitlines()[-1].startswith("error: the prompt is")

    assert train["rc"] == 0 and "recall" in train["stdout"], train["stderr"]
    progress = train["stderr"].replace("\r", "\n")
    assert "training: 100%" in progress and "loss=" in progress
    assert probed["rc"] == 0 and probed["stderr"] == ""


@pytest.mark.slow
def test_a_directory_given_for_the_model_is_named_as_one(tmp_path):
    """Before: "model file not found" for a folder that is there."""
    text = tmp_path / "text.txt"
    text.write_text("words " * 50)
    runs = [(module, ["-m", str(tmp_path)] + ["-f", str(text)] * (module not in TAKES_NO_TEXT_FILE)) for module in CLIS]
    for result in run_all(runs + [("jaxinfer.inspect", [str(tmp_path)])]):
        assert_one_line_error(result, f"{tmp_path} is a directory, not a model file: give the path of a .gguf file")


def test_check_range_rejects_non_finite_and_out_of_range_values():
    values = flags.FlagValues()
    flags.DEFINE_float("budget", -1.0, "", flag_values=values)
    flags.DEFINE_integer("count", 1, "", flag_values=values)
    flags.DEFINE_float("rate", 0.1, "", flag_values=values)
    cli.check_range("budget", 0, 10, sentinel=-1, flag_values=values)
    cli.check_range("count", 1, flag_values=values)
    cli.check_range("rate", 0, low_open=True, flag_values=values)
    flags.DEFINE_float("share", 0.0, "", flag_values=values)
    cli.check_range("share", 0, 1, high_open=True, flag_values=values)
    for good in (["--budget=-1"], ["--budget=0"], ["--budget=10"], ["--count=2147483647"], ["--rate=1e-9"],
                 ["--share=0.99"]):
        values.unparse_flags()
        values(["prog", *good])
    bad = {"--budget=nan": "must be -1 or a finite number in [0, 10]", "--budget=inf": "in [0, 10]",
           "--budget=10.5": "in [0, 10]", "--budget=-0.5": "in [0, 10]", "--count=0": "must be in [1, 2147483647]",
           f"--count={2**31}": "in [1, 2147483647]", "--rate=0": "must be a finite number > 0",
           "--rate=inf": "> 0", "--rate=nan": "> 0", "--share=1": "must be a finite number in [0, 1)"}
    for arg, message in bad.items():
        values.unparse_flags()
        with pytest.raises(flags.IllegalFlagValueError, match=re.escape(message)):
            values(["prog", arg])


def test_check_list_takes_numbers_in_range_or_the_words_given():
    values = flags.FlagValues()
    flags.DEFINE_list("lengths", ["128"], "", flag_values=values)
    flags.DEFINE_list("shares", ["0.5"], "", flag_values=values)
    flags.DEFINE_list("limits", ["none"], "", flag_values=values)
    cli.check_list("lengths", 0, empty=True, flag_values=values)
    cli.check_list("shares", 0, 1, low_open=True, high_open=True, number=float, flag_values=values)
    cli.check_list("limits", 0, low_open=True, number=float, words=("none", "default"), flag_values=values)
    for good in (["--lengths=0,512"], ["--lengths="], ["--shares=0.3,0.999"], ["--limits=none,default,0.5"]):
        values.unparse_flags()
        values(["prog", *good])
    bad = {"--lengths=128,abc": "must be comma-separated integers in [0, 2147483647]", "--lengths=-1": "[0, ",
           "--lengths=0.5": "integers", f"--lengths={2**31}": "2147483647]",
           "--shares=": "must be one or more comma-separated finite numbers in (0, 1)", "--shares=1": "(0, 1)",
           "--shares=0": "(0, 1)", "--shares=nan": "(0, 1)", "--limits=inf": "finite numbers > 0 (or none, default)",
           "--limits=0": "> 0", "--limits=all": "(or none, default)"}
    for arg, message in bad.items():
        values.unparse_flags()
        with pytest.raises(flags.IllegalFlagValueError, match=re.escape(message)):
            values(["prog", arg])


def test_context_beyond_training_is_capped_with_a_note(capsys):
    assert cli.capped_context(64, 128) == 64 and capsys.readouterr().err == ""
    assert cli.capped_context(4096, 128) == 128
    assert capsys.readouterr().err == "note: -c 4096 exceeds the model's training context; using 128\n"


def test_windows_per_batch_never_exceeds_the_windows():
    assert cli.windows_per_batch(2048, 512, 10) == 4
    assert cli.windows_per_batch(2**62, 8, 3) == 3  # no padding to 2**59 copies
    assert cli.windows_per_batch(100, 512, 10) == 1

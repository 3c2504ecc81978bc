"""Start-up time of `python -m jaxinfer.generate`: wall time from launching the process to its first generated token,
cold (empty caches) and warm (the same command again), each run in its own process.

    python scripts/bench_startup.py [-m MODEL] [-p PROMPT] [--warm_runs 2] [--json] [-- GENERATE_FLAGS...]

The runs share a fresh cache folder (JAXINFER_CACHE_DIR, removed afterwards) unless --cache_dir names one, so the
first run is cold: XLA's compilation cache and the stored step programs are empty. The time to the first token is
taken here, when the first text after the prompt's echo reaches the pipe, and is set beside generate's own figure
("first token ... after start", counted from when its module started, after Python's own start-up). Flags after
`--` go to generate (e.g. `-- --vram-budget 0.05`).
With --json the last line is one JSON object.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from jaxinfer.cli import check_range, parse_flags
from jaxinfer.errors import JaxinferError, exit_on_error, how_it_ended

flags.DEFINE_string("model", None, "GGUF model (default: generate's, the built-in SmolLM2 Q4_1)", short_name="m")
flags.DEFINE_string("prompt", "Hello", "prompt", short_name="p")
flags.DEFINE_integer("warm_runs", 2, "runs after the cold one")
flags.DEFINE_string("cache_dir", None, "cache folder to use and keep (default: a fresh temporary one)")
flags.DEFINE_bool("json", False, "print a JSON summary as the last line")
check_range("warm_runs", 1)
FLAGS = flags.FLAGS
REPORTED = re.compile(r"first token (\d+\.\d+) s after start")


def run_generate(args: list[str], echo: bytes, cache_dir: str) -> dict:
    """One `generate -n 1` process: seconds to its first generated text on stdout (what follows the `echo` of the
    prompt) and to its exit, and its own figure."""
    env = dict(os.environ, JAXINFER_CACHE_DIR=cache_dir)
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "jaxinfer.generate", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
    text = b""
    while len(text) <= len(echo) and (chunk := os.read(process.stdout.fileno(), 4096)):
        text += chunk
    first_text = time.perf_counter() - started
    _, stderr = process.communicate()
    finished = time.perf_counter() - started
    stderr = stderr.decode(errors="replace")
    if process.returncode != 0 or len(text) <= len(echo):
        last = (stderr.strip().splitlines() or ["no output"])[-1]
        raise JaxinferError(f"generate failed ({how_it_ended(process.returncode)}): {last}")
    reported = REPORTED.search(stderr)
    return {"first_token_s": round(first_text, 3), "exit_s": round(finished, 3),
            "reported_first_token_s": float(reported[1]) if reported else None}


def parse_own_flags(argv: list[str]) -> list[str]:
    """parse_flags on the flags before `--`; those after it go to generate as given (parse_flags would respell
    them, and take a -h among them for this script's)."""
    end = argv.index("--") if "--" in argv else len(argv)
    return parse_flags(argv[:end]) + argv[end + 1:]


@exit_on_error
def main(argv):
    args = ["-p", FLAGS.prompt, "-n", "1", "--temp", "0", *(["-m", FLAGS.model] if FLAGS.model else []), *argv[1:]]
    echo = b"" if "--chat" in args else FLAGS.prompt.encode()  # generate writes the prompt before a completion
    cache_dir = FLAGS.cache_dir or tempfile.mkdtemp(prefix="jaxinfer-startup-")
    try:
        runs = [run_generate(args, echo, cache_dir) for _ in range(1 + FLAGS.warm_runs)]
    finally:
        if not FLAGS.cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    for name, run in zip(["cold"] + [f"warm {i + 1}" for i in range(FLAGS.warm_runs)], runs):
        print(f"{name}: first token after {run['first_token_s']:.2f} s (generate's own figure "
              f"{run['reported_first_token_s']} s), exit after {run['exit_s']:.2f} s")
    if FLAGS.json:
        print(json.dumps({"generate_args": args, "cold": runs[0], "warm": runs[1:],
                          "warm_best_first_token_s": min(run["first_token_s"] for run in runs[1:])}))


if __name__ == "__main__":
    app.run(main, flags_parser=parse_own_flags)

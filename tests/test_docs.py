"""The documentation's commands run as written, so that README.md and docs/ cannot drift from the code.

A fenced block directly after a `<!-- run -->` line is run, page by page and block by block in order, in one scratch
folder per page (so a page's sequence, say calibrate then profile then generate, runs as a reader copies it). The
folder holds `model.gguf` (a tiny synthetic llama: 2 layers, d 64, F32, 512 words), `wiki.test.raw` (the vendored
WikiText-2 head) and `scripts/`; `python` is this interpreter; the caches live in one folder for the whole session.
Options after `run`: `slow` (a real model or a long run: a page's slow blocks run apart from its quick ones, in their
own test marked slow, so they must not need what a quick block made), `server` (started in the background and waited
for on its `--port` until `/health` answers 200, stopped at the end of the page), `exit=N` (the status expected, 0
by default), `timeout=S` (seconds, 300 by default).

Every other command line of a bash block is checked without running it: each `python -m jaxinfer.X` and `python
scripts/X.py` names a program that exists, and each of its flags is one that program's --helpfull lists. Links to
files resolve inside the repository.
"""

import dataclasses
import functools
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from jaxinfer import runtime
from jaxinfer.synthetic import SyntheticSpec, write_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.join("docs", p) for p in os.listdir(os.path.join(ROOT, "docs"))
                               if p.endswith(".md")) if os.path.isdir(os.path.join(ROOT, "docs")) else ["README.md"]
MARKER = re.compile(r"^<!-- run(?P<options>( [a-z]+(=\d+)?)*) -->$")
FENCE = re.compile(r"^```(?P<lang>[a-z]*)$")
PROGRAM = re.compile(r"^python3? (-m (?P<module>jaxinfer\.[a-z_]+)|(?P<script>scripts/[a-z_]+\.py))(?P<args>.*)$")


@dataclasses.dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    run: bool = False
    slow: bool = False
    server: bool = False
    exit: int = 0
    timeout: int = 300

    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """The fenced blocks of `page`, with the options of a `<!-- run ... -->` line right before one."""
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        lines = f.read().split("\n")
    found, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j] == "```"), None)
        assert end is not None, f"{page}:{i + 1}: a fenced block that is never closed"
        block = Block(page, i + 1, fence["lang"], "\n".join(lines[i + 1:end]))
        marker = MARKER.match(lines[i - 1]) if i else None
        if marker:
            block.run = True
            for option in marker["options"].split():
                name, _, value = option.partition("=")
                if name in ("slow", "server"):
                    setattr(block, name, True)
                elif name in ("exit", "timeout") and value:
                    setattr(block, name, int(value))
                else:
                    raise AssertionError(f"{page}:{i}: unknown run option {option!r}")
            assert block.lang in ("bash", "python"), f"{block.where()}: only bash and python blocks run"
        elif i and lines[i - 1].startswith("<!-- run"):
            raise AssertionError(f"{page}:{i}: malformed run marker {lines[i - 1]!r}")
        found.append(block)
        i = end + 1
    return found


def command_lines(text: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comments dropped, split at ;, &&, || and |."""
    joined = re.sub(r"\\\n\s*", " ", text)
    commands = []
    for line in joined.split("\n"):
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        for part in re.split(r"\s*(?:&&|\|\||;|\||&)\s*", line):
            part = re.sub(r"^(\w+=\S+\s+)+", "", part.strip())  # VAR=value before a command
            if part:
                commands.append(part)
    return commands


@functools.cache
def program_flags(program: str) -> frozenset[str]:
    """The flag names (with their dashes, long and short, --no forms) that `program`'s --helpfull lists (absl), or
    its --help (argparse, which has no --helpfull)."""
    argv = ["-m", program] if program.startswith("jaxinfer.") else [os.path.join(ROOT, program)]
    names = set()
    for asked in ("--helpfull", "--help"):
        result = subprocess.run([sys.executable, *argv, asked], capture_output=True, text=True, timeout=120, cwd=ROOT)
        if result.returncode == 0:
            break
    assert result.returncode == 0, f"{program} --help failed: {result.stderr[-2000:]}"
    if asked == "--help":
        names.update(re.findall(r"^\s+(?:-\w, )?(--?[\w-]+)", result.stdout, re.M))
        names.update(re.findall(r"^\s+-\w, (--[\w-]+)", result.stdout, re.M))
    for match in re.finditer(r"^\s+(?:-(\w+),)?--(\[no\])?(\w+):", result.stdout, re.M):
        short, negatable, name = match.groups()
        names.add("--" + name)
        names.add("--" + name.replace("_", "-"))
        if short:
            names.add("-" + short)
        if negatable:
            names.add("--no" + name)
    return frozenset(names)


def documented_programs() -> list[tuple[Block, str, str, list[str]]]:
    """Every (block, program, command, flags) of a jaxinfer CLI or a script in the pages' bash blocks."""
    found = []
    for page in PAGES:
        for block in blocks(page):
            if block.lang != "bash":
                continue
            for command in command_lines(block.text):
                match = PROGRAM.match(command)
                if not match:
                    continue
                program = match["module"] or match["script"]
                args = shlex.split(match["args"])
                found.append((block, program, command, [a.split("=")[0] for a in args if re.match(r"^--?[a-zA-Z]", a)]))
    return found


@pytest.mark.slow
def test_every_documented_program_and_flag_exists():
    missing = []
    for block, program, command, used in documented_programs():
        if program.startswith("jaxinfer."):
            exists = os.path.isfile(os.path.join(ROOT, *program.split(".")) + ".py")
        else:
            exists = os.path.isfile(os.path.join(ROOT, program))
        if not exists:
            missing.append(f"{block.where()}: no program {program}")
            continue
        unknown = [flag for flag in used if flag not in program_flags(program)]
        if unknown:
            missing.append(f"{block.where()}: {program} has no {', '.join(unknown)} ({command})")
    assert not missing, "\n".join(missing)


def test_links_resolve_inside_the_repository():
    broken = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
                continue
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), target))
            if not path.startswith(ROOT + os.sep) or not os.path.exists(path):
                broken.append(f"{page}: {target}")
    assert not broken, "\n".join(broken)


def test_the_docs_describe_the_product_not_its_history():
    # Words apart by any white space: a phrase wrapped over two lines counts too.
    history = re.compile(r"\b(session|sessions)\s+\d+|\bissue\s+\d+|\bissue\s+titled|tried\s+and\s+dropped|"
                         r"\basked\s+for\b|shared/notes|\.\./shared", re.I)
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            text = f.read()
        for match in history.finditer(text):
            found.append(f"{page}:{text.count(chr(10), 0, match.start()) + 1}: {' '.join(match.group().split())}")
    assert not found, "\n".join(found)


def test_readme_is_a_short_guide():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert len(f.readlines()) <= 320


def _run_pages():
    """(page, slow) for each page with runnable blocks: its quick blocks, and apart its slow ones. All are marked
    slow for pytest (a CLI run costs seconds: the pages' runs take about two minutes together)."""
    params = []
    for page in PAGES:
        runnable = [b for b in blocks(page) if b.run]
        if any(not b.slow for b in runnable):
            params.append(pytest.param(page, False, id=page, marks=pytest.mark.slow))
        if any(b.slow for b in runnable):
            params.append(pytest.param(page, True, id=f"{page}-slow", marks=pytest.mark.slow))
    return params


@pytest.fixture(scope="session")
def docs_cache(tmp_path_factory):
    """One cache folder for every page's commands: derived files are made fresh for its models, while compiled
    programs (`xla/`, `programs/`, keyed on all they depend on) are the suite's own cache's, so a page's commands
    need not compile again what the suite already has."""
    cache = tmp_path_factory.mktemp("docs-cache")
    for kind in ("xla", "programs"):
        shared = os.path.join(runtime.CACHE_DIR, kind)
        os.makedirs(shared, exist_ok=True)
        os.symlink(shared, cache / kind)
    return str(cache)


@pytest.mark.parametrize("page, slow", _run_pages())
def test_documented_commands_run(page, slow, tmp_path, docs_cache):
    os.symlink(os.path.join(ROOT, "scripts"), tmp_path / "scripts")
    shutil.copy(os.path.join(ROOT, "tests", "data", "wiki.test.head.raw"), tmp_path / "wiki.test.raw")
    write_model(str(tmp_path / "model.gguf"), SyntheticSpec(n_vocab=512))  # 512 words: --tp 2 cuts them
    env = dict(os.environ, JAXINFER_CACHE_DIR=docs_cache, PYTHONUNBUFFERED="1",
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    servers = []
    try:
        for block in (b for b in blocks(page) if b.run and b.slow == slow):
            if block.lang == "python":
                argv = [sys.executable, "-c", block.text]
            else:
                argv = ["bash", "-euo", "pipefail", "-c", block.text]
            if block.server:
                servers.append(_start_server(block, argv, tmp_path, env))
                continue
            try:
                result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                                        timeout=block.timeout, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{block.where()}: still running after {block.timeout} s:\n{block.text}")
            assert result.returncode == block.exit, (
                f"{block.where()}: exit status {result.returncode}, expected {block.exit}:\n{block.text}\n"
                f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}")
    finally:
        for process in servers:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _start_server(block: Block, argv: list[str], cwd, env) -> subprocess.Popen:
    """Start a `server` block in its own process group and wait until its /health answers 200."""
    port = re.search(r"--port[ =](\d+)", block.text)
    assert port, f"{block.where()}: a server block names its --port"
    log = open(os.path.join(cwd, f"server-{block.line}.log"), "w")
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + block.timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.close()
            with open(log.name) as f:
                pytest.fail(f"{block.where()}: the server exited with status {process.returncode}:\n{f.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port[1]}/health", timeout=2) as response:
                if response.status == 200:
                    return process
        except OSError:
            pass
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    pytest.fail(f"{block.where()}: the server did not answer /health within {block.timeout} s")

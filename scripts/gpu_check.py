"""The one command to run on a GPU machine: build, test and measure jaxinfer there, each step bounded in time.

    python3 scripts/gpu_check.py --out DIR [--work DIR] [--wheels DIR] [--n_layer 8] [--budget_s 420] [--only STEPS]
    python scripts/gpu_check.py --dry-run --out DIR      # the same steps on this machine's CPU, tiny models

Steps, in order (the models are made in the background while the tests run):
    env        versions, devices and their memory kinds, nvidia-smi
    wheels     pip install --no-index --target DIR/site of the wheels in --wheels (what the GPU image lacks: gguf)
    cpu_ext    cmake configure and build of cpu_ext into cpu_ext/build (dry run: configure only, in DIR)
    tests      the GPU-relevant tests, Pallas compiled (dry run: collected only)
    models     make_sparse_model.py: a model of the default model's shape and format (SmolLM2-135M, Q4_1, random
               weights: decode speed depends on shapes and formats, not values) and a 7B-shaped 90%-sparse
               PowerInfer file of --n_layer layers with its dense twin
    default    bench_generate: pp512 and tg128 of the default-shaped model
    sparse     bench_sparse: dense and predictor decode of the 7B-shaped file, against the bytes each reads
    pp512      bench_generate: pp512 and tg of the 7B-shaped dense twin
    hybrid     bench_hybrid: the one-program hot/cold split at a budget worth 13 of 32 layers' FFNs, against whole
               layers on the device (llama.cpp's -ngl) and everything on the device
    moe        bench_hybrid on a mixture of Qwen3-30B-A3B's width (128 experts of 768, top-8, Q4_0, 2 layers,
               made in the background too): whole experts placed by routing at half the expert bytes, against
               llama.cpp's --n-cpu-moe rule, every expert on the host, and everything on the device
    xla_dump   XLA's optimized programs of the dense twin's prompt and decode steps, the largest in
               OUT/xla_dump.tar.gz: where the time goes

Everything a step prints goes to DIR/gpu_check.log; DIR/summary.json holds each step's status (ok, failed, timeout,
skipped), seconds and the JSON its script printed last, rewritten after every step so that a run stopped midway still
says how far it got. A step that fails does not stop the others unless they need what it makes. The exit status is 0
when every step is ok. No step downloads anything: the GPU machine reaches no network.
"""

import argparse
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
GPU_TESTS = ["tests/test_pallas_sparse_ffn.py", "tests/test_pallas_attention.py", "tests/test_jax_compat.py",
             "tests/test_hybrid.py", "tests/test_model.py", "tests/test_sparse_ffn.py", "tests/test_attention.py",
             "tests/test_architectures.py", "tests/test_moe.py"]
DEFAULT_SHAPE = ["--n_embd", "576", "--n_ff", "1536", "--n_head", "9", "--n_head_kv", "3", "--n_layer", "30",
                 "--n_vocab", "49152", "--weight_type", "Q4_1", "--sparsity", "0"]
TINY_DEFAULT_SHAPE = ["--shape", "tiny", "--n_layer", "2", "--weight_type", "Q4_1", "--sparsity", "0"]
MEASUREMENTS = ("default", "sparse", "pp512", "hybrid", "moe", "xla_dump")
CHOSEN = ("tests", *MEASUREMENTS)  # what --only picks from; the set-up steps always run
HYBRID_SHARE = 13 / 32  # llama.cpp's -ngl 13 of a 32-layer 7B model, as a share of the FFN bytes
MOE_SHAPE = ["--architecture", "qwen3moe", "--n_embd", "2048", "--n_ff", "768", "--n_head", "32", "--n_head_kv", "4",
             "--head_dim", "128", "--n_expert", "128", "--n_expert_used", "8", "--n_vocab", "32000", "--n_layer", "2",
             "--weight_type", "Q4_0", "--sparsity", "0"]
TINY_MOE_SHAPE = ["--architecture", "qwen3moe", "--n_embd", "64", "--n_ff", "32", "--n_head", "4", "--n_head_kv", "2",
                  "--head_dim", "32", "--n_expert", "8", "--n_expert_used", "2", "--n_vocab", "256", "--n_layer", "2",
                  "--weight_type", "Q4_0", "--sparsity", "0"]

ENV_PROBE = """
import json, jax
devices = jax.devices()
print(json.dumps({"python": __import__("sys").version.split()[0], "jax": jax.__version__,
                  "jaxlib": __import__("jaxlib").__version__, "backend": jax.default_backend(),
                  "devices": [str(d) for d in devices], "device_kind": devices[0].device_kind,
                  "memory_kinds": [m.kind for m in devices[0].addressable_memories()]}))
"""


class Run:
    """The steps' log and summary under `out`, and the time left of the budget."""

    def __init__(self, out: Path, budget_s: float, dry_run: bool, only: set[str] | None):
        self.out, self.dry_run, self.only, self.deadline = out, dry_run, only, time.monotonic() + budget_s
        self.log = open(out / "gpu_check.log", "a", buffering=1)
        self.summary = {"dry_run": dry_run, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": {}}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, name: str, result: dict) -> dict:
        self.summary["steps"][name] = result
        (self.out / "summary.json.tmp").write_text(json.dumps(self.summary, indent=1))
        os.replace(self.out / "summary.json.tmp", self.out / "summary.json")
        line = f"== {name}: {result['status']} ({result.get('seconds', 0):.1f} s) {result.get('reason', '')}"
        print(line, flush=True)
        self.log.write(line + "\n")
        return result

    def skip(self, name: str, reason: str) -> dict:
        return self.record(name, {"status": "skipped", "reason": reason})

    def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        self.log.write(f"\n== {name}: {' '.join(argv)}\n")
        return subprocess.Popen(argv, cwd=REPO, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")

    def finish(self, name: str, process: subprocess.Popen, timeout: float, began: float) -> dict:
        """Wait for `process` at most `timeout` seconds (and never past the budget), log its output, record it."""
        try:
            output, _ = process.communicate(timeout=max(1.0, min(timeout, self.left())))
            status = "ok" if process.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGINT)  # pytest then still prints what failed so far
            try:
                output, _ = process.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                output, _ = process.communicate()
            status = "timeout"
        self.log.write(output)
        result = {"status": status, "seconds": round(time.monotonic() - began, 1), "returncode": process.returncode}
        lines = [line for line in output.splitlines() if line.strip()]
        if lines and lines[-1].startswith("{"):
            try:
                result["json"] = json.loads(lines[-1])
            except json.JSONDecodeError:
                pass
        if status != "ok":
            result["tail"] = lines[-12:]
        return self.record(name, result)

    def wanted(self, name: str) -> bool:
        return self.only is None or name not in CHOSEN or name in self.only

    def step(self, name: str, argv: list[str], timeout: float, env: dict | None = None) -> dict:
        if not self.wanted(name):
            return self.skip(name, "not in --only")
        if self.left() < 5:
            return self.skip(name, "the time budget is spent")
        return self.finish(name, self.start(name, argv, env), timeout, time.monotonic())


def python(script: str, *args: str) -> list[str]:
    return [sys.executable, str(SCRIPTS / script), *args]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for gpu_check.log, summary.json and the models made")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with tiny models")
    parser.add_argument("--wheels", help="folder of wheels to install first (--no-index, into OUT/site)")
    parser.add_argument("--work", help="where the wheels are installed and the models made (default: OUT; on the GPU "
                        "machine a folder outside $OUT, whose files all travel back)")
    parser.add_argument("--n_layer", type=int, default=8, help="layers of the 7B-shaped files (default 8)")
    parser.add_argument("--only", help=f"comma-separated steps to run of {', '.join(CHOSEN)} (the set-up steps always "
                        "run; the models are made for the measurements among them)")
    parser.add_argument("--budget_s", type=float, default=420, help="seconds for the whole run (default 420)")
    args = parser.parse_args(argv)
    if args.n_layer < 1:
        parser.error(f"--n_layer must be >= 1, got {args.n_layer}")
    if not 0 < args.budget_s < math.inf:
        parser.error(f"--budget_s must be a finite number > 0, got {args.budget_s}")
    only = set(args.only.split(",")) if args.only else None
    if only and only - set(CHOSEN):
        parser.error(f"--only: unknown steps {', '.join(sorted(only - set(CHOSEN)))}; they are {', '.join(CHOSEN)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.budget_s, args.dry_run, only)
    work = Path(args.work or out)
    models = work / "models"
    models.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        run.env |= {"JAX_PLATFORMS": "cpu"}

    if args.wheels:
        site = work / "site"
        wheels = sorted(str(p) for p in Path(args.wheels).glob("*.whl"))
        result = run.step("wheels", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                     "--no-compile", "--target", str(site), *wheels], 120)
        if result["status"] == "ok":
            run.env["PYTHONPATH"] += os.pathsep + str(site)
    else:
        run.skip("wheels", "no --wheels")
    # The models are made on the CPU while the set-up and the tests run.
    name = "sparse-tiny-0.9" if run.dry_run else f"sparse-7b-{args.n_layer}l-0.9"
    default_model, sparse_model, twin = (models / "default-shape-Q4_1.gguf", models / f"{name}.gguf",
                                         models / f"{name}.dense.gguf")
    shape = ["--shape", "tiny"] if run.dry_run else ["--shape", "7b", "--n_layer", str(args.n_layer)]
    make = " && ".join(shlex.join(command) for command in (
        python("make_sparse_model.py", *(TINY_DEFAULT_SHAPE if run.dry_run else DEFAULT_SHAPE), "-o", str(default_model)),
        python("make_sparse_model.py", *shape, "--weight_type", "Q4_0", "--sparsity", "0.9", "-o", str(sparse_model)),
        python("make_sparse_model.py", "--dense_twin", str(sparse_model), "-o", str(twin))))
    made_since = time.monotonic()
    maker = run.start("models", ["bash", "-c", make]) if any(run.wanted(m) for m in MEASUREMENTS) else None
    mixture = models / ("moe-tiny.gguf" if run.dry_run else "moe-qwen3-30b-width-2l.gguf")
    moe_maker = (run.start("moe_model", python("make_sparse_model.py", *(TINY_MOE_SHAPE if run.dry_run else MOE_SHAPE),
                                               "-o", str(mixture)))
                 if run.wanted("moe") else None)

    run.step("env", [sys.executable, "-c", ENV_PROBE], 60)
    if run.dry_run:
        run.record("nvidia-smi", {"status": "skipped", "reason": "dry run"})
    elif shutil.which("nvidia-smi"):
        run.step("nvidia-smi", ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                                "--format=csv,noheader"], 30)

    build = work / "cpu_ext_build" if run.dry_run else REPO / "cpu_ext" / "build"
    if not shutil.which("cmake"):
        run.skip("cpu_ext", "no cmake on PATH")
    else:
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        configure = ["cmake", "-S", str(REPO / "cpu_ext"), "-B", str(build), *generator,
                     f"-DPython3_EXECUTABLE={sys.executable}"]
        if run.dry_run:
            run.step("cpu_ext", configure, 120)
        else:
            run.step("cpu_ext", ["bash", "-c", f"{' '.join(configure)} && cmake --build {build} -j {os.cpu_count()}"],
                     180)

    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short", *GPU_TESTS]
    if run.dry_run:
        tests.append("--collect-only")
    else:
        if importlib.util.find_spec("pytest_timeout"):
            tests += ["--timeout", "90"]
        if importlib.util.find_spec("xdist"):
            tests += ["-n", "6"]
    # tests/conftest.py picks the CPU unless JAX_PLATFORMS says otherwise; the tests start CLIs beside themselves, so
    # no process may take three quarters of the GPU's memory up front.
    gpu_env = {} if run.dry_run else {"JAX_PLATFORMS": "cuda,cpu", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    run.step("tests", tests, 150, env=run.env | gpu_env)
    if maker is None:
        run.skip("models", "no measurement asked for")
        return report(run)
    if run.finish("models", maker, 240, made_since)["status"] != "ok":
        for name in MEASUREMENTS:
            run.skip(name, "no models")
        return report(run)
    moe_made = moe_maker is not None and run.finish("moe_model", moe_maker, 240, made_since)["status"] == "ok"

    small = run.dry_run
    run.step("default", python("bench_generate.py", "-m", str(default_model), "--pp", "16" if small else "512",
                               "--tg", "8" if small else "128", "--repetitions", "1" if small else "3", "--json"), 150)
    run.step("sparse", python("bench_sparse.py", "--levels", "0.9", "--sparse_files", str(sparse_model),
                              "--tg", "8" if small else "64", "--pp", "16" if small else "512",
                              "--repetitions", "1" if small else "3", "--json"), 180)
    run.step("pp512", python("bench_generate.py", "-m", str(twin), "--pp", "16" if small else "512",
                             "--tg", "8" if small else "32", "--repetitions", "1" if small else "2", "--json"), 150)
    text = work / "profile.txt"
    text.write_text((REPO / "tests" / "data" / "wiki.test.head.raw").read_text()[:4000 if small else 20000])
    run.step("hybrid", python("bench_hybrid.py", "-m", str(sparse_model), "-f", str(text),
                              "--ffn_share", f"{HYBRID_SHARE:.4f}", "-n", "4" if small else "32", "--json"), 180)
    if run.wanted("moe") and not moe_made:
        run.skip("moe", "no mixture made")
    else:
        run.step("moe", python("bench_hybrid.py", "-m", str(mixture), "-f", str(text), "--ffn_share", "0.5",
                               "-n", "4" if small else "32", "--json"), 180)
    dump, cache = work / "xla_dump", work / "xla_dump_cache"  # a cache of its own: XLA dumps what it compiles
    for folder in (dump, cache):
        shutil.rmtree(folder, ignore_errors=True)
    result = run.step("xla_dump", python("bench_generate.py", "-m", str(twin), "--pp", "16", "--tg", "4",
                                         "--repetitions", "1", "--json"), 120,
                      env=run.env | {"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text",
                                     "JAXINFER_CACHE_DIR": str(cache)})
    if result["status"] == "ok":
        largest = sorted(dump.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)[-8:]
        with tarfile.open(out / "xla_dump.tar.gz", "w:gz") as tar:
            for path in largest:
                tar.add(path, arcname=path.name)
    return report(run)


def report(run: Run) -> int:
    steps = run.summary["steps"]
    bad = {name: r["status"] for name, r in steps.items() if r["status"] not in ("ok", "skipped")}
    print(f"gpu_check: {len(steps) - len(bad)} of {len(steps)} steps ok or skipped"
          + (f"; not ok: {', '.join(f'{n} ({s})' for n, s in bad.items())}" if bad else "")
          + f"; summary in {run.out / 'summary.json'}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

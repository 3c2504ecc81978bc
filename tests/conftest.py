import gc
import os
import signal

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Where the tests run on a GPU (JAX_PLATFORMS=cuda,cpu: scripts/gpu_check.py), XLA and Pallas multiply f32 operands
# on TF32 tensor cores by default (10-bit mantissas, ~1e-3 relative); the tests check the logic against f32
# references, so they multiply in full f32 there, as do the CLIs they start.
if any(platform in os.environ["JAX_PLATFORMS"] for platform in ("cuda", "gpu")):
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

# A shell starts a background job (`pytest ... &`) with SIGINT ignored, and an ignored signal stays ignored across
# exec: the CLIs the tests start would never see the Ctrl-C the tests send them. A handler instead is reset to the
# default in a child, where Python installs its KeyboardInterrupt.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# pytest-xdist's workers each run XLA with a thread pool of one thread per CPU it may use, and so do the CLIs they
# start: with two workers on two cores that is twice the threads there are cores, and XLA's idle threads spin. Each
# worker (and what it starts) gets its own share of the CPUs instead: on 2 cores, -n 2, three modules took 87-91 s
# instead of 108-117 s with a sixth less CPU time, the whole suite 734 s instead of 893.
_worker, _workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
if _worker and _workers and hasattr(os, "sched_setaffinity"):
    _cpus = sorted(os.sched_getaffinity(0))
    _index = int(_worker.removeprefix("gw"))
    try:
        os.sched_setaffinity(0, set(_cpus[_index::int(_workers)]) or {_cpus[_index % len(_cpus)]})
    except OSError:  # a sandbox that does not let a process choose its CPUs: the tests run as they would without
        pass

import jax  # noqa: E402
import pytest  # noqa: E402

from jaxinfer import runtime  # noqa: E402
from jaxinfer.synthetic import SyntheticSpec, write_model  # noqa: E402

runtime.enable_compilation_cache()


def pytest_generate_tests(metafunc):
    """A test taking `isa` runs once with each cpu_ext kernel set this CPU runs (tests of the kernels)."""
    if "isa" in metafunc.fixturenames:
        import cpu_ext  # here: only the kernels' tests need the library

        isas = []
        for isa in ("scalar", "avx2", "avx512"):
            try:
                cpu_ext.select_isa(isa)
                isas.append(isa)
            except ValueError:
                pass
        cpu_ext.select_isa("best")
        metafunc.parametrize("isa", isas, indirect=True)


@pytest.fixture
def isa(request):
    """The kernel set the test runs with (pytest_generate_tests), selected for it; the best one again after."""
    import cpu_ext

    cpu_ext.select_isa(request.param)
    yield request.param
    cpu_ext.select_isa("best")


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Each module's compiled programs are let go after it: they pile up over a module's shapes and types (the kernel
    tests' eager calls: +2.3 GB in tests/test_cpu_ext.py), and the persistent compilation cache serves the few that
    a later module compiles again."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def make_model(tmp_path):
    """make_model(**spec_fields) -> path of a freshly written synthetic GGUF model."""

    def make(name="tiny.gguf", **fields):
        return write_model(str(tmp_path / name), SyntheticSpec(**fields))

    return make


@pytest.fixture(scope="session")
def default_model():
    """The real default model (SmolLM2-135M-Instruct Q4_1), installed by the README's install command."""
    from jaxinfer import engine

    return engine.load_model(engine.default_model_path())


@pytest.fixture(scope="session")
def default_model_exact():
    """The default model computing with its Q4_1 weights dequantized to f32: llama.cpp's F32 reference rows."""
    from jaxinfer import engine

    return engine.load_model(engine.default_model_path(), exact=True)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices {jax.devices()}"

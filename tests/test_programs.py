"""Step programs stored across runs (programs.py): a later process loads them instead of tracing and lowering the
steps again, generates the same tokens, and rebuilds a stored program that is corrupt, stale or unusable."""

import hashlib
import os
import pickle
import shutil

import jax
import pytest

from jaxinfer import engine, programs, runtime
from jaxinfer.sampling import SamplingParams

PROMPT = "hello the"


@pytest.fixture
def program_dir(tmp_path, monkeypatch):
    """A fresh folder of stored programs, and no programs held by this process: each build starts as a new run's."""
    monkeypatch.setattr(runtime, "CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(programs, "_built", {})
    return tmp_path / "cache" / "programs"


def new_process(monkeypatch):
    """Forget the programs this process built, as a new run starts without them."""
    monkeypatch.setattr(programs, "_built", {})


def greedy(m) -> list[int]:
    return list(engine.generate_tokens(m, m.tokenizer.encode(PROMPT), 6, 64, SamplingParams(temperature=0), seed=0))


def without_stored_programs(m) -> list[int]:
    """The tokens of the steps compiled as plain jits (programs are stored only with the persistent cache on)."""
    directory = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        return greedy(m)
    finally:
        jax.config.update("jax_compilation_cache_dir", directory)


def forbid_export(monkeypatch):
    """From here on a step that is not loaded from its stored program fails the test (pytest.fail is no Exception,
    so no fallback catches it)."""
    monkeypatch.setattr(programs, "_export", lambda *args: pytest.fail("a step was traced again, not loaded"))


def stored(program_dir) -> list:
    return sorted(program_dir.glob("*.program"))


@pytest.mark.slow
def test_a_new_run_loads_the_stored_programs_and_generates_the_same_tokens(make_model, program_dir, monkeypatch):
    m = engine.load_model(make_model())
    expected = without_stored_programs(m)
    assert not program_dir.exists()
    assert greedy(m) == expected
    assert len(stored(program_dir)) == 2  # prefill and decode
    new_process(monkeypatch)
    forbid_export(monkeypatch)
    assert greedy(m) == expected


@pytest.mark.slow
def test_a_corrupt_stale_or_unloadable_program_is_rebuilt(make_model, program_dir, monkeypatch):
    m = engine.load_model(make_model())
    expected = greedy(m)
    first, second = stored(program_dir)
    intact = {first: first.read_bytes(), second: second.read_bytes()}

    def unloadable(path):  # whole and of the right key, but what it holds is no program
        body = pickle.loads(intact[path][len(programs.FORMAT) + programs.DIGEST_BYTES:])
        body = pickle.dumps(dict(body, program=b"not a program"))
        path.write_bytes(programs.FORMAT + hashlib.sha256(body).digest() + body)

    damages = {"partial": lambda path: path.write_bytes(intact[path][:1000]),
               "stale": lambda path: path.write_bytes(intact[second if path == first else first]),  # another key's
               "unloadable": unloadable}
    for name, damage in damages.items():
        for path in (first, second):
            damage(path)
        new_process(monkeypatch)
        assert greedy(m) == expected, name
        with monkeypatch.context() as patched:  # rebuilt and stored again, whole: the next run loads them
            new_process(patched)
            forbid_export(patched)
            assert greedy(m) == expected, name
        assert stored(program_dir) == [first, second], name


def test_a_cache_folder_that_cannot_be_written_costs_only_time(make_model, tmp_path, monkeypatch):
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setattr(runtime, "CACHE_DIR", str(blocked))
    monkeypatch.setattr(programs, "_built", {})
    m = engine.load_model(make_model())
    assert greedy(m) == without_stored_programs(m)
    assert not os.path.isdir(blocked)


def test_a_step_that_cannot_be_exported_still_runs(make_model, program_dir, monkeypatch):
    def unsupported(*args):
        raise NotImplementedError("a custom call jax.export does not take")

    m = engine.load_model(make_model())
    expected = without_stored_programs(m)
    monkeypatch.setattr(programs, "_export", unsupported)
    assert greedy(m) == expected
    assert not stored(program_dir)


def test_programs_built_at_once_are_those_each_build_then_finds(program_dir):
    """build_at_once compiles on several threads: each program is the one compile_step then returns without building
    it again, computes its step, and a build that fails raises its error."""

    @jax.jit
    def step(x, scale):
        return x * scale + 1.0

    shapes = [(3,), (4, 5), (7,)]
    args = [(jax.numpy.ones(shape), jax.numpy.float32(2.0)) for shape in shapes]
    built = programs.build_at_once([lambda a=a: programs.compile_step(step, *a) for a in args])
    assert [b.origin for b in built] == ["exported"] * len(shapes)
    for a, program in zip(args, built):
        assert programs.compile_step(step, *a) is program
        assert (program(*a) == 3.0).all() and program(*a).shape == a[0].shape

    def fails():
        raise ValueError("no such build")

    with pytest.raises(ValueError, match="no such build"):
        programs.build_at_once([lambda: built, fails])


def test_the_sources_digest_is_their_names_and_contents_not_where_they_are(tmp_path):
    """The same packages in another checkout (or environment) share stored programs; a changed source does not."""
    files = programs._source_files()
    assert {"jaxinfer/programs.py", "jaxinfer/model.py", "cpu_ext/__init__.py"} <= {name for name, _ in files}
    copies = []
    for name, path in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, tmp_path / name)
        copies.append((name, str(tmp_path / name)))
    assert programs._digest(copies) == programs._source_digest()
    with open(tmp_path / "jaxinfer" / "model.py", "a") as f:
        f.write("\n")
    assert programs._digest(copies) != programs._source_digest()

"""The loader under fuzzing (scripts/fuzz_gguf.py): hundreds of corrupt variants of tiny synthetic models, each
either refused with a one-line JaxinferError or run with finite logits; never a traceback, crash, hang, memory
blow-up or a run on NaN logits. Cases run in worker subprocesses under a memory limit and a timeout, so a failing
case fails this test, not the test run."""

import collections
import importlib.util
import pathlib

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "fuzz_gguf.py"
CASES = 400
SEED = 7


@pytest.fixture(scope="module")
def fuzz():
    spec = importlib.util.spec_from_file_location("fuzz_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bases(fuzz, tmp_path_factory):
    return fuzz.build_bases(str(tmp_path_factory.mktemp("bases")))


@pytest.mark.slow
def test_every_corrupt_file_is_refused_cleanly_or_runs_finite(fuzz):
    results = fuzz.run_campaign(CASES, SEED, workers=2, timeout=120)
    assert [r["case"] for r in results] == list(range(CASES))
    failures = [r for r in results if r["outcome"] not in ("error", "ok")]
    assert not failures, "\n".join(f"{r['outcome']}: case {r['case']} {r.get('base')} {r.get('description')}: "
                                   f"{r['message']}" for r in failures[:20])
    counts = fuzz.summarize(results)
    assert counts["error"] > CASES // 2 and counts["ok"] > 10, counts  # both paths are exercised
    mutations = {r["mutation"] for r in results}
    assert mutations == set(fuzz.MUTATIONS), set(fuzz.MUTATIONS) - mutations
    assert {r["base"] for r in results} == set(fuzz.VARIANTS)
    refused_nan = [r for r in results if r["mutation"] == "nonfinite_weights" and "NaN or infinite" in r["message"]]
    assert refused_nan, "no NaN/inf weights reached the logits check"


def test_cases_are_reproducible_and_aimed_at_fields(fuzz, bases):
    first = [fuzz.make_case(bases, SEED, i) for i in range(200)]
    assert first == [fuzz.make_case(bases, SEED, i) for i in range(200)]
    assert len({data for _, _, data, _ in first}) > 150
    kinds = collections.Counter(kind for _, kind, _, _ in first)
    assert set(kinds) == set(fuzz.MUTATIONS)


def test_rebuilt_metadata_keeps_the_tensors(fuzz, bases, tmp_path):
    """A metadata value replaced (a longer string) shifts the data; the file still loads with the same tensors."""
    from gguf import GGUFValueType

    from jaxinfer.gguf_io import open_gguf

    base = bases["llama_f32"]
    original, renamed = tmp_path / "original.gguf", tmp_path / "renamed.gguf"
    original.write_bytes(base.data)
    renamed.write_bytes(fuzz.rebuild(base, {"general.name": fuzz.encode_field("general.name", GGUFValueType.STRING,
                                                                              "x" * 77)}))
    before, after = open_gguf(str(original)), open_gguf(str(renamed))
    assert after.metadata["general.name"] == "x" * 77
    for name, t in before.tensors.items():
        assert bytes(after.tensors[name].data) == bytes(t.data)


@pytest.mark.slow
def test_a_stuck_case_is_blamed_and_the_rest_still_run(fuzz, bases):
    """A case past the timeout is reported as a hang; its worker is replaced and the cases after it run."""
    slow = next(i for i in range(100) if fuzz.make_case(bases, SEED, i)[1] == "nonfinite_weights")
    results = fuzz.run_campaign(3, SEED, workers=1, timeout=0.0, start=slow)
    assert results[0]["outcome"] == "hang" and [r["case"] for r in results] == [slow, slow + 1, slow + 2]

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxinfer import activation_profile, engine, placement, runtime, sidecar, sparsity
from jaxinfer.errors import JaxinferError


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_atomic_write_gives_the_usual_permissions(tmp_path, umask_022):
    path = tmp_path / "derived.json"
    sidecar.atomic_write(str(path), lambda tmp: open(tmp, "w").write("{}"))
    assert os.stat(path).st_mode & 0o777 == 0o644  # as open() makes it, not tempfile's 0600
    with sidecar.atomic_directory(str(tmp_path / "folder")) as tmp:
        open(os.path.join(tmp, "a"), "w").close()
    assert os.stat(tmp_path / "folder").st_mode & 0o777 == 0o755


def test_concurrent_writes_of_one_target_use_their_own_temps(tmp_path):
    path = str(tmp_path / "base.kld")
    with sidecar.atomic_output(path) as first, sidecar.atomic_output(path) as second:
        assert first != second and os.path.dirname(first) == str(tmp_path)
        open(first, "w").write("first")
        open(second, "w").write("second")
    assert open(path).read() == "first"  # the outer write finished last
    assert os.listdir(tmp_path) == ["base.kld"]


def a_dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_stale_temps_of_the_target_are_removed_after_a_successful_write(tmp_path):
    host = sidecar._host()
    names = {
        "killed": f"t.json.{host}-{a_dead_pid()}-0123abcd.tmp",  # made here by a process that is gone
        "old": "t.json.k3j_9xyz.tmp",  # tempfile's naming of older versions, not touched for two days
        "live": f"t.json.{host}-{os.getpid()}-0123abcd.tmp",  # a writer still running
        "elsewhere": f"t.json.otherhost-{a_dead_pid()}-0123abcd.tmp",  # another host's pid means nothing here
        "other target": f"u.json.{host}-{a_dead_pid()}-0123abcd.tmp",
        "killed folder": f"t.json.{host}-{a_dead_pid()}-4567abcd.tmp",
    }
    for key, name in names.items():
        if key == "killed folder":
            os.mkdir(tmp_path / name)
            open(tmp_path / name / "activation_0.pt", "w").close()
        else:
            open(tmp_path / name, "w").close()
    two_days_ago = time.time() - 2 * 24 * 3600
    os.utime(tmp_path / names["old"], (two_days_ago, two_days_ago))
    sidecar.write_json(str(tmp_path / "t.json"), __file__, {})
    left = set(os.listdir(tmp_path))
    assert left == {"t.json", names["live"], names["elsewhere"], names["other target"]}


def test_a_failed_write_leaves_the_target_and_no_temp(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("old")

    def fail(tmp):
        open(tmp, "w").write("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        sidecar.atomic_write(str(path), fail)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["t.json"]


def test_atomic_directory_replaces_the_folder_as_one_unit(tmp_path):
    folder = tmp_path / "activation"
    folder.mkdir()
    (folder / "activation_0.pt").write_text("old 0")
    (folder / "activation_1.pt").write_text("old 1")
    with pytest.raises(RuntimeError):
        with sidecar.atomic_directory(str(folder)) as tmp:
            open(os.path.join(tmp, "activation_0.pt"), "w").write("new 0")
            raise RuntimeError("killed before layer 1")
    assert sorted(os.listdir(tmp_path)) == ["activation"]
    assert (folder / "activation_0.pt").read_text() == "old 0"
    with sidecar.atomic_directory(str(folder)) as tmp:
        open(os.path.join(tmp, "activation_0.pt"), "w").write("new 0")
    assert sorted(os.listdir(tmp_path)) == ["activation"] and os.listdir(folder) == ["activation_0.pt"]
    assert (folder / "activation_0.pt").read_text() == "new 0"
    (tmp_path / "was a file").write_text("")
    with sidecar.atomic_directory(str(tmp_path / "was a file")):
        pass
    assert (tmp_path / "was a file").is_dir()


def test_derived_files_of_a_packaged_model_go_to_its_cache_folder(make_model, tmp_path, monkeypatch):
    monkeypatch.setattr(runtime, "CACHE_DIR", str(tmp_path / "cache"))
    beside = make_model()
    assert sparsity.thresholds_path(beside) == beside + ".sparsity.json"
    assert placement.gpuidx_path(beside) == beside + ".generated.gpuidx"
    assert activation_profile.default_directory(beside) == beside + ".activation"

    packaged = tmp_path / "lib" / "site-packages" / "some_model"
    packaged.mkdir(parents=True)
    model = str(packaged / "tiny.gguf")
    os.rename(beside, model)
    cache = tmp_path / "cache" / "models" / f"tiny.gguf-{sidecar.model_fingerprint(model)[:16]}"
    assert sparsity.thresholds_path(model, create=True) == str(cache / "tiny.gguf.sparsity.json")
    assert placement.gpuidx_path(model) == str(cache / "tiny.gguf.generated.gpuidx")
    assert activation_profile.default_directory(model) == str(cache / "tiny.gguf.activation")
    assert cache.is_dir()
    sparsity.save_thresholds(model, "hidden", {0.5: np.ones(2)}, "test")
    assert os.listdir(packaged) == ["tiny.gguf"]
    np.testing.assert_array_equal(sparsity.load_thresholds(model, "hidden", 0.5, 2), np.ones(2))


def test_a_missing_model_is_reported_as_such(tmp_path):
    with pytest.raises(JaxinferError, match="model file not found"):
        sparsity.thresholds_path(str(tmp_path / "no-such-dir" / "typo.gguf"), create=True)


def test_the_default_models_derived_files_stay_out_of_site_packages():
    path = engine.default_model_path()
    for derived in (sparsity.thresholds_path(path), placement.gpuidx_path(path),
                    activation_profile.default_directory(path)):
        assert derived.startswith(runtime.CACHE_DIR) and "site-packages" not in derived, derived


def test_unwritable_outputs_are_found_before_the_run(tmp_path):
    with pytest.raises(JaxinferError, match="does not exist"):
        sidecar.check_writable_file(str(tmp_path / "missing" / "base.kld"))
    with pytest.raises(JaxinferError, match="is a folder"):
        sidecar.check_writable_file(str(tmp_path))
    (tmp_path / "file").write_text("")
    with pytest.raises(JaxinferError, match="a file is in its place"):
        sidecar.check_writable_folder(str(tmp_path / "file"))
    with pytest.raises(JaxinferError, match="does not exist"):
        sidecar.check_writable_folder(str(tmp_path / "missing" / "activation"))
    sidecar.check_writable_file(str(tmp_path / "file"))
    sidecar.check_writable_folder(str(tmp_path / "activation"))
    assert sorted(os.listdir(tmp_path)) == ["file"]  # the probes leave nothing behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_found_before_the_run(tmp_path):
    (tmp_path / "ro").mkdir(mode=0o555)
    with pytest.raises(JaxinferError, match="cannot write"):
        sidecar.check_writable_file(str(tmp_path / "ro" / "base.kld"))


def test_sidecar_json_must_be_an_object_of_this_model(make_model, tmp_path):
    model = make_model()
    path = tmp_path / "x.json"
    for text in ("[1, 2]", "{\"model_fingerprint\": 3", "\"just a string\""):
        path.write_text(text)
        with pytest.raises(JaxinferError):
            sidecar.read_json(str(path), model)


@pytest.mark.parametrize("values, message", [
    ([1.0, "2"], "list of 2 numbers"), ([1.0], "list of 2 numbers"), ({"0": 1.0}, "list of 2 numbers"),
    ([1.0, True], "list of 2 numbers"), ([1.0, float("nan")], "not a finite"), ([1.0, float("inf")], "not a finite"),
    ([1.0, 10**400], "not a finite"),
])
def test_checked_numbers(values, message):
    with pytest.raises(JaxinferError, match=message):
        sidecar.checked_numbers(values, 2, "thresholds")
    np.testing.assert_array_equal(sidecar.checked_numbers([1, 2.5], 2, "thresholds"), [1.0, 2.5])

"""python -m jaxinfer.inspect: reports checked against what the loader, the kernels' own routing and the file say, on
good, PowerInfer, unknown-architecture, unsupported-type, unknown-type-id and truncated files. The reports are built
in-process (jaxinfer.inspection); the CLI's text, --json and exit statuses in one batch of runs (test_cli's driver)."""

import dataclasses
import json
import os
import pathlib
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType
from test_cli import assert_one_line_error, run_all
from test_gguf_io import fuzz, tensor

from jaxinfer import activation_profile, engine, inspection, quant, sparsity
from jaxinfer.errors import JaxinferError
from jaxinfer.gguf_io import load_config, open_gguf
from jaxinfer.powerinfer import metadata_fields, stored_tensors, write_gguf
from jaxinfer.synthetic import SyntheticSpec

Q = GGMLQuantizationType
UNKNOWN_TYPE_ID = 1000  # no GGML type will take this id
UNSUPPORTED = next((q for q in Q if q not in quant.SUPPORTED_TYPES and GGML_QUANT_SIZES[q][0] == 32
                    and GGML_QUANT_SIZES[q][1] > 4), None)  # a block type jaxinfer cannot decode (Q8_1 today)


def by_type(report) -> dict:
    return {row["type"]: row for row in report["tensor_types"]}


def test_a_good_model_is_reported_as_the_loader_and_the_kernels_see_it(make_model):
    path = make_model(weight_type=Q.Q4_0, embedding_type=Q.Q8_0, tied_output=False)
    report = inspection.inspect_model(path)
    reader = GGUFReader(path)

    f = report["file"]
    assert (f["format"], f["magic"], f["version"], f["alignment"]) == ("GGUF", "GGUF", 3, 32)
    assert (f["size_bytes"], f["tensors"]) == (os.path.getsize(path), len(reader.tensors))

    cfg = load_config(open_gguf(path))
    expected = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("plan", "cache_type")}
    assert report["architecture"]["config"] == expected and report["architecture"]["known"]

    rows = by_type(report)
    for qtype in {t.tensor_type for t in reader.tensors}:
        tensors = [t for t in reader.tensors if t.tensor_type == qtype]
        row = rows[qtype.name]
        assert (row["tensors"], row["bytes"], row["type_id"]) == (len(tensors), sum(int(t.n_bytes) for t in tensors),
                                                                   int(qtype))
        assert row["share"] == pytest.approx(row["bytes"] / f["size_bytes"]) and row["supported"]
        # The route named is the one quant.matmul takes for a decode step under this machine's plan.
        w = quant.QuantArray(np.zeros((32, 64 // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1])), qtype,
                             (32, 64))
        with quant.products(report["kernels"]["products"]):
            takes_kernel = quant._kernels(np.zeros((1, 64), np.float32), w) is not None
        assert row["kernel"].startswith("cpu_ext") == takes_kernel, row
    assert rows["Q4_0"]["kernel"].startswith("cpu_ext") == report["kernels"]["cpu_ext"]["available"]
    assert sum(r["tensors"] for r in rows.values()) == len(reader.tensors)

    assert report["powerinfer"]["layers_with_predictor"] == 0 and not report["powerinfer"]["pwri_magic"]
    assert report["sparsity"]["dense_skips_natural_zeros"] is False  # SwiGLU
    assert not report["sparsity"]["predictor"] and not report["sparsity"]["calibrated_thresholds"]["present"]
    assert report["hybrid_split"]["tensors"] == ["ffn_gate", "ffn_up", "ffn_down"]
    assert not report["hybrid_split"]["applies"]  # no activation profile
    assert not report["gpu"]["pallas_sparse_ffn"] and report["gpu"]["types_supported"]
    assert report["problems"] == [] and report["verdict"]["status"] in (inspection.RUNS, inspection.LIMITED)


WITHOUT_CPU_KERNEL = sorted(quant.SUPPORTED_TYPES - quant.CPU_KERNEL_TYPES - {Q.F32})  # BF16 today


@pytest.mark.skipif(not WITHOUT_CPU_KERNEL, reason="every decodable type but F32 has a cpu_ext kernel")
def test_a_weight_type_without_a_cpu_ext_kernel_runs_with_limitations(make_model):
    qtype = WITHOUT_CPU_KERNEL[0]
    report = inspection.inspect_model(make_model(weight_type=qtype))
    verdict, products = report["verdict"], report["kernels"]["products"]
    assert by_type(report)[qtype.name]["kernel"].startswith("XLA on dequantized weights")
    if products == "cpu_ext":
        assert verdict["status"] == inspection.LIMITED and report["problems"] == []
        assert verdict["limitations"] == [(f"no cpu_ext kernel for {qtype.name}: those weights are dequantized to "
                                           f"f32 for XLA in every product")]
        assert verdict["reason"] == verdict["limitations"][0]
    elif report["kernels"]["backend"] == "cpu":  # cpu_ext not built: every type is slow
        assert verdict["status"] == inspection.LIMITED and "cpu_ext kernels unavailable" in verdict["reason"]
    else:
        assert verdict["status"] == inspection.RUNS


def test_inspecting_reads_no_weights(make_model):
    """Resident memory, in a fresh process warmed up on a tiny file, grows by nothing like a larger file's size."""
    small = make_model()
    large = make_model("large.gguf", n_layer=4, n_embd=256, n_ff=1024, n_head_kv=4)
    script = textwrap.dedent("""
        import sys
        from jaxinfer import inspection
        def status(key):
            return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024
        inspection.inspect_model(sys.argv[1])  # imports, the backend and the tokenizer's code warmed up
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak restarts from here
        base = status("VmRSS")
        inspection.inspect_model(sys.argv[2])
        print(status("VmHWM") - base)
    """)
    done = subprocess.run([sys.executable, "-c", script, small, large], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert os.path.getsize(large) > 16 * 2**20
    assert int(done.stdout) < 2 * 2**20  # the file is 16 MiB; loading its weights would be that much


def test_a_powerinfer_model_with_predictors_thresholds_and_profile(make_model):
    path = make_model(sparsity=0.8)
    n_layer = SyntheticSpec().n_layer
    plain = inspection.inspect_model(path)
    sparsity.save_thresholds(path, "gate", {0.5: np.full(n_layer, 0.1)}, "test text")
    counts = np.ones((n_layer, SyntheticSpec().n_ff), np.int64)
    activation_profile.write_profile(activation_profile.default_directory(path, create=True), path, counts, 4, "dense")
    report = inspection.inspect_model(path)

    p = report["powerinfer"]
    assert p["pwri_magic"] and p["layers_with_ffn_down_t"] == p["layers_with_predictor"] == n_layer
    assert p["sparse_threshold"] == 0.0
    s = report["sparsity"]
    assert s["activations"]["gate"] == "relu" and s["dense_skips_natural_zeros"] and s["predictor"]
    assert not plain["sparsity"]["calibrated_thresholds"]["present"]
    assert s["calibrated_thresholds"]["present"] and s["calibrated_thresholds"]["levels"] == {"gate": ["0.5"]}
    h = report["hybrid_split"]
    assert not plain["hybrid_split"]["applies"]
    assert h["applies"] and h["profile_valid"] and h["tensors"] == ["ffn_gate", "ffn_up", "ffn_down_t"]
    assert report["gpu"]["pallas_sparse_ffn"]  # F32 FFN weights, predictors: the Pallas kernel takes them
    assert report["problems"] == []


def test_a_profile_of_another_model_is_reported_unusable(make_model):
    path = make_model(sparsity=0.8)
    counts = np.ones((SyntheticSpec().n_layer, SyntheticSpec().n_ff), np.int64)
    activation_profile.write_profile(activation_profile.default_directory(path, create=True), path, counts, 4, "dense")
    with open(path, "r+b") as f:  # the model changes after its profile was made
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x00\x80\x3f")
    h = inspection.inspect_model(path)["hybrid_split"]
    assert h["profile_present"] and not h["profile_valid"] and "different model" in h["profile_error"]
    assert not h["applies"]


def test_an_unknown_architecture_still_reports_its_tensors(make_model):
    report = inspection.inspect_model(make_model(architecture="gptneox"))
    a = report["architecture"]
    assert a["name"] == "gptneox" and not a["known"] and a["config"] is None
    assert "unsupported architecture 'gptneox'" in a["config_error"]
    assert by_type(report)["F32"]["tensors"] == report["file"]["tensors"]
    assert report["verdict"]["status"] == inspection.DOES_NOT_RUN
    assert "unsupported architecture 'gptneox'" in report["verdict"]["reason"]


def test_unknown_type_ids_are_each_named_and_the_rest_still_reported(make_model, tmp_path):
    base = fuzz.read_base("tiny", make_model(weight_type=Q.Q8_0))
    names = ["blk.0.ffn_up.weight", "blk.1.attn_q.weight"]
    data = base.data
    for name in names:
        data = fuzz.patch(data, tensor(base, name).parts[4][0], struct.pack("<I", UNKNOWN_TYPE_ID))
    path = tmp_path / "unknown_type.gguf"
    path.write_bytes(data)
    report = inspection.inspect_model(str(path))
    for name in names:
        assert any(name in p and f"unknown type id {UNKNOWN_TYPE_ID}" in p for p in report["problems"]), name
    row = by_type(report)[f"type id {UNKNOWN_TYPE_ID}"]
    assert row["tensors"] == 2 and not row["supported"] and not row["bytes_exact"]
    assert row["kernel"].startswith("unsupported")
    assert by_type(report)["Q8_0"]["tensors"] == 12  # the other matrices (2 layers of 7, less the 2)
    assert report["architecture"]["config"]["n_layer"] == 2
    assert report["notes"] and report["verdict"]["status"] == inspection.DOES_NOT_RUN
    assert not report["gpu"]["types_supported"]


@pytest.mark.skipif(UNSUPPORTED is None, reason="gguf-py knows no block type that jaxinfer cannot decode")
def test_a_known_type_without_a_decoder_is_unsupported(make_model, tmp_path):
    source = open_gguf(make_model(weight_type=Q.Q8_0))
    tensors = stored_tensors(source)
    block_size, type_size = GGML_QUANT_SIZES[UNSUPPORTED]
    for i, t in enumerate(tensors):
        if t.name == "blk.1.ffn_gate.weight":
            rows, cols = t.shape
            tensors[i] = dataclasses.replace(t, qtype=UNSUPPORTED, make=lambda rows=rows, cols=cols: np.zeros(
                (rows, cols // block_size * type_size), np.uint8))
    path = write_gguf(str(tmp_path / "unsupported.gguf"), "llama", metadata_fields(source), tensors)
    report = inspection.inspect_model(path)
    row = by_type(report)[UNSUPPORTED.name]
    assert row["tensors"] == 1 and not row["supported"] and "no decoder" in row["kernel"]
    assert report["verdict"]["status"] == inspection.DOES_NOT_RUN
    assert "blk.1.ffn_gate.weight" in report["verdict"]["reason"] and UNSUPPORTED.name in report["verdict"]["reason"]
    assert report["gpu"]["unsupported_types"] == [UNSUPPORTED.name]


def test_truncated_files(make_model, tmp_path):
    base = fuzz.read_base("tiny", make_model(weight_type=Q.Q8_0))
    cut = len(base.data) * 2 // 3
    path = tmp_path / "truncated.gguf"
    path.write_bytes(base.data[:cut])
    report = inspection.inspect_model(str(path))
    past_end = [t.name for t in base.tensors if t.data_end > cut]
    assert len(report["problems"]) == len(past_end) > 1
    for name, problem in zip(past_end, report["problems"]):
        assert name in problem and "past the end of the file" in problem
    assert report["architecture"]["config"] is not None and report["verdict"]["status"] == inspection.DOES_NOT_RUN

    path.write_bytes(base.data[:2000])  # within the metadata: nothing past the header can be read
    report = inspection.inspect_model(str(path))
    assert set(report) == {"file", "problems", "notes", "verdict"} and report["file"]["version"] == 3
    assert len(report["problems"]) == 1 and "truncated or corrupt" in report["problems"][0]


def test_a_huge_alignment_is_reported_in_plain_numbers(make_model, tmp_path):
    """gguf-py keeps general.alignment as a numpy uint32: offsets computed from it must not reach the report as
    numpy values (not JSON) or wrap around."""
    base = fuzz.read_base("tiny", make_model())
    path = tmp_path / "aligned.gguf"
    path.write_bytes(fuzz.rebuild(base, {"general.alignment": fuzz.encode_field(
        "general.alignment", GGUFValueType.UINT32, 2**31)}))
    report = inspection.inspect_model(str(path))
    json.dumps(report, allow_nan=False)
    assert report["file"]["alignment"] == 2**31 and report["verdict"]["status"] == inspection.DOES_NOT_RUN
    assert len(report["problems"]) == report["file"]["tensors"]  # each misaligned, or (the first) past the end
    assert "spans bytes 2147483648 to" in report["problems"][0]


def test_the_verdict_agrees_with_the_loader_on_fuzzed_files(tmp_path):
    """Seeded corrupt files (scripts/fuzz_gguf.py's mutations): inspecting never raises, the report is strict JSON
    and prints as text, and "does not run" exactly when engine.load_model refuses the file."""
    bases = fuzz.build_bases(str(tmp_path))
    path = str(tmp_path / "case.gguf")
    verdicts = set()
    for index in range(200):
        _, _, data, description = fuzz.make_case(bases, 3, index)
        with open(path, "wb") as f:
            f.write(data)
        report = inspection.inspect_model(path)
        json.dumps(report, allow_nan=False)
        assert inspection.format_report(report).splitlines()[-1].startswith("verdict: ")
        try:
            engine.load_model(path)
            refused = None
        except JaxinferError as e:
            refused = str(e)
        status = report["verdict"]["status"]
        assert (status == inspection.DOES_NOT_RUN) == (refused is not None), (description, report["verdict"], refused)
        verdicts.add(status)
    assert inspection.DOES_NOT_RUN in verdicts and len(verdicts) > 1


@pytest.mark.slow
def test_the_cli_text_json_and_exit_statuses(make_model, tmp_path):
    good = make_model(weight_type=Q.Q4_0)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(pathlib.Path(good).read_bytes()[:-1000])
    not_gguf = tmp_path / "notes.txt"
    not_gguf.write_text("not a model")
    runs = [("jaxinfer.inspect", args) for args in (
        [good], [good, "--json"], [str(truncated)], [str(truncated), "--json"], [str(not_gguf)],
        [str(tmp_path / "missing.gguf")], [str(tmp_path)], [], [good, good], ["--help"], [good, "--bogus"])]
    text, as_json, cut, cut_json, foreign, missing, folder, no_args, two, helped, bad_flag = run_all(runs)

    assert text["rc"] == 0 and text["stderr"] == ""
    lines = text["stdout"].strip().splitlines()
    assert lines[0].startswith(f"file: {os.path.abspath(good)}") and "GGUF v3" in lines[0]
    assert lines[1] == "architecture: llama"
    assert any(line.split()[:3] == ["Q4_0", "14", "tensors"] for line in lines), lines
    assert lines[-1].startswith("verdict: runs")
    report = json.loads(as_json["stdout"])
    assert as_json["rc"] == 0 and report["verdict"]["status"] in (inspection.RUNS, inspection.LIMITED)
    assert lines[-1] == f"verdict: {report['verdict']['status']}: {report['verdict']['reason']}"
    assert report == json.loads(json.dumps(inspection.inspect_model(good)))

    for result in (cut, foreign):
        assert result["rc"] == 1 and result["stderr"] == "", result["stderr"]
        assert result["stdout"].strip().splitlines()[-1].startswith("verdict: does not run: ")
    assert "past the end of the file" in cut["stdout"] and "is not a GGUF file" in foreign["stdout"]
    assert cut_json["rc"] == 1 and json.loads(cut_json["stdout"])["verdict"]["status"] == inspection.DOES_NOT_RUN
    assert_one_line_error(missing, "model file not found")
    assert_one_line_error(folder, f"{tmp_path} is a directory, not a model file: give the path of a .gguf file")
    assert_one_line_error(no_args, "give one model file")
    assert_one_line_error(two, "unexpected arguments")
    assert_one_line_error(bad_flag, "bogus")
    assert helped["rc"] == 0 and "--[no]json" in helped["stdout"] and "Exit status" in helped["stdout"]


def test_a_bitnet_file_with_i2_s_weights_is_named_and_routed(make_model):
    """Microsoft's I2_S (type 36, which gguf-py lacks) is named, sized with its tail and supported; a hot/cold split
    is said not to apply to BitNet's block, as engine.split_model refuses it."""
    from jaxinfer import ternary

    path = make_model(architecture="bitnet-b1.58", n_embd=128, n_ff=256, weight_type=ternary.I2_S)
    report = inspection.inspect_model(path)
    row = by_type(report)["I2_S"]
    assert (row["type_id"], row["tensors"], row["supported"]) == (36, 14, True)
    q_and_output, k_and_v, ffn = 128 * 128, 64 * 128, 128 * 256  # 4 heads of 32 and 2 KV heads: per layer
    assert row["bytes"] == 2 * sum(ternary.i2_s_nbytes(n) for n in (q_and_output, q_and_output, k_and_v, k_and_v,
                                                                     ffn, ffn, ffn))
    assert report["architecture"]["config"]["sub_norms"] and not report["hybrid_split"]["applies"]
    assert report["verdict"]["status"] in (inspection.RUNS, inspection.LIMITED) and report["problems"] == []
    tq1_path = make_model(name="tq1.gguf", architecture="bitnet", n_embd=256, n_ff=512,
                          weight_type=GGMLQuantizationType.TQ1_0)
    tq1 = inspection.inspect_model(tq1_path)
    held = engine.load_model(tq1_path).weights.layers[0].attn_q.qtype == GGMLQuantizationType.TQ2_0  # widens_tq1_0
    assert by_type(tq1)["TQ1_0"]["kernel"].startswith("held as TQ2_0 (repack.py): ") == held

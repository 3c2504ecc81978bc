import json
import os
import pathlib
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q

from jaxinfer import engine
from jaxinfer.sampling import SamplingParams

DATA = pathlib.Path(__file__).parent / "data"


def run_cli(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "jaxinfer.generate", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and result.stderr.strip().endswith(errors[0]), result.stderr
    for fragment in fragments:
        assert fragment in errors[0]


@pytest.mark.parametrize("prompt", json.loads((DATA / "llama_cpp_greedy.json").read_text())["continuations"])
def test_greedy_output_matches_llama_cpp_f32(default_model_exact, prompt):
    """The Q4_1 weights dequantized to f32 must reproduce llama.cpp's F32 greedy text token for token."""
    m = default_model_exact
    expected = json.loads((DATA / "llama_cpp_greedy.json").read_text())["continuations"][prompt]
    new = list(engine.generate_tokens(m, m.tokenizer.encode(prompt), 32, 128, SamplingParams(temperature=0), seed=0))
    assert m.tokenizer.decode(new) == expected


def test_cli_streams_text_and_reports_timings(make_model):
    result = run_cli("-m", make_model(), "-p", "hello the", "-n", "6", "--temp", "0", "-c", "64")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("hello the")
    assert "loaded tiny.gguf" in result.stderr
    assert "compile" in result.stderr and "tok/s" in result.stderr


def test_cli_chat_template(make_model):
    path = make_model()
    tokenizer = engine.load_model(path).tokenizer
    chat = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert chat[0] == tokenizer.token_id("<|im_start|>")
    result = run_cli("-m", path, "-p", "hi", "--chat", "-n", "3", "--seed", "3", "-c", "64")
    assert result.returncode == 0, result.stderr
    assert f"prompt {len(chat)} tokens" in result.stderr


def test_missing_file():
    assert_one_line_error(run_cli("-m", "/no/such/model.gguf"), "not found")


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("this is not a model\n")
    assert_one_line_error(run_cli("-m", str(path)), "not a GGUF file")


@pytest.mark.parametrize("keep", [0.5, 0.01])
def test_truncated_gguf(make_model, tmp_path, keep):
    data = pathlib.Path(make_model()).read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    assert_one_line_error(run_cli("-m", str(path)), "truncated")


def test_unsupported_architecture(make_model):
    assert_one_line_error(run_cli("-m", make_model(architecture="gpt2")), "unsupported architecture 'gpt2'")


def test_unsupported_quant_type_is_named(make_model):
    assert_one_line_error(run_cli("-m", make_model(weight_type=Q.Q5_1)), "Q5_1")


def test_prompt_longer_than_context(make_model):
    assert_one_line_error(run_cli("-m", make_model(), "-p", "x" * 40, "-c", "16"), "longer than the context")


@pytest.mark.parametrize("flag,value,fragment", [
    ("-n", "-1", "n_predict"), ("--temp", "-0.5", "--temp"), ("--top_p", "0", "--top_p"),
    ("--top_k", "-3", "--top_k"), ("--min_p", "1.5", "--min_p"), ("-c", "0", "ctx_size"),
    ("--n_predict", "many", "n_predict"),
])
def test_bad_flag_values(make_model, flag, value, fragment):
    assert_one_line_error(run_cli("-m", make_model(), flag, value), fragment)


def test_results_are_identical_across_micro_batch_sizes(make_model):
    """A 21-token prompt prefilled in chunks of 3, 8 or all at once gives the same greedy continuation, also when
    the padded last chunk reaches past the context."""
    m = engine.load_model(make_model())
    prompt = m.tokenizer.encode("in the hall of the mountain king")[:21]
    runs = {ub: list(engine.generate_tokens(m, prompt, 6, 27, SamplingParams(temperature=0), 0, ubatch=ub))
            for ub in (3, 8, 512)}
    assert runs[3] == runs[8] == runs[512] and len(runs[512]) == 6

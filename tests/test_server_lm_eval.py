"""lm-evaluation-harness (`lm_eval --model local-completions`) against the real server, offline, on a tiny
multiple-choice task written here: its accuracy and each answer's log-likelihood must be those computed from the
model's own forward over the same tokens. lm-eval lives in a virtual environment of its own (it pulls in datasets,
transformers' tokenizers and their pins, which the project's environment does not take): the test skips unless
$LM_EVAL_VENV, or /work/peers/lmeval-venv, holds one (`python -m venv DIR && DIR/bin/pip install "lm-eval[api]"`)."""

import json
import os
import pathlib
import subprocess

import numpy as np
import pytest
import server_process

from jaxinfer import engine, model
from jaxinfer.synthetic import SyntheticSpec, write_model

VENV = pathlib.Path(os.environ.get("LM_EVAL_VENV", "/work/peers/lmeval-venv"))
LM_EVAL = VENV / "bin" / "lm_eval"
# Questions and choices in the synthetic vocabulary's bytes; lm-eval scores " " + each choice after the question.
ITEMS = [
    ("the hall of 1 2 3 is", ["4", "the", "abc"], 0),
    ("in the hall the", ["hall", "in the", "x y"], 1),
    ("1 2 3 4 5", ["6", "7 8", "the end", "a"], 0),
    ("a b a b a", ["b", "a", "c d"], 0),
    ("hello the", ["world", "hall", "there in the"], 2),
    ("x y z", ["w", "x", "the hall"], 1),
    ("abc abc abc", ["abc", "def", "1 2"], 0),
    ("the the the", ["the", "hall of", "in"], 0),
]
TASK = """task: jaxinfer_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def loglikelihood(m, context: str, continuation: str) -> float:
    """log p(continuation | context) from one plain forward, tokenized as lm-eval does (the whole text encoded, the
    context's tokens split off; no special tokens)."""
    context_ids = m.tokenizer.encode(context, add_bos=False)
    ids = m.tokenizer.encode(context + continuation, add_bos=False)
    hidden, _, _ = model.forward(np.array([ids], np.int32), m.weights, m.config)
    logits = np.asarray(model.logits(hidden[0], m.weights, m.config), np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(sum(logprobs[i - 1, ids[i]] for i in range(len(context_ids), len(ids))))


@pytest.mark.slow
@pytest.mark.skipif(not LM_EVAL.exists(), reason=f"lm-eval is not installed in {VENV} (set LM_EVAL_VENV to a virtual "
                                                 f"environment with `pip install \"lm-eval[api]\"`)")
def test_lm_eval_local_completions_scores_a_task_as_the_models_own_log_probabilities(tmp_path):
    path = write_model(str(tmp_path / "tiny.gguf"), SyntheticSpec(n_ctx=512))
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny_mc.yaml").write_text(TASK.format(items=items))
    m = engine.load_model(path)
    expected = [[loglikelihood(m, q, " " + choice) for choice in choices] for q, choices, _ in ITEMS]
    accuracy = np.mean([int(np.argmax(lls)) == answer for lls, (_, _, answer) in zip(expected, ITEMS)])

    with server_process.running(path, "-c", "1024", "-np", "2") as (base, _, _):
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_DATASETS_CACHE=str(tmp_path / "datasets"), HF_HOME=str(tmp_path / "hf"))
        result = subprocess.run(
            [str(LM_EVAL), "--model", "local-completions", "--model_args",
             f"base_url={base}/v1/completions,model=tiny.gguf,tokenizer_backend=remote,tokenized_requests=True,"
             f"num_concurrent=2,max_retries=1", "--tasks", "jaxinfer_tiny_mc", "--include_path",
             str(tmp_path / "tasks"), "--output_path", str(tmp_path / "out"), "--log_samples"],
            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    [results_file] = (tmp_path / "out").rglob("results_*.json")
    assert json.loads(results_file.read_text())["results"]["jaxinfer_tiny_mc"]["acc,none"] == pytest.approx(accuracy)
    [samples_file] = (tmp_path / "out").rglob("samples_jaxinfer_tiny_mc_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert len(samples) == len(ITEMS)
    for sample, lls in zip(samples, expected):
        assert np.allclose([float(resp[0][0]) for resp in sample["resps"]], lls, atol=1e-4), (sample["resps"], lls)

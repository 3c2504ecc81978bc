"""The real server process (python -m jaxinfer.server) on a tiny synthetic model, driven by the official `openai`
client and, for what that client cannot send (malformed JSON, raw status codes), by httpx."""

import json
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import openai
import pytest
import server_process

from jaxinfer import engine, errors, model
from jaxinfer.sampling import SamplingParams
from jaxinfer.synthetic import SyntheticSpec, write_model

# Large enough that a LONG request takes seconds (~1 ms a token on 2 cores) and is still generating when its
# disconnects; short requests take ~20 ms.
SPEC = SyntheticSpec(n_ctx=16384, n_embd=256, n_ff=1024, n_layer=4)
CTX = SPEC.n_ctx  # all slots together: each has CTX // SLOTS positions
SLOTS = 4
LONG = CTX // SLOTS - 24
QUEUE = 8  # 8 concurrent clients always fit, even while the scheduler has not yet taken any from the queue
PROMPTS = ["1 2 3", "hello the", "abc", "in the", "a b a b", "the the hall", "x", "2 3 4 5 6 7"]
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return write_model(str(tmp_path_factory.mktemp("server") / "tiny.gguf"), SPEC)


@pytest.fixture(scope="module")
def server(model_path):
    with server_process.running(model_path, "-c", str(CTX), "-np", str(SLOTS), "--queue", str(QUEUE)) as (
            base, saw_loading, _):
        yield base, saw_loading


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def local(model_path):
    """The same model in this process: what engine.generate_tokens alone makes of a prompt at temperature 0."""
    m = engine.load_model(model_path)

    def greedy(prompt_ids, n):
        ids = list(engine.generate_tokens(m, prompt_ids, n, CTX // SLOTS, SamplingParams(temperature=0), seed=0))
        return m.tokenizer.decode(ids), len(ids)

    return m, greedy


def metrics(base) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if not line.startswith("#")}


def assert_error(response, status, *fragments):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] and "Traceback" not in error["message"]
    for fragment in fragments:
        assert fragment in error["message"], error["message"]


@pytest.mark.slow
def test_health_was_503_while_loading_then_200(server):
    base, saw_loading = server
    assert saw_loading, "the HTTP server should answer /health before the model has loaded"
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}


def test_models_lists_the_file(client):
    assert [m.id for m in client.models.list().data] == ["tiny.gguf"]


def test_completion_at_temperature_0_equals_generate_tokens(client, local):
    m, greedy = local
    for prompt in PROMPTS[:2]:
        ids = m.tokenizer.encode(prompt)
        expected, n = greedy(ids, 12)
        result = client.completions.create(model="tiny.gguf", prompt=prompt, max_tokens=12, temperature=0)
        assert result.choices[0].text == expected
        assert result.usage.prompt_tokens == len(ids) and result.usage.completion_tokens == n
        assert result.usage.total_tokens == len(ids) + n
        assert result.choices[0].finish_reason == ("length" if n == 12 else "stop")


def test_a_prompt_prefilled_in_several_pieces_equals_generate_tokens(client, local):
    """A 300-token prompt is prefilled in pieces (256 + 32 + 16, scheduler.prefill_pieces) in its slot's row."""
    m, greedy = local
    prompt = " ".join(["the hall of 1 2 3"] * 20)
    ids = m.tokenizer.encode(prompt)
    assert 256 < len(ids) <= 320
    expected, n = greedy(ids, 10)
    result = client.completions.create(model="tiny.gguf", prompt=prompt, max_tokens=10, temperature=0)
    assert result.choices[0].text == expected and result.usage.prompt_tokens == len(ids)


def test_streamed_completion_equals_the_whole_one(client):
    whole = client.completions.create(model="tiny.gguf", prompt="abc", max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model="tiny.gguf", prompt="abc", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_renders_the_template_and_streams_role_first(client, local):
    m, greedy = local
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello the"}]
    ids = m.tokenizer.encode(engine.apply_chat_template(m.tokenizer.chat_template, messages, m.tokenizer))
    expected, n = greedy(ids, 8)
    reply = client.chat.completions.create(model="tiny.gguf", messages=messages, max_tokens=8, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == n
    chunks = list(client.chat.completions.create(model="tiny.gguf", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == reply.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_max_tokens_ends_with_length(client):
    result = client.completions.create(model="tiny.gguf", prompt="1 2 3", max_tokens=3, temperature=0)
    assert result.choices[0].finish_reason == "length" and result.usage.completion_tokens == 3


def test_stop_strings_cut_the_text_before_them(client):
    full = client.completions.create(model="tiny.gguf", prompt="1 2 3", max_tokens=16, temperature=0)
    text = full.choices[0].text
    # A stop string taken from the middle of the greedy text: two printable characters after the first one.
    start = next(i for i in range(1, len(text) - 1) if text[i:i + 2].isprintable() and text[i:i + 2].isascii())
    stop = text[start:start + 2]
    expected = text[:text.index(stop)]
    for stream in (False, True):
        kwargs = {"model": "tiny.gguf", "prompt": "1 2 3", "max_tokens": 16, "temperature": 0,
                  "stop": [stop, "never"]}
        if stream:
            chunks = list(client.completions.create(stream=True, **kwargs))
            got, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            result = client.completions.create(**kwargs)
            got, finish = result.choices[0].text, result.choices[0].finish_reason
        assert (got, finish) == (expected, "stop")
    single = client.completions.create(model="tiny.gguf", prompt="1 2 3", max_tokens=16, temperature=0, stop=stop)
    assert single.choices[0].text == expected


def test_tokenize_and_detokenize(server, local):
    base, (m, _) = server[0], local
    tokens = httpx.post(f"{base}/tokenize", json={"content": "hello the"}).json()["tokens"]
    assert tokens == m.tokenizer.encode("hello the")
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens}).json()["content"] == "hello the"
    assert_error(httpx.post(f"{base}/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    assert_error(httpx.post(f"{base}/tokenize", json={"text": "x"}), 400, "content")


@pytest.mark.parametrize("body, status, fragment", [
    ({"prompt": "hi", "temperature": "hot"}, 400, "'temperature' must be a number"),
    ({"prompt": "hi", "temperature": -1}, 400, "'temperature'"),
    ({"prompt": "hi", "top_p": 0}, 400, "'top_p'"),
    ({"prompt": "hi", "top_k": 1.5}, 400, "'top_k' must be an integer"),
    ({"prompt": "hi", "min_p": 2}, 400, "'min_p'"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "'max_tokens'"),
    ({"prompt": "hi", "seed": -5}, 400, "'seed'"),
    ({"prompt": "hi", "stop": [1]}, 400, "'stop'"),
    ({"prompt": "hi", "n": 2}, 400, "'n'"),
    ({"prompt": "hi", "stream": "yes"}, 400, "'stream'"),
    ({"prompt": "hi", "presence_penalty": 2.5}, 400, "'presence_penalty' must be in [-2, 2]"),
    ({"prompt": "hi", "frequency_penalty": "a lot"}, 400, "'frequency_penalty' must be a number"),
    ({"max_tokens": 4}, 400, "'prompt' is required"),
    ({"prompt": 7}, 400, "'prompt' must be a string"),
    ({"prompt": "x " * (CTX // SLOTS)}, 400, "longer than the context"),
    ({"prompt": "hi", "repeat_last_n": 8}, 400, "'repeat_last_n' must be 64"),
    ({"prompt": "hi", "ignore_eos": 1}, 400, "'ignore_eos' must be a boolean"),
    # Fields this server does not honour: refused, not ignored.
    ({"prompt": "hi", "logit_bias": {"5": 10}}, 400, "'logit_bias' is not supported"),
    ({"prompt": "hi", "logprobs": 1, "stream": True}, 400, "'logprobs' cannot be streamed"),
    ({"prompt": "hi", "logprobs": 21}, 400, "'logprobs' must be an integer in [0, 20]"),
    ({"prompt": [1, 10**6]}, 400, "list of token ids in [0, "),
    ({"prompt": ["a", "b"], "stream": True}, 400, "a stream takes one prompt"),
    ({"prompt": "hi", "model": "m" * 300}, 400, "'model' may be at most 256 characters"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}}, 400,
     "'response_format' is not a valid grammar"),
    ({"prompt": "hi", "tools": [{"type": "function"}]}, 400, "'tools' is not supported"),
    ({"prompt": "hi", "best_of": 2}, 400, "'best_of' is not supported"),
    ({"prompt": "hi", "stream": True, "stream_options": {"include_usage": "no"}}, 400,
     "'stream_options.include_usage'"),
    ({"prompt": "hi", "stop": ["a"] * 17}, 400, "at most 16 strings"),
    ({"prompt": "hi", "repeat_penalty": 1e300}, 400, "'repeat_penalty' must be at most"),
])
def test_bad_completion_requests(server, body, status, fragment):
    assert_error(httpx.post(f"{server[0]}/v1/completions", json=body), status, fragment)


@pytest.mark.parametrize("body, fragment", [
    ({}, "'messages' is required"),
    ({"messages": []}, "must not be empty"),
    ({"messages": ["hi"]}, "'messages[0]'"),
    ({"messages": [{"role": "user", "content": 3}]}, "'messages[0].content'"),
    ({"messages": [{"content": "hi"}]}, "'messages[0].role'"),
])
def test_bad_chat_requests(server, body, fragment):
    assert_error(httpx.post(f"{server[0]}/v1/chat/completions", json=body), 400, fragment)


def test_malformed_json_unknown_routes_and_models(server, client):
    base = server[0]
    for route in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        assert_error(httpx.post(f"{base}{route}", content=b"{not json", headers=JSON), 400, "not valid JSON")
    assert_error(httpx.post(f"{base}/v1/completions", json=["a list"]), 400, "JSON object")
    assert_error(httpx.post(f"{base}/v1/completions", content=b"[" * 100_000, headers=JSON), 400, "not valid JSON")
    assert_error(httpx.post(f"{base}/v1/completions", content=b"\xff\xfe", headers=JSON), 400, "not valid JSON")
    assert_error(httpx.get(f"{base}/v2/nothing"), 404, "/v2/nothing")
    assert_error(httpx.get(f"{base}/v1/completions"), 405, "GET /v1/completions")
    # One model is served, whatever name a client was configured with: the reply names it.
    assert client.completions.create(model="no-such-model", prompt="hi", max_tokens=2).model == "tiny.gguf"
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="tiny.gguf", messages=[{"role": "user", "content": "hi"}], top_p=1.5)
    # Python's json reads NaN and Infinity: they are numbers there, out of range here.
    nan = httpx.post(f"{base}/v1/completions", content=b'{"prompt": "hi", "temperature": NaN}', headers=JSON)
    assert_error(nan, 400, "'temperature' must be a finite number")


def wait_until_idle(base, seconds=20) -> dict[str, float]:
    """/metrics once no slot is busy and nothing waits (failing after `seconds`)."""
    deadline = time.monotonic() + seconds
    while (now := metrics(base))["jaxinfer_busy_slots"] or now["jaxinfer_queue_length"]:
        assert time.monotonic() < deadline, now
        time.sleep(0.05)
    return now


def test_disconnects_free_their_slots_and_a_full_queue_answers_503(server, client):
    base = server[0]
    before = metrics(base)
    body = {"prompt": "hello the", "max_tokens": LONG, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base, timeout=30) as http:
        def send(n):
            return [http.send(http.build_request("POST", "/v1/completions", json=body), stream=True) for _ in range(n)]

        streams = send(SLOTS)  # every slot generating
        # Their line iterators stay referenced: a dropped one closes the response.
        lines = [stream.iter_lines() for stream in streams]
        for generating in lines:
            assert next(line for line in generating if line.startswith("data: {"))
        streams += send(QUEUE)  # and QUEUE waiting: the queue is full
        now = metrics(base)
        assert now["jaxinfer_busy_slots"] == SLOTS and now["jaxinfer_queue_length"] == QUEUE, now
        assert all(stream.status_code == 200 for stream in streams)
        refused = httpx.post(f"{base}/v1/completions", json=body)
        assert_error(refused, 503, "busy", "queue")
        assert refused.headers["retry-after"] == "1"
        for response in streams:  # every client goes away mid-stream
            response.close()
    now = wait_until_idle(base)
    # The generating requests stopped early and the waiting ones never ran.
    assert now["jaxinfer_tokens_generated_total"] - before["jaxinfer_tokens_generated_total"] < SLOTS * LONG
    after = client.completions.create(model="tiny.gguf", prompt="abc", max_tokens=4, temperature=0)
    assert after.usage.completion_tokens == 4 or after.choices[0].finish_reason == "stop"
    assert metrics(base)["jaxinfer_requests_total"] == before["jaxinfer_requests_total"] + SLOTS + QUEUE + 1


def test_a_non_streaming_client_that_gives_up_cancels_its_request(server, client):
    base = server[0]
    before = metrics(base)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json={"prompt": "abc", "max_tokens": LONG, "temperature": 0,
                                                   "ignore_eos": True}, timeout=0.3)
    now = wait_until_idle(base)
    assert now["jaxinfer_tokens_generated_total"] - before["jaxinfer_tokens_generated_total"] < LONG
    assert client.completions.create(model="tiny.gguf", prompt="abc", max_tokens=2, temperature=0).choices


def test_ignore_eos_generates_max_tokens(client):
    result = client.completions.create(model="tiny.gguf", prompt="abc", max_tokens=40, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 40 and result.choices[0].finish_reason == "length"


REQUESTS = [  # (prompt, max_tokens, sampling): greedy and seeded draws with their own values, mixed in one batch
    (prompt, 5 + 3 * i, {"temperature": 0} if i % 2 else {
        "temperature": 0.9, "top_p": 0.9, "seed": 100 + i, "frequency_penalty": 0.1 * i, "presence_penalty": 0.3,
        "extra_body": {"top_k": 0 if i % 4 else 20, "repeat_penalty": 1.2}})  # llama-server's fields
    for i, prompt in enumerate(PROMPTS)]


def test_concurrent_clients_each_get_what_they_get_alone(server, client):
    """8 clients, different prompts, lengths and sampling values (greedy, and seeded draws over top-k or the whole
    vocabulary), at once on 4 slots: each gets the text and counts it gets alone (4 wait in the queue, then join
    the running batch as slots free up)."""
    def run(prompt, n, sampling, stream):
        result = client.completions.create(model="tiny.gguf", prompt=prompt, max_tokens=n, stream=stream,
                                           **({"stream_options": {"include_usage": True}} if stream else {}),
                                           **sampling)
        if not stream:
            return result.choices[0].text, result.usage.completion_tokens
        chunks = list(result)
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    alone = [run(*request, stream=False) for request in REQUESTS]
    together = [None] * len(REQUESTS)

    def client_thread(i):
        together[i] = run(*REQUESTS[i], stream=i % 2 == 0)

    threads = [threading.Thread(target=client_thread, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert together == alone
    assert len({text for text, _ in alone}) == len(alone)  # different prompts and lengths: a mix-up would show
    assert wait_until_idle(server[0])["jaxinfer_busy_slots"] == 0


def test_no_cors_and_no_key_by_default(server):
    """Without --cors-origin a browser may not read replies across origins; without --api-key no key is asked."""
    reply = httpx.post(f"{server[0]}/v1/completions", headers={"Origin": "http://page.example"},
                       json={"prompt": "abc", "max_tokens": 1})
    assert reply.status_code == 200 and "access-control-allow-origin" not in reply.headers
    preflight = httpx.options(f"{server[0]}/v1/completions", headers={"Origin": "http://page.example",
                                                                       "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers


def test_metrics_count_requests_and_tokens(server, client):
    base = server[0]
    before = metrics(base)
    client.completions.create(model="tiny.gguf", prompt="1 2 3", max_tokens=3, temperature=0)
    after = metrics(base)
    assert after["jaxinfer_requests_total"] == before["jaxinfer_requests_total"] + 1
    assert after["jaxinfer_tokens_generated_total"] == before["jaxinfer_tokens_generated_total"] + 3
    assert after["jaxinfer_busy_slots"] == 0 and after["jaxinfer_queue_length"] == 0
    assert after["jaxinfer_slots"] == SLOTS and after["jaxinfer_tokens_per_second"] > 0
    assert after["process_resident_memory_bytes"] > 0


@pytest.mark.slow
def test_a_model_that_cannot_load_stops_the_server_with_one_error_line():
    result = subprocess.run([sys.executable, "-m", "jaxinfer.server", "-m", "/no/such/model.gguf", "--port",
                             str(server_process.free_port())], env=server_process.env(), capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == ["error: model file not found: /no/such/model.gguf"]


def test_a_port_in_use_is_one_error_line_before_the_model_loads():
    """The port is taken before anything loads: no model is needed to learn that it is in use."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "jaxinfer.server", "-m", "/no/such/model.gguf", "--port",
                                 str(port)], env=server_process.env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: port {port} on 127.0.0.1 is already in use (give another with --port)"]


def wait_health(process: subprocess.Popen, base: str, status: int):
    """Wait until the server at `base` answers /health with `status` (200: ready)."""
    deadline = time.monotonic() + server_process.READY_TIMEOUT_S
    while True:
        assert process.poll() is None and time.monotonic() < deadline, process.returncode
        try:
            if httpx.get(f"{base}/health").status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.02)


@pytest.mark.slow
def test_first_start_says_what_it_compiles_and_ctrl_c_stops_it_with_one_line(make_model, tmp_path):
    """A first start (an empty cache) says what it compiles before the programs compile, a later one does not.
    SIGINT (Ctrl-C) while it compiles (in native code, which an ordinary exit would abort) and once it serves
    (uvicorn stops, then the rounds): one line, status 130; SIGTERM: status 0."""
    path, cache = make_model(n_ctx=64), tmp_path / "cache"
    notice = (f"compiling 2 prefill programs and 1 decode program for 1 slot (first run with these shapes; cached in "
              f"{cache} for the next)")

    def start() -> tuple[subprocess.Popen, str, pathlib.Path]:
        port, log = server_process.free_port(), tmp_path / f"server-{time.monotonic_ns()}.err"
        command = [sys.executable, "-m", "jaxinfer.server", "-m", path, "--port", str(port), "-c", "32", "-np", "1"]
        with open(log, "w") as stderr:
            process = subprocess.Popen(command, env=dict(server_process.env(), JAXINFER_CACHE_DIR=str(cache)),
                                       stderr=stderr, text=True)
        return process, f"http://127.0.0.1:{port}", log

    def stopped(process: subprocess.Popen, log: pathlib.Path, sig: int) -> list[str]:
        process.send_signal(sig)
        process.wait(timeout=60)
        text = log.read_text()
        assert process.returncode == (errors.INTERRUPTED if sig == signal.SIGINT else 0), text
        assert "Traceback" not in text and "terminate called" not in text and "Fatal" not in text, text
        return text.strip().splitlines()

    compiling, _, log = start()
    deadline = time.monotonic() + server_process.READY_TIMEOUT_S
    while notice not in log.read_text():
        assert compiling.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.02)
    lines = stopped(compiling, log, signal.SIGINT)
    assert lines[-2:] == [notice, errors.INTERRUPTED_LINE], lines
    serving, base, log = start()
    wait_health(serving, base, 200)
    lines = stopped(serving, log, signal.SIGINT)
    assert lines[-2].startswith("serving tiny.gguf") and lines[-1] == errors.INTERRUPTED_LINE, lines
    cached, base, log = start()
    wait_health(cached, base, 200)
    lines = stopped(cached, log, signal.SIGTERM)
    assert lines[-1].startswith("serving tiny.gguf") and not any(line.startswith("compiling") for line in lines)


def reference_logprobs(m, ids: list[int]) -> np.ndarray:
    """log p(ids[i + 1] | ids[:i + 1]) from one plain forward over the sequence (no padding, no pieces)."""
    hidden, _, _ = model.forward(np.array([ids], np.int32), m.weights, m.config)
    logits = np.asarray(model.logits(hidden[0], m.weights, m.config), np.float64)
    logprobs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    return logprobs[np.arange(len(ids) - 1), ids[1:]]


def test_echo_and_logprobs_in_openais_legacy_shape_as_lm_eval_asks(server, local):
    """lm-eval's loglikelihood request: token-id prompts in a list, max_tokens 1, logprobs 1, echo: each choice has
    its prompt's tokens, their log-probabilities (null for the first) as one forward computes them, the top
    alternative at each position, and offsets into the echoed text."""
    base, (m, greedy) = server[0], local
    prompts = [m.tokenizer.encode("hello the hall"), m.tokenizer.encode("1 2 3 4")]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234,
            "model": "jaxinfer"}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
    assert reply["model"] == "tiny.gguf" and [c["index"] for c in reply["choices"]] == [0, 1]
    for ids, choice in zip(prompts, reply["choices"]):
        logprobs = choice["logprobs"]
        generated, _ = greedy(ids, 1)
        assert logprobs["tokens"] == [m.tokenizer.decode([t]) for t in ids] + [generated]
        assert choice["text"] == m.tokenizer.decode(ids) + generated
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        assert np.allclose(logprobs["token_logprobs"][1:len(ids)], reference_logprobs(m, ids), atol=1e-4)
        assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
        assert list(logprobs["top_logprobs"][-1]) == [generated]  # greedy: the top alternative was taken
        assert logprobs["token_logprobs"][-1] == pytest.approx(logprobs["top_logprobs"][-1][generated])
        offsets = logprobs["text_offset"]
        assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"]))
    alone = httpx.post(f"{base}/v1/completions", json={**body, "prompt": prompts[1]}, timeout=60).json()
    assert alone["choices"][0]["logprobs"] == reply["choices"][1]["logprobs"]
    assert reply["usage"]["prompt_tokens"] == sum(map(len, prompts)) and reply["usage"]["completion_tokens"] == 2


def test_chat_logprobs_as_openais_content_list(client):
    reply = client.chat.completions.create(model="any-name", messages=[{"role": "user", "content": "hello the"}],
                                           max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens and reply.model == "tiny.gguf"
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0


def test_tokenizer_endpoints_for_remote_tokenizers(server, local):
    """What lm-eval's tokenizer_backend=remote asks for: /tokenizer_info, /tokenize with 'prompt', /detokenize."""
    base, (m, _) = server[0], local
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert info["eos_token"] == m.tokenizer.decode([m.tokenizer.eos_id])
    assert info["chat_template"] == m.tokenizer.chat_template
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": "hello the", "add_special_tokens": False}).json()
    assert tokens["tokens"] == m.tokenizer.encode("hello the", add_bos=False)
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "hello the"


def test_a_conversations_next_turn_prefills_only_what_its_slot_does_not_hold(server, client, local):
    """The prompt cache: the second turn of a chat goes to the slot that served the first and prefills only the new
    messages (usage.prompt_tokens_details.cached_tokens, /metrics), with the greedy text generate gives alone."""
    base, (m, greedy) = server[0], local
    messages = [{"role": "system", "content": " ".join(["be brief and the hall"] * 8)},
                {"role": "user", "content": "hello the"}]

    def ask(messages, **extra):
        ids = m.tokenizer.encode(engine.apply_chat_template(m.tokenizer.chat_template, messages, m.tokenizer))
        reply = client.chat.completions.create(model="tiny.gguf", messages=messages, max_tokens=8, temperature=0,
                                               **extra)
        assert reply.choices[0].message.content == greedy(ids, 8)[0]
        return ids, reply

    first_ids, first = ask(messages)
    before = metrics(base)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and then?"}]
    ids, second = ask(messages)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert len(first_ids) <= cached < len(ids) == second.usage.prompt_tokens
    assert metrics(base)["jaxinfer_prompt_tokens_cached_total"] == before["jaxinfer_prompt_tokens_cached_total"] + cached
    _, uncached = ask(messages, extra_body={"cache_prompt": False})
    assert uncached.usage.prompt_tokens_details.cached_tokens == 0


def test_structured_output_through_openais_client(client):
    """response_format over HTTP, chat (streamed too) and completions: each seed's reply parses and validates against
    its schema (test_structured_output.py checks many more, json_object's too: on this model's random strings a
    reply of any object may run for thousands of tokens)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "w": {"enum": ["the", "hall"]}}, "required": ["n", "w"],
              "additionalProperties": False}
    for seed in range(3):
        reply = client.chat.completions.create(
            model="tiny.gguf", messages=[{"role": "user", "content": "hi"}], temperature=1.0, seed=seed,
            max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        answer = json.loads(reply.choices[0].message.content)
        assert set(answer) == {"n", "w"} and 0 <= answer["n"] <= 99 and answer["w"] in ("the", "hall")
        chunks = client.chat.completions.create(
            model="tiny.gguf", messages=[{"role": "user", "content": "hi"}], temperature=1.0, seed=seed,
            max_tokens=200, stream=True, response_format={"type": "json_schema", "json_schema": {"schema": schema}})
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == reply.choices[0].message.content
        completion = client.completions.create(model="tiny.gguf", prompt="1 2 3", temperature=1.0, seed=seed,
                                               max_tokens=200, extra_body={"response_format": {
                                                   "type": "json_schema", "json_schema": {"schema": schema}}})
        assert json.loads(completion.choices[0].text).keys() == {"n", "w"}


def test_the_chat_page_is_served_at_the_root_and_streams_over_the_chat_api(server, client):
    """GET /: one HTML page whose inline script streams /v1/chat/completions (with the usage chunk for tokens/s) and
    sends the whole conversation each turn; its script may call only this server. The stream it reads is checked
    here as the page parses it: 'data: ' events, the text in choices[0].delta.content, the usage last."""
    page = httpx.get(f"{server[0]}/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    policy = page.headers["content-security-policy"]
    assert "connect-src 'self'" in policy and "default-src 'none'" in policy
    html = page.text
    assert html.startswith("<!doctype html>") and "<script>" in html and "src=" not in html  # nothing to fetch
    for reference in ('const API = "/v1/chat/completions"', "stream: true", "include_usage: true", "messages.push(",
                      "delta.content", "completion_tokens", "tokens/s", ".textContent = text"):
        assert reference in html, reference
    assert "innerHTML" not in html  # replies are shown as text, never as markup
    events = httpx.post(f"{server[0]}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True},
        "temperature": 0, "max_tokens": 6}).text.split("\n\n")
    chunks = [json.loads(e.removeprefix("data: ")) for e in events if e and e != "data: [DONE]"]
    reply = client.chat.completions.create(model="tiny.gguf", messages=[{"role": "user", "content": "hi"}],
                                           temperature=0, max_tokens=6)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        reply.choices[0].message.content
    assert chunks[-1]["usage"]["completion_tokens"] == reply.usage.completion_tokens

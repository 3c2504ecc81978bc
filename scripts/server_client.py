"""The client side shared by bench_server.py and load_test_server.py: requests to an OpenAI-compatible server (ours or
llama.cpp's llama-server), streamed or not, each timed and checked as it arrives, run from a number of concurrent
clients; /metrics read back. Needs httpx (pip install httpx, or the project's `bench` extra)."""

import dataclasses
import json
import threading
import time

import httpx
import numpy as np

from jaxinfer.errors import JaxinferError

CONNECT_TIMEOUT_S = 5.0
# The prompts' text: each request takes the first N words, N from PROMPT_WORDS, after a number of its own so that no
# two prompts share more than a few tokens (llama-server reuses a slot's cached prefix; ours does not).
TEXT = ("The history of computing is a story of machines that got smaller, faster and cheaper while the problems "
        "people gave them kept growing. Early computers filled rooms and were programmed by rewiring panels; later "
        "ones read punched cards, then magnetic tape, then disks. Each step changed who could use a computer and for "
        "what. Scientists modelled weather and bombs, banks kept accounts, airlines booked seats. When the "
        "microprocessor arrived, computers moved onto desks and into homes, and software became an industry of its "
        "own. Networks then joined the machines together, and the web turned them into a library, a shop and a post "
        "office at once. Today a phone holds more memory than every computer of the nineteen sixties together, and "
        "people carry it in a pocket without a thought. Language models are the newest chapter: programs that "
        "continue a text one token at a time, trained on a large part of everything people have written down. "
        "Serving them well means keeping many conversations going at once on hardware that is never quite enough.")
PROMPT_WORDS = (4, 24, 64, 160)
HEADERS: dict[str, str] = {}  # sent with every request (use_api_key)


def use_api_key(key: str | None):
    """Send `Authorization: Bearer KEY` with every request from now on (a server started with --api-key)."""
    HEADERS.pop("Authorization", None)
    if key:
        HEADERS["Authorization"] = f"Bearer {key}"


def prompt(index: int, words: int) -> str:
    """Request `index`'s prompt: its number, then the first `words` words of TEXT (repeated if need be)."""
    base = TEXT.split()
    return f"Request {index}: " + " ".join(base[i % len(base)] for i in range(words))


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request to send, and how its client gives up on it on purpose (at most one of the two cancel fields)."""

    prompt: str
    max_tokens: int
    stream: bool = True
    chat: bool = False  # /v1/chat/completions with one user message, else /v1/completions
    temperature: float = 0.0
    ignore_eos: bool = True  # llama-server's field: generate exactly max_tokens
    cancel_after_chunks: int | None = None  # streaming: close the connection after this many content chunks
    cancel_after_s: float | None = None  # not streaming: give up waiting after this long

    def body(self) -> dict:
        body = {"max_tokens": self.max_tokens, "temperature": self.temperature, "stream": self.stream,
                "ignore_eos": self.ignore_eos}
        if self.stream:  # OpenAI refuses stream_options on a request that does not stream
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            return body | {"messages": [{"role": "user", "content": self.prompt}]}
        return body | {"prompt": self.prompt}

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"


@dataclasses.dataclass
class Outcome:
    """How one request went."""

    status: int | None = None  # the HTTP status (None: no response)
    content_chunks: int = 0  # stream chunks (or the one body) with generated text
    usage_tokens: int | None = None  # completion_tokens of the server's usage, when it gave them
    ttft_s: float | None = None  # from sending to the first generated text
    gaps_s: list[float] = dataclasses.field(default_factory=list)  # between consecutive content chunks
    finish_reason: str | None = None
    done: bool = False  # a stream ended with data: [DONE]
    cancelled: bool = False  # the client gave up on purpose before the end
    error: str | None = None  # one line on what went wrong; None: completed (or cancelled)
    clean: bool = False  # the error was the server's own JSON error (a refusal, a bad request), not a broken exchange

    @property
    def tokens(self) -> int:
        """Generated tokens: the server's count when it gave one, else one per content chunk (one per token as
        llama-server streams; ours holds back text that may still turn into a stop string or a UTF-8 character)."""
        return self.usage_tokens if self.usage_tokens is not None else self.content_chunks

    @property
    def completed(self) -> bool:
        return self.error is None and not self.cancelled


def send(client: httpx.Client, base: str, spec: RequestSpec, read_timeout_s: float) -> Outcome:
    """Send `spec` and follow it to its end -> its Outcome (never raises for what the server or network does)."""
    outcome = Outcome()
    timeout = read_timeout_s if spec.cancel_after_s is None else spec.cancel_after_s
    start = time.perf_counter()
    try:
        with client.stream("POST", base + spec.path, json=spec.body(),
                           timeout=httpx.Timeout(timeout, connect=CONNECT_TIMEOUT_S)) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                _read_error(response, outcome)
            elif spec.stream:
                _read_stream(response, spec, outcome, start)
            else:
                _read_whole(response, spec, outcome, start)
    except httpx.TimeoutException:
        if spec.cancel_after_s is not None:
            outcome.cancelled = True
        else:
            outcome.error = f"no answer within {timeout:g} s"
    except httpx.HTTPError as e:
        outcome.error = f"{type(e).__name__}: {e}"
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:  # a body that is not what OpenAI sends
        outcome.error = f"malformed response ({type(e).__name__}: {e})"
    return outcome


def _read_error(response: httpx.Response, outcome: Outcome):
    text = response.read().decode(errors="replace")
    try:
        error = json.loads(text)["error"]
        outcome.error, outcome.clean = f"{response.status_code}: {error['message']}", True
    except (ValueError, KeyError, TypeError):
        outcome.error = f"{response.status_code} without a JSON error: {text[:200]!r}"


def _content(choice: dict, chat: bool) -> str | None:
    return (choice.get("delta") or {}).get("content") if chat else choice.get("text")


def _read_stream(response: httpx.Response, spec: RequestSpec, outcome: Outcome, start: float):
    last = None
    for line in response.iter_lines():
        if not line.startswith("data:"):  # blank separators, SSE comments
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            outcome.done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:  # the server's error event, then [DONE]
            outcome.error, outcome.clean = f"error event: {chunk['error'].get('message')}", True
            continue
        if chunk.get("usage"):  # ours: a last chunk without choices; llama-server: on the finish_reason chunk
            outcome.usage_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or ():
            if _content(choice, spec.chat):
                now = time.perf_counter()
                if last is None:
                    outcome.ttft_s = now - start
                else:
                    outcome.gaps_s.append(now - last)
                last = now
                outcome.content_chunks += 1
            if choice.get("finish_reason"):
                outcome.finish_reason = choice["finish_reason"]
        if spec.cancel_after_chunks is not None and outcome.content_chunks >= spec.cancel_after_chunks:
            outcome.cancelled = outcome.finish_reason is None
            if outcome.cancelled:
                return  # leaving the `with` closes the connection mid-stream
    if not outcome.done:  # even after an error event: the end of a stream is always data: [DONE]
        after = f" (after {outcome.error})" if outcome.error else ""
        outcome.error, outcome.clean = f"the stream ended without data: [DONE]{after}", False
    elif outcome.error is None and outcome.finish_reason is None:
        outcome.error = "the stream ended without a finish_reason"


def _read_whole(response: httpx.Response, spec: RequestSpec, outcome: Outcome, start: float):
    body = json.loads(response.read())
    outcome.ttft_s = time.perf_counter() - start
    choice = body["choices"][0]
    outcome.content_chunks = 1 if (choice["message"]["content"] if spec.chat else choice["text"]) else 0
    outcome.finish_reason = choice.get("finish_reason")
    outcome.usage_tokens = body["usage"]["completion_tokens"]
    if outcome.finish_reason is None:
        outcome.error = "the response has no finish_reason"


def run_concurrently(base: str, specs: list[RequestSpec], clients: int, read_timeout_s: float
                     ) -> tuple[list[Outcome], float]:
    """Send `specs` from `clients` threads, each with its own connection, taking the next spec as it finishes one
    -> (the outcomes in the order of `specs`, wall seconds from the first send to the last answer)."""
    outcomes: list[Outcome | None] = [None] * len(specs)
    next_index = iter(range(len(specs)))
    lock = threading.Lock()

    def client_loop():
        with httpx.Client(headers=HEADERS) as client:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                outcomes[i] = send(client, base, specs[i], read_timeout_s)

    threads = [threading.Thread(target=client_loop, name=f"client-{n}") for n in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, time.perf_counter() - start


def check_server(base: str) -> str:
    """Fail with one line unless the server at `base` answers /health with 200 -> the model it serves."""
    try:
        health = httpx.get(base + "/health", timeout=CONNECT_TIMEOUT_S)
        if health.status_code != 200:
            raise JaxinferError(f"the server at {base} is not ready: /health answered {health.status_code}")
        models = httpx.get(base + "/v1/models", headers=HEADERS, timeout=CONNECT_TIMEOUT_S)
        if models.status_code == 401:
            raise JaxinferError(f"the server at {base} asks for an API key: give it with --api_key")
        models = models.json()
    except httpx.HTTPError as e:
        raise JaxinferError(f"cannot reach the server at {base} ({type(e).__name__}: {e})") from None
    except ValueError:
        raise JaxinferError(f"{base}/v1/models did not answer JSON: is this an OpenAI-compatible server?") from None
    return models["data"][0]["id"] if models.get("data") else "?"


def metrics(base: str) -> dict[str, float]:
    """/metrics' samples by name (labels kept in the name); {} when the server has no /metrics (llama-server without
    --metrics)."""
    try:
        response = httpx.get(base + "/metrics", headers=HEADERS, timeout=CONNECT_TIMEOUT_S)
    except httpx.HTTPError as e:
        raise JaxinferError(f"cannot read {base}/metrics ({type(e).__name__}: {e})") from None
    if response.status_code != 200:
        return {}
    samples = {}
    for line in response.text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and not line.startswith("#"):
            samples[parts[0]] = float(parts[1])
    return samples


def percentile_ms(seconds: list[float], q: float) -> float | None:
    return round(float(np.percentile(seconds, q)) * 1000, 2) if seconds else None

"""OpenAI-compatible serving without the HTTP layer: request bodies checked into typed requests, responses and
stream chunks in OpenAI's shapes, and stop strings applied on the detokenized text. scheduler.py runs the requests;
python -m jaxinfer.server puts HTTP in front of both."""

import dataclasses
import json
import os
import time
import uuid

from jaxinfer import engine, structured_output
from jaxinfer.errors import JaxinferError
from jaxinfer.sampling import SamplingParams

UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
REPEAT_LAST_N = 64  # llama-server's default; fixed: the window's size shapes the compiled programs
# Stop strings are matched on the thread that generates for every slot: their count and length are bounded (OpenAI
# takes 4; lm-eval's generate_until sends a task's `until` list, rarely more than a handful).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_SAMPLING_VALUE = 1e6  # temperature and repeat_penalty: larger ones overflow nothing but mean nothing either
MAX_MODEL_NAME = 256  # a `model` field longer than this is refused
MAX_LOGPROBS = 20  # alternatives per position (scoring.TOP): OpenAI's chat allows 20, its legacy completions 5
MAX_PROMPTS = 64  # prompts in one completions request (each a choice)
# Fields of OpenAI's API this server does not implement: refused unless they ask for nothing (their value here).
UNSUPPORTED = {"best_of": (None, 1), "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"),
               "functions": (None, []), "function_call": (None, "none"), "suffix": (None, "")}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
               415: "invalid_request_error", 499: "invalid_request_error", 500: "server_error",
               503: "unavailable_error"}


class RequestError(Exception):
    """A request the server refuses, with its HTTP status; its message is one line for the client."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.retry_after_s = status, retry_after_s  # a 503's Retry-After header

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"Retry-After": str(self.retry_after_s)}

    def body(self) -> dict:
        return error_body(self.status, str(self))


def error_body(status: int, message: str) -> dict:
    """OpenAI's (and llama-server's) error object."""
    return {"error": {"code": status, "message": message, "type": ERROR_TYPES.get(status, "server_error")}}


@dataclasses.dataclass
class Request:
    """A checked generation request. `chat` selects the chat shapes of responses (else completion shapes)."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk carries the usage counts
    ignore_eos: bool = False  # llama-server's: stop tokens do not end the request (benchmarks of fixed lengths)
    logprobs: int | None = None  # log-probabilities wanted, with this many alternatives per token (None: none)
    echo: bool = False  # completions: the prompt's text (and with logprobs, its tokens) come back first
    cache_prompt: bool = True  # llama-server's: the prefill starts after the prefix a free slot still holds
    grammar: str | None = None  # llguidance's grammar the reply follows (response_format or grammar), None: free text


# ---- reading request bodies ----

def parse_json(raw: bytes):
    """A request body's JSON, every string in it valid Unicode: JSON's escapes can spell a lone surrogate ("\\ud800")
    that no text encoding takes (the tokenizer would fail on it)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError; RecursionError: deep nesting
        raise RequestError(400, f"the request body is not valid JSON ({e})") from None
    values = [body]
    while values:
        value = values.pop()
        if isinstance(value, str) and not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise RequestError(400, "a string in the request body is not valid Unicode (it holds a lone "
                                        "surrogate, such as \\ud800)") from None
        elif isinstance(value, dict):
            values += [*value.keys(), *value.values()]
        elif isinstance(value, list):
            values += value
    return body


def _field(body: dict, name: str, kinds: tuple[type, ...], what: str, default=None, required: bool = False):
    """body[name] when it is one of `kinds` (bools are not numbers here), `default` when absent or null."""
    value = body.get(name)
    if value is None:
        if required:
            raise RequestError(400, f"'{name}' is required")
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise RequestError(400, f"'{name}' must be {what}, got {type(value).__name__}")
    return value


def _integer(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = _field(body, name, (int,), "an integer", default)
    if value is not None and not low <= value <= high:
        raise RequestError(400, f"'{name}' must be an integer in [{low}, {high}], got {value}")
    return value


def _stop_strings(body: dict) -> list[str]:
    stop = _field(body, "stop", (str, list), "a string or a list of strings", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not all(isinstance(s, str) for s in stop):
        raise RequestError(400, "'stop' must be a string or a list of strings")
    if any(s == "" for s in stop):
        raise RequestError(400, "'stop' strings must not be empty")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(400, f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    if (longest := max(map(len, stop), default=0)) > MAX_STOP_CHARS:
        raise RequestError(400, f"'stop' strings may be at most {MAX_STOP_CHARS} characters long, got {longest}")
    return stop


def _refuse_unsupported(body: dict):
    """A field this server does not honour gets a 400 rather than a 200 that ignores it."""
    for name, harmless in UNSUPPORTED.items():
        if name in body and body[name] not in harmless:
            raise RequestError(400, f"'{name}' is not supported by this server")
    stream_options = _field(body, "stream_options", (dict,), "an object", {})
    if not isinstance(stream_options.get("include_usage", False), bool):
        raise RequestError(400, "'stream_options.include_usage' must be a boolean")


def _sampling_number(body: dict, name: str, default: float) -> float:
    value = _field(body, name, (int, float), "a number", default)
    if abs(value) > MAX_SAMPLING_VALUE:  # float32 would make an infinity of it; NaN passes to validate()
        raise RequestError(400, f"'{name}' must be at most {MAX_SAMPLING_VALUE:g}, got {value:g}")
    return value


def _is_id(value) -> bool:
    """A token id (an int, not a bool)."""
    return type(value) is int


def _message_text(content, index: int) -> str:
    """A message's content: a string, or OpenAI's list of text parts (their texts joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(400, f"'messages[{index}].content' must be a string or a list of text parts")


def _messages(body: dict) -> list[dict]:
    messages = _field(body, "messages", (list,), "a list of messages", required=True)
    if not messages:
        raise RequestError(400, "'messages' must not be empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(400, f"'messages[{i}]' must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(400, f"'messages[{i}].role' must be a non-empty string")
        checked.append({"role": role, "content": _message_text(message.get("content"), i)})
    return checked


class Parser:
    """Turns request bodies into Requests for one loaded model served with a context of `ctx` positions, each
    generating at most `n_predict` tokens (None: as many as the context holds)."""

    def __init__(self, m: engine.LoadedModel, model_id: str, ctx: int, n_predict: int | None = None):
        self.model, self.model_id, self.ctx, self.n_predict = m, model_id, ctx, n_predict
        # A token spells at most this many characters, so a text of more than ctx times as many cannot fit: it is
        # refused before the tokenizer spends time and memory on it.
        vocab = m.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
        self.max_chars = ctx * max(map(len, vocab), default=1)
        self.grammars = structured_output.Grammars(m.tokenizer, m.config.n_vocab)

    def check_length(self, text_chars: int, what: str):
        if text_chars > self.max_chars:
            raise RequestError(400, f"{what} is {text_chars} characters, more than a slot's context of {self.ctx} "
                                    f"tokens can hold: give each slot more context (-c / -np) or shorten it")

    def chat(self, body) -> Request:
        body = self._object(body)
        messages = _messages(body)
        self.check_length(sum(len(m["content"]) for m in messages), "the conversation")
        template = self.model.tokenizer.chat_template
        if not template:
            raise RequestError(400, "the model has no chat template (tokenizer.chat_template): use /v1/completions")
        try:
            prompt = engine.apply_chat_template(template, messages, self.model.tokenizer)
        except JaxinferError as e:
            raise RequestError(400, str(e)) from None
        # The template writes the special tokens; a BOS is added only where the vocabulary asks and it is missing.
        ids = self.model.tokenizer.encode(prompt)
        if len(ids) > 1 and ids[0] == ids[1] == self.model.tokenizer.bos_id:
            ids = ids[1:]
        return self._request(body, ids, chat=True, max_tokens_names=("max_completion_tokens", "max_tokens"),
                             grammar=self._grammar(body))

    def completion(self, body) -> Request:
        """The one request of a completions body (the server takes several prompts through `completions`)."""
        requests = self.completions(body)
        if len(requests) != 1:
            raise RequestError(400, "'prompt' must be one prompt here")
        return requests[0]

    def completions(self, body) -> list[Request]:
        """A completions body's requests, one per prompt: `prompt` is a string, a list of token ids, or a list of
        either (each a choice of the response)."""
        body = self._object(body)
        prompts = body.get("prompt")
        if prompts is None:
            raise RequestError(400, "'prompt' is required and must be a string")
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and _is_id(prompts[0])):
            prompts = [prompts]  # one prompt: text, or token ids
        if not isinstance(prompts, list) or not prompts or len(prompts) > MAX_PROMPTS:
            raise RequestError(400, f"'prompt' must be a string, a list of token ids, or a list of 1 to {MAX_PROMPTS} "
                                    f"of either")
        if len(prompts) > 1 and _field(body, "stream", (bool,), "a boolean", False):
            raise RequestError(400, "a stream takes one prompt")
        n_vocab = self.model.config.n_vocab
        grammar = self._grammar(body)
        requests = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self.check_length(len(prompt), "the prompt")
                ids = self.model.tokenizer.encode(prompt)
            elif isinstance(prompt, list) and all(_is_id(t) and 0 <= t < n_vocab for t in prompt):
                ids = list(prompt)
            else:
                raise RequestError(400, f"'prompt[{i}]' must be a string or a list of token ids in [0, {n_vocab})")
            requests.append(self._request(body, ids, chat=False, max_tokens_names=("max_tokens",), grammar=grammar))
        return requests

    def _object(self, body) -> dict:
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise RequestError(400, f"'model' must be a string, got {type(model).__name__}")
        if model is not None and len(model) > MAX_MODEL_NAME:
            raise RequestError(400, f"'model' may be at most {MAX_MODEL_NAME} characters, got {len(model)}")
        # Any other name is served (one model is loaded, as llama-server does): responses name the real one.
        _refuse_unsupported(body)
        _stop_strings(body)  # before the prompt is tokenized
        return body

    def _grammar(self, body: dict) -> str | None:
        """The grammar of the body's response_format or grammar (structured_output.py), checked: a 400 otherwise."""
        try:
            grammar = structured_output.grammar_of(body)
            self.grammars.check(grammar, "'grammar'" if body.get("grammar") is not None else "'response_format'")
        except JaxinferError as e:
            raise RequestError(400, str(e)) from None
        return grammar

    def _request(self, body: dict, ids: list[int], chat: bool, max_tokens_names: tuple[str, ...],
                 grammar: str | None = None) -> Request:
        try:
            engine.check_prompt(len(ids), self.ctx, self.model.config.n_ctx_train)
        except JaxinferError as e:
            raise RequestError(400, str(e).replace("raise -c/--ctx_size", "give each slot more context (-c / -np)"))
        room = self.ctx - len(ids)
        max_tokens = room
        for name in max_tokens_names:
            max_tokens = _integer(body, name, None, 1, INT32_MAX) or max_tokens
        if _integer(body, "n", 1, 1, 1) != 1:
            raise RequestError(400, "'n' must be 1")
        params = SamplingParams(
            temperature=_sampling_number(body, "temperature", 0.8),
            top_k=_field(body, "top_k", (int,), "an integer", 40),
            top_p=_field(body, "top_p", (int, float), "a number", 0.95),
            min_p=_field(body, "min_p", (int, float), "a number", 0.05),
            repeat_penalty=_sampling_number(body, "repeat_penalty", 1.0),
            repeat_last_n=REPEAT_LAST_N,
            frequency_penalty=_field(body, "frequency_penalty", (int, float), "a number", 0.0),
            presence_penalty=_field(body, "presence_penalty", (int, float), "a number", 0.0))
        try:
            params.validate(name=lambda field: f"'{field}'")  # the ranges generate's flags have
        except JaxinferError as e:
            raise RequestError(400, str(e)) from None
        if _integer(body, "repeat_last_n", REPEAT_LAST_N, -1, INT32_MAX) != REPEAT_LAST_N:
            raise RequestError(400, f"'repeat_last_n' must be {REPEAT_LAST_N} (the server's repeat-penalty window)")
        seed = _integer(body, "seed", -1, -1, UINT32_MAX)
        stream_options = _field(body, "stream_options", (dict,), "an object", {})
        stream = _field(body, "stream", (bool,), "a boolean", False)
        if chat:
            wanted = _field(body, "logprobs", (bool,), "a boolean", False)
            top = _integer(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
            logprobs, echo = (top if wanted else None), False
        else:
            logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
            echo = _field(body, "echo", (bool,), "a boolean", False)
        if logprobs is not None and stream:
            raise RequestError(400, "'logprobs' cannot be streamed by this server: ask without 'stream'")
        if logprobs is not None and (self.model.split is not None or self.model.config.plan.tp > 1):
            # scoring.py runs the plain forward of one device's weights
            raise RequestError(400, "'logprobs' is not supported with a hot/cold split (--vram-budget) or --tp")
        return Request(chat=chat, prompt_ids=ids, max_tokens=min(max_tokens, room, self.n_predict or room),
                       params=params, seed=seed if seed >= 0 else time.time_ns() % 2**31, stop=_stop_strings(body),
                       stream=stream, include_usage=stream_options.get("include_usage", False),
                       ignore_eos=_field(body, "ignore_eos", (bool,), "a boolean", False), logprobs=logprobs, echo=echo,
                       cache_prompt=_field(body, "cache_prompt", (bool,), "a boolean", True), grammar=grammar)


# ---- text out of tokens ----

class StopMatcher:
    """Where stop strings occur in a text fed to it piece by piece, in time linear in the text: for each stop string,
    Knuth-Morris-Pratt's state, the length of the longest end of the text so far that begins the string."""

    def __init__(self, stop: list[str]):
        self.stop, self.fed = stop, 0
        self.partial = [0] * len(stop)
        self.fallback = [_kmp_fallback(s) for s in stop]

    def feed(self, text: str) -> int | None:
        """Read text[self.fed:] -> the start of the earliest stop string that ends in it, or None."""
        found = None
        for i, (s, back) in enumerate(zip(self.stop, self.fallback)):
            n = self.partial[i]
            for position in range(self.fed, len(text)):
                c = text[position]
                while n and s[n] != c:
                    n = back[n - 1]
                if s[n] == c:
                    n += 1
                if n == len(s):
                    start = position + 1 - n
                    found = start if found is None else min(found, start)
                    n = back[n - 1]
            self.partial[i] = n
        self.fed = len(text)
        return found

    @property
    def held(self) -> int:
        """Characters at the end of the text that could still begin a stop string."""
        return max(self.partial, default=0)


def _kmp_fallback(s: str) -> list[int]:
    """fallback[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    fallback, n = [0] * len(s), 0
    for i in range(1, len(s)):
        while n and s[i] != s[n]:
            n = fallback[n - 1]
        if s[i] == s[n]:
            n += 1
        fallback[i] = n
    return fallback


class TextAssembler:
    """Detokenized text of a growing token list, released only where it is final: an incomplete UTF-8 sequence and
    any tail that could begin a stop string are held back; at a stop string the text before it is all there is.

    Each token decodes a short window (from the token before the last complete text): decoding the whole list each
    time would cost a long reply quadratic time. The window keeps a token of context because a tokenizer may decode
    a token differently at the start (SentencePiece drops its leading space there). Stop strings are looked for in the
    new characters only (StopMatcher): this runs on the thread that generates for every slot."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.ids, self.text, self.sent, self.stopped = tokenizer, [], "", 0, False
        self.window_start = self.decoded = 0  # ids[window_start:decoded] are context; ids[:decoded] are in `text`
        self.matcher = StopMatcher(stop)

    def add(self, token: int) -> str:
        """The newly final text after `token`; sets `stopped` when a stop string appeared."""
        self.ids.append(token)
        self._decode(complete_only=True)
        found = self.matcher.feed(self.text)
        if found is not None:
            self.stopped = True
            return self._release(found)
        # A stop string may be starting at the end: its first characters wait for the tokens that decide it.
        return self._release(max(len(self.text) - self.matcher.held, self.sent))

    def finish(self) -> str:
        """What was held back, once no token follows."""
        if self.stopped:
            return ""
        self._decode(complete_only=False)
        return self._release(len(self.text))

    def _decode(self, complete_only: bool):
        """Append the text of the tokens not yet in `text`; with `complete_only`, only once it ends in a whole
        character (a multi-byte one may be split over tokens)."""
        context = self.tokenizer.decode(self.ids[self.window_start:self.decoded])
        window = self.tokenizer.decode(self.ids[self.window_start:])
        if complete_only and (len(window) <= len(context) or window.endswith("\ufffd")):
            return
        self.text += window[len(context):]
        self.window_start, self.decoded = self.decoded, len(self.ids)

    def _release(self, end: int) -> str:
        piece = self.text[self.sent:end]
        self.sent += len(piece)
        return piece


# ---- responses ----

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens taken from the prompt cache, not prefilled."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Responder:
    """The response bodies of one request, in chat or completion shapes."""

    def __init__(self, request: Request, model_id: str, tokenizer=None):
        self.request, self.model_id, self.created = request, model_id, int(time.time())
        self.tokenizer = tokenizer  # for logprobs and echo: the tokens' text
        self.id = ("chatcmpl-" if request.chat else "cmpl-") + uuid.uuid4().hex

    def _envelope(self, kind: str, choice: dict, **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model_id,
                "choices": [choice], **extra}

    def complete(self, text: str, finish_reason: str, counts: dict, scores: dict | None = None) -> dict:
        """The whole response; `scores`: the request's tokens scored (scheduler: scoring.score of prompt and reply)."""
        return self.complete_all([(text, finish_reason, scores)], counts)

    def complete_all(self, replies: list[tuple[str, str, dict | None]], counts: dict) -> dict:
        """The whole response of one or more prompts: (text, finish_reason, scores) each, a choice each."""
        choices = []
        for index, (text, finish_reason, scores) in enumerate(replies):
            if self.request.chat:
                logprobs = None if scores is None else {"content": self._chat_logprobs(scores)}
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "finish_reason": finish_reason, "logprobs": logprobs})
            else:
                prompt = self.tokenizer.decode(scores["ids"][:scores["n_prompt"]]) if scores else ""
                logprobs = None if scores is None or self.request.logprobs is None else self._legacy_logprobs(
                    scores, len(prompt))
                choices.append({"index": index, "text": (prompt if self.request.echo else "") + text,
                                "finish_reason": finish_reason, "logprobs": logprobs})
        return {**self._envelope("chat.completion" if self.request.chat else "text_completion", {}),
                "choices": choices, "usage": counts}

    def _legacy_logprobs(self, scores: dict, prompt_chars: int) -> dict:
        """OpenAI's legacy completions logprobs: tokens, token_logprobs (null for the first of an echoed prompt),
        top_logprobs ({token: logprob}, null there too) and text_offset (into prompt + completion)."""
        start = 0 if self.request.echo else scores["n_prompt"]
        ids, top_n = scores["ids"][start:], self.request.logprobs
        tokens = [self.tokenizer.decode([t]) for t in ids]
        tops = []
        for alternatives in scores["top"][start:]:
            top = {}
            for t, lp in alternatives[:top_n]:  # most likely first: two ids of the same text keep the likelier
                top.setdefault(self.tokenizer.decode([t]), lp)
            tops.append(top if alternatives else None)
        offsets, offset = [], 0 if self.request.echo else prompt_chars
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": scores["token_logprobs"][start:], "top_logprobs": tops,
                "text_offset": offsets}

    def _chat_logprobs(self, scores: dict) -> list[dict]:
        """OpenAI's chat logprobs content: each generated token with its logprob, bytes and top_logprobs."""
        def entry(token_id, logprob):
            token = self.tokenizer.decode([token_id])
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}

        start = scores["n_prompt"]
        return [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top[:self.request.logprobs]]}
                for t, lp, top in zip(scores["ids"][start:], scores["token_logprobs"][start:], scores["top"][start:])]

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict:
        """A stream chunk: `role` marks a chat stream's first chunk, `finish_reason` its last."""
        if self.request.chat:
            delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("chat.completion.chunk", choice)
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("text_completion", choice)

    def usage_chunk(self, counts: dict) -> dict:
        """stream_options.include_usage's last chunk: no choices, the request's usage."""
        return {**self._envelope("chat.completion.chunk" if self.request.chat else "text_completion", {}),
                "choices": [], "usage": counts}


def model_id(path: str) -> str:
    """The name /v1/models lists and requests may give: the GGUF's file name."""
    return os.path.basename(path)

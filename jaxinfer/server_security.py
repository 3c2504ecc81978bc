"""What stands between the network and the server's routes (python -m jaxinfer.server): an ASGI middleware that checks
the Host header, answers CORS only for the origins given, asks for an API key, takes JSON bodies only, and reads a
body within a size and a time limit before any route sees it; and uvicorn's HTTP/1.1 protocol with a deadline for a
request's headers. Each refusal is OpenAI's JSON error object (serving.error_body) with one line of text."""

import asyncio
import dataclasses
import hmac
import ipaddress
import json
from collections.abc import Callable

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from jaxinfer.errors import JaxinferError
from jaxinfer.serving import error_body

BODY_POLL_S = 0.25  # how often a body being read checks whether the server is shutting down
# Answered without an API key: a load balancer's probe has none, and a browser loading the chat page sends none (the
# page sends the key the user gives it with its API calls).
OPEN_PATHS = frozenset({"/health", "/"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclasses.dataclass(frozen=True)
class Policy:
    """api_keys: any of them opens the routes but OPEN_PATHS (none: no key asked). allowed_hosts: the names the Host
    header may give (None: any). cors_origins: the origins a browser may call from ("*": any; none: no CORS)."""

    api_keys: tuple[str, ...] = ()
    allowed_hosts: frozenset[str] | None = None
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 8 * 2**20
    body_timeout_s: float = 60.0


def read_api_keys(keys: str | None, key_file: str | None) -> tuple[str, ...]:
    """The keys of --api-key (comma-separated, as llama-server's) and --api-key-file (one a line, blank lines and
    lines starting with # skipped)."""
    found = [k.strip() for k in (keys or "").split(",") if k.strip()]
    if key_file is not None:
        try:
            with open(key_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise JaxinferError(f"cannot read --api-key-file {key_file}: {getattr(e, 'strerror', None) or e}") from None
        found += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not found:
            raise JaxinferError(f"--api-key-file {key_file} holds no key")
    if any(not k.isascii() or not k.isprintable() or " " in k for k in found):
        raise JaxinferError("an API key must be printable ASCII without spaces (it travels in an HTTP header)")
    return tuple(found)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def allowed_hosts(listen_host: str, configured: str | None) -> frozenset[str] | None:
    """The Host names requests may give: --allowed_hosts's (comma-separated; "*" any), else those of the address the
    server listens on (a loopback address: every loopback name, so that a DNS-rebinding page cannot read a local
    server's replies; a wildcard address, 0.0.0.0 or ::, does not name the server: any)."""
    if configured is not None:
        names = {name.strip().lower() for name in configured.split(",") if name.strip()}
        return None if "*" in names else frozenset(names)
    if listen_host in ("0.0.0.0", "::", ""):
        return None
    names = {listen_host.lower().strip("[]")}
    if is_loopback(listen_host):
        names.update(LOOPBACK_NAMES)
    return frozenset(names)


def host_name(header: str) -> str:
    """The name of a Host header, without its port: "[::1]:8080" -> "::1", "Example.com:80" -> "example.com"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Guard:
    """The checks, in order: the Host header (400), CORS (a preflight answered here; replies carry
    Access-Control-Allow-Origin for an allowed origin), the API key (401, but OPEN_PATHS), a POST's Content-Type
    (415: a browser may send text/plain across origins without asking first), and its body: too large (413, from
    Content-Length before any byte is read), too slow (408), or the client gone (nothing to answer). The route then
    gets the body as read."""

    def __init__(self, app, policy: Policy):
        self.app, self.policy = app, policy
        self.closing = False  # set when a shutdown's time is up: bodies still arriving get a 503

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        policy = self.policy
        host = headers.get("host", "")
        if policy.allowed_hosts is not None and host_name(host) not in policy.allowed_hosts:
            return await respond(send, 400, f"the Host header {host[:100]!r} does not name this server (the names "
                                            f"it answers to are set with --allowed_hosts)")
        origin = headers.get("origin")
        cors = origin is not None and ("*" in policy.cors_origins or origin in policy.cors_origins)
        if cors:
            send = with_cors_headers(send, origin)
            if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
                return await respond(send, 204, None, [
                    ("access-control-allow-methods", "GET, POST"),
                    ("access-control-allow-headers", "Authorization, Content-Type"), ("access-control-max-age", "600")])
        if policy.api_keys and scope["path"] not in OPEN_PATHS and not self.authorized(headers):
            return await respond(send, 401, "invalid or missing API key: send the header 'Authorization: Bearer KEY'",
                                 [("www-authenticate", "Bearer")])
        if scope["method"] != "POST":
            return await self.app(scope, receive, send)
        media_type = headers.get("content-type", "").split(";")[0].strip().lower()
        if media_type != "application/json":
            return await respond(send, 415, f"the request body must be JSON, sent with 'Content-Type: "
                                            f"application/json' (got {media_type[:100] or 'none'!r})")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > policy.max_body_bytes:
            return await respond(send, 413, too_large(policy.max_body_bytes), [("connection", "close")])
        body, status = await self.read_body(receive)
        if status is None:
            return  # the client went away during the upload: nobody to answer
        if status != 200:
            message = {413: too_large(policy.max_body_bytes), 503: "the server is shutting down",
                       408: f"the request body did not arrive within {policy.body_timeout_s:g} s (--body_timeout)"}
            return await respond(send, status, message[status], [("connection", "close")])
        await self.app(scope, replay(body, receive), send)

    def authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = key.strip().encode("latin-1")
        # compare_digest for every key: how long a refusal takes says nothing about the keys.
        return sum(hmac.compare_digest(given, k.encode()) for k in self.policy.api_keys) > 0

    async def read_body(self, receive) -> tuple[bytes, int | None]:
        """The whole body -> (body, 200), or 413 past the limit, 408 past the deadline, 503 once the server is
        closing, None when the client left."""
        pieces, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), min(BODY_POLL_S, max(0.0, deadline - loop.time())))
            except TimeoutError:
                if self.closing:
                    return b"", 503
                if loop.time() >= deadline:
                    return b"", 408
                continue
            if message["type"] == "http.disconnect":
                return b"", None
            piece = message.get("body", b"")
            size += len(piece)
            if size > self.policy.max_body_bytes:
                return b"", 413
            pieces.append(piece)
            if not message.get("more_body", False):
                return b"".join(pieces), 200


def too_large(limit: int) -> str:
    return f"the request body is larger than the server's limit of {limit} bytes (--max_body_mb)"


def replay(body: bytes, receive):
    """An ASGI receive that gives `body` first, then what the connection says (a disconnect)."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


def with_cors_headers(send, origin: str):
    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"access-control-allow-origin",
                                                                             origin.encode("latin-1")),
                                              (b"vary", b"Origin")]}
        await send(message)

    return sending


async def respond(send, status: int, message: str | None, headers: list[tuple[str, str]] = ()):
    """A whole response: OpenAI's error object for `message` (none: an empty body)."""
    body = b"" if message is None else json.dumps(error_body(status, message)).encode()
    fields = [(b"content-length", str(len(body)).encode())] + [(k.encode(), v.encode()) for k, v in headers]
    if message is not None:
        fields.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": fields})
    await send({"type": "http.response.body", "body": body})


class ShutdownTimer(uvicorn.Server):
    """uvicorn's server, calling `time_is_up()` `seconds` into its graceful shutdown (so that the requests left end
    with an answer before uvicorn's own timeout cancels their handlers)."""

    def __init__(self, config: uvicorn.Config, seconds: float, time_is_up: Callable[[], None]):
        super().__init__(config)
        self.seconds, self.time_is_up = seconds, time_is_up

    async def shutdown(self, sockets=None):
        timer = asyncio.get_running_loop().call_later(self.seconds, self.time_is_up)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def header_deadline_protocol(seconds: float) -> type[H11Protocol]:
    """uvicorn's HTTP/1.1 protocol, with a connection closed (after a 408) when a request's headers have not all
    arrived `seconds` after it opened or after the last response: an idle or half-sent request would otherwise hold
    its connection, and a graceful shutdown, for ever."""

    class HeaderDeadline(H11Protocol):
        deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc):
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

        def _arm(self):
            if self.deadline is not None:
                self.deadline.cancel()
            waiting_for = self.cycle  # a new request replaces the cycle as soon as its headers are read
            self.deadline = self.loop.call_later(seconds, self._expire, waiting_for)

        def _expire(self, waiting_for):
            # No request since the deadline was set (a request whose headers are in has a cycle of its own, until
            # its response is complete).
            idle = self.cycle is None or self.cycle.response_complete
            if self.cycle is waiting_for and idle and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                self.transport.close()

    return HeaderDeadline

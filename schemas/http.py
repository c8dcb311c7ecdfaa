"""HTTP serving shared by `sao serve` and `sao reward serve`: uvicorn in the service's process, the
guards every POST passes before its handler sees the body, and Prometheus metrics on `GET /metrics`.

Bounds a hostile client cannot get past (`HttpConfig`): a listen backlog the kernel queues bursts
in; at most `max_connections` connections, past which uvicorn answers 503; request headers within
`read_timeout_s` of their first byte (or of the connection) and then the body within
`read_timeout_s` of the headers, else 408 and the connection is closed; idle keep-alive
connections closed after `keep_alive_s`; on shutdown, requests in flight get `shutdown_s`.

Guards (`Guard.body`), in this order, so nothing is read for a request refused early: the bearer
token (constant-time; the scheme is case-insensitive, RFC 7235), a Content-Length (411 without one
or chunked encoding) within the size limit (413; a chunked body is counted as it streams and
refused once over, unread beyond), `Content-Type: application/json` (415), then JSON with at most
`MAX_DEPTH` levels of nesting, integers within ±2**63 and no NaN/Infinity (400 naming where).
Every refusal is `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape), and an
early one (body unread) closes the connection, since the unread body would be read as the next
request. GETs (health, metrics) need no token: they say nothing a client could train on.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import math
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from .config import ConfigError, is_loopback

MAX_DEPTH = 64
"""Deepest JSON nesting accepted; no request of ours needs a tenth of it."""
MAX_INT = 1 << 63
"""Largest JSON integer magnitude accepted: what a signed 64-bit field holds (seeds, token ids)."""
_BODY_READ = "sao.body_read"  # scope key: the request's body was read to its end
_FIELD = re.compile(r"([A-Za-z_][\w.\[\]]*): ")


@dataclass(kw_only=True)
class HttpConfig:
    backlog: int = 2048
    """Connections the kernel queues before the server accepts them (a burst waits, never refused)."""
    max_connections: int = 1024
    """Most connections open (and requests in flight) at once; past it a request is answered 503."""
    read_timeout_s: float = 10.0
    """Seconds a client has to send a request's headers, then again its body; past it: 408, closed."""
    keep_alive_s: float = 5.0
    """Seconds an idle keep-alive connection stays open."""
    shutdown_s: float = 3.0
    """Seconds requests in flight get to finish on SIGTERM before they are cancelled."""

    def __post_init__(self):
        if min(self.backlog, self.max_connections) < 1 or min(self.read_timeout_s, self.keep_alive_s,
                                                               self.shutdown_s) <= 0:
            raise ConfigError("--http.backlog and --http.max-connections must be >= 1, "
                              "--http.read-timeout-s, --http.keep-alive-s and --http.shutdown-s > 0")


def check_exposure(host: str, token: str, flag: str) -> None:
    """ConfigError for a server bound beyond loopback without a bearer token (`flag`): its POSTs
    decide what the model learns."""
    if not token and not is_loopback(host):
        raise ConfigError(f"--host {host} is beyond loopback: set {flag} (SAO_{flag[2:].upper().replace('-', '_')})")


class RequestError(ValueError):
    """A request the server refuses: `status` is the HTTP answer, `param` the field at fault (by
    default the message's leading `field:`), `reason` its label in the rejections metric."""

    def __init__(self, message: str, status: int = 400, *, param: str | None = None, reason: str = "invalid"):
        super().__init__(message)
        self.status, self.reason = status, reason
        named = _FIELD.match(message)
        self.param = param if param is not None else named.group(1) if named else None


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(e: RequestError, close: bool) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else {}
    if e.status == 429:
        headers["Retry-After"] = "1"
    if close:
        headers["Connection"] = "close"
    return JSONResponse(error_body(str(e), e.status, e.param), e.status, headers)


class _Refused:
    """A JSON value refused where it stands (too large an integer, NaN); `_check` names its place."""

    def __init__(self, problem: str):
        self.problem = problem


def _int(text: str) -> int | _Refused:
    if len(text) > 20 or abs(n := int(text)) > MAX_INT:  # the length test spares int() a million digits
        return _Refused(f"integer {text[:24]}{'...' if len(text) > 24 else ''} is beyond ±2**63")
    return n


def _float(text: str) -> float | _Refused:
    x = float(text)
    return x if math.isfinite(x) else _Refused(f"number {text[:24]} is beyond a double's range")


def _check(value: Any, path: str = "", depth: int = 1) -> None:
    """Raise RequestError at the first refused value or nesting beyond MAX_DEPTH, naming its
    place (`messages[0].content`); the recursion is as deep as the nesting, so bounded."""
    if isinstance(value, _Refused):
        raise RequestError(f"{path or 'body'}: {value.problem}", param=path or None, reason="json")
    if depth > MAX_DEPTH:
        raise RequestError(f"{path or 'body'}: JSON nested deeper than {MAX_DEPTH} levels", reason="json")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(item, (dict, list, _Refused)):  # scalars need no visit: a long prompt stays cheap
            _check(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key, depth + 1)


def parse_json(data: bytes) -> Any:
    """The JSON value of a request body; RequestError (400) naming where it is not one we accept."""
    try:
        value = json.loads(data, parse_int=_int, parse_float=_float,
                           parse_constant=lambda c: _Refused(f"{c} is not a number JSON allows"))
    except RecursionError:  # the C scanner nests ~1000 deep before Python's stack guard stops it
        raise RequestError(f"body: JSON nested deeper than {MAX_DEPTH} levels", reason="json") from None
    except ValueError as e:  # also bad UTF-8
        raise RequestError(f"body: not valid JSON ({e})", reason="json") from None
    _check(value)
    return value


@dataclass(frozen=True, kw_only=True)
class Guard:
    """The checks of every POST (see the module docstring) and the body's size and time limits."""

    token: str
    """Bearer token every POST must carry; empty: none (loopback only, the configs check)."""
    max_body: int
    """Most bytes a body may have."""
    read_timeout_s: float
    """Seconds the body may take to arrive once the headers have."""
    limit_note: str = ""
    """Why `max_body` is what it is, for the 413's message."""

    def check_token(self, headers) -> None:
        """RequestError 401 unless `Authorization: Bearer <token>`; hashing first makes the
        comparison constant-time whatever the lengths."""
        if not self.token:
            return
        scheme, _, given = headers.get("authorization", "").partition(" ")
        same = hmac.compare_digest(hashlib.sha256(given.strip().encode()).digest(),
                                   hashlib.sha256(self.token.encode()).digest())
        if not (scheme.lower() == "bearer" and same):
            raise RequestError("Authorization: missing or wrong bearer token (Authorization: Bearer <token>)",
                               401, reason="token")

    async def body(self, request: Request) -> dict:
        """The request's JSON object ({} for an empty body), checked in the module docstring's order."""
        self.check_token(request.headers)
        length = self._length(request.headers)
        if length == 0:
            request.scope[_BODY_READ] = True
            return {}
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise RequestError(f"Content-Type: expected application/json, got {media or 'none'!r}", 415,
                               reason="content_type")
        body = parse_json(await self._read(request))
        if not isinstance(body, dict):
            raise RequestError("body: expected a JSON object")
        return body

    def _length(self, headers) -> int | None:
        """The declared body length (None: chunked, counted as it comes). h11 has refused a
        Content-Length that is not one number, before the app saw the request."""
        declared = headers.get("content-length")
        if declared is None:
            if "chunked" not in headers.get("transfer-encoding", "").lower():
                raise RequestError("Content-Length: required (or Transfer-Encoding: chunked)", 411, reason="length")
            return None
        if int(declared) > self.max_body:
            raise self._too_large()
        return int(declared)

    def _too_large(self) -> RequestError:
        return RequestError(f"body: over the limit of {self.max_body} bytes{self.limit_note}", 413, reason="too_large")

    async def _read(self, request: Request) -> bytes:
        chunks, n = [], 0
        try:
            async with asyncio.timeout(self.read_timeout_s):
                async for chunk in request.stream():
                    n += len(chunk)
                    if n > self.max_body:
                        raise self._too_large()
                    chunks.append(chunk)
        except TimeoutError:
            raise RequestError(f"body: not received within {self.read_timeout_s:g} s ({n} bytes came)", 408,
                               reason="timeout") from None
        except ClientDisconnect:
            raise RequestError("body: the client went away before sending it all", reason="disconnect") from None
        request.scope[_BODY_READ] = True
        return b"".join(chunks)


class Metrics:
    """One server's Prometheus metrics, in a registry of its own: `{prefix}_requests_total{route,
    status}`, `{prefix}_request_seconds{route}` and `{prefix}_rejections_total{reason}`."""

    def __init__(self, prefix: str):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(f"{prefix}_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.seconds = Histogram(f"{prefix}_request_seconds", "Seconds from request headers to the end of the answer",
                                 ["route"], registry=r,
                                 buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, math.inf))
        self.rejections = Counter(f"{prefix}_rejections", "Requests refused, by reason", ["reason"], registry=r)

    async def endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class _Counted:
    """ASGI middleware counting every answer by route (its pattern, so ids do not become labels)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500  # 500: what the client gets if the app raises

        async def sending(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope["route"].path if "route" in scope else "other"
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.seconds.labels(route).observe(time.perf_counter() - start)


def make_app(routes: list[Route], metrics: Metrics) -> Starlette:
    """A starlette app of `routes` plus `GET /metrics`; every refusal answered in `error_body`'s
    shape and counted."""
    async def refused(request: Request, e: RequestError) -> JSONResponse:
        metrics.rejections.labels(e.reason).inc()
        return error_response(e, close=not request.scope.get(_BODY_READ))

    async def no_route(request: Request, e: HTTPException) -> JSONResponse:
        return await refused(request, RequestError(f"{request.method} {request.url.path}: {e.detail}",
                                                   e.status_code, reason="route"))

    async def crashed(request: Request, e: Exception) -> JSONResponse:  # logged by uvicorn, which it reaches
        return JSONResponse(error_body(f"internal error ({type(e).__name__}); see the server's log", 500), 500)

    return Starlette(routes=[*routes, Route("/metrics", metrics.endpoint)], middleware=[Middleware(_Counted, metrics)],
                     exception_handlers={RequestError: refused, HTTPException: no_route, Exception: crashed})


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with what it lacks against slow or broken clients: request headers
    must arrive within `read_timeout_s` of the connection or of their first byte (uvicorn times
    only idle keep-alive), and a request h11 cannot parse (a Content-Length that is not a number)
    is refused in `error_body`'s shape, naming h11's reason, rather than as plain text."""

    def __init__(self, *args, read_timeout_s: float, metrics: Metrics, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout_s, self.metrics = read_timeout_s, metrics
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.read_timeout_s, self._head_late)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._stop_timer()
        elif self._head_timer is None:  # the first bytes of a keep-alive connection's next request
            self._head_timer = self.loop.call_later(self.read_timeout_s, self._head_late)

    def connection_lost(self, exc) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_late(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._refuse(408, f"request headers not received within {self.read_timeout_s:g} s", "timeout")

    def send_400_response(self, msg: str) -> None:
        error = sys.exception()  # uvicorn calls this inside its `except h11.RemoteProtocolError`
        self._refuse(getattr(error, "error_status_hint", 400), f"malformed HTTP request: {error or msg}", "malformed")

    def _refuse(self, status: int, message: str, reason: str) -> None:
        """Answer outside h11's state machine (it has no request to answer), then close."""
        self.metrics.rejections.labels(reason).inc()
        body = json.dumps(error_body(message[:300], status)).encode()
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (status, STATUS_PHRASES[status], len(body), body))
        self.transport.close()


class Server:
    """uvicorn serving `routes` (and `GET /metrics`) with the bounds of `cfg`, on a socket bound
    here, so `server_address` is known (port 0 included) before `serve_forever` runs; requests
    arriving before then wait in the backlog. `shutdown` may be called from any thread."""

    def __init__(self, routes: list[Route], *, metrics_prefix: str, cfg: HttpConfig, host: str, port: int):
        self.metrics = Metrics(metrics_prefix)
        self.socket = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                           backlog=cfg.backlog)
        self.server_address = self.socket.getsockname()
        protocol = functools.partial(_Protocol, read_timeout_s=cfg.read_timeout_s, metrics=self.metrics)
        self._uvicorn = uvicorn.Server(uvicorn.Config(
            make_app(routes, self.metrics), http=protocol, ws="none", lifespan="off", backlog=cfg.backlog,
            limit_concurrency=cfg.max_connections, timeout_keep_alive=cfg.keep_alive_s,
            timeout_graceful_shutdown=cfg.shutdown_s,
            log_config=None, access_log=False,  # the service's logging stays its own
            proxy_headers=False, server_header=False))  # no proxy in front to trust; no version to show
        self._stopped = threading.Event()
        self._stopped.set()

    def serve_forever(self) -> None:
        """Serve until `shutdown`; uvicorn runs its own event loop in the calling thread."""
        self._stopped.clear()
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop serving, waiting for requests in flight up to `shutdown_s`, then cancelling them."""
        self._uvicorn.should_exit = True
        self._stopped.wait()

    def server_close(self) -> None:
        self.socket.close()

    def serve_until(self, stop: threading.Event, check: Callable[[], None] = lambda: None) -> None:
        """Serve in a thread until `stop` is set (SIGTERM) or `check()` raises, then shut down."""
        thread = threading.Thread(target=self.serve_forever, name="http", daemon=True)
        thread.start()
        try:
            while not stop.wait(0.5):
                check()
                if not thread.is_alive():
                    raise RuntimeError("the HTTP server stopped")
        finally:
            self.shutdown()
            self.server_close()

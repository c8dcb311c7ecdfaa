"""Hostile HTTP clients for the tests of both endpoints (`sao serve`, `sao reward serve`): a burst
of requests at once, half-sent requests, and raw requests no well-behaved client would send.
Loopback only; every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Awaitable, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sao.broker import free_port


def request(path: str, body: bytes = b"", headers: dict[str, str | None] | None = None, token: str = "") -> bytes:
    """A POST as raw bytes: JSON, its Content-Length and the bearer token unless `headers` replace
    or (None) drop them; `Connection: close`, so the answer ends with the connection."""
    base = {"Host": "127.0.0.1", "Connection": "close", "Content-Type": "application/json",
            "Content-Length": str(len(body)), "Authorization": f"Bearer {token}" if token else None}
    lines = [f"{k}: {v}" for k, v in {**base, **(headers or {})}.items() if v is not None]
    return (f"POST {path} HTTP/1.1\r\n" + "\r\n".join(lines) + "\r\n\r\n").encode() + body


def exchange(port: int, data: bytes, timeout: float = 30.0) -> tuple[int, dict]:
    """Send raw bytes, read the answer until the server closes; its status and JSON body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        return parse(read_all(s))


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def parse(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def flood(n: int, send: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]],
          timeout: float = 60.0) -> tuple[list, float]:
    """`n` requests at once, each on its own connection: their statuses (or the error of those not
    answered within `timeout`) and the wall seconds until the last answer."""
    async def burst():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            start = time.perf_counter()
            answers = await asyncio.gather(*(send(client) for _ in range(n)), return_exceptions=True)
            return ([a.status_code if isinstance(a, httpx.Response) else repr(a) for a in answers],
                    time.perf_counter() - start)
    return asyncio.run(burst())


def half_send(port: int, data: bytes, n: int) -> list[socket.socket]:
    """`n` connections that each send `data` (headers, and a body cut short) and then nothing."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(data)
        socks.append(s)
    return socks


def dropped(socks: list[socket.socket], within: float) -> list[int]:
    """The status each half-sent connection was answered with before the server closed it, all
    within `within` seconds (a socket still open then raises TimeoutError)."""
    deadline = time.monotonic() + within
    statuses = []
    for s in socks:
        with s:
            s.settimeout(max(deadline - time.monotonic(), 0.01))
            statuses.append(parse(read_all(s))[0])
    return statuses


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus endpoint (0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def health(port: int) -> dict:
    """`GET /health`'s JSON; {} while nothing answers."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
    except httpx.HTTPError:
        return {}


def seconds_to_stop(kafka, args: list[str], path: str, token: str, ready: Callable[[dict], bool]) -> float:
    """Start `sao <args> --port P`, wait until `ready(its health)`, then SIGTERM it while a
    half-sent request to `path` is open: the seconds until it exited, with status 0."""
    from tests.consumers.util import Service, wait_until

    port = free_port()
    service = Service(kafka, *args, "--port", str(port))
    try:
        wait_until(lambda: service.p.poll() is not None or ready(health(port)), timeout=120)
        assert service.p.poll() is None, service.log()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(request(path, b"{", {"Content-Length": "9"}, token))
            start = time.monotonic()
            service.p.send_signal(signal.SIGTERM)
            assert service.p.wait(30) == 0, service.log()
            return time.monotonic() - start
    finally:
        service.p.kill()

"""schemas/http.py alone: bounded JSON (hand cases and a random-input property), the bearer check,
and the protocol's bounds on a real uvicorn on loopback (slow headers, keep-alive, early refusals
closing the connection). The endpoints' own hostile-client tests are in tests/producers/
test_serve_hostile.py and tests/consumers/test_endpoint.py."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from hypothesis import given, strategies as st
from starlette.responses import JSONResponse
from starlette.routing import Route

from schemas.config import ConfigError
from schemas.http import MAX_DEPTH, MAX_INT, Guard, HttpConfig, RequestError, Server, parse_json
from tests.http_clients import parse, read_all, request

TOKEN = "t0ken"
READ_TIMEOUT_S = 1.0


@pytest.mark.parametrize("text, where, words", [
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "[0]" * MAX_DEPTH, "nested deeper"),
    ('{"a": ' * (MAX_DEPTH + 1) + "0" + "}" * (MAX_DEPTH + 1), ".a" * MAX_DEPTH, "nested deeper"),
    ("[" * 100_000, "body", "nested deeper"),  # C-stack deep: the scanner's own guard
    (f'{{"seed": {MAX_INT + 1}}}', "seed", "beyond ±2**63"),
    (f'{{"x": [{-MAX_INT - 1}]}}', "x[0]", "beyond ±2**63"),
    ('{"x": "' + "9" * 100_000 + '"}', None, None),  # digits in a string are a string
    ('{"messages": [{"content": NaN}]}', "messages[0].content", "NaN is not a number"),
    ('{"t": -Infinity}', "t", "Infinity is not a number"),
    ('{"t": 1e400}', "t", "beyond a double"),
    ('{"t": 1', "body", "not valid JSON"),
    (b'{"t": "\xff"}', "body", "not valid JSON"),
])
def test_parse_json_names_where_a_value_is_refused(text, where, words):
    if where is None:
        assert parse_json(text.encode()) == json.loads(text)
        return
    with pytest.raises(RequestError) as e:
        parse_json(text if isinstance(text, bytes) else text.encode())
    message = str(e.value)
    assert e.value.status == 400 and message.startswith(where.lstrip(".")) and words in message, message


def test_parse_json_accepts_the_bounds_themselves():
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert parse_json(deepest.encode()) == json.loads(deepest)
    assert parse_json(f"[{MAX_INT}, {-MAX_INT}, 1e308]".encode()) == [MAX_INT, -MAX_INT, 1e308]


_values = st.recursive(st.none() | st.booleans() | st.integers(-MAX_INT, MAX_INT) | st.text(max_size=5)
                       | st.floats(allow_nan=False, allow_infinity=False),
                       lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
                       max_leaves=30)


@given(_values)
def test_parse_json_reads_what_the_standard_library_reads_within_the_bounds(value):
    data = json.dumps(value).encode()
    assert parse_json(data) == json.loads(data)


def test_the_bearer_check_wants_the_token_and_takes_the_scheme_in_any_case():
    guard = Guard(token=TOKEN, max_body=10, read_timeout_s=1)
    for header in (f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER  {TOKEN}"):
        guard.check_token({"authorization": header})
    for header in ("", TOKEN, f"Basic {TOKEN}", f"Bearer {TOKEN}x", "Bearer", f"Bearer{TOKEN}"):
        with pytest.raises(RequestError) as e:
            guard.check_token({"authorization": header})
        assert e.value.status == 401 and e.value.param == "Authorization"
    Guard(token="", max_body=10, read_timeout_s=1).check_token({})  # no token set: none asked


def test_bad_bounds_name_the_flag():
    with pytest.raises(ConfigError, match="--http.read-timeout-s"):
        HttpConfig(read_timeout_s=0)


@pytest.fixture(scope="module")
def echo():
    guard = Guard(token=TOKEN, max_body=1000, read_timeout_s=READ_TIMEOUT_S)

    async def echoed(req):
        return JSONResponse(await guard.body(req))

    server = Server([Route("/echo", echoed, methods=["POST"])], metrics_prefix="test",
                    cfg=HttpConfig(read_timeout_s=READ_TIMEOUT_S), host="127.0.0.1", port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _answer(s: socket.socket) -> tuple[int, dict, bytes]:
    """One keep-alive answer off `s`: status, JSON body, head."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(v for k, v in (line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
                      if k.lower() == b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split(b" ")[1]), json.loads(body), head.lower()


def test_headers_sent_too_slowly_are_answered_408_and_closed(echo):
    for data in (b"", b"POST /echo HTTP/1.1\r\nHost: x\r\n"):  # silent, and stalled mid-headers
        with socket.create_connection(("127.0.0.1", echo), timeout=READ_TIMEOUT_S + 10) as s:
            s.sendall(data)
            start = time.monotonic()
            status, body = parse(read_all(s))
        assert status == 408 and "headers not received" in body["error"]["message"]
        assert READ_TIMEOUT_S - 0.1 < time.monotonic() - start < READ_TIMEOUT_S + 5


def test_a_read_body_keeps_the_connection_and_an_unread_one_closes_it(echo):
    with socket.create_connection(("127.0.0.1", echo), timeout=10) as s:
        keep = {"Connection": None}
        for body in (b'{"a": 1}', b'{"b": [2]}'):  # two requests on one connection
            s.sendall(request("/echo", body, keep, TOKEN))
            assert _answer(s)[:2] == (200, json.loads(body))
        s.sendall(request("/echo", b'{"a": NaN}', keep, TOKEN))  # refused, but read: the connection stays
        status, _, head = _answer(s)
        assert status == 400 and b"connection: close" not in head
        s.sendall(request("/echo", b"", {**keep, "Content-Length": "5000"}, TOKEN))  # refused unread
        status, _, head = _answer(s)
        assert status == 413 and b"connection: close" in head
        assert s.recv(1) == b""


def test_an_empty_body_is_an_empty_object_whatever_its_content_type(echo):
    with socket.create_connection(("127.0.0.1", echo), timeout=10) as s:
        s.sendall(request("/echo", b"", {"Content-Type": None}, TOKEN))
        assert parse(read_all(s)) == (200, {})

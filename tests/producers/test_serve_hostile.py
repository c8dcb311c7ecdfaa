"""`sao serve` against hostile clients, on a real server on loopback: a burst answered whole,
half-sent requests timed out while others are served, every malformed request a 4xx naming its
problem, Prometheus counters that move, and SIGTERM obeyed within its bound."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from producers.generate.hf import HFGenerator
from producers.models import load_model
from schemas.catalogue import TINY_LLAMA
from producers.serve.service import make_server
from schemas.http import HttpConfig
from schemas.tokenizers import load_tokenizer
from tests.http_clients import dropped, exchange, flood, half_send, metric, request, seconds_to_stop

TOKEN = "s3cret"
READ_TIMEOUT_S = 2.0
OK = {"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 0}
LIMIT = (1 << 20) + 64 * TINY_LLAMA["max_positions"]  # the server's body limit for this model


@pytest.fixture(scope="module")
def served():
    server = make_server(HFGenerator(load_model("tiny-llama")), load_tokenizer("tiny-llama"), token=TOKEN,
                         max_concurrent=300, http=HttpConfig(read_timeout_s=READ_TIMEOUT_S))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _complete(port: int, body=OK, **headers) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {TOKEN}", **headers})


def test_300_concurrent_completions_are_all_answered(served):
    statuses, wall = flood(300, lambda client: client.post(
        f"http://127.0.0.1:{served}/v1/completions", json=OK, headers={"Authorization": f"Bearer {TOKEN}"}))
    print(f"sao serve: {statuses.count(200)}/300 completions answered 200 in {wall:.1f} s")
    assert statuses == [200] * 300 and wall < 60


def test_half_sent_requests_are_dropped_by_the_read_timeout_while_others_are_served(served):
    socks = half_send(served, request("/v1/completions", b'{"prompt": [1', {"Content-Length": "100"}, TOKEN), 200)
    start = time.monotonic()
    assert _complete(served).status_code == 200  # meanwhile
    statuses = dropped(socks, within=READ_TIMEOUT_S + 20)
    print(f"sao serve: 200 half-sent requests dropped in {time.monotonic() - start:.1f} s")
    assert statuses == [408] * 200
    assert _complete(served).status_code == 200  # and after


def _body(**change) -> bytes:
    return json.dumps({**OK, **change}).encode()


HUGE = {"Content-Length": str(10 ** 12)}
MALFORMED = {  # why: (body sent, headers replaced, status, words of the message, param)
    "deep JSON": (b"[" * 60000, {}, 400, "nested deeper than 64", "body"),
    "deep but valid JSON": (b'{"prompt": [1], "x": ' + b"[" * 70 + b"]" * 70 + b"}", {}, 400, "nested deeper",
                            "x" + "[0]" * 63),
    "Content-Length abc": (b"{}", {"Content-Length": "abc"}, 400, "bad Content-Length", None),
    "Content-Length -1": (b"{}", {"Content-Length": "-1"}, 400, "bad Content-Length", None),
    "Content-Length huge": (b"", HUGE, 413, "over the limit", "body"),
    "no Content-Length, a body": (_body(), {"Content-Length": None}, 411, "Content-Length: required", None),
    "chunked, over the limit": (b"%x\r\n" % (10 * LIMIT) + b"1" * (LIMIT + 1),  # the rest of the chunk never sent
                                {"Content-Length": None, "Transfer-Encoding": "chunked"}, 413, "over the limit", "body"),
    "JSON as text/plain": (_body(), {"Content-Type": "text/plain"}, 415, "application/json", None),
    "no token": (_body(), {"Authorization": None}, 401, "bearer token", "Authorization"),
    "wrong token": (_body(), {"Authorization": "Bearer guess"}, 401, "bearer token", "Authorization"),
    "wrong token, huge body": (b"", {**HUGE, "Authorization": "Bearer guess"}, 401, "bearer token", "Authorization"),
    "seed 2**70": (_body(seed=2 ** 70), {}, 400, "beyond", "seed"),
    "seed -1": (_body(seed=-1), {}, 400, "2**63", "seed"),
    "temperature 1e-300": (_body(temperature=1e-300), {}, 400, "log-probs need a distribution", "temperature"),
    "temperature NaN": (_body().replace(b'"max_tokens"', b'"temperature": NaN, "max_tokens"'), {}, 400,
                        "NaN is not a number", "temperature"),
    "temperature Infinity": (_body().replace(b'"max_tokens"', b'"temperature": -Infinity, "max_tokens"'), {}, 400,
                             "Infinity is not a number", "temperature"),
    "temperature 1e999": (_body().replace(b'"max_tokens"', b'"temperature": 1e999, "max_tokens"'), {}, 400,
                          "beyond a double", "temperature"),
    "top_p 0": (_body(top_p=0), {}, 400, "(0, 1]", "top_p"),
    "max_tokens 0": (_body(max_tokens=0), {}, 400, "[1,", "max_tokens"),
    "max_tokens a string": (_body(max_tokens="8"), {}, 400, "integer", "max_tokens"),
    "prompt id 2**64": (_body(prompt=[1, 2 ** 64]), {}, 400, "beyond", "prompt[1]"),
    "a list, not an object": (b"[1, 2]", {}, 400, "JSON object", "body"),
}


@pytest.mark.parametrize("why", MALFORMED)
def test_a_malformed_request_is_a_4xx_naming_its_problem(served, why):
    body, headers, status, words, param = MALFORMED[why]
    start = time.monotonic()
    got, answer = exchange(served, request("/v1/completions", body, headers, TOKEN))
    assert (got, answer["error"]["param"]) == (status, param) and words in answer["error"]["message"], answer
    assert time.monotonic() - start < READ_TIMEOUT_S  # refused at once, never waiting for a body it does not read
    assert _complete(served).status_code == 200


def test_the_bearer_scheme_is_case_insensitive(served):
    assert _complete(served, Authorization=f"bearer {TOKEN}").status_code == 200
    assert _complete(served, Authorization=f"BEARER {TOKEN}").status_code == 200
    assert _complete(served, Authorization=f"Basic {TOKEN}").status_code == 401


def test_metrics_count_requests_by_route_and_status_and_rejections_by_reason(served):
    url = f"http://127.0.0.1:{served}/metrics"
    ok, bad, token = (metric(url, "sao_serve_requests_total", route="/v1/completions", status=s) for s in ("200", "400", "401"))
    rejected = metric(url, "sao_serve_rejections_total", reason="token")
    timed = metric(url, "sao_serve_request_seconds_count", route="/v1/completions")
    assert _complete(served).status_code == 200
    assert _complete(served, body={**OK, "top_p": 0}).status_code == 400
    assert _complete(served, Authorization="Bearer guess").status_code == 401
    assert metric(url, "sao_serve_requests_total", route="/v1/completions", status="200") == ok + 1
    assert metric(url, "sao_serve_requests_total", route="/v1/completions", status="400") == bad + 1
    assert metric(url, "sao_serve_requests_total", route="/v1/completions", status="401") == token + 1
    assert metric(url, "sao_serve_rejections_total", reason="token") == rejected + 1
    assert metric(url, "sao_serve_request_seconds_count", route="/v1/completions") == timed + 3


def test_sigterm_stops_the_server_within_its_bound_with_a_request_in_flight(kafka_cfg):
    seconds = seconds_to_stop(kafka_cfg, ["serve", "--model", "tiny-llama", "--serve-token", TOKEN],
                              "/v1/completions", TOKEN, ready=lambda h: h.get("status") == "ok")
    print(f"sao serve: exited {seconds:.1f} s after SIGTERM")
    assert seconds < 10

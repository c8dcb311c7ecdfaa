"""`sao reward serve` on the real broker: what it publishes, what it refuses and why, hostile
clients (a burst answered whole, half-sent requests timed out, malformed requests a 4xx naming
their problem), its metrics, SIGTERM, and a start before its topics exist."""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest
from confluent_kafka.admin import AdminClient

from consumers.endpoint import MAX_BODY, RewardServer, RewardServeConfig
from schemas import topics as T
from schemas.config import ConfigError
from schemas.http import HttpConfig
from schemas.kafka import KafkaConfig, ensure_topics
from schemas.messages import Reward
from tests.consumers.util import pending_trajectory, publish, read_topic, wait_until
from tests.http_clients import dropped, exchange, flood, half_send, health, metric, request, seconds_to_stop

TOKEN = "s3cret-token"
READ_TIMEOUT_S = 2.0


def _serving(cfg: RewardServeConfig):
    srv = RewardServer(cfg)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


@pytest.fixture
def server(kafka_cfg):
    srv = _serving(RewardServeConfig(port=0, reward_token=TOKEN, seen_wait=2.0, kafka=kafka_cfg))
    yield kafka_cfg, f"http://127.0.0.1:{srv.port}/rewards"
    srv.close()


@pytest.fixture(scope="module")
def hostile(module_kafka):
    """A server for the hostile clients, and a trajectory id it has seen pending."""
    tid = f"t-{uuid.uuid4().hex[:8]}"
    publish(module_kafka, T.PENDING, [pending_trajectory(tid)])
    srv = _serving(RewardServeConfig(port=0, reward_token=TOKEN, seen_wait=1.0, kafka=module_kafka,
                               http=HttpConfig(read_timeout_s=READ_TIMEOUT_S)))
    wait_until(lambda: _post(f"http://127.0.0.1:{srv.port}/rewards", {"trajectory_id": tid, "reward": 1})
               .status_code == 202, timeout=60)  # the reader has joined its group and read the id
    yield srv.port, tid
    srv.close()


def _post(url: str, body, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    content = body if isinstance(body, (str, bytes)) else httpx.Request("POST", url, json=body).content
    return httpx.post(url, content=content, headers=headers, timeout=30)


def test_a_valid_reward_for_a_pending_trajectory_lands_on_the_rewards_topic_and_bad_ones_do_not(server):
    kafka, url = server
    tid = f"t-{uuid.uuid4().hex[:8]}"
    publish(kafka, T.PENDING, [pending_trajectory(tid)])
    refused = {
        "malformed JSON": (_post(url, b'{"trajectory_id": '), 400, "JSON"),
        "NaN": (_post(url, f'{{"trajectory_id": "{tid}", "reward": NaN}}'), 400, "NaN"),
        "unknown field": (_post(url, {"trajectory_id": tid, "reward": 1, "bonus": 2}), 400, "bonus"),
        "wrong type": (_post(url, {"trajectory_id": tid, "reward": "high"}), 400, "reward"),
        "negative index": (_post(url, {"trajectory_id": tid, "reward": 1, "token_index": -3}), 400, "token_index"),
        "no token": (_post(url, {"trajectory_id": tid, "reward": 1}, token=None), 401, "token"),
        "wrong token": (_post(url, {"trajectory_id": tid, "reward": 1}, token="guess"), 401, "token"),
        "never pending": (_post(url, {"trajectory_id": "ghost", "reward": 1}), 404, "never seen"),
    }
    for why, (resp, code, reason) in refused.items():
        assert resp.status_code == code and reason in resp.json()["error"]["message"], (why, resp.text)
    ok = _post(url, {"trajectory_id": tid, "reward": 0.5, "criterion": "concise"})
    assert ok.status_code == 202, ok.text
    rewards = read_topic(kafka, T.REWARDS, 2, timeout=5)
    assert len(rewards) == 1, "a refused request published something"
    [r] = rewards
    assert isinstance(r, Reward) and (r.trajectory_id, r.reward, r.source, r.criterion) == (tid, 0.5, "http", "concise")


def test_refuses_to_start_beyond_loopback_without_a_token():
    with pytest.raises(ConfigError, match="reward-token"):
        RewardServeConfig(host="0.0.0.0")
    assert RewardServeConfig(host="127.0.0.1").reward_token == ""
    assert RewardServeConfig(host="0.0.0.0", reward_token=TOKEN).host == "0.0.0.0"


def test_300_concurrent_rewards_are_all_answered(hostile):
    port, tid = hostile
    body = {"trajectory_id": tid, "reward": 1.0}
    statuses, wall = flood(300, lambda client: client.post(
        f"http://127.0.0.1:{port}/rewards", json=body, headers={"Authorization": f"Bearer {TOKEN}"}))
    print(f"sao reward serve: {statuses.count(202)}/300 rewards answered 202 in {wall:.1f} s")
    assert statuses == [202] * 300 and wall < 60


def test_half_sent_requests_are_dropped_by_the_read_timeout_while_others_are_served(hostile):
    port, tid = hostile
    socks = half_send(port, request("/rewards", b'{"trajectory_id": ', {"Content-Length": "100"}, TOKEN), 200)
    start = time.monotonic()
    url = f"http://127.0.0.1:{port}/rewards"
    assert _post(url, {"trajectory_id": tid, "reward": 1}).status_code == 202  # meanwhile
    statuses = dropped(socks, within=READ_TIMEOUT_S + 20)
    print(f"sao reward serve: 200 half-sent requests dropped in {time.monotonic() - start:.1f} s")
    assert statuses == [408] * 200
    assert _post(url, {"trajectory_id": tid, "reward": 1}).status_code == 202  # and after


HUGE = {"Content-Length": str(10 ** 12)}


def _malformed(tid: str) -> dict:
    """why: (body sent, headers replaced, status, words of the message, param)."""
    def body(**fields) -> bytes:
        return json.dumps({"trajectory_id": tid, "reward": 1.0, **fields}).encode()
    return {
        "deep JSON": (b"[" * 60000, {}, 400, "nested deeper than 64", "body"),
        "Content-Length abc": (b"{}", {"Content-Length": "abc"}, 400, "bad Content-Length", None),
        "Content-Length -1": (b"{}", {"Content-Length": "-1"}, 400, "bad Content-Length", None),
        "Content-Length huge": (b"", HUGE, 413, "over the limit", "body"),
        "no Content-Length, a body": (body(), {"Content-Length": None}, 411, "Content-Length: required", None),
        "chunked, over the limit": (b"%x\r\n" % (10 * MAX_BODY) + b"1" * (MAX_BODY + 1),  # the rest never sent
                                    {"Content-Length": None, "Transfer-Encoding": "chunked"}, 413, "over the limit",
                                    "body"),
        "JSON as text/plain": (body(), {"Content-Type": "text/plain"}, 415, "application/json", None),
        "no token": (body(), {"Authorization": None}, 401, "bearer token", "Authorization"),
        "wrong token": (body(), {"Authorization": "Bearer guess"}, 401, "bearer token", "Authorization"),
        "wrong token, huge body": (b"", {**HUGE, "Authorization": "Bearer guess"}, 401, "bearer token",
                                   "Authorization"),
        "token_index 2**64": (body(token_index=2 ** 64), {}, 400, "beyond", "token_index"),
        "token_index 2**40": (body(token_index=2 ** 40), {}, 400, "[0, 2**31)", "token_index"),
        "reward NaN": (body().replace(b"1.0", b"NaN"), {}, 400, "NaN is not a number", "reward"),
        "reward Infinity": (body().replace(b"1.0", b"Infinity"), {}, 400, "Infinity is not a number", "reward"),
        "reward a string": (body(reward="1"), {}, 400, "wrong type", "reward"),
        "a list, not an object": (b"[1]", {}, 400, "JSON object", "body"),
    }


@pytest.mark.parametrize("why", _malformed(""))
def test_a_malformed_request_is_a_4xx_naming_its_problem(hostile, why):
    port, tid = hostile
    body, headers, status, words, param = _malformed(tid)[why]
    start = time.monotonic()
    got, answer = exchange(port, request("/rewards", body, headers, TOKEN))
    assert (got, answer["error"]["param"]) == (status, param) and words in answer["error"]["message"], answer
    assert time.monotonic() - start < READ_TIMEOUT_S  # refused at once, never waiting for a body it does not read
    assert _post(f"http://127.0.0.1:{port}/rewards", {"trajectory_id": tid, "reward": 1}).status_code == 202


def test_the_bearer_scheme_is_case_insensitive(hostile):
    port, tid = hostile
    answer = httpx.post(f"http://127.0.0.1:{port}/rewards", json={"trajectory_id": tid, "reward": 1},
                        headers={"Authorization": f"bearer {TOKEN}"}, timeout=30)
    assert answer.status_code == 202, answer.text


def test_metrics_count_requests_by_route_and_status_and_rejections_by_reason(hostile):
    port, tid = hostile
    url, metrics = f"http://127.0.0.1:{port}/rewards", f"http://127.0.0.1:{port}/metrics"
    before = {s: metric(metrics, "sao_reward_serve_requests_total", route="/rewards", status=s)
              for s in ("202", "400", "404")}
    rejected = metric(metrics, "sao_reward_serve_rejections_total", reason="unknown_trajectory")
    assert _post(url, {"trajectory_id": tid, "reward": 1}).status_code == 202
    assert _post(url, {"trajectory_id": tid, "reward": "high"}).status_code == 400
    assert _post(url, b'{"trajectory_id": "ghost", "reward": 1, "token_index": null}').status_code == 404
    after = {s: metric(metrics, "sao_reward_serve_requests_total", route="/rewards", status=s) for s in before}
    assert after == {s: n + 1 for s, n in before.items()}
    assert metric(metrics, "sao_reward_serve_rejections_total", reason="unknown_trajectory") == rejected + 1
    assert metric(metrics, "sao_reward_serve_request_seconds_count", route="/rewards") >= 3


def test_sigterm_stops_the_server_within_its_bound_with_a_request_in_flight(kafka_cfg):
    seconds = seconds_to_stop(kafka_cfg, ["reward", "serve", "--reward-token", TOKEN], "/rewards", TOKEN,
                              ready=lambda h: h.get("pending_ids") == "reading")
    print(f"sao reward serve: exited {seconds:.1f} s after SIGTERM")
    assert seconds < 10


def test_started_before_its_topics_exist_it_reads_them_once_they_are_created(kafka_bootstrap):
    kafka = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=f"late{uuid.uuid4().hex[:10]}")
    srv = _serving(RewardServeConfig(port=0, seen_wait=30.0, kafka=kafka))
    try:
        time.sleep(1.0)  # the reader has looked for the pending topic, and not found it
        assert health(srv.port)["pending_ids"] == "waiting" and srv.seen.error is None
        ensure_topics(kafka)
        tid = f"t-{uuid.uuid4().hex[:8]}"
        publish(kafka, T.PENDING, [pending_trajectory(tid)])
        answer = _post(f"http://127.0.0.1:{srv.port}/rewards", {"trajectory_id": tid, "reward": 1}, token=None)
        assert answer.status_code == 202, answer.text
        assert health(srv.port)["pending_ids"] == "reading"
    finally:
        srv.close()
        AdminClient(kafka.client()).delete_topics([kafka.topic(t) for t in T.ALL], operation_timeout=30)


"""`sao reward serve` on the real broker: what it publishes, and what it refuses and why."""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest

from consumers.endpoint import RewardServer, ServeConfig
from schemas import topics as T
from schemas.config import ConfigError
from schemas.messages import Reward
from tests.consumers.util import pending_trajectory, publish, read_topic

TOKEN = "s3cret-token"


@pytest.fixture
def server(kafka_cfg):
    srv = RewardServer(ServeConfig(port=0, reward_token=TOKEN, seen_wait=2.0, kafka=kafka_cfg))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield kafka_cfg, f"http://127.0.0.1:{srv.port}/rewards"
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
        assert resp.status_code == code and reason in resp.json()["error"], (why, resp.text)
    ok = _post(url, {"trajectory_id": tid, "reward": 0.5, "criterion": "concise"})
    assert ok.status_code == 202, ok.text
    rewards = read_topic(kafka, T.REWARDS, 2, timeout=5)
    assert len(rewards) == 1, "a refused request published something"
    [r] = rewards
    assert isinstance(r, Reward) and (r.trajectory_id, r.reward, r.source, r.criterion) == (tid, 0.5, "http", "concise")


def test_refuses_to_start_beyond_loopback_without_a_token():
    with pytest.raises(ConfigError, match="reward-token"):
        ServeConfig(host="0.0.0.0")
    assert ServeConfig(host="127.0.0.1").reward_token == ""
    assert ServeConfig(host="0.0.0.0", reward_token=TOKEN).host == "0.0.0.0"

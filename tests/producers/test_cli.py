"""`sao serve`, `sao feed` and `sao producer --backend http` end to end as processes, tiny settings."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from schemas import topics as T
from tests.producers.util import read_topic, wait_until

REPO = Path(__file__).resolve().parents[2]


def _sao(kafka_cfg, *args: str) -> subprocess.Popen:
    env = {**os.environ, "SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap,
           "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "sao", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_serve_feed_and_an_http_producer_end_to_end(kafka_cfg):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    serve = _sao(kafka_cfg, "serve", "--model", "tiny-llama", "--port", str(port))
    feed = _sao(kafka_cfg, "feed", "--env", "toy-target", "--count", "3", "--wait-done", "--poll-s", "0.2")
    producer = _sao(kafka_cfg, "producer", "--backend", "http", "--url", url, "--env", "toy-target",
                    "--model", "tiny-llama", "--max-tokens", "5", "--max-prompts", "3", "--producer-id", "cpu-1")
    try:
        assert producer.wait(180) == 0, producer.stdout.read()
        assert feed.wait(60) == 0, feed.stdout.read()
        trajs = read_topic(kafka_cfg, T.TRAJECTORIES, 3)
        assert len(trajs) == 3 and {t.producer_id for t in trajs} == {"cpu-1"}
        assert all((t.versions[t.action_mask == 1] == 0).all() for t in trajs)
        wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, timeout=10)
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0, serve.stdout.read()
    finally:
        for p in (serve, feed, producer):
            p.kill()

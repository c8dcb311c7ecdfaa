"""Helpers of the consumer tests: pending trajectories, and `sao` services run as child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import numpy as np

from sao.broker import free_port
from schemas import topics as T
from schemas.kafka import KafkaConfig, make_producer, produce
from schemas.messages import Trajectory
from tests.producers.util import read_topic, wait_until  # noqa: F401 (re-exported)

REPO = Path(__file__).resolve().parents[2]


def pending_trajectory(tid: str, n: int = 12, prompt_len: int = 4, tokens: np.ndarray | None = None) -> Trajectory:
    """A trajectory waiting for its reward; every token after the prompt is an action."""
    tokens = np.arange(n, dtype=np.int32) % 200 if tokens is None else np.asarray(tokens, np.int32)
    n = len(tokens)
    mask = (np.arange(n) >= prompt_len).astype(np.uint8)
    return Trajectory(id=tid, prompt_id=f"p-{tid}", env="writing", producer_id="test", tokens=tokens,
                      action_mask=mask, rollout_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
                      versions=np.where(mask == 1, 0, -1).astype(np.int32), prompt_len=prompt_len, reward=None)


def publish(kafka: KafkaConfig, topic: T.Topic, messages: list) -> None:
    """Publish messages (or (key, raw bytes) pairs) and wait for the acks."""
    producer = make_producer(kafka)
    for m in messages:
        key, value = m if isinstance(m, tuple) else (m.key, m.encode())
        produce(producer, kafka.topic(topic), value, key=key)
    assert producer.flush(30) == 0


class Service:
    """A `sao <command>` child process whose log lines are collected as they come."""

    def __init__(self, kafka: KafkaConfig, *args: str, env: dict | None = None):
        env = {**os.environ, "SAO_KAFKA_BOOTSTRAP": kafka.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.p = subprocess.Popen([sys.executable, "-m", "sao", *args], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True).start()

    def ready(self) -> bool:
        """A faust worker has joined its group and recovered its tables."""
        return any("Worker ready" in line for line in self.lines)

    def log(self, last: int = 40) -> str:
        return "".join(self.lines[-last:])

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        """The exit status; a process still running after `timeout` is killed (status -9)."""
        self.p.send_signal(sig)
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()


def joiner(kafka: KafkaConfig, *args: str) -> tuple[Service, int]:
    """A `sao reward-join` child process and its metrics port."""
    port = free_port()
    return Service(kafka, "reward-join", "--metrics-port", str(port), "--log-every-s", "5", *args), port


def counts(port: int) -> dict[str, float]:
    """The joiner's event counters and pending gauge, scraped from its /metrics."""
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith('sao_joiner_events_total{event="'):
            name, value = line[len('sao_joiner_events_total{event="'):].split('"} ')
            out[name] = float(value)
        elif line.startswith("sao_joiner_pending "):
            out["pending"] = float(line.split()[1])
    return out


def read_ids(kafka: KafkaConfig, topic: T.Topic, ids: set[str], timeout: float = 60.0) -> list:
    """Messages of `topic` until every id in `ids` has been seen at least once (or the timeout)."""
    return read_topic(kafka, topic, 0, timeout=timeout,
                      until=lambda ms: ids <= {getattr(m, "id", None) for m in ms})

"""Helpers of the consumer tests: pending trajectories and the reward joiner as a child process; the
Kafka and child-process helpers are tests/kafka_util.py's."""

from __future__ import annotations

import httpx
import numpy as np

from sao.broker import free_port
from schemas.kafka import KafkaConfig
from schemas.messages import Trajectory
from tests.kafka_util import REPO, Service, publish, read_ids, read_topic, wait_until  # noqa: F401 (re-exported)


def pending_trajectory(tid: str, n: int = 12, prompt_len: int = 4, tokens: np.ndarray | None = None) -> Trajectory:
    """A trajectory waiting for its reward; every token after the prompt is an action."""
    tokens = np.arange(n, dtype=np.int32) % 200 if tokens is None else np.asarray(tokens, np.int32)
    n = len(tokens)
    mask = (np.arange(n) >= prompt_len).astype(np.uint8)
    return Trajectory(id=tid, prompt_id=f"p-{tid}", env="writing", producer_id="test", tokens=tokens,
                      action_mask=mask, rollout_logprobs=np.where(mask == 1, -0.5, 0.0).astype(np.float32),
                      versions=np.where(mask == 1, 0, -1).astype(np.int32), prompt_len=prompt_len, reward=None)


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

"""Reward joiner and judge metrics: Prometheus (optionally served on a port) and, for the joiner, a
periodic log line.

Names: `sao_joiner_events_total{event}` (joined, waiting, turn, duplicate, late, timeout,
expired_reward, duplicate_trajectory, dlq, forgotten), `sao_joiner_pending` (trajectories waiting
in this worker's partitions) and `sao_joiner_reward_latency_seconds` (trajectory published →
outcome reward published). The log line adds joined/s and the latency's p50/p99 over the last
`window` joins.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)


class JoinerMetrics:
    def __init__(self, port: int = 0, log_every_s: float = 30.0, window: int = 4096):
        self.log_every_s = log_every_s
        self.registry = r = CollectorRegistry()
        self.events = Counter("sao_joiner_events", "Join events by outcome", ["event"], registry=r)
        self.pending_gauge = Gauge("sao_joiner_pending", "Trajectories waiting for a reward", registry=r)
        self.latency = Histogram("sao_joiner_reward_latency_seconds", "Trajectory published to reward published",
                                 buckets=(0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 1800), registry=r)
        self._server = start_http_server(port, registry=r)[0] if port else None
        self.counts: collections.Counter = collections.Counter()
        self._latencies: collections.deque = collections.deque(maxlen=window)
        self._pending = 0
        self._last = (time.monotonic(), 0)

    def event(self, what: str, latency: float | None = None) -> None:
        self.events.labels(what).inc()
        self.counts[what] += 1
        if latency is not None:
            self.latency.observe(latency)
            self._latencies.append(latency)

    def pending(self, n: int) -> None:
        self._pending = n
        self.pending_gauge.set(n)

    def tick(self) -> None:
        """Log the rates when `log_every_s` has passed."""
        t0, joined0 = self._last
        dt = time.monotonic() - t0
        if dt < self.log_every_s:
            return
        p50, p99 = np.percentile(self._latencies, [50, 99]) if self._latencies else (float("nan"),) * 2
        c = self.counts
        log.info("reward-join: %.1f joined/s, %d pending, reward latency p50 %.2fs p99 %.2fs, %d joined, "
                 "%d timeouts, %d duplicates, %d late, %d expired rewards, %d dlq",
                 (c["joined"] - joined0) / dt, self._pending, p50, p99, c["joined"], c["timeout"],
                 c["duplicate"], c["late"], c["expired_reward"], c["dlq"])
        self._last = (time.monotonic(), c["joined"])

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()


class JudgeMetrics:
    """`sao judge`: rewards published by criterion, trajectories skipped by reason, seconds per
    reward (judging and publishing), on a Prometheus port when one is given."""

    def __init__(self, port: int = 0):
        self.registry = r = CollectorRegistry()
        self.rewards = Counter("sao_judge_rewards", "Rewards published", ["criterion"], registry=r)
        self.skips = Counter("sao_judge_skipped", "Trajectories not scored", ["reason"], registry=r)
        self.seconds = Histogram("sao_judge_seconds", "Judging and publishing one reward",
                                 buckets=(0.001, 0.01, 0.1, 0.5, 1, 5, 30, 120), registry=r)
        self._server = start_http_server(port, registry=r)[0] if port else None

    def scored(self, criterion: str, seconds: float) -> None:
        self.rewards.labels(criterion).inc()
        self.seconds.observe(seconds)

    def skipped(self, reason: str) -> None:
        self.skips.labels(reason).inc()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()

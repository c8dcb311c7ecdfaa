"""Producer metrics: Prometheus counters and gauges (optionally served on a port) and a periodic
log line with the rates derived from them.

Names: `sao_producer_episodes_total`, `sao_producer_action_tokens_total`,
`sao_producer_errors_total{kind}`, `sao_producer_episodes_in_flight`, `sao_producer_weight_version`,
`sao_producer_weight_updates{outcome=loaded|rejected|ignored|invalid|anchor_asks}`, and per weight update
(schemas/weights/follow.py) `sao_producer_weight_last_seconds{phase=fetch|load|pause|lag}` with
their sums `sao_producer_weight_seconds_sum{phase}`, `sao_producer_weight_bytes_sum` and
`sao_producer_weight_updates_by_source{source}`: the pause is what the engine stopped decoding
for, apart from fetching and rebuilding the update. Labelled
by nothing else: one registry per producer process, scraped per process.
"""

from __future__ import annotations

import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from schemas.messages import Trajectory

log = logging.getLogger(__name__)


class ProducerMetrics:
    def __init__(self, producer_id: str, port: int = 0, log_every_s: float = 30.0):
        self.producer_id = producer_id
        self.log_every_s = log_every_s
        self.registry = r = CollectorRegistry()
        self.episodes = Counter("sao_producer_episodes", "Trajectories published", registry=r)
        self.tokens = Counter("sao_producer_action_tokens", "Action tokens generated", registry=r)
        self.errors = Counter("sao_producer_errors", "Prompts not played, by reason", ["kind"], registry=r)
        self.in_flight = Gauge("sao_producer_episodes_in_flight", "Episodes being played now", registry=r)
        self.version = Gauge("sao_producer_weight_version", "Weight version in use", registry=r)
        self.weights = Gauge("sao_producer_weight_updates", "Weight announcements by outcome", ["outcome"],
                             registry=r)
        self._watching = False  # the subscriber's update gauges, registered at the first tick that has one
        self._server = start_http_server(port, registry=r)[0] if port else None
        self._n = {"episodes": 0, "tokens": 0, "errors": 0}
        self._last = (time.monotonic(), dict(self._n))

    def episode(self, traj: Trajectory) -> None:
        n = int(traj.action_mask.sum())
        self.episodes.inc()
        self.tokens.inc(n)
        self._n["episodes"] += 1
        self._n["tokens"] += n

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()
        self._n["errors"] += 1

    def tick(self, version: int, subscriber=None, in_flight: int = 0) -> None:
        """Update gauges; log rates when `log_every_s` has passed."""
        self.version.set(version)
        self.in_flight.set(in_flight)
        counts = subscriber.counts if subscriber is not None else {}
        for outcome, count in counts.items():
            self.weights.labels(outcome).set(count)
        if subscriber is not None and not self._watching:
            weight_update_gauges(self.registry, "sao_producer", subscriber)
            self._watching = True
        t0, last = self._last
        dt = time.monotonic() - t0
        if dt < self.log_every_s:
            return
        rate = {k: (self._n[k] - last[k]) / dt for k in self._n}
        log.info("producer %s: %.2f episodes/s, %.1f tokens/s, %d in flight, %d episodes, %d errors, "
                 "weights v%d %s", self.producer_id, rate["episodes"], rate["tokens"], in_flight,
                 self._n["episodes"], self._n["errors"], version, counts)
        self._last = (time.monotonic(), dict(self._n))

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()


def weight_update_gauges(registry: CollectorRegistry, prefix: str, subscriber) -> None:
    """Gauges read from a weight subscriber at each scrape (the producer's and `sao serve`'s):
    `{prefix}_weight_last_seconds{phase}`, `{prefix}_weight_seconds_sum{phase}`, `{prefix}_weight_bytes_sum`,
    `{prefix}_weight_updates_by_source{source=inline|file|collective}`."""
    last = Gauge(f"{prefix}_weight_last_seconds", "The last weight update, by phase", ["phase"], registry=registry)
    total = Gauge(f"{prefix}_weight_seconds_sum", "All weight updates, by phase", ["phase"], registry=registry)
    for phase in ("fetch", "load", "pause", "lag"):
        last.labels(phase).set_function(lambda k=f"{phase}_s": subscriber.last.get(k, float("nan")))
        if phase != "lag":
            total.labels(phase).set_function(lambda k=f"{phase}_s": subscriber.totals[k])
    Gauge(f"{prefix}_weight_bytes_sum", "Bytes of every weight update read",
          registry=registry).set_function(lambda: subscriber.totals["bytes"])
    by_source = Gauge(f"{prefix}_weight_updates_by_source", "Weight updates loaded, by how their bytes came",
                      ["source"], registry=registry)
    for source in subscriber.by_source:
        by_source.labels(source).set_function(lambda s=source: subscriber.by_source[s])

"""Joiner metrics: named Prometheus series and the log line's rates and latency percentiles."""

from __future__ import annotations

import logging

import httpx

from consumers.metrics import JoinerMetrics
from sao.broker import free_port


def test_metrics_are_served_and_the_log_line_has_rates_latency_and_counts(caplog):
    port = free_port()
    metrics = JoinerMetrics(port=port, log_every_s=0)
    try:
        for latency in (0.1, 0.2, 0.3, 4.0):
            metrics.event("joined", latency=latency)
        metrics.event("duplicate")
        metrics.event("timeout")
        metrics.pending(7)
        with caplog.at_level(logging.INFO, logger="consumers.metrics"):
            metrics.tick()
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'sao_joiner_events_total{event="joined"} 4.0' in text
        assert 'sao_joiner_events_total{event="duplicate"} 1.0' in text and "sao_joiner_pending 7.0" in text
        assert "sao_joiner_reward_latency_seconds_count 4.0" in text
        [line] = [r.getMessage() for r in caplog.records]
        assert "7 pending" in line and "p50 0.25s" in line and "1 timeouts" in line and "1 duplicates" in line
        assert "joined/s" in line and "4 joined" in line
    finally:
        metrics.close()

"""Per-step JSONL, Prometheus gauges and the staleness histogram."""

from __future__ import annotations

import json

from prometheus_client import REGISTRY

from learner.telemetry import Telemetry, staleness_metrics


def test_staleness_metrics_histogram_and_percentiles():
    m = staleness_metrics([0, 0, 1, 3, 0])
    assert m["stale/hist"] == {"0": 3, "1": 1, "3": 1}
    assert m["stale/max"] == 3 and m["stale/p50"] == 0.0
    assert staleness_metrics([]) == {}


def test_a_step_becomes_a_jsonl_line_and_prometheus_gauges(tmp_path, capsys):
    t = Telemetry(tmp_path)
    record = {"step/index": 4, "weights/version": 3, "reward/mean": 0.5, "loss/policy": 0.1,
              "perf/tokens_per_s": 100.0, "kafka/lag": 7, "count/dlq": 2, "count/stale": 1,
              "count/duplicate": 0, "trajectory_ids": ["a", "b"], **staleness_metrics([1, 2])}
    t.record(record)
    t.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == record
    assert REGISTRY.get_sample_value("sao_learner_kafka_lag") == 7
    assert REGISTRY.get_sample_value("sao_learner_count_dlq") == 2
    assert "step      4 v3" in capsys.readouterr().err

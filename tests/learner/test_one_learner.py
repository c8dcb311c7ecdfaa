"""Exactly one learner consumes a run's trajectories: a second one on the same run exits at start
with a clear error, before it publishes or writes anything, and a learner whose partitions another
group member takes stops (fenced) instead of training on the part of the stream left to it."""

from __future__ import annotations

import os
import subprocess
import time

from confluent_kafka.admin import AdminClient

from learner.source import group_id
from schemas import topics as T
from schemas.kafka import KafkaConfig, make_consumer
from tests.learner.service_util import ROOT, announcements, learner_cmd, metrics, ONE_PARTITION, publish, rollouts

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "WARNING"}


def _members(cfg: KafkaConfig) -> int:
    group, admin = group_id(cfg), AdminClient(cfg.client())  # held: a collected client drops its futures
    try:
        return len(admin.describe_consumer_groups([group], request_timeout=5)[group].result().members)
    except Exception:  # the coordinator still loading: not joined yet
        return 0


def _start_and_join(cfg: KafkaConfig, run_dir, *flags: str) -> subprocess.Popen:
    proc = subprocess.Popen(learner_cmd(cfg, run_dir, *flags), cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while _members(cfg) < 1 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
    assert proc.poll() is None and _members(cfg) == 1, "the first learner never joined its group"
    return proc


def test_a_second_learner_on_the_same_run_exits_at_start_and_the_first_trains_on(kafka_cfg, tmp_path):
    flags = ("--batch-trajectories", "4", "--max-steps", "1")
    first = _start_and_join(kafka_cfg, tmp_path / "a", *flags)
    try:
        second = subprocess.run(learner_cmd(kafka_cfg, tmp_path / "b", *flags), cwd=ROOT, env=ENV,
                                capture_output=True, text=True, timeout=180)
        assert second.returncode == 2, second.stderr[-3000:]
        assert "exactly one learner" in second.stderr and group_id(kafka_cfg) in second.stderr
        assert not (tmp_path / "b" / "weights").exists() or not any((tmp_path / "b" / "weights").iterdir())
        assert first.poll() is None and _members(kafka_cfg) == 1
        publish(kafka_cfg, T.TRAJECTORIES, [t.encode() for t in rollouts(4, seed=3)], key=ONE_PARTITION)
        assert first.wait(120) == 0, first.stderr.read()[-3000:]
    finally:
        first.kill()
    assert [m["step/index"] for m in metrics(tmp_path / "a")] == [0]
    assert [w.version for w in announcements(kafka_cfg, timeout=5)] == [0, 1]  # the second published nothing


def test_a_learner_whose_partitions_another_member_takes_stops_fenced(kafka_cfg, tmp_path):
    learner = _start_and_join(kafka_cfg, tmp_path, "--batch-trajectories", "4")
    intruder = make_consumer(kafka_cfg, group_id(kafka_cfg))
    intruder.subscribe([kafka_cfg.topic(T.TRAJECTORIES)])
    try:
        deadline = time.monotonic() + 60
        while learner.poll() is None and time.monotonic() < deadline:
            intruder.poll(0.2)
        assert learner.poll() == 2, "the learner trained on while another member held part of its stream"
        err = learner.stderr.read()
        assert "joined group" in err and "exactly one learner" in err, err[-3000:]
    finally:
        learner.kill()
        intruder.close()

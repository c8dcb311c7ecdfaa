"""Backpressure from the learner to the rollouts (`--max-lag`): with no learner consuming, the
feeder and the producers hold new prompts once that many trajectories wait, without spinning or
crashing; a learner that starts then consumes them and the rollouts resume by themselves, its
staleness within what the bound implies."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from schemas import topics as T
from schemas.kafka import make_producer
from schemas.progress import learner_lag
from tests.learner.service_util import ROOT, learner_cmd, metrics
from tests.producers.util import wait_until

MAX_LAG, BATCH = 16, 4


def _sao(kafka_cfg, *args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "WARNING", "SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap,
           "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix}
    return subprocess.Popen([sys.executable, "-m", "sao", *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def _cpu_s(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _trajectories(kafka_cfg) -> int:
    """Every trajectory published so far (the topic's high watermarks)."""
    lag = learner_lag(kafka_cfg)
    try:
        return sum(high for _, high in lag.watermarks().values())
    finally:
        lag.close()


def test_rollouts_hold_at_the_bound_while_no_learner_consumes_and_resume_when_one_does(kafka_cfg, tmp_path):
    sim = ("--backend", "sim", "--sim.median-tokens", "6", "--sim.token-s", "0.001", "--max-tokens", "8")
    feeder = _sao(kafka_cfg, "feed", "--env", "toy-target", "--max-unfinished", "64", "--max-lag", str(MAX_LAG),
                  "--poll-s", "0.2")
    producer = _sao(kafka_cfg, "producer", *sim, "--env", "toy-target", "--concurrency", "4", "--max-lag",
                    str(MAX_LAG))
    learner = None
    try:
        wait_until(lambda: _trajectories(kafka_cfg) >= MAX_LAG, timeout=120, every=0.5)
        time.sleep(5)  # held: nothing more comes while no learner consumes
        held = _trajectories(kafka_cfg)
        cpu0, t0 = _cpu_s(producer.pid), time.monotonic()
        time.sleep(5)
        assert _trajectories(kafka_cfg) == held <= MAX_LAG + 4  # the bound, plus what was in flight
        assert _cpu_s(producer.pid) - cpu0 < 0.5 * (time.monotonic() - t0), "a held producer spins"
        assert producer.poll() is None and feeder.poll() is None
        learner = subprocess.Popen(learner_cmd(kafka_cfg, tmp_path, "--batch-trajectories", str(BATCH),
                                               "--max-steps", "12"), cwd=ROOT, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert learner.wait(300) == 0, learner.stderr.read()[-3000:]
        assert _trajectories(kafka_cfg) >= 12 * BATCH  # resumed by themselves
    finally:
        for p in (producer, feeder, learner):
            if p is not None:
                p.kill()
    steps = metrics(tmp_path)
    assert len(steps) == 12 and steps[-1]["count/stale"] == 0
    # rollouts run at most MAX_LAG trajectories (MAX_LAG / BATCH steps) ahead of the learner
    assert max(s["stale/max"] for s in steps) <= MAX_LAG // BATCH + 1, [s["stale/max"] for s in steps]


def test_a_bound_under_one_step_opens_while_the_learner_holds_a_partial_step_and_dead_letters(kafka_cfg, tmp_path):
    """What the learner has read counts as consumed even before it forms a step: dead letters ahead
    of the rollouts and the trajectories a partial step holds would otherwise keep a bound smaller
    than a step (or than the garbage) closed for good."""
    garbage = make_producer(kafka_cfg)
    for i in range(5):
        garbage.produce(kafka_cfg.topic(T.TRAJECTORIES), value=b"not a trajectory %d" % i)
    garbage.flush(30)
    bound = 3
    sim = ("--backend", "sim", "--sim.median-tokens", "6", "--sim.token-s", "0.001", "--max-tokens", "8")
    feeder = _sao(kafka_cfg, "feed", "--env", "toy-target", "--max-unfinished", "64", "--max-lag", str(bound),
                  "--poll-s", "0.2")
    producer = _sao(kafka_cfg, "producer", *sim, "--env", "toy-target", "--concurrency", "2", "--max-lag",
                    str(bound))
    learner = subprocess.Popen(learner_cmd(kafka_cfg, tmp_path, "--batch-trajectories", str(BATCH),
                                           "--max-steps", "3"), cwd=ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert learner.wait(300) == 0, learner.stderr.read()[-3000:]
    finally:
        for p in (producer, feeder, learner):
            p.kill()
    steps = metrics(tmp_path)
    assert len(steps) == 3 and steps[-1]["count/dlq"] == 5  # the garbage, read and dead-lettered

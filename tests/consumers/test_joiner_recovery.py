"""Joiner processes killed and added while trajectories wait: nothing pending is lost."""

from __future__ import annotations

import signal
import time
import uuid

from consumers.rewards import RewardPublisher
from schemas import topics as T
from schemas.kafka import KafkaConfig, make_consumer
from schemas.messages import Reward
from tests.consumers.util import joiner, pending_trajectory, publish, read_ids, wait_until


def _count(kafka: KafkaConfig, topic: str) -> int:
    """Committed records on a topic (all partitions), read by a throwaway group."""
    consumer = make_consumer(kafka, f"count-{uuid.uuid4().hex}")
    consumer.subscribe([topic])
    n, idle = 0, time.monotonic()
    try:
        while time.monotonic() - idle < 3:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                n, idle = n + 1, time.monotonic()
    finally:
        consumer.close()
    return n


def _started(proc) -> None:
    wait_until(lambda: proc.ready() or proc.p.poll() is not None, timeout=120)
    assert proc.p.poll() is None, proc.log()


def test_sigkill_with_100_pending_then_restart_joins_every_one_exactly_once(kafka_cfg):
    """With faust's exactly-once processing (Kafka transactions, which work against this broker)
    the output holds each trajectory once: no duplicate for the learner to drop."""
    ids = [f"k{i}-{uuid.uuid4().hex[:6]}" for i in range(100)]
    first, _ = joiner(kafka_cfg, "--exactly-once")
    try:
        _started(first)
        publish(kafka_cfg, T.PENDING, [pending_trajectory(i) for i in ids])
        changelog = f"{kafka_cfg.topic_prefix}.reward-join-entries-changelog"
        wait_until(lambda: _count(kafka_cfg, changelog) >= len(ids), timeout=60, every=1)
        first.stop(signal.SIGKILL)
    finally:
        first.p.kill()
    second, _ = joiner(kafka_cfg, "--exactly-once")
    try:
        _started(second)
        publish(kafka_cfg, T.REWARDS, [Reward(trajectory_id=i, reward=float(n)) for n, i in enumerate(ids)])
        out = [m for m in read_ids(kafka_cfg, T.TRAJECTORIES, set(ids), timeout=90) if m.id in ids]
        assert {m.id for m in out} == set(ids), f"missing {set(ids) - {m.id for m in out}}"
        assert all(m.reward == float(ids.index(m.id)) for m in out)
        assert len(out) == len(ids), f"{len(out) - len(ids)} duplicates despite exactly-once"
    finally:
        second.stop()


def test_a_joiner_added_and_another_killed_mid_stream_lose_nothing(kafka_cfg):
    ids = [f"s{i}-{uuid.uuid4().hex[:6]}" for i in range(200)]
    publisher = RewardPublisher(kafka_cfg)

    def rewards(part: list[str]) -> None:
        for i in part:
            publisher.send(Reward(trajectory_id=i, reward=float(ids.index(i))))
        publisher.flush()

    first, _ = joiner(kafka_cfg)
    procs = [first]
    try:
        _started(first)
        publish(kafka_cfg, T.PENDING, [pending_trajectory(i) for i in ids])
        rewards(ids[:100])
        procs.append(joiner(kafka_cfg)[0])  # same app id: it takes over half the partitions
        _started(procs[1])
        rewards(ids[100:150])
        first.stop(signal.SIGKILL)  # its partitions, state and all, move to the second
        rewards(ids[150:])
        out = read_ids(kafka_cfg, T.TRAJECTORIES, set(ids), timeout=120)
        got = {m.id: m.reward for m in out if m.id in ids}
        assert set(got) == set(ids), f"lost {len(set(ids) - set(got))} of {len(ids)}"
        assert all(r == float(ids.index(i)) for i, r in got.items())
        assert procs[1].stop() == 0, procs[1].log()
    finally:
        for p in procs:
            p.p.kill()

"""Joiner processes killed and added while trajectories wait: nothing pending is lost."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

from confluent_kafka import TopicPartition

from consumers.joiner import Backfill, Input
from consumers.rewards import RewardPublisher
from schemas import topics as T
from schemas.kafka import KafkaConfig, make_consumer, make_producer
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


def test_backfill_reads_back_exactly_the_offsets_an_agent_did_not_handle(kafka_cfg):
    """The joiner's guard against faust passing over a message (`consumers.joiner.Backfill`): per
    partition, from the group's committed offset (or the start) on, every offset an agent was not
    shown or did not finish handling is read back with its key, value and timestamp, and nothing
    else is."""
    topic, group = kafka_cfg.topic(T.REWARDS), f"bf-{uuid.uuid4().hex[:8]}"
    producer = make_producer(kafka_cfg)
    for i in range(12):
        producer.produce(topic, value=f"v{i}".encode(), key=f"k{i}".encode(), partition=1, timestamp=1_000_000 + i)
    assert producer.flush(30) == 0

    async def seen(backfill: Backfill, offset: int, handle: bool = True) -> list[int]:
        """What the agent is given back when faust hands it `offset` (which it then handles)."""
        missed = await backfill.passed_over(topic, 1, offset)
        assert all(m.key == f"k{m.offset}".encode() and m.value == f"v{m.offset}".encode()
                   and m.timestamp == (1_000_000 + m.offset) / 1000 and m.partition == 1 for m in missed)
        for m in missed:
            backfill.handled(m)
        if handle:
            backfill.handled(Input(topic=topic, partition=1, offset=offset, timestamp=0, key=None, value=None))
        return [m.offset for m in missed]

    async def scenario() -> None:
        backfill = Backfill(kafka_cfg, group)
        assert await seen(backfill, 0) == []  # no committed offset: the agent starts at the start
        assert await seen(backfill, 1) == []
        assert await seen(backfill, 4) == [2, 3]  # a gap in the middle
        assert await seen(backfill, 5, handle=False) == []  # its handling raised ...
        assert await seen(backfill, 6) == [5]  # ... so the next event brings it back
        assert await seen(backfill, 2) == []  # faust handing over an offset again: nothing to add
        assert await seen(backfill, 7) == []
        assert await backfill.passed_over(topic, 0, 0) == []  # partitions are independent
        committer = make_consumer(kafka_cfg, group)
        committer.commit(offsets=[TopicPartition(topic, 1, 8)], asynchronous=False)
        committer.close()
        backfill.forget([TopicPartition(topic, 1)])  # revoked and assigned again: from the committed offset
        assert await seen(backfill, 10) == [8, 9]  # the gap at the head, after the committed offset
        assert await seen(backfill, 11) == []

    asyncio.run(scenario())

"""`sao reward-join` on the real broker, one joiner process shared by the tests of this module:
each join outcome asserted on the output topic, the DLQ and the joiner's own counters."""

from __future__ import annotations

import math
import uuid

import pytest

from schemas import topics as T
from schemas.messages import DeadLetter, Reward
from tests.consumers.util import counts, joiner, pending_trajectory, publish, read_ids, read_topic, wait_until

TIMEOUT = 4.0  # seconds a trajectory or an orphan reward waits


@pytest.fixture(scope="module")
def running(module_kafka, tmp_path_factory):
    """The joiner here keeps its table in RocksDB; the recovery tests use the memory store."""
    proc, port = joiner(module_kafka, "--reward-timeout", str(TIMEOUT), "--orphan-timeout", str(TIMEOUT),
                        "--on-timeout", "default", "--default-reward", "-1", "--sweep-every", "0.5",
                        "--store", "rocksdb", "--data-dir", str(tmp_path_factory.mktemp("rocksdb")))
    try:
        wait_until(lambda: proc.ready() or proc.p.poll() is not None, timeout=120)
        assert proc.p.poll() is None, proc.log()
        yield module_kafka, port
    finally:
        code = proc.stop()
        assert code == 0, proc.log()


def _id() -> str:
    return uuid.uuid4().hex[:12]


def _joined(kafka, tid: str, timeout: float = 60.0) -> list:
    return [m for m in read_ids(kafka, T.TRAJECTORIES, {tid}, timeout) if m.id == tid]


def _grows(port: int, event: str, before: dict, timeout: float = 30.0) -> None:
    wait_until(lambda: counts(port).get(event, 0) > before.get(event, 0), timeout=timeout)


def test_reward_first_then_trajectory_is_joined(running):
    kafka, _ = running
    tid = _id()
    publish(kafka, T.REWARDS, [Reward(trajectory_id=tid, reward=0.75, source="judge", criterion="c")])
    publish(kafka, T.PENDING, [pending_trajectory(tid)])
    [out] = _joined(kafka, tid)
    assert out.reward == 0.75 and out.meta["reward_source"] == "judge" and out.meta["reward_criterion"] == "c"
    assert (out.tokens == pending_trajectory(tid).tokens).all()


def test_trajectory_first_then_reward_is_joined(running):
    kafka, _ = running
    tid = _id()
    publish(kafka, T.PENDING, [pending_trajectory(tid)])
    publish(kafka, T.REWARDS, [Reward(trajectory_id=tid, reward=-0.5)])
    [out] = _joined(kafka, tid)
    assert out.reward == -0.5


def test_duplicate_rewards_first_wins_and_the_rest_are_counted(running):
    kafka, port = running
    tid, before = _id(), counts(running[1])
    publish(kafka, T.PENDING, [pending_trajectory(tid)])
    publish(kafka, T.REWARDS, [Reward(trajectory_id=tid, reward=r) for r in (1.0, 2.0, 3.0)])
    wait_until(lambda: counts(port).get("duplicate", 0) >= before.get("duplicate", 0) + 2, timeout=30)
    assert [m.reward for m in _joined(kafka, tid)] == [1.0]


def test_reward_after_the_timeout_is_late_and_the_trajectory_got_the_default(running):
    kafka, port = running
    tid, before = _id(), counts(running[1])
    publish(kafka, T.PENDING, [pending_trajectory(tid)])
    [out] = _joined(kafka, tid, timeout=TIMEOUT + 30)
    assert out.reward == -1.0 and counts(port)["timeout"] > before.get("timeout", 0)
    publish(kafka, T.REWARDS, [Reward(trajectory_id=tid, reward=1.0)])
    _grows(port, "late", before)
    assert [m.reward for m in _joined(kafka, tid)] == [-1.0]


def test_reward_for_a_trajectory_that_never_comes_expires_and_is_forgotten(running):
    kafka, port = running
    tid, before = _id(), counts(running[1])
    publish(kafka, T.REWARDS, [Reward(trajectory_id=tid, reward=5.0)])
    _grows(port, "expired_reward", before, timeout=TIMEOUT + 30)
    # the trajectory, arriving after all, waits for a reward of its own
    publish(kafka, T.PENDING, [pending_trajectory(tid)])
    publish(kafka, T.REWARDS, [Reward(trajectory_id=tid, reward=0.25)])
    assert [m.reward for m in _joined(kafka, tid)] == [0.25]


def test_per_turn_rewards_are_merged_into_the_joined_trajectory(running):
    kafka, _ = running
    tid = _id()
    publish(kafka, T.REWARDS, [Reward(trajectory_id=tid, reward=0.5, token_index=5)])
    publish(kafka, T.PENDING, [pending_trajectory(tid)])
    publish(kafka, T.REWARDS, [Reward(trajectory_id=tid, reward=0.25, token_index=9),
                               Reward(trajectory_id=tid, reward=1.0)])
    [out] = _joined(kafka, tid)
    assert out.reward == 1.0 and out.turn_rewards == [(5, 0.5), (9, 0.25)]


def test_invalid_rewards_and_trajectories_go_to_the_dlq(running):
    kafka, _ = running
    tid = _id()
    publish(kafka, T.PENDING, [pending_trajectory(tid)])
    nan = Reward(trajectory_id=tid, reward=math.nan).encode()
    off_action = Reward(trajectory_id=tid, reward=1.0, token_index=1).encode()  # a prompt token
    rewarded = pending_trajectory(f"{tid}-r")
    rewarded.reward = 1.0
    miskeyed = pending_trajectory(f"{tid}-k").encode()  # its reward would never meet it
    bad = {tid.encode(): [b"\xc1junk", nan, off_action], rewarded.key: [rewarded.encode()], b"k": [miskeyed]}
    publish(kafka, T.REWARDS, [(tid.encode(), v) for v in bad[tid.encode()]])
    publish(kafka, T.PENDING, [(rewarded.key, rewarded.encode()), (b"k", miskeyed)])
    letters = read_topic(kafka, T.DLQ, 0, until=lambda ds: {v for vs in bad.values() for v in vs}
                         <= {d.payload for d in ds})
    assert all(isinstance(d, DeadLetter) for d in letters)
    errors = {d.payload: d.error for d in letters}
    assert "MessagePack" in errors[b"\xc1junk"] and "finite" in errors[nan]
    assert "token_index" in errors[off_action] and "reward" in errors[rewarded.encode()]
    assert "key" in errors[miskeyed]
    publish(kafka, T.REWARDS, [Reward(trajectory_id=tid, reward=0.5)])  # the joiner went on
    assert [m.reward for m in _joined(kafka, tid)] == [0.5]


def test_the_joiners_producer_is_idempotent_with_acks_all_like_every_producer_of_ours(kafka_cfg, tmp_path):
    """faust 0.15 leaves idempotence off under at-least-once; a send retried across a broker
    failure would then be written twice. The joiner's producer (its outputs, dead letters and
    changelog writes) is built idempotent, acks=all, with faust's own topics replicated as ours."""
    import asyncio

    from consumers.joiner import Joiner, JoinerConfig
    from consumers.metrics import JoinerMetrics
    from schemas.kafka import replication_now

    joiner = Joiner(JoinerConfig(data_dir=str(tmp_path), kafka=kafka_cfg), JoinerMetrics())

    async def settings() -> tuple:
        aio = joiner.app.producer._new_producer()  # the client faust starts on its first send
        try:
            return aio._txn_manager is not None, aio._sender._acks  # aiokafka keeps both privately
        finally:
            await aio.stop()
    try:
        assert asyncio.run(settings()) == (True, -1)
        assert joiner.app.conf.topic_replication_factor == replication_now(kafka_cfg)[0]
    finally:
        joiner.backfill.close()  # its client would otherwise outlive the broker, reconnecting

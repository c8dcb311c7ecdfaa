"""What the learner refuses before a step is formed, and how a failing step stops being retried."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from learner.checks import Trainable, untrainable
from learner.failures import StepFailures
from learner.long_episodes import staleness
from learner.source import TrajectorySource
from schemas import topics as T
from schemas.kafka import KafkaConfig, make_consumer, make_producer
from schemas.messages import DeadLetter, Trajectory
from tests.schemas.test_messages import _traj as traj

SPEC = Trainable(vocab_size=64, max_seq_len=16, temperature=1.0)


def test_a_trainable_trajectory_passes():
    assert untrainable(traj(), SPEC) is None


@pytest.mark.parametrize("overrides,field", [
    (dict(reward=None), "reward"),
    (dict(tokens=np.array([1, 2, 3, 64, 5, 6], np.int32)), "tokens"),  # = vocab size
    (dict(tokens=np.array([1, 2, 3, -4, 5, 6], np.int32)), "tokens"),
    (dict(tokens=np.arange(17, dtype=np.int32), action_mask=np.r_[0, np.ones(16)].astype(np.uint8),
          rollout_logprobs=np.full(17, -1.0, np.float32), versions=np.r_[-1, np.zeros(16)].astype(np.int32),
          prompt_len=1), "tokens"),  # longer than --max-seq-len
    (dict(action_mask=np.zeros(6, np.uint8), versions=np.full(6, -1, np.int32)), "action_mask"),
    (dict(action_mask=np.array([1, 0, 1, 1, 0, 1], np.uint8), versions=np.array([0, -1, 2, 2, -1, 3], np.int32),
          prompt_len=0), "action_mask"),  # nothing conditions the first token
    (dict(rollout_logprobs=np.array([0, 0, 0.5, -1.0, 0, -0.1], np.float32)), "rollout_logprobs"),
    (dict(temperature=0.7), "temperature"),
    (dict(top_p=0.9), "top_p"),
    (dict(top_k=20), "top_k"),
])
def test_each_untrainable_kind_is_named(overrides, field):
    reason = untrainable(traj(**overrides), SPEC)
    assert reason is not None and field in reason.split(":")[0]


def test_group_baselines_refuse_lone_rollouts_and_groups_larger_than_a_step():
    groups = dataclasses.replace(SPEC, needs_groups=True, max_group_size=8)
    assert "group_size" in untrainable(traj(group="g", group_size=1), groups)
    assert "group_size" in untrainable(traj(group="g", group_size=9), groups)
    assert untrainable(traj(group="g", group_size=8), groups) is None


def test_log_prob_rounding_above_zero_is_tolerated():
    assert untrainable(traj(rollout_logprobs=np.array([0, 0, 1e-6, -1, 0, 0], np.float32)), SPEC) is None


# ------------------------------------------------------------------ a step that keeps failing


def _fail(failures: StepFailures, ids: list[str]) -> None:
    with pytest.raises(RuntimeError), failures.guard(ids):
        raise RuntimeError("device error")


def test_staleness_counts_updates_along_the_learners_line_not_version_numbers():
    def at(v: int) -> Trajectory:
        return traj(versions=np.array([-1, -1, v, v, -1, v], np.int32))  # every action token: v

    assert staleness(8, at(3)) == 5
    # a restart restored version 3 and published it as 6: 4 and 5 were steps it replayed
    restarts = [(3, 6)]
    assert [staleness(8, at(v), restarts) for v in (3, 6, 7, 8)] == [2, 2, 1, 0]
    assert staleness(8, at(4), restarts) == 3  # 1 update on the undone branch, 2 on the line
    assert staleness(8, at(1), restarts) == 4
    # a second restart from version 7, published as 10 (8 and 9 undone); 3 and 6 are one policy
    restarts = [(3, 6), (7, 10)]
    assert [staleness(11, at(v), restarts) for v in (11, 10, 7, 6, 3, 8)] == [0, 1, 1, 2, 2, 2]


def test_a_step_failing_on_consecutive_starts_is_poisoned_with_its_error(tmp_path):
    failures = StepFailures(tmp_path / "f.json", max_failures=3)
    ids = ["a", "b", "c"]
    for _ in range(2):
        _fail(failures, ids)
        assert failures.poisoned(ids) is None
    _fail(failures, ["c", "b", "x"])  # re-formed with another companion: shares b, c
    reason = failures.poisoned(["b", "y"])
    assert reason is not None and "3 consecutive" in reason and "device error" in reason
    assert failures.poisoned(["a", "x"]) is None  # the record narrowed to the shared ids


def test_a_failure_of_another_step_restarts_the_count_and_success_records_nothing(tmp_path):
    failures = StepFailures(tmp_path / "f.json", max_failures=2)
    _fail(failures, ["a"])
    _fail(failures, ["b"])
    assert failures.poisoned(["a"]) is None and failures.poisoned(["b"]) is None
    with failures.guard(["b"]):
        pass
    _fail(failures, ["b"])
    assert failures.poisoned(["b"]) is not None


# ------------------------------------------------------------------ a poisoned step (formation itself: test_formation.py)


def source(**kw) -> TrajectorySource:
    return TrajectorySource(KafkaConfig(), kw.pop("trainable", SPEC), **kw)  # never started


def feed(src: TrajectorySource, trajs: list[Trajectory], partition: int = 0) -> None:
    for offset, t in enumerate(trajs):
        src._queue.put((partition, offset, t, t.encode()))


def test_a_poisoned_step_is_dead_lettered_whole_and_the_next_one_formed(kafka_cfg):
    src = source()
    src.kafka, src.dlq = kafka_cfg, make_producer(kafka_cfg)
    feed(src, [traj(id=f"t{i}") for i in range(8)])
    step = src.next_step(step_index=0, staleness=lambda t: staleness(3, t), fresh=lambda t: 1.0, min_fresh_frac=0.0, batch_trajectories=4,
                         batch_tokens=1 << 20, stop=threading.Event(),
                         poisoned=lambda ids: "boom" if "t0" in ids else None)
    assert step.ids == ["t4", "t5", "t6", "t7"] and src.counts["dead_step"] == 1
    assert src.positions == {0: 8} and "t0" in src.formation.trained  # a late duplicate is not trained either
    letters = read_dead_letters(kafka_cfg, 4)
    assert [(dl.offset, dl.error) for dl in letters] == [(i, "boom") for i in range(4)]
    assert [Trajectory.decode(dl.payload).id for dl in letters] == ["t0", "t1", "t2", "t3"]


def read_dead_letters(cfg: KafkaConfig, n: int, timeout: float = 30) -> list[DeadLetter]:
    consumer = make_consumer(cfg, f"dlq-reader-{time.time_ns()}")
    consumer.subscribe([cfg.topic(T.DLQ)])
    letters, deadline = [], time.monotonic() + timeout
    try:
        while len(letters) < n and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and msg.error() is None:
                letters.append(DeadLetter.decode(msg.value()))
    finally:
        consumer.close()
    return letters

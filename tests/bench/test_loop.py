"""The shared in-process training loop (bench/loop.py): rollouts as stale as asked, read back from
the versions the generator stamped on each token, and one metrics dict per step."""

import random

import pytest

from bench.loop import LoopConfig, lags, run
from learner.update import UpdateConfig


@pytest.mark.parametrize("algorithm", ["sao", "grpo"])
def test_rollouts_are_exactly_staleness_versions_old(algorithm):
    history = run(LoopConfig(steps=5, batch=4, group=2, staleness=2,
                             update=UpdateConfig(algorithm=algorithm, warmup_steps=0)))
    assert [m["stale/versions"] for m in history] == [0, 1, 2, 2, 2]  # clamped at version 0
    assert [m["step/index"] for m in history] == list(range(5))
    assert all(0 <= m["reward/mean"] <= 1 and m["step/policy_updated"] == 1 for m in history)


def test_sync_every_lags_by_the_steps_since_the_last_reload():
    history = run(LoopConfig(steps=5, batch=2, sync_every=3, update=UpdateConfig(algorithm="grpo_dis"),
                             group=2))
    assert [m["stale/versions"] for m in history] == [0, 1, 2, 0, 1]


def test_stale_tail_lags_are_bounded_and_mostly_fresh():
    cfg = LoopConfig(staleness=8, stale_tail=True)
    drawn = [lag for step in range(200) for lag in lags(cfg, step, 16, random.Random(step))]
    assert min(drawn) == 0 and max(drawn) == 8
    assert drawn.count(0) > len(drawn) / 2 > drawn.count(8) * 20

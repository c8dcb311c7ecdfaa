"""bench/fresh_fraction.py's analysis: what each --min-fresh-frac would drop, on trajectories whose
tokens were sampled by known versions (the pipeline run itself is the bench)."""

import numpy as np
import pytest

from bench.fresh_fraction import analyse, turns
from schemas.messages import Trajectory


def trajectory(tid: str, versions: list[int]) -> Trajectory:
    """A prompt token then one action token per entry of `versions`, sampled by that version."""
    n = len(versions) + 1
    return Trajectory(id=tid, prompt_id=tid, env="toy", producer_id="p", tokens=np.arange(n, dtype=np.int32),
                      action_mask=np.array([0] + [1] * (n - 1), np.uint8),
                      rollout_logprobs=np.array([0.0] + [-1.0] * (n - 1), np.float32),
                      versions=np.array([-1, *versions], np.int32), prompt_len=1, reward=0.0)


def test_drops_and_lost_fresh_tokens_follow_each_tokens_staleness():
    # trained at version 10, bound 2: fresh = sampled at 8 or later
    trajs = [trajectory("all-fresh", [9, 9, 10, 10]),  # 1.0
             trajectory("half", [5, 5, 9, 9]),  # 0.5
             trajectory("long-quarter", [1, 1, 1, 1, 1, 1, 10, 10]),  # 0.25, the longest
             trajectory("stale", [3, 3, 3, 3])]  # 0.0
    rows = {r["threshold"]: r for r in analyse(trajs, {t.id: 10 for t in trajs}, 2, (0.0, 0.3, 0.6, 1.0))}
    assert rows[0.0]["stale episodes"] == 0.75 and rows[0.0]["dropped"] == 0.0
    assert rows[0.0]["trained per fresh"] == pytest.approx(20 / 8)  # 20 action tokens, 4 + 2 + 2 fresh
    assert rows[0.3]["dropped"] == 0.5 and rows[0.3]["fresh tokens lost"] == pytest.approx(2 / 8)
    assert rows[0.3]["long dropped"] == 1.0  # the long episode is the one the threshold hits
    assert rows[0.6]["dropped"] == 0.75 and rows[0.6]["fresh tokens lost"] == pytest.approx(4 / 8)
    assert rows[1.0]["dropped"] == 0.75 and rows[1.0]["trained per fresh"] == 1.0


def test_turns_are_long_tailed_within_the_bound():
    rng = np.random.default_rng(0)
    drawn = [turns(rng, 6) for _ in range(4000)]
    assert min(drawn) == 1 and max(drawn) == 6
    assert drawn.count(1) > drawn.count(2) > drawn.count(6) > 0

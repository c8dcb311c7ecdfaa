"""Long episodes the SAO way: staleness judged per token, and episodes cut at a token budget
trained under an overlong policy. Pure functions over one trajectory.

Staleness (docs/algorithm.md §6) is the number of policy updates between the version that sampled a token and
the learner's. A long agent episode spans several versions, and every action token carries its
own and is weighed by its own ratio, so an episode is not judged by its oldest token: action
tokens older than `max_staleness` give no policy gradient (they still count in the loss's N, as
DIS-masked tokens do, and stay context and critic targets), and the episode is dropped only when
fewer than `min_fresh_frac` of its action tokens are within the bound (the source's decision).

Overlong (DAPO's overlong filtering): an episode whose finish reason is one of
`schemas.messages.TRUNCATED` was cut at a token budget, not ended by the model, so its reward says
little about its tokens. `mask` takes its policy gradient out, `penalty` lowers its reward by
`--update.overlong-penalty`, `keep` (the default, as before) trains it like any other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from schemas.messages import TRUNCATED, Trajectory

Overlong = Literal["keep", "mask", "penalty"]


def depth(versions: np.ndarray, restarts: Sequence[tuple[int, int]]) -> np.ndarray:
    """Updates along the learner's line up to each version. A restart (c, r) restored the policy
    of version c and published it as r, past numbers c+1 … r−1 that are not updates of the line
    (learner/service.py `continue_versions`); a version on such a branch sits as far from the line
    as its way back to c. `versions` of any shape; returns the same shape."""
    def on_line(v: np.ndarray) -> np.ndarray:  # the numbers skipped by every restart before v left out
        return v - sum(np.where(v >= r, r - c, 0) for c, r in restarts)

    v = np.asarray(versions, np.int64)
    out = on_line(v)
    for c, r in reversed(restarts):  # on a branch a restart undid (the oldest such counts)
        out = np.where((v > c) & (v < r), on_line(np.array(c)) - (v - c), out)
    return out


def token_staleness(learner_version: int, traj: Trajectory, restarts: Sequence[tuple[int, int]] = ()) -> np.ndarray:
    """(T,) staleness of each action token against `learner_version`; -1 off actions."""
    acted = traj.action_mask.astype(bool)
    stale = depth(np.array([learner_version]), restarts)[0] - depth(np.maximum(traj.versions, 0), restarts)
    return np.where(acted, stale, -1)


def staleness(learner_version: int, traj: Trajectory, restarts: Sequence[tuple[int, int]] = ()) -> int:
    """The trajectory's staleness: that of its oldest action token (docs/algorithm.md §6); 0 with none."""
    return max(int(token_staleness(learner_version, traj, restarts).max(initial=0)), 0)


def fresh_tokens(learner_version: int, traj: Trajectory, max_staleness: int,
                 restarts: Sequence[tuple[int, int]] = ()) -> np.ndarray:
    """(T,) bool: action tokens at most `max_staleness` updates old (-1: no bound)."""
    acted = traj.action_mask.astype(bool)
    if max_staleness < 0:
        return acted
    return acted & (token_staleness(learner_version, traj, restarts) <= max_staleness)


def fresh_fraction(learner_version: int, traj: Trajectory, max_staleness: int,
                   restarts: Sequence[tuple[int, int]] = ()) -> float:
    """Share of the action tokens within the bound (1.0 with none)."""
    acted = int(traj.action_mask.sum())
    return float(fresh_tokens(learner_version, traj, max_staleness, restarts).sum()) / acted if acted else 1.0


def overlong(traj: Trajectory, policy: Overlong, penalty: float) -> tuple[Trajectory, bool]:
    """The trajectory as trained under the overlong policy, and whether its tokens give policy
    gradient (False only for a truncated one under `mask`)."""
    if traj.finish_reason not in TRUNCATED or policy == "keep":
        return traj, True
    if policy == "mask":
        return traj, False
    return dataclasses.replace(traj, reward=(traj.reward or 0.0) - penalty), True


def policy_tokens(learner_version: int, trajs: Sequence[Trajectory], max_staleness: int, policy: Overlong,
                  penalty: float, restarts: Sequence[tuple[int, int]] = ()) -> tuple[list[Trajectory], list[np.ndarray]]:
    """The step's trajectories (rewards under the overlong policy) and, for each, the (T,) bool
    action tokens whose policy gradient counts: fresh, and not in a masked truncated episode."""
    out, masks = [], []
    for traj in trajs:
        trained, counts = overlong(traj, policy, penalty)
        out.append(trained)
        masks.append(fresh_tokens(learner_version, traj, max_staleness, restarts) & counts)
    return out, masks

"""Reward functions by import path (`sao producer --reward mypkg.rewards:score`).

    score(task: dict, text: str, trajectory: schemas.messages.Trajectory) -> float | None

is called once per finished episode, through the plug-in boundary (schemas/boundary.py: its own
thread, at most `--env-step-timeout` seconds): `task` is the prompt's task map, `text`
the decoded action tokens of the response (every turn's, special tokens skipped), `trajectory` the
episode as it will be published. Its value replaces the trajectory's outcome reward (whatever the
env gave); None sends the trajectory to `sao.trajectories.pending` for a live reward stream, as an
env without a reward does. A value that is not a finite number, or an exception in the function,
sends that prompt to `sao.dlq` with the reason (`RewardError`), and the producer goes on.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable

from schemas.messages import SchemaError, Trajectory
from schemas.plugins import load_callable

RewardFn = Callable[[dict, str, Trajectory], float | None]


class RewardError(SchemaError):
    """The reward function failed on one episode; its prompt goes to the DLQ."""

    def __init__(self, problem: str):
        super().__init__("reward", problem)


def load_reward(spec: str) -> RewardFn:
    return load_callable(spec, "--reward", ("task", "text", "trajectory"))


def outcome(value: object, spec: str) -> float | None:
    """The reward function's return as the outcome reward, or RewardError."""
    if value is None:
        return None
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise RewardError(f"--reward {spec} returned a {type(value).__name__} ({value!r:.60}), not a number or None")
    if not math.isfinite(value):
        raise RewardError(f"--reward {spec} returned {value}, not a finite number")
    return float(value)


def scored(fn: RewardFn, spec: str, task: dict, text: str, traj: Trajectory) -> Trajectory:
    """`traj` with the outcome reward `fn` gives it."""
    try:
        value = fn(task, text, traj)
    except BaseException as e:  # noqa: BLE001 - the user's function may raise anything, SystemExit too; it costs this episode only
        raise RewardError(f"--reward {spec} raised {type(e).__name__}: {e}") from e
    return dataclasses.replace(traj, reward=outcome(value, spec), meta={**traj.meta, "reward_source": spec})


def scorer(spec: str, tokenizer) -> Callable[[dict, Trajectory], Trajectory]:
    """The `--reward` function as (task, trajectory) -> scored trajectory; `text` is decoded here."""
    fn = load_reward(spec)

    def score(task: dict, traj: Trajectory) -> Trajectory:
        text = tokenizer.decode(traj.tokens[traj.action_mask == 1].tolist(), skip_special_tokens=True)
        return scored(fn, spec, task, text, traj)
    return score

"""How an episode ends, through the producer's episode loop with a real (tiny) model: its reason,
tool counts and reward on the trajectory; an episode at its token budget trained as truncated
instead of dead-lettered; and the episode closed on every path (answer, limit, error, cancel)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from producers.envs.base import Step
from producers.episode import TrajectoryIds, run_episode
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator
from producers.models import load_model
from schemas.boundary import Bounds, PluginError
from schemas.messages import Trajectory

PARAMS = SamplingParams(temperature=1.0, max_tokens=4, seed=0)
IDS = TrajectoryIds(id="t", prompt_id="p", env="test", producer_id="x")


@pytest.fixture(scope="module")
def generator():
    return HFGenerator(load_model("tiny-llama", seed=0), seed=0)


@dataclass
class Scripted:
    """A plug-in episode whose steps are given: (observation length, reward, done, reason, tool calls, errors),
    or an exception to raise, or a number of seconds to hang."""

    steps: list
    closed: list = field(default_factory=list)
    prompt_ids: list = field(default_factory=lambda: [1, 3])
    max_turns: int = 8
    turn: int = 0

    def step(self, action_ids):
        what = self.steps[self.turn]
        self.turn += 1
        if isinstance(what, Exception):
            raise what
        if isinstance(what, float):
            time.sleep(what)
            return Step(done=True, reward=1.0)
        obs, reward, done, reason, calls, errors = what
        return Step(observation=[5] * obs, reward=reward, done=done, reason=reason, tool_calls=calls,
                    tool_errors=errors)

    def close(self):
        self.closed.append(self.turn)


def play(episode, generator, bounds=None) -> Trajectory:
    return asyncio.run(run_episode(episode, generator, PARAMS, IDS, bounds or Bounds(plugin="test", vocab_size=64)))


def test_the_envs_reason_and_tool_counts_travel_on_the_trajectory_and_the_episode_is_closed(generator):
    ep = Scripted([(3, None, False, "", 2, 1), (3, None, False, "", 1, 0), (0, 0.0, True, "invalid_calls", 1, 1)])
    traj = play(ep, generator)
    assert (traj.finish_reason, traj.num_turns, traj.tool_calls, traj.tool_errors, traj.reward) == \
        ("invalid_calls", 3, 4, 2, 0.0)
    assert ep.closed == [3]
    assert Trajectory.decode(traj.encode()).tool_calls == 4


def test_a_reply_still_acting_at_the_turn_budget_ends_as_max_turns(generator):
    ep = Scripted([(2, None, False, "", 1, 0)] * 3 + [(2, 0.5, False, "", 1, 0)], max_turns=4)
    traj = play(ep, generator)
    assert traj.finish_reason == "max_turns" and traj.num_turns == 4 and ep.closed == [4]


def test_an_episode_at_its_token_budget_ends_as_truncated_and_is_not_dead_lettered(generator):
    ep = Scripted([(3, 0.25, False, "", 0, 0), (15, 0.5, False, "", 0, 0), (3, 1.0, True, "", 0, 0)])
    traj = play(ep, generator, Bounds(plugin="test", vocab_size=64, max_tokens=24))
    assert traj.finish_reason == "context" and traj.num_tokens <= 24
    # the cut turn's reward is the outcome, on its last action token, and not counted twice
    assert traj.reward == 0.5 and [r for _, r in traj.turn_rewards] == [0.25]
    assert ep.closed == [2]
    none = play(Scripted([(12, None, False, "", 0, 0)]), generator, Bounds(plugin="test", vocab_size=64, max_tokens=16))
    assert none.finish_reason == "context" and none.reward == 0.0  # no reward to keep: nothing was answered


def test_an_episode_whose_step_raises_is_closed(generator):
    ep = Scripted([(2, None, False, "", 0, 0), RuntimeError("the env broke")])
    with pytest.raises(PluginError, match="the env broke"):
        play(ep, generator)
    assert ep.closed == [2]


def test_a_cancelled_episode_is_closed(generator):
    ep = Scripted([(2, None, False, "", 0, 0), 5.0])

    async def cancel_it():
        task = asyncio.create_task(run_episode(ep, generator, PARAMS, IDS, Bounds(plugin="test", vocab_size=64)))
        while ep.turn < 2:
            await asyncio.sleep(0.05)
        task.cancel()  # a revoked partition, a stop
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(cancel_it())
    deadline = time.monotonic() + 10
    while not ep.closed and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ep.closed

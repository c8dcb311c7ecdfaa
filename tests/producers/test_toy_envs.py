"""The toy environments and `run_episode`, which turns an episode into a Trajectory."""

import asyncio

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import random

import numpy as np
import pytest

from producers.envs import ENVS, make_env
from producers.envs.toy import BOS, FIRST, SEP, MultiTurnEnv, TargetEnv, target_fraction
from producers.episode import TrajectoryIds, play_tasks, run_episode
from producers.generate.base import Generation, SamplingParams
from schemas.messages import Trajectory

IDS = TrajectoryIds(id="t1", prompt_id="p1", env="toy", producer_id="test")


class Scripted:
    """A generator that replays fixed action spans, with made-up log-probs and versions."""

    def __init__(self, spans):
        self.spans = list(spans)
        self.prompts = []

    @property
    def version(self):
        return 7

    async def generate(self, prompt_ids, params):
        self.prompts.append(list(prompt_ids))
        span = self.spans.pop(0)
        return Generation(token_ids=np.array(span, np.int32),
                          logprobs=-np.arange(1, len(span) + 1, dtype=np.float32),
                          versions=np.full(len(span), 7, np.int32), finish_reason="length",
                          timing={"generate_s": 0.5})

    def load_weights(self, path, version):
        raise NotImplementedError


def test_target_fraction_counts_members_of_the_set():
    # n_tasks = 4: set 1 = {FIRST + 1, FIRST + 5, …}; reserved ids never count
    assert target_fraction([FIRST + 1, FIRST + 5, FIRST + 2, BOS], 1, 4) == 0.5
    assert target_fraction([], 0, 4) == 0.0


def test_registry_builds_by_name_and_refuses_unknown():
    assert isinstance(make_env("toy-target", vocab_size=32), TargetEnv)
    assert isinstance(make_env("toy-multiturn"), MultiTurnEnv)
    assert {"toy-target", "toy-multiturn"} <= set(ENVS)
    with pytest.raises(ValueError, match="unknown env"):
        make_env("nope")
    with pytest.raises(ValueError, match="n_tasks"):
        TargetEnv(vocab_size=5, n_tasks=4)


def test_single_turn_episode():
    env = TargetEnv(vocab_size=16, n_tasks=4)
    task = env.sample_task(random.Random(0))
    ep = env.episode(task)
    assert ep.prompt_ids == [BOS, FIRST + task["target"]] and ep.max_turns == 1
    good = FIRST + task["target"]
    step = ep.step([good, good + 4, good + 1, BOS])
    assert step.done and step.reward == 0.5 and step.observation == []


@pytest.mark.parametrize("turn_rewards", [False, True])
def test_multi_turn_episode_observations_and_rewards(turn_rewards):
    env = MultiTurnEnv(n_tasks=4, n_turns=3, turn_rewards=turn_rewards)
    ep = env.episode({"targets": [0, 2, 1]})
    assert ep.prompt_ids == [BOS, FIRST + 0] and ep.max_turns == 3
    s1 = ep.step([FIRST, FIRST])  # 1.0 of turn 0
    assert s1.observation == [SEP, FIRST + 2] and not s1.done
    s2 = ep.step([FIRST + 2, FIRST])  # 0.5 of turn 1
    assert s2.observation == [SEP, FIRST + 1]
    s3 = ep.step([FIRST])  # 0 of turn 2
    assert s3.done
    if turn_rewards:
        assert (s1.reward, s2.reward, s3.reward) == pytest.approx((1 / 3, 1 / 6, 0.0))
    else:
        assert (s1.reward, s2.reward, s3.reward) == (None, None, pytest.approx(0.5))


def test_run_episode_builds_the_trajectory_with_observations_and_turn_rewards():
    env = MultiTurnEnv(n_tasks=4, n_turns=2, turn_rewards=True)
    gen = Scripted([[FIRST, FIRST + 4], [FIRST + 1, FIRST + 9, FIRST]])
    traj = asyncio.run(run_episode(env.episode({"targets": [0, 1]}), gen, SamplingParams(max_tokens=3), IDS))
    #            prompt          a_0 (2)            o_0            a_1 (3)
    assert traj.tokens.tolist() == [BOS, FIRST, FIRST, FIRST + 4, SEP, FIRST + 1,
                                    FIRST + 1, FIRST + 9, FIRST]
    assert traj.action_mask.tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert traj.rollout_logprobs.tolist() == [0, 0, -1, -2, 0, 0, -1, -2, -3]
    assert traj.versions.tolist() == [-1, -1, 7, 7, -1, -1, 7, 7, 7]
    assert traj.prompt_len == 2 and traj.num_turns == 2
    assert traj.turn_rewards == [(3, 0.5)]  # turn 0 scored 1.0 / 2 turns, on token 3
    assert traj.reward == pytest.approx(2 / 3 / 2)  # turn 1: 2 of 3 in set 1
    assert gen.prompts[1] == traj.tokens[:6].tolist()  # turn 2 sees the observation
    assert traj.timing["generate_s"] == 1.0 and traj.finish_reason == "length"
    again = Trajectory.decode(traj.encode())  # it is a valid wire message
    assert again.turn_rewards == traj.turn_rewards and np.array_equal(again.tokens, traj.tokens)
    assert (again.temperature, again.top_p, again.top_k) == (1.0, 1.0, 0)


def test_single_turn_run_episode_has_no_turn_rewards():
    env = TargetEnv(n_tasks=2)
    traj = asyncio.run(run_episode(env.episode({"target": 1}), Scripted([[FIRST + 1, FIRST]]),
                       SamplingParams(max_tokens=2), IDS))
    assert traj.reward == 0.5 and traj.turn_rewards == [] and traj.num_turns == 1


def test_play_tasks_groups_share_a_prompt_id():
    env = TargetEnv(n_tasks=4)
    trajs = play_tasks(env, Scripted([[FIRST]] * 6), SamplingParams(max_tokens=1),
                       random.Random(0), num_prompts=3, group_size=2)
    assert len(trajs) == 6 and len({t.id for t in trajs}) == 6
    assert [t.prompt_id == u.prompt_id for t, u in zip(trajs[::2], trajs[1::2])] == [True] * 3


def test_play_tasks_concurrent_plays_the_same_tasks_and_groups():
    env = TargetEnv(n_tasks=4)
    one_by_one, together = (
        play_tasks(env, Scripted([[FIRST]] * 6), SamplingParams(max_tokens=1), random.Random(0),
                   num_prompts=3, group_size=2, concurrent=concurrent) for concurrent in (False, True))
    assert [(t.id, t.prompt_id, t.group) for t in together] == [
        (t.id, t.prompt_id, t.group) for t in one_by_one]
    assert [t.reward for t in together] == [t.reward for t in one_by_one]

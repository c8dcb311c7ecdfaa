"""Play one environment episode with a generator and return it as a `schemas.Trajectory`.

The sequence is `[prompt, a_0, o_0, a_1, …, a_n]`: action spans sampled by the generator
(action_mask 1, their rollout log-probs and weight versions) and observation spans from the
environment (action_mask 0, log-prob 0.0, version −1). The final step's reward is
`Trajectory.reward` (None: a live reward stream will score it); earlier turns' rewards go to
`Trajectory.turn_rewards` as `(token_index, reward)` pairs, `token_index` being the last action
token of that turn, which is where the learner places them (docs/algorithm.md §4). The sampling settings
travel with it, so the learner can refuse what it would not recompute the same way. The final step's
observation, if any, is dropped: nothing acts on it.

An episode is a coroutine so a producer keeps many in flight on one event loop: it awaits the
generator, and calls the environment through the plug-in boundary (schemas/boundary.py: a
thread per call, bounded in time, its results checked), since a sandboxed tool call blocks for
seconds and a plug-in may hang, raise anything, or return what no trajectory can carry.
"""

from __future__ import annotations

import asyncio
import json
import numbers
import random
import time
from dataclasses import dataclass, replace

import numpy as np

from schemas.boundary import Bounds, call, reward, room, token_ids
from producers.envs.base import Env, Episode, Step
from producers.generate.base import Generator, SamplingParams
from producers.generate.sim import ToolLatency
from schemas.messages import Prompt, SchemaError, Trajectory


@dataclass(frozen=True, kw_only=True)
class TrajectoryIds:
    """Who and what a trajectory is, for its message."""

    id: str
    prompt_id: str
    env: str
    producer_id: str
    group: str = ""
    group_size: int = 1


async def run_episode(episode: Episode, generator: Generator, params: SamplingParams,
                      ids: TrajectoryIds, bounds: Bounds | None = None) -> Trajectory:
    """Alternate generator turns and environment steps until done or `episode.max_turns`. Every
    call into the episode goes through the plug-in boundary (schemas/boundary.py): bounded in
    time, its results checked, whatever it does costing this episode alone. An episode that
    reaches its token budget (`bounds.max_tokens`: the context window, or less) ends there as
    truncated (`finish_reason` context); the episode is closed however it ends."""
    bounds = bounds or Bounds(plugin=f"env {ids.env}")
    if params.max_tokens < 1:
        raise ValueError("max_tokens must be >= 1: every turn needs an action token")
    try:
        return await _play(episode, generator, params, ids, bounds)
    finally:
        if callable(getattr(episode, "close", None)):
            await asyncio.shield(call(bounds, "env.close", episode.close))


async def _play(episode: Episode, generator: Generator, params: SamplingParams, ids: TrajectoryIds,
                bounds: Bounds) -> Trajectory:
    spans = {"tokens": [], "action_mask": [], "rollout_logprobs": [], "versions": []}
    used = 0

    def add(token_ids, acted: bool, logprobs=None, versions=None) -> None:
        nonlocal used
        n = len(token_ids)
        used += n
        spans["tokens"].append(np.asarray(token_ids, np.int32))
        spans["action_mask"].append(np.full(n, acted, np.uint8))
        spans["rollout_logprobs"].append(np.zeros(n, np.float32) if logprobs is None else logprobs)
        spans["versions"].append(np.full(n, -1, np.int32) if versions is None else versions)

    prompt, max_turns = await call(bounds, "env.episode", lambda: (
        token_ids(bounds, "env.prompt_ids", episode.prompt_ids), _turns(bounds, episode.max_turns)))
    room(bounds, "env.prompt_ids", 0, len(prompt))
    add(prompt, False)
    turn_rewards, timing, tools = [], {"generate_s": 0.0, "env_s": 0.0}, [0, 0]
    start = time.perf_counter()
    for turn in range(1, max_turns + 1):
        turn_params = replace(params, max_tokens=min(params.max_tokens, bounds.max_tokens - used))
        gen = await generator.generate(np.concatenate(spans["tokens"]).tolist(), turn_params)
        add(gen.token_ids, True, gen.logprobs, gen.versions)
        timing["generate_s"] += gen.timing.get("generate_s", 0.0)
        t = time.perf_counter()
        step = await call(bounds, "env.step", env_step, bounds, episode, gen.token_ids.tolist())
        timing["env_s"] += time.perf_counter() - t
        tools[0], tools[1] = tools[0] + step.tool_calls, tools[1] + step.tool_errors
        finish = step.reason or ("max_turns" if turn == max_turns and not step.done else gen.finish_reason)
        if step.done or turn == max_turns:
            break
        if step.reward is not None:
            turn_rewards.append((used - 1, step.reward))  # on the last token of this turn's action span
        if used + len(step.observation) + 1 > bounds.max_tokens:  # no room for its next turn: cut here,
            if step.reward is not None:  # this turn's reward becoming the outcome (the same token)
                turn_rewards.pop()
            step, finish = replace(step, reward=step.reward or 0.0), "context"
            break
        add(step.observation, False)
    timing["total_s"] = time.perf_counter() - start
    return Trajectory(id=ids.id, prompt_id=ids.prompt_id, env=ids.env, producer_id=ids.producer_id,
                      group=ids.group, group_size=ids.group_size,
                      **{k: np.concatenate(v) for k, v in spans.items()},
                      prompt_len=len(prompt), reward=step.reward, turn_rewards=turn_rewards,
                      temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                      finish_reason=finish, num_turns=turn, tool_calls=tools[0], tool_errors=tools[1],
                      timing=timing)


def _turns(bounds: Bounds, max_turns) -> int:
    if not isinstance(max_turns, numbers.Integral) or isinstance(max_turns, bool) or max_turns < 1:
        raise bounds.fail("env.max_turns", f"expected an int >= 1, got {max_turns!r:.40}")
    return int(max_turns)


def env_step(bounds: Bounds, episode: Episode, action_ids: list[int]) -> Step:
    """`episode.step`, its result checked (a Step, int token ids in the vocabulary, finite
    rewards); runs on the boundary's thread (`call`), which turns whatever it raises into a
    PluginError."""
    step = episode.step(action_ids)
    if not isinstance(step, Step):
        raise bounds.fail("env.step", f"expected a Step, got {type(step).__name__}")
    counts = (step.tool_calls, step.tool_errors)
    if not all(isinstance(n, numbers.Integral) and not isinstance(n, bool) and n >= 0 for n in counts):
        raise bounds.fail("env.step.tool_calls", f"tool counts must be ints >= 0, got {counts!r:.60}")
    if not isinstance(step.reason, str) or len(step.reason) > 64:
        raise bounds.fail("env.step.reason", f"expected a short str, got {step.reason!r:.60}")
    return Step(observation=token_ids(bounds, "env.step.observation", step.observation),
                reward=reward(bounds, "env.step.reward", step.reward), done=bool(step.done),
                reason=step.reason if step.done else "", tool_calls=int(counts[0]), tool_errors=int(counts[1]))


@dataclass(kw_only=True)
class Player:
    """Plays prompts of its environments (by the name each prompt carries) on one generator."""

    envs: dict[str, object]
    generator: Generator
    params: SamplingParams
    producer_id: str
    tool_s: float = 0.0  # simulated tool-call time per continuing step (sim backend)
    bounds: Bounds | None = None
    """What the env's results must fit (default: its name and the codec's limits)."""

    async def play(self, prompt: Prompt) -> Trajectory:
        """One episode of `prompt`; SchemaError when its env or task is not one this producer can play."""
        if (env := self.envs.get(prompt.env)) is None:
            raise SchemaError("env", f"this producer plays {sorted(self.envs)}, not {prompt.env!r}")
        bounds = replace(self.bounds or Bounds(plugin=""), plugin=f"env {prompt.env}")
        episode = await call(bounds, "task", env.episode, prompt.task)  # the env could not start this task
        if self.tool_s:
            episode = ToolLatency(episode, self.tool_s)
        ids = TrajectoryIds(id=prompt.trajectory_id, prompt_id=prompt.id, env=prompt.env,
                            producer_id=self.producer_id, group=prompt.group, group_size=prompt.group_size)
        return await run_episode(episode, self.generator, self.params, ids, bounds)


def play_tasks(env: Env, generator: Generator, params: SamplingParams, rng: random.Random, *,
               num_prompts: int, group_size: int = 1, producer_id: str = "local",
               id_prefix: str = "", concurrent: bool = False) -> list[Trajectory]:
    """`num_prompts` fresh tasks of `env`, `group_size` episodes each, played in-process one after
    another (tests, benchmarks; sequential so a seeded run samples the same tokens every time), or
    with `concurrent` all at once so the generator batches them (several times faster; which tokens
    a seed samples then depends on how the requests met in batches). A task's prompt id is its
    content, so every repeat of a task shares one running mean and the G episodes of a sampled task
    form one group."""
    episodes = []
    for p in range(num_prompts):
        task = env.sample_task(rng)
        prompt_id = f"{env.name}/{json.dumps(task, sort_keys=True)}"
        for g in range(group_size):
            ids = TrajectoryIds(id=f"{id_prefix}{p}.{g}", prompt_id=prompt_id, env=env.name,
                                producer_id=producer_id, group=f"{id_prefix}{p}", group_size=group_size)
            episodes.append(run_episode(env.episode(task), generator, params, ids))
    if concurrent:
        async def together() -> list[Trajectory]:
            return list(await asyncio.gather(*episodes))
        return asyncio.run(together())
    return [asyncio.run(e) for e in episodes]

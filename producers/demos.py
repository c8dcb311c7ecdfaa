"""Demonstrations an environment writes itself, as trajectories: the cold start of agentic RL.

An env that can solve its own tasks has `demonstration(task) -> [(reply, observation), ...]`: the
assistant's text of each turn and what the env answers it with (None after the last). Here each
becomes a trajectory laid out exactly as a played episode of that task would be: the episode's
prompt ids, each reply encoded and closed with the template's end of turn (action tokens), each
observation through the same `Chat.observation_ids` an episode appends (observation tokens). The
learner's supervised warm-up (learner/sft.py) trains on their action tokens; the model then plays
the env's format, which RL improves on.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np

from producers.envs.chat import Chat
from producers.heldout import held_out, split_frac
from schemas.messages import Trajectory


def demonstration_trajectory(env, task: dict, chat: Chat, traj_id: str) -> Trajectory:
    episode = env.episode(task)
    try:
        tokens, acted = list(episode.prompt_ids), [0] * len(episode.prompt_ids)
    finally:
        if callable(getattr(episode, "close", None)):
            episode.close()
    end = chat.encode(chat.turn_end.strip())[:1]  # the end-of-turn token a model samples to stop
    turns = env.demonstration(task)
    for reply, observation in turns:
        action = chat.encode(reply) + end
        tokens += action
        acted += [1] * len(action)
        if observation is not None:
            obs = chat.observation_ids(action, observation)
            tokens += obs
            acted += [0] * len(obs)
    mask = np.array(acted, np.uint8)
    return Trajectory(id=traj_id, prompt_id=f"demo/{traj_id}", env=env.name, producer_id="demonstration",
                      tokens=np.array(tokens, np.int32), action_mask=mask, rollout_logprobs=np.zeros(len(tokens)),
                      versions=np.where(mask == 1, 0, -1), prompt_len=len(episode.prompt_ids), reward=1.0,
                      num_turns=len(turns))


def training_tasks(env, n: int, heldout_frac: float, seed: int) -> Iterator[dict]:
    """`n` tasks of the env's generator outside its held-out split (producers/heldout.py), so a
    warm-up never sees what evaluation scores."""
    rng, frac, given = random.Random(seed), split_frac(env, heldout_frac), 0
    while given < n:
        task = env.sample_task(rng)
        if not held_out(task, frac):
            given += 1
            yield task


def demonstrations(env, chat: Chat, n: int, heldout_frac: float, seed: int) -> list[Trajectory]:
    if not callable(getattr(env, "demonstration", None)):
        raise TypeError(f"env {env.name} writes no demonstrations (it has no demonstration(task))")
    return [demonstration_trajectory(env, task, chat, f"demo-{i}")
            for i, task in enumerate(training_tasks(env, n, heldout_frac, seed))]

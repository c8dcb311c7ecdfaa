"""Gym-style text environments as `Env`s, for users who think in strings.

A text env is any object with

    reset(task: dict) -> str                      # the prompt (or a list of chat messages)
    step(action: str) -> (str, float | None, bool)  # observation, reward, done
    sample_task(rng: random.Random) -> dict       # optional: without it, tasks come from a dataset

and one is made per episode (episodes run concurrently, and a gym env holds one episode's state),
from the factory `--env` names with the settings it takes; the first one made also samples tasks.
`TextEnv` owns the tokenizer: the prompt and each observation are tokenised through the model's
chat template (producers/envs/chat.py), the action is decoded for `step`, and the trained tokens
are exactly the ids the model sampled, never the decoded text tokenised again (which need not
give the same ids). The final step's observation is not used; its reward is the outcome (None:
a live reward stream scores it). An exception in `reset` or `step`, or a `step` result of the
wrong shape, sends that episode's prompt to `sao.dlq`; the producer goes on.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from producers.envs.base import Step
from producers.envs.chat import Chat
from schemas.messages import SchemaError


def is_text_env(obj: object) -> bool:
    """Gym-style (reset/step) rather than an `Env` (sample_task/episode over token ids)."""
    return callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None)) \
        and not callable(getattr(obj, "episode", None))


def text_step(out: object) -> tuple[str, float | None, bool]:
    """A text env's `step` result, checked: SchemaError (the prompt goes to the DLQ) otherwise."""
    if not isinstance(out, tuple) or len(out) != 3:
        raise SchemaError("step", f"a text env's step must return (observation, reward, done), got {out!r:.80}")
    observation, reward, done = out
    if not isinstance(observation, str):
        raise SchemaError("step.observation", f"expected str, got {type(observation).__name__}")
    if reward is not None and (not isinstance(reward, numbers.Real) or isinstance(reward, bool)):
        raise SchemaError("step.reward", f"expected a number or None, got {type(reward).__name__}")
    return observation, None if reward is None else float(reward), bool(done)


@dataclass
class TextEpisode:
    user: Any
    chat: Chat
    prompt_ids: list[int]
    max_turns: int

    def step(self, action_ids: list[int]) -> Step:
        observation, reward, done = text_step(self.user.step(self.chat.decode(action_ids)))
        ids = [] if done else self.chat.observation_ids(action_ids, observation)
        return Step(observation=ids, reward=reward, done=done)

    def close(self) -> None:
        """The text env's own close (a Gymnasium env's, an OpenEnv session's), however the episode ended."""
        if callable(close := getattr(self.user, "close", None)):
            close()


class TextEnv:
    """An `Env` over a text env's factory; `first` is the instance the factory made at start."""

    def __init__(self, *, name: str, first: Any, make: Callable[[], Any], tokenizer=None, max_turns: int = 1):
        self.name, self.make, self.max_turns = name, make, max_turns
        self.chat = Chat(tokenizer) if tokenizer is not None else None
        if callable(getattr(first, "sample_task", None)):  # else the env has none: tasks come from a dataset
            self.sample_task = first.sample_task

    def episode(self, task: dict) -> TextEpisode:
        if self.chat is None:
            raise ValueError(f"text env {self.name} needs a tokenizer to run episodes")
        user = self.make()
        prompt = user.reset(task)  # what it raises costs this prompt (producers/episode.py)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise SchemaError("reset", f"a text env's reset must return a str or chat messages, got {prompt!r:.80}")
        return TextEpisode(user, self.chat, self.chat.prompt_ids(messages), self.max_turns)

"""The environment interface: a task generator plus a per-episode state machine over token ids.

An episode starts from prompt token ids; after each action span the model emits, `step` returns
the observation tokens to append (action_mask 0), an optional per-turn reward, and whether the
episode is over. Text environments hold a tokenizer; toy environments work on ids directly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(kw_only=True)
class Step:
    observation: list[int] = field(default_factory=list)
    """Tokens the environment appends after the action span (not trained on)."""
    reward: float | None = None
    """Reward of this turn, placed on the last token of its action span; on the final step, the
    outcome reward. None on the final step means a live reward stream will score it."""
    done: bool = False


class Episode(Protocol):
    prompt_ids: list[int]
    max_turns: int

    def step(self, action_ids: list[int]) -> Step: ...


class Env(Protocol):
    name: str

    def sample_task(self, rng: random.Random) -> dict:
        """A fresh task (the prompt's `task` map); JSON/msgpack-serialisable."""

    def episode(self, task: dict) -> Episode: ...

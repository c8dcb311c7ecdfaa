"""The environment interface: a task generator plus a per-episode state machine over token ids.

An episode starts from prompt token ids; after each action span the model emits, `step` returns
the observation tokens to append (action_mask 0), an optional per-turn reward, and whether the
episode is over. Text environments hold a tokenizer; toy environments work on ids directly.

The contract a plug-in (`--env module:attr`, or a `sao.envs` entry point) keeps, checked on one
smoke task at start where the env samples tasks:
- token ids in, token ids out, all Python or numpy ints: `step` gets exactly the ids the model
  sampled, and the ids it returns are appended as they are; nothing is re-tokenised between turns;
- the tokenizer is the policy's, handed to the constructor when it names a `tokenizer` parameter
  (likewise `sandbox` and `max_turns`); the env owns it and must not swap it: its ids are the model's;
- a task map is JSON/msgpack-serialisable (it travels in the prompt message); a task the env cannot
  read raises KeyError, TypeError or ValueError in `episode`, which sends that prompt to `sao.dlq`;
- the env is shared by every episode in flight and `step` runs in a worker thread, so state lives
  in the `Episode`, not the `Env`;
- `name` is set to the name the env was loaded by, which is what prompts carry;
- an episode that holds something (an interpreter, a connection) frees it in `close()`, which the
  producer calls once however the episode ends.
Users who think in strings write a gym-style text env instead (producers/envs/text.py).
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
    reason: str = ""
    """Why the env ended the episode, when it ends it for anything but the model's final answer
    (`max_turns`, `invalid_calls`, `deadline`, ...): the trajectory's `finish_reason`."""
    tool_calls: int = 0
    """Tool calls the model made in this turn's action span."""
    tool_errors: int = 0
    """Of them, those that failed: malformed, an unknown tool, bad arguments, or the tool raised."""


class Episode(Protocol):
    prompt_ids: list[int]
    max_turns: int

    def step(self, action_ids: list[int]) -> Step: ...

    # optional: `close()`, called once however the episode ends (answer, limit, error, cancellation),
    # to free what it holds (a sandboxed interpreter)


class Env(Protocol):
    name: str

    def sample_task(self, rng: random.Random) -> dict:
        """A fresh task (the prompt's `task` map); JSON/msgpack-serialisable. Optional for a
        plug-in whose tasks come only from a dataset (`sao feed --dataset`)."""

    def episode(self, task: dict) -> Episode: ...

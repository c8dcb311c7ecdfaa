"""A TRL-style environment class, as TRL's `environment_factory` takes one, for `--env module:Class`:

    sao up --env examples.trl_env:Counter --model tiny-llama-bytes

`reset(**task)` starts an episode (its text, if any, is added to the task's `prompt`); every other
public method is a tool the model calls in JSON, its schema read from the signature and docstring;
a tool that raises has its error sent back to the model as the reply. Once the model answers
without a tool call, the episode's reward is `reward`. `sample_task` (optional) makes tasks for
`sao feed`; without it, give the tasks as a `--dataset` whose rows hold `prompt` and `reset`'s
arguments.
"""

from __future__ import annotations

import random


class Counter:
    def __init__(self):
        self.value, self.target = 0, 0

    @staticmethod
    def sample_task(rng: random.Random) -> dict:
        target = rng.randint(2, 9)
        return {"prompt": f"Use the increment tool until the counter reaches {target}, then say done.",
                "target": target}

    def reset(self, target: int) -> str:
        self.value, self.target = 0, target
        return "The counter is at 0."

    def increment(self, by: int) -> int:
        """Add to the counter.

        Args:
            by: How much to add, 1 to 3.
        """
        if not 1 <= by <= 3:
            raise ValueError(f"by must be 1 to 3, got {by}")
        self.value += by
        return self.value

    @property
    def reward(self) -> float:
        return 1.0 if self.value == self.target else 0.0

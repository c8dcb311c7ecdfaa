"""`writing`: short creative-writing prompts with no built-in reward.

The final step's reward is None, so the producer publishes these trajectories to
`sao.trajectories.pending`, where a live reward stream (judges, humans, the CLI) scores them and
the reward joiner forwards them to the learner. Tasks are `{"instruction": str}`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from producers.envs.base import Step
from producers.envs.chat import Chat
from schemas.messages import SchemaError

_FORMS = ("a two-line poem", "a haiku", "a one-sentence story", "a short product slogan", "a limerick")
_TOPICS = ("the sea", "a lost umbrella", "Monday mornings", "a friendly robot", "autumn leaves",
           "a cup of tea", "the last train home", "a cat on a keyboard")


@dataclass
class WritingEpisode:
    prompt_ids: list[int]
    max_turns: int = 1

    def step(self, action_ids: list[int]) -> Step:
        return Step(reward=None, done=True)  # scored later, by whoever reads the pending topic


@dataclass(kw_only=True)
class WritingEnv:
    tokenizer: Any = None
    """Tokenizer of the policy; only `episode` needs it."""
    name: str = "writing"
    _chat: Chat | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        self._chat = Chat(self.tokenizer) if self.tokenizer is not None else None

    def sample_task(self, rng: random.Random) -> dict:
        return {"instruction": f"Write {rng.choice(_FORMS)} about {rng.choice(_TOPICS)}."}

    def episode(self, task: dict) -> WritingEpisode:
        instruction = task.get("instruction")
        if not isinstance(instruction, str) or not instruction:
            raise SchemaError("task.instruction", "expected a non-empty string")
        if self._chat is None:
            raise ValueError("WritingEnv needs a tokenizer to run episodes")
        return WritingEpisode(self._chat.prompt_ids([{"role": "user", "content": instruction}]))

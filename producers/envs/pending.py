"""`writing`: short creative-writing prompts with no built-in reward.

The final step's reward is None, so the producer publishes these trajectories to
`sao.trajectories.pending`, where a live reward stream (judges, humans, the CLI) scores them and
the reward joiner forwards them to the learner. Tasks are `{"instruction": str}`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from producers.envs.base import Step
from producers.envs.chat import ChatEnv
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
class WritingEnv(ChatEnv):
    name: str = "writing"

    def sample_task(self, rng: random.Random) -> dict:
        return {"instruction": f"Write {rng.choice(_FORMS)} about {rng.choice(_TOPICS)}."}

    def episode(self, task: dict) -> WritingEpisode:
        instruction = task.get("instruction")
        if not isinstance(instruction, str) or not instruction:
            raise SchemaError("task.instruction", "expected a non-empty string")
        return WritingEpisode(self.episode_chat().prompt_ids([{"role": "user", "content": instruction}]))

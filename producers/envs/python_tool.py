"""`python-tool`: a multi-turn agent that may run Python before answering.

Each turn the model writes text; if it contains a fenced ```python block (the last one counts; an
unclosed block at the end of the turn counts too) and turns remain, the sandbox runs it and its
output (or the reason it was stopped) comes back as a user turn wrapped in ```output fences, as
observation tokens (action_mask 0). A turn without code, or the last allowed turn, is final: its
`Answer: <integer>` is verified exactly, as in `math`. Tasks are math problems with larger
operands, where running code pays.

The sandbox (producers/sandbox.py) contains whatever the code does; the episode only ever sees
its text result, so an attack costs at most one timeout and the producer goes on. A producer's
episodes in flight share one `Sandbox`, whose runs are separate (own root, /tmp, uid, cgroup), so
episodes cannot see or disturb each other.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from producers.envs.base import Step
from producers.envs.chat import Chat, ChatEnv
from producers.envs.math import check_task, sample_problem, score
from producers.sandbox import Sandbox, format_result

SYSTEM = ("You can run Python. To run code, write it in a ```python fenced block and stop; you will "
          "see its output. When you know the result, end your reply with 'Answer: <integer>'.")

_CODE = re.compile(r"```python[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def extract_code(text: str) -> str | None:
    """The last ```python block of `text` (closed, or open until the end), or None."""
    blocks = _CODE.findall(text)
    return blocks[-1] if blocks and blocks[-1].strip() else None


@dataclass
class PythonToolEpisode:
    prompt_ids: list[int]
    answer: int
    chat: Chat
    sandbox: Sandbox
    max_turns: int
    turn: int = 0

    def step(self, action_ids: list[int]) -> Step:
        self.turn += 1
        text = self.chat.decode(action_ids)
        code = extract_code(text)
        if code is None or self.turn >= self.max_turns:
            return Step(reward=score(text, self.answer), done=True)
        observation = f"```output\n{format_result(self.sandbox.run(code))}\n```"
        return Step(observation=self.chat.observation_ids(action_ids, observation))


@dataclass(kw_only=True)
class PythonToolEnv(ChatEnv):
    sandbox: Sandbox | None = None
    """Where the model's code runs; only `episode` needs it."""
    max_turns: int = 4
    """Most model turns per episode; the last one must answer."""
    max_operand: int = 100_000
    """Largest operand in generated problems."""
    name: str = "python-tool"
    def sample_task(self, rng: random.Random) -> dict:
        return sample_problem(rng, self.max_operand)

    def episode(self, task: dict) -> PythonToolEpisode:
        question, answer = check_task(task)
        chat = self.episode_chat(sandbox=self.sandbox)
        ids = chat.prompt_ids([{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
        return PythonToolEpisode(ids, answer, chat, self.sandbox, self.max_turns)

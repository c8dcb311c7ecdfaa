"""`math`: single-turn arithmetic and word problems generated in code, with an exact-answer verifier.

Tasks are `{"question": str, "answer": int}`. The model is asked to end with `Answer: <integer>`
(`\\boxed{<integer>}` is accepted too); reward 1.0 when the last such answer equals the task's
answer exactly, else 0.0. No partial credit, no tolerance: every answer is an integer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from producers.envs.base import Step
from producers.envs.chat import Chat, ChatEnv
from schemas.messages import SchemaError

INSTRUCTION = "Solve the problem. End your reply with 'Answer: <integer>'."

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goro", "Hana")
_WORD_PROBLEMS = (
    ("{n} has {a} apples and buys {b} bags with {c} apples in each. How many apples does {n} have now?",
     lambda a, b, c: a + b * c),
    ("A train travels {a} km every hour for {b} hours, then {c} km more. How many km does it travel?",
     lambda a, b, c: a * b + c),
    ("{n} had {a} coins, found {c} more and gave {b} away. How many coins does {n} have?",
     lambda a, b, c: a - b + c),
    ("A hall has {a} rows of {b} chairs and {c} people sit down. How many chairs are free?",
     lambda a, b, c: a * b - c),
)
_ANSWER = re.compile(r"(?:answer\s*(?:is)?\s*[:=]?\s*|\\boxed\{\s*)\$?(-?\d[\d,]*)", re.IGNORECASE)


def evaluate(nums: list[int], ops: list[str]) -> int:
    """Value of nums[0] ops[0] nums[1] ... with * before + and -."""
    terms, signs = [nums[0]], []
    for op, x in zip(ops, nums[1:]):
        if op == "*":
            terms[-1] *= x
        else:
            terms.append(x)
            signs.append(op)
    return terms[0] + sum(t if s == "+" else -t for s, t in zip(signs, terms[1:]))


def sample_problem(rng: random.Random, max_operand: int) -> dict:
    """An arithmetic expression or a word problem, with its integer answer."""
    if rng.random() < 0.5:
        nums = [rng.randint(1, max_operand) for _ in range(rng.randint(2, 3))]
        ops = [rng.choice("+-*") for _ in nums[1:]]
        expr = " ".join(f"{x} {op}" for x, op in zip(nums, ops)) + f" {nums[-1]}"
        return {"question": f"What is {expr}?", "answer": evaluate(nums, ops)}
    template, answer = rng.choice(_WORD_PROBLEMS)
    a, b, c = (rng.randint(2, max_operand) for _ in range(3))
    a = max(a, b) if "{b} away" in template else a
    c = min(c, a * b) if "chairs" in template else c
    return {"question": template.format(n=rng.choice(_NAMES), a=a, b=b, c=c), "answer": answer(a, b, c)}


def extract_answer(text: str) -> int | None:
    """The last `Answer: N` or `\\boxed{N}` integer in `text`, or None."""
    found = _ANSWER.findall(text)
    return int(found[-1].replace(",", "")) if found else None


def score(text: str, answer: int) -> float:
    return 1.0 if extract_answer(text) == answer else 0.0


def check_task(task: dict) -> tuple[str, int]:
    """The question and answer of a task map; SchemaError (the prompt goes to the DLQ) otherwise."""
    question, answer = task.get("question"), task.get("answer")
    if not isinstance(question, str) or not question:
        raise SchemaError("task.question", "expected a non-empty string")
    if not isinstance(answer, int) or isinstance(answer, bool):
        raise SchemaError("task.answer", f"expected an integer, got {type(answer).__name__}")
    return question, answer


@dataclass
class MathEpisode:
    prompt_ids: list[int]
    answer: int
    chat: Chat
    max_turns: int = 1

    def step(self, action_ids: list[int]) -> Step:
        return Step(reward=score(self.chat.decode(action_ids), self.answer), done=True)


@dataclass(kw_only=True)
class MathEnv(ChatEnv):
    max_operand: int = 50
    """Largest operand in generated problems."""
    name: str = "math"
    def sample_task(self, rng: random.Random) -> dict:
        return sample_problem(rng, self.max_operand)

    def episode(self, task: dict) -> MathEpisode:
        question, answer = check_task(task)
        chat = self.episode_chat()
        ids = chat.prompt_ids([{"role": "user", "content": f"{question}\n{INSTRUCTION}"}])
        return MathEpisode(ids, answer, chat)

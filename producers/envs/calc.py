"""`calc-agent`: multi-step word problems over four-digit numbers, solved with a stateful `python` tool.

A task is a quantity and one to five operations on it, generated in code (no download):

    Ana has 4821 coins. Then she buys 12 boxes of 37 coins each. Then she gives away 1297 coins.
    How many coins does Ana have now?

A 135M model cannot do four-digit arithmetic in its head; with the tool it only has to turn each
sentence into a line of Python. The number of operations is long-tailed (30 % one, 30 % two, 20 %
three, 12 % four, 8 % five), and the demonstrations (`demonstration`: what `sao warmup` trains
the cold model on) call the tool once per operation, keeping the running value in a variable of
the session, then answer, so an episode takes two to six turns. The reward is 1.0 when the last
`Answer: <integer>` of the final reply is the answer, else 0.0; with `step_reward`, each operation
a tool output shows done (`Progress`) also pays that much on its turn, and a turn of calls that
shows none done costs that much.

Tasks are `{"name", "item", "start", "steps": [[op, *numbers], ...], "answer"}`; the question is
rendered from them, so the held-out split (producers/heldout.py) is by the problem itself.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from producers.envs.agent import AgentLimits, ToolEpisode, python, python_tools
from producers.envs.chat import ChatEnv
from producers.envs.math import extract_answer
from producers.envs.tools import CLOSE, OPEN, render_chat, tool_response, tool_schema
from producers.sandbox import Sandbox
from schemas.messages import SchemaError

SYSTEM = "Use the python tool, one step per call, then reply 'Answer: <integer>'."
NAMES = (("Ana", "she"), ("Ben", "he"), ("Chen", "he"), ("Dara", "she"), ("Eli", "he"), ("Fatima", "she"),
         ("Goro", "he"), ("Hana", "she"))
ITEMS = ("coins", "marbles", "stamps", "cards", "beads", "apples")
STEPS_WEIGHTS = (0.30, 0.30, 0.20, 0.12, 0.08)
"""P(1 .. 5 operations): a long tail of longer episodes."""

# op -> (sentence, the Python expression of the new value from `x`)
OPS = {
    "buy": ("{p} buys {0} boxes of {1} {item} each", "{x} + {0} * {1}"),
    "give": ("{p} gives away {0} {item}", "{x} - {0}"),
    "times": ("the number of {item} is multiplied by {0}", "{x} * {0}"),
    "find": ("{p} finds {0} more {item}", "{x} + {0}"),
    "half": ("{p} sells half of the {item}, rounded down", "{x} // 2"),
}


def apply(op: str, x: int, args: list[int]) -> int:
    return eval(OPS[op][1].format(*args, x=x))  # our own templates over ints, never the model's text


def sample_steps(rng: random.Random, x: int, n: int) -> tuple[list[list], int]:
    steps = []
    for _ in range(n):
        op = rng.choice([o for o in OPS if o != "give" or x > 20])
        args = {"buy": lambda: [rng.randint(2, 30), rng.randint(11, 99)], "give": lambda: [rng.randint(1, x // 2)],
                "times": lambda: [rng.randint(2, 19)], "find": lambda: [rng.randint(100, 9999)],
                "half": lambda: []}[op]()
        steps.append([op, *args])
        x = apply(op, x, args)
    return steps, x


def question(task: dict) -> str:
    name, pronoun = task["name"], dict(NAMES).get(task["name"], "they")
    sentences = [f"{name} has {task['start']} {task['item']}."]
    for op, *args in task["steps"]:
        sentences.append("Then " + OPS[op][0].format(*args, p=pronoun, item=task["item"]) + ".")
    return " ".join(sentences) + f" How many {task['item']} does {name} have now?"


def check_task(task: dict) -> dict:
    """The task if it is one this env can play (its answer recomputed); SchemaError otherwise."""
    try:
        x = int(task["start"])
        for op, *args in task["steps"]:
            if op not in OPS or not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
                raise ValueError(f"step {[op, *args]}")
            x = apply(op, x, args)
        if x != task["answer"] or task["item"] not in ITEMS or not isinstance(task["name"], str):
            raise ValueError("answer, item or name")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise SchemaError("task", f"not a calc-agent task ({type(e).__name__}: {e})") from None
    return task


class Progress:
    """The per-turn reward of a task's tool outputs: `per_step` for each operation a turn's outputs
    newly show done, or −`per_step` for a turn of calls that shows none done. An output whose last
    line is the running value after operation j (and past any shown before) shows operations up to j
    done, so one call that does two operations counts both and a repeated value counts nothing.
    Answering before the last operation then forfeits what the rest would pay, even where the
    answer would have failed anyway; and a call that advances nothing costs, or calling until
    `max_turns` would pay for the operations done without ever answering."""

    def __init__(self, task: dict, per_step: float):
        self.per_step, self.done, self.values, x = per_step, 0, [], task["start"]
        for op, *args in task["steps"]:
            x = apply(op, x, args)
            self.values.append(str(x))

    def __call__(self, outputs: list[str]) -> float:
        before = self.done
        for out in outputs:
            last = (out.strip().splitlines() or [""])[-1].strip()
            later = [j + 1 for j in range(self.done, len(self.values)) if self.values[j] == last]
            self.done = max(later, default=self.done)
        return self.per_step * (self.done - before) if self.done > before else -self.per_step


def demonstration(task: dict) -> list[tuple[str, str | None]]:
    """A solution as (assistant reply, the env's answer to it) per turn, None after the final one:
    one call per operation, the running value kept in the session's variable."""
    item, x, turns = task["item"], task["start"], []
    for i, (op, *args) in enumerate(task["steps"]):
        expr = OPS[op][1].format(*args, x=str(task["start"]) if i == 0 else item)
        code = f"{item} = {expr}\nprint({item})"
        x = apply(op, x, args)
        turns.append((OPEN + json.dumps({"name": "python", "arguments": {"code": code}}) + CLOSE,
                      tool_response([str(x)])))
    return turns + [(f"Answer: {x}", None)]


@dataclass(kw_only=True)
class CalcAgentEnv(ChatEnv):
    sandbox: Sandbox | None = None
    """Where the python tool's sessions run; only `episode` needs it."""
    max_turns: int = 8
    """Most model turns per episode (the answer's included)."""
    max_invalid_calls: int = 3
    """Replies in a row whose every tool call failed before the episode ends."""
    deadline_s: float = 300.0
    """Wall-clock seconds an episode may take."""
    step_reward: float = 0.0
    """Reward of each operation a tool output shows done, and cost of a turn of calls that shows
    none (`Progress`), beside the answer's 1.0; 0: the answer alone."""
    name: str = "calc-agent"
    def sample_task(self, rng: random.Random) -> dict:
        name, _ = rng.choice(NAMES)
        start = rng.randint(100, 9999)
        steps, answer = sample_steps(rng, start, rng.choices(range(1, 6), STEPS_WEIGHTS)[0])
        return {"name": name, "item": rng.choice(ITEMS), "start": start, "steps": steps, "answer": answer}

    def demonstration(self, task: dict) -> list[tuple[str, str | None]]:
        return demonstration(check_task(task))

    def messages(self, task: dict) -> list[dict]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(task)}]

    def prompt_ids(self, task: dict) -> list[int]:
        return self.episode_chat().encode(render_chat(self.tokenizer, self.messages(task), [tool_schema(python)]))

    def episode(self, task: dict) -> ToolEpisode:
        check_task(task)
        chat = self.episode_chat(sandbox=self.sandbox)
        answer = task["answer"]
        return ToolEpisode(prompt_ids=self.prompt_ids(task), chat=chat, tools=python_tools(self.sandbox),
                           score=lambda text: 1.0 if extract_answer(text) == answer else 0.0,
                           progress=Progress(task, self.step_reward) if self.step_reward else None,
                           limits=AgentLimits(max_turns=self.max_turns, max_invalid_calls=self.max_invalid_calls,
                                              deadline_s=self.deadline_s))

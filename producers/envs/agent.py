"""Tool-using agents: an episode whose tools are Python functions the model calls in JSON.

The prompt offers the tools through the model's chat template (producers/envs/tools.py). Each turn
the model replies; a reply with `<tool_call>` blocks gets the results of its calls, in order, as
one user turn of `<tool_response>` blocks (observation tokens, action_mask 0), and the episode
goes on; a reply without calls is the answer, scored by the task. What the model gets back for a
call that fails (malformed JSON, an unknown tool, arguments the tool does not take, a tool that
raised) is the error, as TRL's tool loop does: the model sees why and may try again, and the call
is counted in `Step.tool_errors`.

The episode ends, with its reason as the trajectory's `finish_reason` and reward 0, after
`max_invalid_calls` replies in a row whose every call failed (`invalid_calls`), or at the first
turn that ends past its wall-clock `deadline_s`, answer or not (`deadline`; a turn itself is
bounded by `--max-tokens`, a tool call by its own timeout). Replies still calling tools at `max_turns` end
it too (`max_turns`). Tools live per episode (`ToolSet`): the Python tool is a stateful sandbox
session, closed with the episode however it ends.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from producers.envs.base import Step
from producers.envs.chat import Chat
from producers.envs.tools import tool_calls, tool_response
from producers.sandbox import Sandbox, format_result
from producers.session import PythonSession


class ToolError(Exception):
    """Raised by a tool whose call failed: the message is what the model gets back."""


@dataclass(kw_only=True)
class AgentLimits:
    """Where an agent's episode is cut short."""

    max_turns: int = 6
    """Most model turns; the last must answer."""
    max_invalid_calls: int = 3
    """Replies in a row whose every tool call failed before the episode ends (invalid_calls)."""
    deadline_s: float = 300.0
    """Wall-clock seconds from the episode's start after which its next turn ends it (deadline)."""


class ToolSet:
    """One episode's tools: `functions` by name, and what must be freed when the episode ends."""

    def __init__(self, functions: list[Callable], closers: list[Callable[[], None]] = ()):
        self.functions = {f.__name__: f for f in functions}
        self.closers = list(closers)

    def call(self, name: str, arguments) -> tuple[str, bool]:
        """(what the model gets back, whether the call succeeded)."""
        fn = self.functions.get(name)
        if fn is None:
            return f"error: no tool named {name!r}; the tools are {sorted(self.functions)}", False
        if not isinstance(arguments, dict):
            return f"error: the arguments of {name} must be a JSON object, got {arguments!r:.80}", False
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            return f"error: {name}: {e}", False
        try:
            return str(fn(**arguments)), True
        except ToolError as e:
            return str(e), False
        except Exception as e:  # noqa: BLE001 - the tool's failure is the model's to see, not the producer's
            return f"error: {name} raised {type(e).__name__}: {e}", False

    def close(self) -> None:
        for close in self.closers:
            close()


def python(code: str) -> str:
    """Run Python; variables persist between calls.

    Args:
        code: Python code; print the result.
    """
    raise NotImplementedError("the declaration the model is offered; `python_tools` binds it to a session")


def python_tools(sandbox: Sandbox) -> ToolSet:
    """The `python` tool over a sandbox session of its own (variables persist between its calls)."""
    session = PythonSession(sandbox)

    @functools.wraps(python)
    def run(code: str) -> str:
        result = session.run(code)
        if not result.ok:
            raise ToolError(format_result(result))
        return format_result(result)
    return ToolSet([run], [session.close])


@dataclass(kw_only=True)
class ToolEpisode:
    """One agent episode (module docstring); `score(reply_text)` is the reward of the answer, and
    `progress(outputs)`, where the task can check intermediate results, the reward of a turn's
    successful tool outputs (a per-turn reward on that turn's last action token)."""

    prompt_ids: list[int]
    chat: Chat
    tools: ToolSet
    score: Callable[[str], float]
    progress: Callable[[list[str]], float] | None = None
    limits: AgentLimits = field(default_factory=AgentLimits)
    turn: int = 0
    invalid_in_a_row: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def max_turns(self) -> int:
        return self.limits.max_turns

    def step(self, action_ids: list[int]) -> Step:
        self.turn += 1
        text = self.chat.decode(action_ids)
        if time.monotonic() - self.started > self.limits.deadline_s:
            return Step(reward=0.0, done=True, reason="deadline")
        calls, problems = tool_calls(text)
        if not calls and not problems:
            return Step(reward=self.score(text), done=True)
        replies = [(f"error: malformed tool call ({p})", False) for p in problems]
        replies += [self.tools.call(c["name"], c["arguments"]) for c in calls]
        made, failed = len(replies), sum(not ok for _, ok in replies)
        self.invalid_in_a_row = self.invalid_in_a_row + 1 if failed == made else 0
        reason = ("invalid_calls" if self.invalid_in_a_row >= self.limits.max_invalid_calls else
                  "max_turns" if self.turn >= self.limits.max_turns else "")
        if reason:
            return Step(reward=0.0, done=True, reason=reason, tool_calls=made, tool_errors=failed)
        return Step(observation=self.chat.observation_ids(action_ids, tool_response([r for r, _ in replies])),
                    reward=self.progress([r for r, ok in replies if ok]) if self.progress else None,
                    tool_calls=made, tool_errors=failed)

    def close(self) -> None:
        self.tools.close()

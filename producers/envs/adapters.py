"""The environments users already have, played as they are:

- `gym://ENV_ID`: a Gymnasium environment whose observations and actions are text (`gymnasium.make`,
  so `gym://module:Env-v0` imports the module that registers it). A task is a reset seed; the
  episode ends when it terminates or is truncated, its rewards summed.
- `reasoning-gym://DATASET`: one of reasoning-gym's procedural datasets, offline, scored by its
  own `score_answer`. A task is an index into the dataset of `seed` 0; one turn, the answer taken
  from `<answer>…</answer>` if the model writes one, else the whole reply.
- `openenv://HOST:PORT`: an OpenEnv environment server, over its own WebSocket protocol (`/ws`: one
  session, and so one environment instance, per episode), so nothing of `openenv` is imported here.
  The observation's text is its one string field, else its fields as JSON; the model's reply is the
  action's one string field, else parsed as the action's JSON object (schema from `/schema`).
- a TRL-style environment class (`module:Class`, found by its shape: `reset` and public methods,
  no `step`): `reset(**task)` may return text added to the task's `prompt`, every other public
  method is a tool (its schema read from the signature and docstring), a tool's exception goes back
  to the model as its reply, and the reward is the instance's `reward` once the model answers
  without a tool call (an attribute, or a method given the answer's text).

The first three are text envs (producers/envs/text.py turns their strings into the model's chat);
the last is an agent env (producers/envs/agent.py).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from producers.envs.agent import AgentLimits, ToolEpisode, ToolSet
from producers.envs.chat import Chat
from producers.envs.tools import render_chat, tool_schema
from schemas.config import ConfigError


class GymnasiumText:
    """A Gymnasium env with text observations and actions, as a text env (one per episode)."""

    def __init__(self, env_id: str):
        try:
            import gymnasium
        except ImportError:
            raise ConfigError(f"--env gym://{env_id} needs gymnasium (pip install gymnasium)") from None
        try:
            self.env = gymnasium.make(env_id)
        except Exception as e:  # noqa: BLE001 - an unknown id or a failing constructor, said at start
            raise ConfigError(f"--env gym://{env_id}: gymnasium.make raised {type(e).__name__}: {e}") from e

    def sample_task(self, rng: random.Random) -> dict:
        return {"seed": rng.randrange(2 ** 31)}

    def reset(self, task: dict) -> str:
        observation, _ = self.env.reset(seed=task.get("seed"), options=task.get("options"))
        return observation

    def step(self, action: str) -> tuple[str, float, bool]:
        observation, reward, terminated, truncated, _ = self.env.step(action)
        return observation, float(reward), bool(terminated or truncated)

    def close(self) -> None:
        self.env.close()


ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class ReasoningGym:
    """One of reasoning-gym's procedural datasets as a one-turn text env scored by its own scorer."""

    INSTRUCTION = "\n\nGive your final answer as <answer>...</answer>."

    def __init__(self, dataset: str, size: int = 100_000):
        try:
            import reasoning_gym
        except ImportError:
            raise ConfigError(f"--env reasoning-gym://{dataset} needs reasoning-gym (pip install reasoning-gym)") from None
        try:
            self.data = reasoning_gym.create_dataset(dataset, seed=0, size=size)
        except Exception as e:  # noqa: BLE001 - an unknown dataset name, said at start
            raise ConfigError(f"--env reasoning-gym://{dataset}: {type(e).__name__}: {e}") from e
        self.size, self.entry = size, None

    def sample_task(self, rng: random.Random) -> dict:
        return {"index": rng.randrange(self.size)}

    def reset(self, task: dict) -> str:
        self.entry = self.data[int(task["index"])]
        return self.entry["question"] + self.INSTRUCTION

    def step(self, action: str) -> tuple[str, float, bool]:
        found = ANSWER.findall(action)
        answer = (found[-1] if found else action).strip()
        return "", float(self.data.score_answer(answer=answer, entry=self.entry) or 0.0), True


class OpenEnvClient:
    """An episode on an OpenEnv server: a WebSocket session of its own, closed with the episode."""

    def __init__(self, address: str, timeout_s: float = 60.0):
        self.url, self.timeout_s, self.ws = f"ws://{address.rstrip('/')}/ws", timeout_s, None
        self.session = contextlib.ExitStack()
        self.http = f"http://{address.rstrip('/')}"
        self.action_field = self._action_field()

    def _action_field(self) -> str | None:
        """The action's one string field, if it has just one; None: the reply is the action's JSON."""
        import httpx

        try:
            schema = httpx.get(f"{self.http}/schema", timeout=self.timeout_s).raise_for_status().json()["action"]
        except Exception as e:  # noqa: BLE001 - no server there, said at start
            raise ConfigError(f"--env openenv://{self.http[7:]}: no OpenEnv server answered /schema ({e})") from e
        strings = [k for k, p in schema.get("properties", {}).items() if p.get("type") == "string"
                   and k != "metadata"]
        return strings[0] if len(strings) == 1 else None

    def sample_task(self, rng: random.Random) -> dict:
        return {"seed": rng.randrange(2 ** 31)}

    def _send(self, message: dict) -> dict:
        self.ws.send(json.dumps(message))
        reply = json.loads(self.ws.recv(timeout=self.timeout_s))
        if reply.get("type") == "error":
            raise RuntimeError(f"OpenEnv server: {reply.get('data')}")
        return reply["data"]

    def reset(self, task: dict) -> str:
        from websockets.sync.client import connect

        self.ws = self.session.enter_context(connect(self.url, open_timeout=self.timeout_s))
        return self.text(self._send({"type": "reset", "data": task}))

    def step(self, action: str) -> tuple[str, float | None, bool]:
        data = {self.action_field: action} if self.action_field else json.loads(action)
        out = self._send({"type": "step", "data": data})
        return self.text(out), out.get("reward"), bool(out.get("done"))

    @staticmethod
    def text(result: dict) -> str:
        observation = {k: v for k, v in (result.get("observation") or {}).items() if k != "metadata"}
        strings = [v for v in observation.values() if isinstance(v, str)]
        return strings[0] if len(strings) == 1 else json.dumps(observation)

    def close(self) -> None:
        if self.ws is not None:
            with self.session:  # closes the connection, however the message went
                self.ws.send(json.dumps({"type": "close"}))


ADAPTERS: dict[str, Callable[..., Any]] = {"gym": GymnasiumText, "reasoning-gym": ReasoningGym,
                                           "openenv": OpenEnvClient}
"""`--env SCHEME://REST`: the text env each scheme makes of REST."""


# ---------------------------------------------------------------- TRL-style environment classes

NOT_TOOLS = ("reset", "reward", "sample_task", "close")


def is_tool_class(obj: object) -> bool:
    """A TRL-style environment: `reset` and public methods (its tools), no `step` or `episode`."""
    return callable(getattr(obj, "reset", None)) and not hasattr(obj, "step") and not hasattr(obj, "episode") \
        and bool(public_methods(obj))


def public_methods(obj: object) -> list[Callable]:
    return [getattr(obj, n) for n in dir(obj) if not n.startswith("_") and n not in NOT_TOOLS
            and inspect.ismethod(getattr(obj, n, None))]


@dataclass(kw_only=True)
class ToolClassEnv:
    """An `Env` over a TRL-style class (module docstring): one instance per episode."""

    name: str
    make: Callable[[], Any]
    first: Any
    tokenizer: Any = None
    limits: AgentLimits = field(default_factory=AgentLimits)

    def __post_init__(self):
        self.chat = Chat(self.tokenizer) if self.tokenizer is not None else None
        if callable(getattr(self.first, "sample_task", None)):  # else tasks come from a dataset
            self.sample_task = self.first.sample_task

    def episode(self, task: dict) -> ToolEpisode:
        if self.chat is None:
            raise ValueError(f"env {self.name} needs a tokenizer to run episodes")
        env = self.make()
        kwargs = {k: v for k, v in task.items() if k != "prompt"}
        extra = env.reset(**kwargs)  # what it raises costs this prompt (producers/episode.py)
        prompt = "\n".join(p for p in (task.get("prompt"), extra) if p)
        tools = public_methods(env)
        messages = [{"role": "user", "content": prompt}]
        ids = self.chat.encode(render_chat(self.tokenizer, messages, [tool_schema(f) for f in tools]))

        def score(answer: str) -> float:
            reward = getattr(env, "reward", None)
            reward = reward(answer) if callable(reward) else reward
            return 0.0 if reward is None else float(reward)
        closers = [env.close] if callable(getattr(env, "close", None)) else []
        return ToolEpisode(prompt_ids=ids, chat=self.chat, tools=ToolSet(tools, closers), score=score,
                           limits=self.limits)

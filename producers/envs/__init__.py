"""Environments by name: a built-in (`ENVS`, a plain dict), an installed package's entry point in
group `sao.envs`, or `module:attr`. `env_factory` resolves the name, `build_env` builds the env
with the settings its constructor takes (a gym-style text env comes wrapped in `TextEnv`), and
`check_env` plays one smoke task's start so a broken plug-in fails at start, not per prompt.
"""

from __future__ import annotations

import inspect
import numbers
import random
from collections.abc import Callable, Mapping
from functools import partial

from producers.envs.adapters import ADAPTERS, ToolClassEnv, is_tool_class
from producers.envs.agent import AgentLimits
from producers.envs.calc import CalcAgentEnv
from producers.envs.math import MathEnv
from producers.envs.pending import WritingEnv
from producers.envs.python_tool import PythonToolEnv
from producers.envs.text import TextEnv, is_text_env
from producers.envs.toy import MultiTurnEnv, TargetEnv
from schemas.config import ConfigError
from schemas.messages import Prompt
from schemas.plugins import entry_point, entry_point_names, load_object

ENVS = {"toy-target": TargetEnv, "toy-multiturn": MultiTurnEnv}
ENVS["math"] = MathEnv
ENVS["python-tool"] = PythonToolEnv
ENVS["writing"] = WritingEnv  # no built-in reward: trajectories go to sao.trajectories.pending
ENVS["calc-agent"] = CalcAgentEnv  # tools declared as functions, called in JSON, a stateful python session
ENVS["calc-agent-steps"] = partial(CalcAgentEnv, step_reward=0.2, name="calc-agent-steps")  # operations done pay too
GROUP = "sao.envs"


def env_mixture(spec: str, flag: str = "--env") -> dict[str, float]:
    """The environments of `--env NAME[=WEIGHT],...` and their weights (1 where not given): a run
    plays several environments at once, the feeder draws each prompt's env by weight, producers
    play any of them."""
    mixture: dict[str, float] = {}
    for item in (x.strip() for x in spec.split(",")):
        name, _, weight = item.partition("=")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            w = -1.0
        if not name or not (w > 0 and w < float("inf")) or name in mixture:
            raise ConfigError(f"{flag} {spec!r}: give NAME[=WEIGHT],... with distinct names and weights > 0")
        mixture[name] = w
    return mixture


def env_factory(name: str, flag: str = "--env") -> Callable:
    """The class or factory function `name` names (SCHEME://REST: an adapter's, producers/envs/adapters.py)."""
    if name in ENVS:
        return ENVS[name]
    scheme, sep, rest = name.partition("://")
    if sep:
        if scheme not in ADAPTERS:
            raise ConfigError(f"{flag} {name!r}: unknown scheme {scheme!r}; adapters: {sorted(ADAPTERS)}")
        return partial(ADAPTERS[scheme], rest)
    spec = name if ":" in name else entry_point(GROUP, name)
    if spec is None:
        raise ConfigError(f"{flag} {name!r}: unknown env; built in: {sorted(ENVS)}; installed ({GROUP} entry "
                          f"points): {entry_point_names(GROUP)}; or module:attr")
    factory = load_object(spec, flag)
    if not callable(factory):
        raise ConfigError(f"{flag} {name!r}: {spec} is a {type(factory).__name__}, not a class or factory")
    return factory


def build_env(name: str, offered: Mapping[str, Callable[[], object]], flag: str = "--env"):
    """The env `name`, built with the settings of `offered` (setting -> maker, so a sandbox is made
    only for an env that takes one) its constructor names. Its `name` becomes `name`: prompts
    carry the `--env` string, and a producer plays only prompts that name its env."""
    factory = env_factory(name, flag)
    kw = {k: make() for k, make in offered.items() if takes(factory, k)}
    try:
        env = factory(**kw)
    except Exception as e:  # a plug-in's constructor may raise anything; at start, say which
        raise ConfigError(f"{flag} {name!r}: building it raised {type(e).__name__}: {e}") from e
    if is_text_env(env):
        made = {k: offered[k]() for k in ("tokenizer", "max_turns") if k in offered}
        return TextEnv(name=name, first=env, make=partial(factory, **kw), **made)
    if is_tool_class(env):  # TRL-style: reset(**task) and tools as methods
        limits = {k: offered[k]() for k in ("max_turns", "max_invalid_calls", "deadline_s") if k in offered}
        return ToolClassEnv(name=name, first=env, make=partial(factory, **kw), limits=AgentLimits(**limits),
                            tokenizer=offered["tokenizer"]() if "tokenizer" in offered else None)
    if name not in ENVS:
        env.name = name
    return env


def make_env(name: str, **settings):
    """The env `name` with those of `settings` it takes (tests, benchmarks, the feeder)."""
    return build_env(name, {k: partial(lambda v: v, v) for k, v in settings.items()})


def takes(factory: Callable, setting: str) -> bool:
    """Whether `factory` accepts the keyword `setting` (by name, or through **kwargs)."""
    try:
        params = inspect.signature(factory).parameters
    except ValueError:  # no signature to read: offer nothing
        return False
    return setting in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def check_env(env, flag: str = "--env") -> None:
    """One smoke task: the env samples a task (where it can) that travels as a prompt, and its
    episode starts from token ids that are ints. A ConfigError names what is wrong."""
    if not callable(getattr(env, "sample_task", None)):
        return  # tasks come only from a dataset
    try:
        task = env.sample_task(random.Random(0))
        if not isinstance(task, dict):
            raise TypeError(f"sample_task returned a {type(task).__name__}, not a dict")
        Prompt.decode(Prompt(id="smoke", env=env.name, task=task).encode())
        episode = env.episode(task)
        ids, max_turns = list(episode.prompt_ids), episode.max_turns
    except Exception as e:  # the plug-in's own code: report it at start, whatever it raised
        raise ConfigError(f"{flag} {env.name!r}: its smoke task failed: {type(e).__name__}: {e}") from e
    bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
    if bad or not ids:
        raise ConfigError(f"{flag} {env.name!r}: episode(task).prompt_ids must be a non-empty list of int "
                          f"token ids; found {bad[:1] or ids!r}")
    if not isinstance(max_turns, int) or max_turns < 1:
        raise ConfigError(f"{flag} {env.name!r}: episode(task).max_turns must be an int >= 1, got {max_turns!r}")

"""Environments by name: `make_env(name, **kw)` builds one from `ENVS`, a plain dict."""

from __future__ import annotations

from producers.envs.math import MathEnv
from producers.envs.pending import WritingEnv
from producers.envs.python_tool import PythonToolEnv
from producers.envs.toy import MultiTurnEnv, TargetEnv

ENVS = {"toy-target": TargetEnv, "toy-multiturn": MultiTurnEnv}
ENVS["math"] = MathEnv
ENVS["python-tool"] = PythonToolEnv
ENVS["writing"] = WritingEnv  # no built-in reward: trajectories go to sao.trajectories.pending


def make_env(name: str, **kw):
    """The environment registered as `name`, built with keyword settings `kw`."""
    if name not in ENVS:
        raise ValueError(f"unknown env {name!r}; known: {sorted(ENVS)}")
    return ENVS[name](**kw)

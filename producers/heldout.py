"""The held-out split: tasks kept out of training, so that `sao eval` scores a policy on prompts it
never trained on.

A task is held out when a hash of its content (its map, keys sorted) falls in the lowest
`frac` of the hash range. The rule keeps no state and gives the same answer in the feeder and the
evaluator on any machine, and it sets a task aside however it reaches the system: from the
environment's generator or from any row of any dataset that holds the same task. The feeder skips
held-out tasks (`sao feed --heldout-frac`); the evaluator takes only them. Both must be given the
same fraction: `sao up` passes one to both, and every score names its split. A fraction of 0 (both
services' default) holds nothing out: the evaluator then takes any task, and its scores say `all`.

An environment whose tasks are too few to set any aside (`toy-target`: four tasks) says so with
`heldout = False`; it is evaluated on any of its tasks, which training sees too (`all`).
"""

from __future__ import annotations

import hashlib
import json
import random
from schemas.config import ConfigError

MAX_DRAWS_PER_TASK = 200
"""Tasks drawn from a generator for each one wanted, before giving up on finding distinct ones."""


def task_key(task: dict) -> bytes:
    """The task's content, canonically: the same map gives the same bytes in every process."""
    return json.dumps(task, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr).encode()


def held_out(task: dict, frac: float) -> bool:
    """Whether `task` belongs to the held-out share `frac` of all tasks."""
    if frac <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(task_key(task), digest_size=8).digest(), "big")
    return h < frac * 2.0 ** 64


def split_frac(env, frac: float) -> float:
    """The held-out share `env` gets: `frac`, or 0 for an env that declares `heldout = False`."""
    return frac if getattr(env, "heldout", True) else 0.0


def evaluation_tasks(env, n: int, frac: float, seed: int) -> list[dict]:
    """`n` distinct tasks of `env`'s generator in its evaluation split: held out where there is one
    (`split_frac`), else any; fewer when the generator runs out of distinct ones (a small task
    space), at least one or a ConfigError."""
    frac, rng = split_frac(env, frac), random.Random(seed)
    found: dict[bytes, dict] = {}
    for _ in range(MAX_DRAWS_PER_TASK * n):
        task = env.sample_task(rng)
        if (frac <= 0 or held_out(task, frac)) and task_key(task) not in found:
            found[task_key(task)] = task
            if len(found) == n:
                break
    if not found:
        raise ConfigError(f"--heldout-frac {frac}: no held-out task of {env.name} in {MAX_DRAWS_PER_TASK * n} draws; "
                          "raise it, or give the env `heldout = False` to evaluate on sampled tasks")
    return list(found.values())

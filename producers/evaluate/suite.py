"""One environment's evaluation: its tasks, how each of their episodes is played on the
evaluator's engine, and the figures of a version from them (producers/evaluate/scores.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from producers.episode import TrajectoryIds, run_episode
from producers.evaluate.scores import episode_scores, greedy_scores, sampled_scores, task_scores
from producers.generate.base import MAX_SEED
from schemas.boundary import Bounds, call
from schemas.config import ConfigError
from schemas.messages import Trajectory

if TYPE_CHECKING:
    from producers.evaluate.service import EvalConfig

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Suite:
    """One env's evaluation: its tasks and how an episode of each is played and scored."""

    cfg: EvalConfig
    """Its settings: --name, --seed, --samples, --greedy, sampling (`EvalConfig.sampling`)."""
    env: object
    generator: object
    tasks: list[dict]
    split: str
    stops: tuple[int, ...]
    score: object = None
    bounds: Bounds | None = None

    async def episode(self, version: int, task: int, sample: int) -> Trajectory:
        """Task `task`'s greedy episode (`sample` -1) or its sample `sample`, seeded by both."""
        params = self.cfg.sampling(sample < 0, self.stops)
        if sample >= 0:  # the same seed for every version: versions differ by their weights alone
            params = dataclasses.replace(params, seed=(self.cfg.seed * 1_000_003 + task * 1009 + sample) % MAX_SEED)
        bounds = self.bounds or Bounds(plugin=f"env {self.env.name}")
        episode = await call(bounds, "task", self.env.episode, self.tasks[task])
        ids = TrajectoryIds(id=f"eval-{self.cfg.name}-v{version}-{task}.{sample}", prompt_id=f"eval/{task}",
                            env=self.env.name, producer_id=self.cfg.evaluator_id)
        traj = await run_episode(episode, self.generator, params, ids, bounds)
        if self.score is not None:
            traj = await call(bounds, "reward", self.score, self.tasks[task], traj)
        return traj

    async def play(self, version: int) -> dict[int, list[Trajectory | None]]:
        """Every episode of every task at once (the engine batches them): task -> [greedy, samples...];
        None for an episode that failed on the task, the env or the engine."""
        first = -1 if self.cfg.greedy else 0
        keys = [(t, s) for t in range(len(self.tasks)) for s in range(first, self.cfg.samples)]
        results = await asyncio.gather(*(self.episode(version, t, s) for t, s in keys), return_exceptions=True)
        out: dict[int, list[Trajectory | None]] = {t: [] for t in range(len(self.tasks))}
        for (t, s), r in zip(keys, results):
            if isinstance(r, BaseException) and not isinstance(r, ValueError):
                raise r  # not the episode's fault (a bug, a cancelled loop)
            if isinstance(r, ValueError):
                log.warning("eval v%d task %d episode %d failed: %s", version, t, s, r)
            out[t].append(None if isinstance(r, ValueError) else r)
        return out


def rewards(played: dict[int, list[Trajectory | None]]) -> dict[int, list[float]]:
    """Each task's episode rewards, a failed episode's 0."""
    return {t: [0.0 if x is None else x.reward for x in row] for t, row in played.items()}


def per_task(cfg: EvalConfig, played: dict[int, list[Trajectory | None]]) -> dict[str, list]:
    """Each task's figures in task order, to compare versions task by task: `tasks`, its score
    (scores.task_scores); `task_turns` and `task_tool_calls`, the turns and tool calls of the same
    episodes (the greedy one, else the samples' mean; None where they all failed), which say how a
    version's way of solving a task changed, not only whether it did."""
    def mean_of(row: list[Trajectory | None], field: str) -> float | None:
        values = [getattr(t, field) for t in (row[:1] if cfg.greedy else row) if t is not None]
        return float(np.mean(values)) if values else None

    return {"tasks": task_scores(list(rewards(played).values()), cfg.greedy),
            "task_turns": [mean_of(row, "num_turns") for row in played.values()],
            "task_tool_calls": [mean_of(row, "tool_calls") for row in played.values()]}


def figures(cfg: EvalConfig, played: dict[int, list[Trajectory | None]], version: int) -> dict[str, float]:
    """The evaluation's figures from its episodes (a failed one scores 0); checks that every action
    token was sampled by `version`, and that the env (or --reward) gave every episode a reward."""
    episodes = [t for row in played.values() for t in row if t is not None]
    for traj in episodes:
        acted = traj.versions[traj.action_mask == 1]
        if acted.size and not (acted == version).all():
            raise RuntimeError(f"evaluation of v{version}: episode {traj.id} has tokens of versions "
                               f"{sorted(set(acted.tolist()))}; the engine changed weights mid-evaluation")
        if traj.reward is None:
            raise ConfigError(f"--env {traj.env} gives no reward of its own: give sao eval --reward module:function")
    scored = rewards(played)
    metrics = {}
    if cfg.greedy:
        metrics |= greedy_scores([row[0] for row in scored.values()], cfg.success)
    if cfg.samples:
        metrics |= sampled_scores([row[int(cfg.greedy):] for row in scored.values()], cfg.success)
    n = sum(len(row) for row in played.values())
    return metrics | episode_scores(episodes) | {"episode/errors": (n - len(episodes)) / n}

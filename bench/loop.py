"""The in-process training loop the learning benchmarks share (bench/learning.py,
bench/async_stability.py, bench/critic_ablation.py): a policy (and critic) trained by `SAOUpdate`,
rollouts played on the toy tasks by a separate `HFGenerator` whose weights are copied from the
learner's, with staleness under control instead of left to timing (docs/algorithm.md §6).

Versions count learner steps: the policy before step t is version t. Step t's rollouts come from
version t − lag(t), clamped at 0, with lag(t) = `staleness` + (t mod `sync_every`): `staleness` s
alone gives rollouts exactly s versions old (the last s + 1 snapshots are kept), `sync_every` k
alone reloads the generator every k steps (lag 0 … k − 1, as an asynchronous system with a
weight-sync interval). With `stale_tail` each prompt's rollouts are instead a heavy-tailed number
of versions old (a Zipf draw ≤ `staleness`): most fresh, a few as old as the bound, the shape of
asynchronous rollouts whose episode lengths are heavy-tailed.

No broker, no processes: one run is one function call returning one dict of metrics per step
(`SAOUpdate.step`'s, plus the rollouts' `stale/versions` and the step's wall time).
"""

from __future__ import annotations

import math
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

from learner.models import tiny_llama  # noqa: E402
from learner.update import SAOUpdate, UpdateConfig  # noqa: E402
from learner.value import ValueModel  # noqa: E402
from producers.envs import make_env  # noqa: E402
from producers.episode import play_tasks  # noqa: E402
from producers.generate.base import SamplingParams  # noqa: E402
from producers.generate.hf import HFGenerator  # noqa: E402
from schemas.messages import Trajectory  # noqa: E402

TASKS = {"toy-target": 8, "toy-multiturn": 4}  # env → action tokens per turn
SMOOTH = 20  # steps of the benchmarks' trailing means


def finite_mean(xs: list[float]) -> float:
    """Mean of the finite values; NaN if none (explained variance is undefined on a step whose
    returns are all equal, and absent without a critic)."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.fmean(xs) if xs else math.nan


def trailing_mean(values, window: int = SMOOTH) -> np.ndarray:
    """Mean of the finite values among the last `window` (fewer at the start); entry i ends at
    step i, so `[window - 1:]` holds only full windows. NaN where a window has no finite value."""
    y = np.asarray(values, float)
    ok = np.isfinite(y)
    total = np.cumsum(np.insert(np.where(ok, y, 0.0), 0, 0.0))
    count = np.cumsum(np.insert(ok, 0, False))
    end = np.arange(1, len(y) + 1)
    start = np.maximum(end - window, 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (total[end] - total[start]) / (count[end] - count[start])


@dataclass(kw_only=True)
class LoopConfig:
    """One in-process training run."""

    env: str = "toy-target"
    """A toy task of `TASKS`."""
    steps: int = 300
    """Learner steps."""
    batch: int = 16
    """Trajectories per step: `batch` prompts × 1 rollout, or `batch / group` prompts × `group`
    rollouts for the group baselines, so every method sees as many."""
    group: int = 8
    """Rollouts per prompt of the group baselines (grpo, grpo_dis)."""
    staleness: int = 0
    """Versions the rollouts lag the policy by (the bound, with `stale_tail`)."""
    sync_every: int = 1
    """Steps between generator reloads, adding lag t mod k (1: none)."""
    stale_tail: bool = False
    """Each prompt's lag a Zipf(2) draw capped at `staleness` instead of exactly `staleness`."""
    start: Path | None = None
    """transformers folder policy and critic start from; None: the random tiny Llama of `seed`."""
    seed: int = 0
    """Seeds the random start, the task draws and the generator's sampling."""
    update: UpdateConfig = field(default_factory=UpdateConfig)
    """The learner step (algorithm, learning rates, critic knobs)."""

    def __post_init__(self):
        if self.env not in TASKS:
            raise ValueError(f"env {self.env!r}: expected one of {sorted(TASKS)}")
        if self.staleness < 0 or self.sync_every < 1:
            raise ValueError(f"staleness must be >= 0 and sync_every >= 1, got {self.staleness}, "
                             f"{self.sync_every}")
        if self.group_size > 1 and self.batch % self.group_size:
            raise ValueError(f"batch {self.batch} must be a multiple of group {self.group_size}")

    @property
    def group_size(self) -> int:
        return self.group if self.update.settings.advantage == "group" else 1

    @property
    def max_lag(self) -> int:
        return self.staleness + self.sync_every - 1


def start_model(cfg: LoopConfig) -> torch.nn.Module:
    """A fresh copy of the starting policy in float32."""
    if cfg.start is None:
        return tiny_llama(seed=cfg.seed)
    hf_logging.disable_progress_bar()  # a bar per load, two loads per run, buries the bench's output
    return AutoModelForCausalLM.from_pretrained(cfg.start, dtype=torch.float32)


def lags(cfg: LoopConfig, step: int, num_prompts: int, rng: random.Random) -> list[int]:
    """Versions behind the policy of each prompt's rollouts at `step`, before clamping at 0."""
    if not cfg.stale_tail:
        return [cfg.staleness + step % cfg.sync_every] * num_prompts
    # P(lag = k) ∝ 1/(k+1)² for k ≤ staleness: a Zipf tail cut at the bound
    weights = [1 / (k + 1) ** 2 for k in range(cfg.staleness + 1)]
    return [k + step % cfg.sync_every for k in rng.choices(range(cfg.staleness + 1), weights, k=num_prompts)]


def run(cfg: LoopConfig) -> list[dict[str, float]]:
    """Train for `cfg.steps` steps; returns each step's metrics."""
    policy = start_model(cfg)
    critic = ValueModel.from_policy(policy) if cfg.update.settings.uses_critic else None
    update = SAOUpdate(policy, critic, cfg.update)
    generator = HFGenerator(start_model(cfg).eval(), seed=cfg.seed)
    env = make_env(cfg.env, vocab_size=policy.config.vocab_size)
    rng, lag_rng = random.Random(cfg.seed), random.Random(cfg.seed + 1)
    params = SamplingParams(max_tokens=TASKS[cfg.env], temperature=cfg.update.temperature)
    num_prompts = cfg.batch // cfg.group_size
    snapshots = {0: _clone(policy)}  # version → weights, only those a later step can still use
    history = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for step in range(cfg.steps):
                start = time.perf_counter()
                versions = [max(0, step - lag) for lag in lags(cfg, step, num_prompts, lag_rng)]
                trajs = []
                # oldest first: a generator only ever moves forward in versions
                for version in sorted(set(versions)):
                    if version != generator.version:
                        save_file(snapshots[version], f"{tmp}/w.safetensors")
                        generator.load_weights(f"{tmp}/w.safetensors", version=version)
                    trajs += play_tasks(env, generator, params, rng, num_prompts=versions.count(version),
                                        group_size=cfg.group_size, id_prefix=f"{step}.{version}.",
                                        concurrent=True)
                metrics = update.step(trajs)
                snapshots[step + 1] = _clone(policy)
                snapshots = {v: w for v, w in snapshots.items() if v >= step + 1 - cfg.max_lag}
                history.append(metrics | {"stale/versions": staleness(trajs, step),
                                          "perf/step_s": time.perf_counter() - start})
    finally:
        generator.close()
    return history


def staleness(trajs: list[Trajectory], step: int) -> float:
    """Mean over action tokens of how many versions behind `step` the weights that sampled them
    were, read from the trajectories themselves."""
    versions = np.concatenate([t.versions[t.action_mask.astype(bool)] for t in trajs])
    return float(step - versions.mean())


def _clone(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors sharing storage (a tied LM head): each gets its own copy
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}

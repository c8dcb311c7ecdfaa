"""Learning curves of SAO against grpo_dis, running_mean and grpo on the toy tasks (docs/algorithm.md §7, §8).

Every method sees the same number of trajectories per step (`--batch`, default 16): the
single-rollout methods (sao, running_mean) get 16 prompts × 1 rollout, the GRPO variants
2 prompts × 8. Rollouts come from a separate `HFGenerator` (the loop of bench/loop.py) whose
weights are refreshed from the learner through a safetensors file every `--sync-every` steps: 1 is
on-policy; k > 1 makes rollouts up to k − 1 versions stale, as in an asynchronous system.

Prints, per task and method, the final reward (mean of the last `--final` steps; mean ± std over
seeds) and the steps to reach 80 % of the best method's final reward (first step at which the
20-step trailing mean gets there; mean over the seeds that do, with how many did), and writes a
PNG of the reward curves. Run: `python bench/learning.py [--steps 300 --seeds 3 --jobs 2]`.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402

from bench.loop import SMOOTH, TASKS, LoopConfig, trailing_mean  # noqa: E402
from bench.loop import run as train  # noqa: E402
from bench.report import save_figure  # noqa: E402
from learner.update import UpdateConfig  # noqa: E402

ALGORITHMS = ("sao", "grpo_dis", "running_mean", "grpo")
GROUP = 8  # rollouts per prompt of the GRPO variants


@dataclass(kw_only=True)
class LearningConfig:
    """Every method on every toy task."""

    steps: int = 300
    """learner steps per run"""
    seeds: int = 3
    """seeds per task and method"""
    batch: int = 16
    """trajectories per step, a multiple of 8"""
    sync_every: int = 1
    """steps between generator weight loads (1 = on-policy)"""
    start: Path | None = None
    """transformers folder to start from (default: the random tiny Llama)"""
    lr_policy: float = 3e-3
    """policy learning rate"""
    lr_critic: float = 3e-3
    """critic learning rate"""
    final: int = 50
    """steps averaged into the final reward"""
    jobs: int = 2
    """runs in parallel, one CPU thread each"""
    png: Path = Path("runs/bench/learning.png")
    """where the reward curves go"""

    def __post_init__(self):
        if self.batch % GROUP:  # the GRPO variants see batch / GROUP prompts x GROUP rollouts
            raise ValueError(f"--batch must be a multiple of {GROUP}")


def run(env_name: str, algorithm: str, seed: int, args: LearningConfig) -> list[float]:
    """Mean trajectory return of each step of one training run."""
    torch.set_num_threads(1)
    cfg = LoopConfig(env=env_name, steps=args.steps, batch=args.batch, group=GROUP,
                     sync_every=args.sync_every, start=args.start, seed=seed,
                     update=UpdateConfig(algorithm=algorithm, lr_policy=args.lr_policy,
                                         lr_critic=args.lr_critic))
    return [m["reward/mean"] for m in train(cfg)]


def full_windows(curve: list[float]) -> np.ndarray:
    """Mean of the last SMOOTH steps; entry i ends at step i + SMOOTH."""
    return trailing_mean(curve)[SMOOTH - 1:]


def steps_to(curve: list[float], target: float) -> int | None:
    hit = np.flatnonzero(full_windows(curve) >= target)
    return int(hit[0]) + SMOOTH if hit.size else None


def report(curves: dict[tuple[str, str], list[list[float]]], args: LearningConfig) -> None:
    print(f"{'task':<15}{'method':<14}{'final reward':>16}{'steps to 80% best':>20}")
    for env_name in TASKS:
        finals = {a: [statistics.fmean(c[-args.final:]) for c in curves[env_name, a]]
                  for a in ALGORITHMS}
        best = max(statistics.fmean(f) for f in finals.values())
        for a in ALGORITHMS:
            reached = [s for c in curves[env_name, a] if (s := steps_to(c, 0.8 * best)) is not None]
            mean = f"{statistics.fmean(reached):.0f}" if reached else "never"
            when = f"{mean} ({len(reached)}/{args.seeds})"
            f = finals[a]
            final = f"{statistics.fmean(f):.3f} ± {statistics.pstdev(f):.3f}"
            print(f"{env_name:<15}{a:<14}{final:>17}{when:>20}")


def plot(curves: dict[tuple[str, str], list[list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(TASKS), figsize=(6 * len(TASKS), 4), squeeze=False)
    for ax, env_name in zip(axes[0], TASKS):
        for a in ALGORITHMS:
            runs = np.array([full_windows(c) for c in curves[env_name, a]])
            x = np.arange(runs.shape[1]) + SMOOTH
            ax.plot(x, runs.mean(0), label=a)
            ax.fill_between(x, runs.min(0), runs.max(0), alpha=0.2)
        ax.set(title=env_name, xlabel="learner step", ylabel=f"reward ({SMOOTH}-step mean)",
               ylim=(0, 1))
        ax.legend()
    save_figure(fig, path, dpi=120)


def main() -> None:
    args = tyro.cli(LearningConfig, description=__doc__)
    model = args.start or "tiny Llama (vocab 64, hidden 32, 2 layers)"
    print(f"learning: {model}, {args.steps} steps x {args.batch} "
          f"trajectories, GRPO groups of {GROUP}, sync every {args.sync_every}, lr {args.lr_policy:g} "
          f"policy / {args.lr_critic:g} critic, seeds 0..{args.seeds - 1}  [{platform.machine()}, "
          f"{os.cpu_count()} cores, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}]")
    jobs = [(e, a, s) for e in TASKS for a in ALGORITHMS for s in range(args.seeds)]
    start = time.perf_counter()
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, *zip(*jobs), [args] * len(jobs)))
    curves: dict[tuple[str, str], list[list[float]]] = {}
    for (e, a, _), curve in zip(jobs, results):
        curves.setdefault((e, a), []).append(curve)
    report(curves, args)
    plot(curves, args.png)
    print(f"wrote {args.png} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()

"""Stability under asynchrony (docs/algorithm.md §6, §8): every method trained with rollouts exactly s versions
old, s ∈ {0, 2, 4, 8}, from the trained starting point of bench/pretrain.py, with collapse detected.

The staleness is controlled, not left to timing: the in-process loop of bench/loop.py keeps the last
s + 1 policy snapshots and plays each step's rollouts on the one s versions back. Methods: `sao`,
`grpo_dis`, `grpo`, `running_mean` and `vapo` (sao without the DIS mask, the paper's
critic-without-DIS comparison). Every method sees `--batch` trajectories a step (the GRPO variants
as groups of 8).
With `--stale-tail` each prompt's lag is instead a Zipf draw of at most s versions (heavy-tailed
episode lengths: most rollouts fresh, a few as old as the bound).

A run has collapsed (`collapse_step`) at the first step of `--patience` consecutive steps whose
reward (the 20-step trailing mean, so one lucky batch cannot set the maximum) is below half its
running maximum, or at the first step whose loss is not finite or that the learner had to skip.
The paper sees vanilla GRPO collapse near step 160 and a critic without DIS near step 90, while SAO
and GRPO+DIS stay stable to ~1,000 steps.

Prints and writes `--out`.md: per staleness and method, the final reward (mean of the last `--final`
steps; mean ± std over seeds), collapse rate and median collapse step, DIS kept fraction, the
critic's explained variance (its median over the run's steps) and the policy entropy at the end;
and `--out`.png: the reward curves per staleness, collapses marked. Run:
`python bench/async_stability.py [--quick]`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402

from bench.loop import SMOOTH, LoopConfig, finite_mean, trailing_mean  # noqa: E402
from bench.loop import run as train  # noqa: E402
from bench.pretrain import pretrained_start  # noqa: E402
from bench.report import save_figure  # noqa: E402
from learner.algorithms import algorithm_settings  # noqa: E402
from learner.update import UpdateConfig  # noqa: E402

Algorithm = Literal["sao", "grpo_dis", "grpo", "running_mean", "vapo"]
ALGORITHMS: tuple[Algorithm, ...] = get_args(Algorithm)
STALENESS = (0, 2, 4, 8)
RECORDED = {"reward": "reward/mean", "kept": "dis/kept_frac", "stale": "stale/versions",
            "ev": "value/explained_var", "entropy": "policy/entropy", "loss": "loss/policy",
            "skipped": "step/skipped"}
Curves = dict[str, list[float]]  # one run: RECORDED's short names → per-step values


@dataclass(kw_only=True)
class AsyncStabilityConfig:
    """The sweep; `main` fills the fields left None from `quick`."""

    quick: bool = False
    """a few minutes: 150 steps, 1 seed, staleness 0 and 8, quick start"""
    steps: int | None = None
    """learner steps per run (default 1000)"""
    seeds: int | None = None
    """seeds per configuration (default 3)"""
    staleness: tuple[int, ...] | None = None
    """versions old (default (0, 2, 4, 8))"""
    stale_tail: bool = False
    """each prompt's lag a Zipf draw of at most the staleness, not exactly it (heavy-tailed episode lengths)"""
    algorithms: tuple[Algorithm, ...] = ALGORITHMS
    """methods to train"""
    env: Literal["toy-target", "toy-multiturn"] = "toy-target"
    """toy task of bench/loop.py"""
    batch: int = 16
    """trajectories per step, a multiple of 8"""
    lr_policy: float = 3e-3
    """policy learning rate"""
    lr_critic: float = 3e-3
    """critic learning rate"""
    warmup: int = 10
    """critic-only steps of sao and vapo"""
    final: int | None = None
    """steps averaged into the final numbers (default 100)"""
    patience: int = 50
    """low steps in a row that are a collapse"""
    start: Path | None = None
    """transformers folder (default: bench/pretrain.py's)"""
    jobs: int = 2
    """runs in parallel, one CPU thread each"""
    out: Path = Path("bench/results/async_stability")
    """writes OUT.md and OUT.png"""
    raw: Path = Path("runs/bench/async_stability.json")
    """every run's per-step records, written before the table"""
    replot: bool = False
    """table and PNG from --raw, no training"""


def collapse_step(reward: list[float], loss: list[float], skipped: list[float],
                  patience: int = 50, smooth_steps: int = SMOOTH) -> int | None:
    """First step of the first run of `patience` steps with the reward (its `smooth_steps` trailing
    mean) below half its running maximum, or the first step with a non-finite loss or a skipped
    update; None if stable."""
    broken = [i for i, (l, s) in enumerate(zip(loss, skipped)) if not math.isfinite(l) or s]
    smooth = trailing_mean(reward, smooth_steps)
    low = smooth < 0.5 * np.maximum.accumulate(smooth)
    run = 0
    for i, is_low in enumerate(low):
        run = run + 1 if is_low else 0
        if run == patience:
            return min([i - patience + 1, *broken[:1]])
    return broken[0] if broken else None


def one_run(algorithm: str, staleness: int, seed: int, args: AsyncStabilityConfig) -> Curves:
    """One training run's per-step records."""
    torch.set_num_threads(1)
    cfg = LoopConfig(env=args.env, steps=args.steps, batch=args.batch, staleness=staleness,
                     stale_tail=args.stale_tail, start=args.start, seed=seed,
                     update=UpdateConfig(algorithm=algorithm, lr_policy=args.lr_policy,
                                         lr_critic=args.lr_critic,
                                         warmup_steps=args.warmup if algorithm_settings(algorithm).uses_critic else None))
    history = train(cfg)
    return {short: [float(m.get(key, math.nan)) for m in history] for short, key in RECORDED.items()}


def row(runs: list[Curves], final: int, patience: int) -> dict[str, str]:
    """One table row: a method at one staleness over its seeds."""
    finals = [statistics.fmean(r["reward"][-final:]) for r in runs]
    collapses = [s for r in runs if (s := collapse_step(r["reward"], r["loss"], r["skipped"], patience))
                 is not None]
    # the median step: near a reward of 1 the returns barely vary and one step's EV can be -10
    ev = finite_mean([statistics.median(e) if (e := [x for x in r["ev"] if math.isfinite(x)]) else math.nan
                      for r in runs])
    return {"reward, steps 1-20": f"{statistics.fmean(statistics.fmean(r['reward'][:SMOOTH]) for r in runs):.3f}",
            "final reward": f"{statistics.fmean(finals):.3f} ± {statistics.pstdev(finals):.3f}",
            "collapsed": f"{len(collapses)}/{len(runs)}",
            "median collapse step": f"{statistics.median(collapses):.0f}" if collapses else "-",
            "staleness seen": f"{statistics.fmean(statistics.fmean(r['stale']) for r in runs):.2f}",
            "DIS kept": f"{statistics.fmean(statistics.fmean(r['kept']) for r in runs):.4f}",
            "EV (median step)": "-" if math.isnan(ev) else f"{ev:.3f}",
            "entropy (final)": f"{statistics.fmean(statistics.fmean(r['entropy'][-final:]) for r in runs):.2f}"}


def table(curves: dict[tuple[int, str], list[Curves]], args: AsyncStabilityConfig) -> str:
    """The markdown table of every (staleness, method)."""
    rows = {(s, a): row(curves[s, a], args.final, args.patience) for s, a in curves}
    head = ["staleness", "method", *next(iter(rows.values()))]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += [f"| {s} | {a} | " + " | ".join(r.values()) + " |" for (s, a), r in rows.items()]
    return "\n".join(lines)


def plot(curves: dict[tuple[int, str], list[Curves]], staleness: list[int], args: AsyncStabilityConfig,
         path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(staleness), figsize=(4.5 * len(staleness), 3.8), squeeze=False,
                             sharey=True)
    for ax, s in zip(axes[0], staleness):
        for color, a in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], args.algorithms):
            if (s, a) not in curves:  # a sweep stopped early
                continue
            runs = np.array([trailing_mean(r["reward"]) for r in curves[s, a]])
            ax.plot(runs.mean(0), color=color, label=a, lw=1.2)
            for r, smooth in zip(curves[s, a], runs):
                if (c := collapse_step(r["reward"], r["loss"], r["skipped"], args.patience)) is not None:
                    ax.plot(c, smooth[c], "x", color=color, ms=8, mew=2)
        ax.set(title=f"rollouts {s} versions old", xlabel="learner step", ylim=(0, 1))
    axes[0][0].set_ylabel(f"reward ({SMOOTH}-step mean over seeds; x = collapse)")
    axes[0][0].legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def main() -> None:
    args = tyro.cli(AsyncStabilityConfig, description=__doc__)
    quick = args.quick
    args.steps = args.steps or (150 if quick else 1000)
    args.seeds = args.seeds or (1 if quick else 3)
    args.final = min(args.final or (30 if quick else 100), args.steps)
    staleness = args.staleness or ([0, 8] if quick else list(STALENESS))
    if args.replot:
        report(**json.loads(args.raw.read_text()), args=args)
        return
    args.start = args.start or pretrained_start("llama", quick=quick)
    lag = "Zipf lag up to the staleness" if args.stale_tail else "lag exactly the staleness"
    config = (f"{args.start.name} on {args.env}, {lag}, {args.steps} steps x {args.batch} trajectories, "
              f"lr {args.lr_policy:g} policy / {args.lr_critic:g} critic, warm-up {args.warmup}, "
              f"seeds 0..{args.seeds - 1}, collapse: {args.patience} steps below half the running "
              f"max of the {SMOOTH}-step mean  [{platform.machine()}, {os.cpu_count()} cores, "
              f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}]")
    print(f"async stability: {config}", flush=True)
    # seed by seed, so a run stopped early still covers every configuration; within a seed the
    # slowest (critic) runs first, so the pool's last runs are short ones
    jobs = sorted(((a, s, seed) for s in staleness for a in args.algorithms for seed in range(args.seeds)),
                  key=lambda j: (j[2], j[0] not in ("sao", "vapo")))
    start = time.perf_counter()
    raw = {"command": f"python bench/async_stability.py {' '.join(sys.argv[1:])}", "config": config,
           "elapsed": 0.0, "staleness": staleness, "runs": []}
    args.raw.parent.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(args.jobs) as pool:
        for (a, s, seed), run in zip(jobs, pool.map(one_run, *zip(*jobs), [args] * len(jobs))):
            raw["runs"].append([a, s, seed, run])
            raw["elapsed"] = time.perf_counter() - start
            args.raw.write_text(json.dumps(raw))  # after every run: --replot works on a stopped sweep
            print(f"{len(raw['runs'])}/{len(jobs)} {a} staleness {s} seed {seed}: final reward "
                  f"{statistics.fmean(run['reward'][-args.final:]):.3f} ({raw['elapsed']:.0f} s)", flush=True)
    report(**raw, args=args)


def report(command: str, config: str, elapsed: float, staleness: list[int], runs: list,
           args: AsyncStabilityConfig) -> None:
    """Print the table, write it and the PNG under `args.out`."""
    curves: dict[tuple[int, str], list[Curves]] = {}
    for a, s, _, run in runs:
        curves.setdefault((s, a), []).append(run)
    args.algorithms = tuple(a for a in ALGORITHMS if any(key[1] == a for key in curves))
    curves = {(s, a): curves[s, a] for s in staleness for a in args.algorithms if (s, a) in curves}
    text = table(curves, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(f"`{command}` ({elapsed:.0f} s): {config}\n\n{text}\n")
    plot(curves, staleness, args, args.out.with_suffix(".png"))
    print(f"wrote {args.out}.md and {args.out}.png ({elapsed:.0f} s)")


if __name__ == "__main__":
    main()

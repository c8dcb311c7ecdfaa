"""Does the critic learn? `sao` against `sao_k1` (one critic step) and `sao_full_critic` (critic
attention trains) on the trained start of bench/pretrain.py, dense (tiny Llama) and tiny-MoE
(tiny Qwen3-MoE), on `toy-target`; plus, on the dense model, the knobs other SAO ports found
necessary (docs/algorithm.md §9) and the random start every earlier run used (docs/algorithm.md §5, §8).

Every run is bench/loop.py's in-process loop: on-policy rollouts, `--batch` single-rollout
trajectories per step. Prints and writes (`--out`, default bench/results/critic_ablation.md and
.png) one row per variant, each cell mean ± std over seeds: the starting reward (first 20 steps)
and the final one (last `--final` steps); the critic's explained variance after the warm-up,
overall and by third of the response (first / middle / last action tokens), and over the last
`--final` steps; the value/return correlation; the critic gradient norm (before clipping) early and
late. The header gives the explained variance of the best possible critic of the starting policy;
a second table gives reward and EV while the policy rises and after, and when the reward gets to 0.8.

Run: `python bench/critic_ablation.py [--steps 400 --seeds 3 --jobs 2] [--models llama qwen3_moe
smollm2]`; `--quick` trains the quick starts and runs 12 steps of the three algorithms on each
model (a smoke run: its numbers mean nothing).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402

from bench.loop import SMOOTH, LoopConfig, finite_mean, run, trailing_mean  # noqa: E402
from bench.pretrain import CACHE, PretrainConfig, pretrained_start, value_ceiling  # noqa: E402
from bench.report import save_figure  # noqa: E402
from learner.update import UpdateConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
Model = Literal["llama", "qwen3_moe", "smollm2"]  # bench/pretrain.py kinds
MODELS: dict[Model, str] = {"llama": "dense", "qwen3_moe": "MoE", "smollm2": "SmolLM2"}
POSITIONS = ("first", "middle", "last")
WARMUP = UpdateConfig().settings.warmup_steps


@dataclass(kw_only=True)
class CriticAblationConfig:
    """The ablation; `quick` overrides `steps`, `seeds` and `final` in `main`."""

    steps: int = 400
    """learner steps per run"""
    seeds: int = 3
    """seeds per variant"""
    batch: int = 16
    """trajectories per step"""
    lr_policy: float = 2e-4
    """small: the reward takes ~100 steps to rise, so the critic has a moving target with variance to explain"""
    lr_critic: float = 3e-3
    """critic learning rate"""
    final: int = 50
    """last steps averaged into the final figures"""
    jobs: int = 2
    """runs in parallel, one CPU thread each"""
    quick: bool = False
    """quick starts, 12 steps, 1 seed, the three algorithms only (a smoke run)"""
    out: Path = RESULTS / "critic_ablation"
    """writes OUT.md and OUT.png"""
    models: tuple[Model, ...] = ("llama", "qwen3_moe")
    """starting points (bench/pretrain.py kinds); smollm2: SmolLM2-135M taught the same text, far slower on a CPU"""
    cache: Path = CACHE
    """folder of the starting points"""
    raw: Path = CACHE.parent / "bench" / "critic_ablation.json"
    """where every run's per-step metrics go"""
    replot: bool = False
    """redo the table and PNG from --raw instead of training (same settings)"""


@dataclass(frozen=True, eq=False)  # keyed by identity: a dict field is not hashable
class Variant:
    """One configuration: a model, an algorithm, UpdateConfig overrides and where it starts."""

    name: str
    kind: str = "llama"
    algorithm: str = "sao"
    knobs: dict = field(default_factory=dict)
    start: str = "trained"  # trained | random (the same architecture, untrained)

    @property
    def label(self) -> str:
        return f"{MODELS[self.kind]} {self.name}"


def variants(kinds: tuple[Model, ...], quick: bool, lr_critic: float) -> list[Variant]:
    """The three algorithms on each model; on the tiny dense model the knobs and the random start."""
    out = [Variant(a, kind, a) for kind in kinds for a in ("sao", "sao_k1", "sao_full_critic")]
    if quick or "llama" not in kinds:
        return out
    return out + [
        Variant("sao +whiten", knobs={"whiten_advantages": True}),
        Variant("sao +critic clip 10", knobs={"critic_max_grad_norm": 10.0}),
        Variant("sao +warm-up 50", knobs={"warmup_steps": 50}),
        Variant("sao K=4", knobs={"critic_updates": 4}),
        Variant("sao +critic lr x3", knobs={"lr_critic": 3 * lr_critic}),
        # the verl port's fixes together: whitening, critic clip 10, a longer critic warm-up
        Variant("sao +port fixes", knobs={"whiten_advantages": True, "critic_max_grad_norm": 10.0,
                                          "warmup_steps": 20}),
        # the policy never updates: the critic's target stands still at the start's returns, whose
        # best possible critic is known (`value_ceiling`)
        Variant("sao, critic only", knobs={"warmup_steps": 10 ** 9}),
        Variant("sao_full_critic, critic only", algorithm="sao_full_critic", knobs={"warmup_steps": 10 ** 9}),
        Variant("sao, random start", start="random"),
        Variant("sao_full_critic, random start", algorithm="sao_full_critic", start="random"),
    ]


def one_run(v: Variant, start: Path, seed: int, args: CriticAblationConfig) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    update = UpdateConfig(**{"algorithm": v.algorithm, "lr_policy": args.lr_policy,
                             "lr_critic": args.lr_critic} | v.knobs)
    return run(LoopConfig(env="toy-target", steps=args.steps, batch=args.batch, start=start, seed=seed,
                          update=update))


def window_mean(history: list[dict[str, float]], key: str, lo: int, hi: int | None = None) -> float:
    """Mean of a metric over steps [lo, hi), ignoring the steps where it is undefined (NaN)."""
    return finite_mean([h.get(key) for h in history[lo:hi]])


def _cell(xs: list[float], digits: int = 2) -> str:
    xs = [x for x in xs if math.isfinite(x)]
    if not xs:
        return "n/a"
    return f"{statistics.fmean(xs):.{digits}f}" + (f" ± {statistics.pstdev(xs):.{digits}f}" if len(xs) > 1 else "")


def table(runs: dict[Variant, list[list[dict]]], args: CriticAblationConfig) -> str:
    """The markdown table: one row per variant, each cell mean ± std over seeds."""
    last, run = -args.final, WARMUP  # EV and correlation: over the run after the default warm-up
    head = ["model", "variant", "start reward", "final reward", "EV", *(f"EV {p}" for p in POSITIONS),
            "EV, end", "corr(V, R)", f"critic grad norm, steps 0-{args.final}", "critic grad norm, end"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for v, hs in runs.items():
        cells = [MODELS[v.kind], v.name, _cell([window_mean(h, "reward/mean", 0, 20) for h in hs], 3),
                 _cell([window_mean(h, "reward/mean", last) for h in hs], 3),
                 _cell([window_mean(h, "value/explained_var", run) for h in hs]),
                 *(_cell([window_mean(h, f"value/explained_var_{p}", run) for h in hs]) for p in POSITIONS),
                 _cell([window_mean(h, "value/explained_var", last) for h in hs]),
                 _cell([window_mean(h, "value/return_corr", run) for h in hs]),
                 _cell([window_mean(h, "grad_norm/critic", 0, args.final) for h in hs], 3),
                 _cell([window_mean(h, "grad_norm/critic", last) for h in hs], 3)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def phases_table(runs: dict[Variant, list[list[dict]]]) -> str:
    """EV and reward while the policy rises and after it, and when the reward gets to 0.8: the
    critic chases a moving target, or a still one in the critic-only rows."""
    spans = [(WARMUP, 60), (60, 150), (150, None)]
    names = [f"{lo}-{hi - 1 if hi else 'end'}" for lo, hi in spans]
    head = ["model", "variant", *(f"reward {n}" for n in names), *(f"EV {n}" for n in names),
            "first step at reward 0.8 (20-step mean), per seed"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for v, hs in runs.items():
        reached = [np.flatnonzero(smooth(h, "reward/mean") >= 0.8) for h in hs]
        cells = [MODELS[v.kind], v.name,
                 *(_cell([window_mean(h, "reward/mean", lo, hi) for h in hs]) for lo, hi in spans),
                 *(_cell([window_mean(h, "value/explained_var", lo, hi) for h in hs]) for lo, hi in spans),
                 ", ".join(str(int(r[0]) + min(SMOOTH, len(h)) - 1) if r.size else "never"
                           for r, h in zip(reached, hs))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def smooth(history: list[dict], key: str) -> np.ndarray:
    """SMOOTH-step trailing mean of a metric, NaN steps skipped (entry i ends at step i + SMOOTH − 1)."""
    return trailing_mean([h.get(key, math.nan) for h in history])[min(SMOOTH, len(history)) - 1:]


def plot(runs: dict[Variant, list[list[dict]]], path: Path, ceiling: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("reward/mean", "reward"), ("value/explained_var", "critic explained variance"),
              ("grad_norm/critic", "critic gradient norm (before clipping)")]
    kinds = list(dict.fromkeys(v.kind for v in runs))
    colors = plt.get_cmap("tab20").colors  # the default cycle has 10: the dense row has more variants
    fig, axes = plt.subplots(len(kinds), len(panels) + 1, figsize=(22, 4.6 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds):
        mine = {v: hs for v, hs in runs.items() if v.kind == kind}
        for ax, (key, title) in zip(row, panels):
            for i, (v, hs) in enumerate(mine.items()):
                curves = np.array([smooth(h, key) for h in hs])
                x = np.arange(curves.shape[1]) + len(hs[0]) - curves.shape[1]
                ax.plot(x, np.nanmean(curves, 0), label=v.name, color=colors[i % len(colors)],
                        ls="--" if v.start == "random" else "-")
            ax.set(title=f"{MODELS[kind]}: {title} ({SMOOTH}-step mean)", xlabel="learner step")
            if key == "grad_norm/critic":
                ax.set_yscale("log")
        row[0].legend(fontsize=7)
        ax = row[-1]  # EV by third of the response over the run: where the critic knows R
        width = 0.8 / max(len(mine), 1)
        for i, (v, hs) in enumerate(mine.items()):
            ev = [np.nanmean([window_mean(h, f"value/explained_var_{p}", WARMUP) for h in hs]) for p in POSITIONS]
            ax.bar(np.arange(3) + i * width, ev, width, label=v.name, color=colors[i % len(colors)])
        ax.set_xticks(np.arange(3) + 0.4 - width / 2, POSITIONS)
        ax.axhline(0, color="k", lw=0.5)
        if ceiling:
            ax.scatter(np.arange(3) + 0.4 - width / 2, [ceiling[p] for p in POSITIONS], marker="_", s=600,
                       color="k", label="best possible critic at the start")
        ax.legend(fontsize=7)
        ax.set(title=f"{MODELS[kind]}: EV by third of the response, steps {WARMUP}-end")
    save_figure(fig, path, dpi=90)


def main() -> None:
    args = tyro.cli(CriticAblationConfig, description=__doc__)
    if args.quick:
        args.steps, args.seeds, args.final = 12, 1, 6
    vs = variants(args.models, args.quick, args.lr_critic)
    if args.replot:
        saved = json.loads(args.raw.read_text())
        header, runs = saved["header"], {v: saved["runs"][v.label] for v in vs}
    else:
        header, runs = train_all(vs, args)
        # every run's per-step metrics, for another look without rerunning (not committed: megabytes)
        args.raw.parent.mkdir(parents=True, exist_ok=True)
        args.raw.write_text(json.dumps({"header": header, "runs": {v.label: hs for v, hs in runs.items()}}))
    ceiling = value_ceiling(PretrainConfig())
    text = (header + "\n\nEV (explained variance) and corr(V, R) are means over steps "
            f"{WARMUP}-{args.steps - 1}, 'EV, end' over the last {args.final}; the best possible critic "
            "of the trained start's policy (bench/pretrain.py `value_ceiling`, exact Bayes values of its "
            f"text) explains {ceiling['all']:.2f} (first / middle / last third: "
            f"{ceiling['first']:.2f} / {ceiling['middle']:.2f} / {ceiling['last']:.2f}).\n\n"
            + table(runs, args) + "\n\nOver time:\n\n" + phases_table(runs) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    plot(runs, args.out.with_suffix(".png"), ceiling)
    print(text)
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.png')}")


def train_all(vs: list[Variant], args: CriticAblationConfig) -> tuple[str, dict[Variant, list[list[dict]]]]:
    """Every variant × seed, `args.jobs` at a time; returns the results' header line and the runs."""
    torch.set_num_threads(1)
    start_time = time.perf_counter()
    # the random start is the same architecture saved untrained (0 steps), so only training differs
    starts = {(kind, start): pretrained_start(kind, quick=args.quick, cache=args.cache,
                                              **({"steps": 0} if start == "random" else {}))
              for kind, start in dict.fromkeys((v.kind, v.start) for v in vs)}
    jobs = [(v, starts[v.kind, v.start], seed) for v in vs for seed in range(args.seeds)]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(one_run, *zip(*jobs), [args] * len(jobs)))
    runs: dict[Variant, list[list[dict]]] = {v: [] for v in vs}
    for (v, _, _), history in zip(jobs, results):
        runs[v].append(history)
    header = (f"critic ablation: toy-target, {args.steps} steps x {args.batch} trajectories, seeds "
              f"0..{args.seeds - 1}, lr {args.lr_policy:g} policy / {args.lr_critic:g} critic, "
              f"{'quick ' if args.quick else ''}trained starts {', '.join(str(starts[k, 'trained'].name) for k in args.models)}; "
              f"final figures over the last {args.final} steps  [{platform.machine()}, {os.cpu_count()} "
              f"cores shared, {args.jobs} jobs x 1 thread, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}, "
              f"{time.perf_counter() - start_time:.0f} s]")
    return header, runs


if __name__ == "__main__":
    main()

"""Stability through the real pipeline on SmolLM2 (docs/algorithm.md §6, §8): SAO against GRPO+DIS and the
running-mean baseline, each trained by `sao up` (Kafka, vLLM producers, the judge and the reward
joiner, the streaming learner) with rollouts allowed to run `--max-lag-steps` learner steps ahead,
so that they arrive about that many versions old.

bench/async_stability.py sweeps staleness on a toy with the lag set exactly, for 1,000 steps. This
is the same comparison where timing sets the lag: the `make run` task (`writing`, rewarded by the
`concise` judge), its learning rates, and `--max-lag-steps 4` instead of 2. Every method sees
`--batch` trajectories a step; `grpo_dis` as groups of `--group-size` rollouts of one prompt, the
others one rollout per prompt. running_mean's baseline is the mean of the last 128 rewards of any
prompt (`--update.running-mean-scope global`, docs/algorithm.md §7's online setting): the feeder gives every
task a fresh prompt id, so a per-prompt history would never see a prompt twice and train nothing.

Budget: on 2 CPU cores a SmolLM2 step takes ~25-45 s, so the default of 20 steps per method is
~15 minutes a method and ~45 minutes for the three; one seed each. That is enough to see a trend
and a collapse of the kind the paper reports early (a critic without DIS near step 90 of ~1,000),
not its long-horizon ones (vanilla GRPO near step 160).

A run has collapsed at the first of `--patience` steps in a row whose reward (its `--smooth`-step
trailing mean) is below half its running maximum, or at a step whose loss is not finite or that the
learner skipped: bench/async_stability.py's criterion, its windows scaled from 1,000 steps to 20.

Prints and writes `--out`.md (per method: reward of the first and last 5 steps and the rise,
collapse, staleness seen, DIS kept fraction, the critic's explained variance, entropy, stale drops,
wall time) and `--out`.png (reward and staleness against the learner step). Every run's per-step
records go to `--raw` after each run, so `--replot` redoes the table of a stopped sweep. Run:
`python bench/pipeline_stability.py [--quick]`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tyro  # noqa: E402

from bench.async_stability import collapse_step  # noqa: E402
from bench.loop import finite_mean, trailing_mean  # noqa: E402
from bench.report import save_figure  # noqa: E402
from learner.algorithms import algorithm_settings  # noqa: E402
from sao import report  # noqa: E402

Method = Literal["sao", "grpo_dis", "running_mean"]
METHODS: tuple[Method, ...] = get_args(Method)
GROUPED = {"grpo_dis"}  # methods whose baseline is the group's: G rollouts of each prompt
METHOD_FLAGS = {"running_mean": "--update.running-mean-scope global"}  # prompt ids never repeat here
RECORDED = {"reward": "reward/mean", "kept": "dis/kept_frac", "stale": "stale/p50", "stale_p99": "stale/p99",
            "ev": "value/explained_var", "entropy": "policy/entropy", "loss": "loss/policy",
            "skipped": "step/skipped", "dropped": "count/stale"}
Curves = dict[str, list[float]]  # one run: RECORDED's short names → per-step values


@dataclass(kw_only=True)
class PipelineStabilityConfig:
    """The sweep; `main` fills the fields left None from `quick`, which also sets model, env and judge."""

    quick: bool = False
    """a minute or two a method: tiny-llama on toy-target, 6 steps of 8, no judge"""
    methods: tuple[Method, ...] = METHODS
    """methods to run, one `sao up` each"""
    steps: int | None = None
    """learner steps per method (default 20; --quick 6)"""
    max_lag_steps: float = 4.0
    """`sao up --max-lag-steps`"""
    batch: int = 8
    """trajectories per learner step"""
    group_size: int = 4
    """rollouts per prompt of grpo_dis"""
    max_tokens: int = 24
    """most tokens per rollout (`sao up --max-tokens`)"""
    lr_policy: float | None = None
    """default 1e-4 (make run's; --quick 3e-3)"""
    lr_critic: float | None = None
    """default 5e-4 (make run's; --quick 3e-3)"""
    warmup: int = 1
    """critic-only steps of sao"""
    patience: int = 5
    """low steps in a row that are a collapse"""
    smooth: int = 5
    """steps of the reward's trailing mean"""
    timeout: float = 2400.0
    """seconds one `sao up` may take"""
    run_root: Path = Path("runs/bench/pipeline_stability")
    """each method's `sao up` run directory, <run-root>/<method>"""
    out: Path = Path("bench/results/pipeline_stability")
    """writes OUT.md and OUT.png"""
    raw: Path = Path("runs/bench/pipeline_stability.json")
    """every run's per-step records, written after each run"""
    replot: bool = False
    """table and PNG from --raw, no training"""
    add: bool = False
    """keep the runs --raw holds (same setting) and run only --methods, replacing theirs"""

    @property
    def model(self) -> str:
        """The `sao up --model`."""
        return "tiny-llama" if self.quick else "smollm2"

    @property
    def env(self) -> str:
        """The `sao up --env`."""
        return "toy-target" if self.quick else "writing"

    @property
    def judge(self) -> str:
        """The `sao up --judge` criterion; empty: the env's own reward."""
        return "" if self.quick else "concise"


def up_command(method: str, args: PipelineStabilityConfig, run_dir: Path) -> list[str]:
    """The `sao up` run of one method: `make run`'s setting with the bench's lag bound."""
    warmup = f"--update.warmup-steps {args.warmup} " if algorithm_settings(method).uses_critic else ""
    learner = (f"--update.algorithm {method} {warmup}"
               f"--update.lr-policy {args.lr_policy:g} --update.lr-critic {args.lr_critic:g} "
               f"{METHOD_FLAGS.get(method, '')}").strip()
    cmd = [sys.executable, "-m", "sao", "up", "--model", args.model, "--env", args.env, "--producers", "1",
           "--batch-trajectories", str(args.batch), "--max-tokens", str(args.max_tokens),
           "--steps", str(args.steps), "--max-lag-steps", f"{args.max_lag_steps:g}",
           "--group-size", str(args.group_size if method in GROUPED else 1),
           "--run-dir", str(run_dir), "--no-dashboard", f"--learner-flags={learner}"]
    return cmd + (["--judge", args.judge] if args.judge else [])


def curves(steps: list[dict]) -> Curves:
    """Per-step records of a run's metrics, the last line of each step (a restarted learner
    writes a resumed step again)."""
    last = {int(s["step/index"]): s for s in steps}
    ordered = [last[i] for i in sorted(last)]
    return {short: [float(s.get(key, math.nan)) for s in ordered] for short, key in RECORDED.items()}


def row(run: Curves, wall_s: float, args: PipelineStabilityConfig) -> dict[str, str]:
    """One table row: a method's run."""
    reward, n = run["reward"], min(5, len(run["reward"]) // 2)
    collapse = collapse_step(reward, run["loss"], run["skipped"], args.patience, args.smooth)
    ev = [x for x in run["ev"] if math.isfinite(x)]
    return {"steps": f"{len(reward)}",
            "reward, first 5": f"{finite_mean(reward[:n]):.3f}",
            "reward, last 5": f"{finite_mean(reward[-n:]):.3f}",
            "rise": f"{finite_mean(reward[-n:]) - finite_mean(reward[:n]):+.3f}",
            "collapsed at": "-" if collapse is None else f"step {collapse}",
            "staleness p50 (mean) / p99 (max)": f"{finite_mean(run['stale']):.2f} / {max(run['stale_p99']):.0f}",
            "DIS kept (mean / last)": f"{finite_mean(run['kept']):.3f} / {run['kept'][-1]:.3f}",
            "EV (median step)": f"{statistics.median(ev):.3f}" if ev else "-",
            "entropy (first / last)": f"{run['entropy'][0]:.2f} / {run['entropy'][-1]:.2f}",
            "dropped as stale": f"{run['dropped'][-1]:.0f}",
            "wall": f"{wall_s:.0f} s"}


def table(runs: dict[str, tuple[Curves, float]], args: PipelineStabilityConfig) -> str:
    rows = {m: row(run, wall, args) for m, (run, wall) in runs.items()}
    head = ["method", *next(iter(rows.values()))]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return "\n".join(lines + [f"| {m} | " + " | ".join(r.values()) + " |" for m, r in rows.items()])


def plot(runs: dict[str, tuple[Curves, float]], args: PipelineStabilityConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_s) = plt.subplots(1, 2, figsize=(10, 3.8))
    for color, (m, (run, _)) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], runs.items()):
        smooth = trailing_mean(run["reward"], args.smooth)
        ax_r.plot(run["reward"], color=color, lw=0.8, alpha=0.4)
        ax_r.plot(smooth, color=color, lw=1.8, label=m)
        if (c := collapse_step(run["reward"], run["loss"], run["skipped"], args.patience, args.smooth)) is not None:
            ax_r.plot(c, smooth[c], "x", color=color, ms=9, mew=2)
        ax_s.plot(run["stale_p99"], color=color, label=m)
    ax_r.set(title=f"reward (thin: per step; thick: {args.smooth}-step mean; x = collapse)",
             xlabel="learner step", ylim=(0, 1))
    ax_s.set(title="staleness p99 (versions)", xlabel="learner step")
    ax_s.axhline(args.max_lag_steps, color="grey", ls=":", lw=1)
    ax_r.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def report_runs(raw: dict, args: PipelineStabilityConfig) -> str:
    """Print the table, write it and the PNG under `args.out`."""
    runs = {m: (r["curves"], r["wall_s"]) for m, r in raw["runs"].items() if r["curves"]["reward"]}
    text = table(runs, args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    failed = [f"- {m}: `sao up` exited {r['returncode']}; log {r['log']}" for m, r in raw["runs"].items()
              if r["returncode"] != 0]
    args.out.with_suffix(".md").write_text(
        f"`{raw['command']}` ({raw['elapsed']:.0f} s): {raw['config']}\n\n{text}\n" + "\n".join(failed))
    plot(runs, args, args.out.with_suffix(".png"))
    print(f"wrote {args.out}.md and {args.out}.png ({raw['elapsed']:.0f} s)")
    return text


def main() -> None:
    args = tyro.cli(PipelineStabilityConfig, description=__doc__)
    quick = args.quick
    args.steps = args.steps or (6 if quick else 20)
    args.lr_policy = args.lr_policy or (3e-3 if quick else 1e-4)
    args.lr_critic = args.lr_critic or (3e-3 if quick else 5e-4)
    if args.replot:
        report_runs(json.loads(args.raw.read_text()), args)
        return
    config = (f"{args.model} on {args.env}{f' (judge {args.judge})' if args.judge else ''}, "
              f"`sao up --max-lag-steps {args.max_lag_steps:g}`, {args.steps} steps x {args.batch} trajectories "
              f"(grpo_dis: groups of {args.group_size}), {args.max_tokens} tokens, lr {args.lr_policy:g} policy / "
              f"{args.lr_critic:g} critic, warm-up {args.warmup}, one seed, collapse: {args.patience} steps below "
              f"half the running max of the {args.smooth}-step mean  [{platform.machine()}, {os.cpu_count()} cores, "
              f"{time.strftime('%Y-%m-%d')}]")
    print(f"pipeline stability: {config}", flush=True)
    raw = {"command": f"python bench/pipeline_stability.py {' '.join(sys.argv[1:])}".strip(), "config": config,
           "elapsed": 0.0, "runs": {}}
    if args.add and args.raw.exists():
        kept = json.loads(args.raw.read_text())
        if kept["config"] != config:
            raise SystemExit(f"--add: {args.raw} holds another setting:\n  {kept['config']}")
        raw = kept | {"command": f"{kept['command']}; {raw['command']}",
                      "runs": {m: r for m, r in kept["runs"].items() if m not in args.methods}}
    args.raw.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter() - raw["elapsed"]
    for i, method in enumerate(args.methods, 1):
        run_dir = args.run_root / method
        run_dir.mkdir(parents=True, exist_ok=True)
        log = run_dir / "up.log"
        t0 = time.perf_counter()
        print(f"{i}/{len(args.methods)} {method}: sao up, log {log}", flush=True)
        with log.open("w") as out:
            code = subprocess.run(up_command(method, args, run_dir), stdout=out, stderr=subprocess.STDOUT,
                                  timeout=args.timeout, env=os.environ | {"HF_HUB_OFFLINE": "1"}).returncode
        run = curves(report.load_steps(run_dir))
        raw["runs"][method] = {"curves": run, "wall_s": time.perf_counter() - t0, "returncode": code, "log": str(log)}
        raw["elapsed"] = time.perf_counter() - start
        args.raw.write_text(json.dumps(raw))  # after every run: --replot works on a stopped sweep
        r = run["reward"]
        print(f"{i}/{len(args.methods)} {method}: exit {code}, {len(r)} steps, reward "
              f"{finite_mean(r[:5]):.3f} -> {finite_mean(r[-5:]):.3f} ({raw['elapsed']:.0f} s)", flush=True)
    report_runs(raw, args)
    if any(r["returncode"] != 0 for r in raw["runs"].values()):
        raise SystemExit("pipeline stability: a `sao up` run failed (see the logs named above)")


if __name__ == "__main__":
    main()

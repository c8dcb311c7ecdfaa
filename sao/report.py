"""`sao report RUN_DIR`: the end-of-run report of `sao up`, from what the run left on disk.

Writes `RUN_DIR/report.png` (reward, critic explained variance overall and by third of the
response, DIS kept fraction, staleness, learner throughput, consumer lag, the held-out score of
every evaluated version from `RUN_DIR/eval.jsonl`, the episodes' turns, tool calls and errors, lengths,
observation tokens and why they ended, one panel each, against the learner step) and
`RUN_DIR/summary.txt` (steps, wall time, first and last reward and the rise between the first and
last five steps, trajectories trained, stale drops, staleness, dead letters, the held-out score of
the first and last version evaluated, each process's fate from `RUN_DIR/processes.json` when
`sao up` wrote one), and prints the summary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import tyro

from producers.evaluate.scores import by_env, headline, paired_change

PANELS = [("reward/mean", "mean reward"), ("value/explained_var", "critic explained variance"),
          ("dis/kept_frac", "DIS kept fraction"), ("stale/p99", "staleness p99 (versions)"),
          ("perf/tokens_per_s", "learner tokens/s"), ("kafka/lag", "learner consumer lag")]


@dataclass(kw_only=True)
class ReportConfig:
    run_dir: tyro.conf.Positional[Path] = Path("runs/up")
    """The run directory of `sao up` (holds learner/metrics.jsonl)."""
    window: int = 10
    """Steps averaged for the first and last reward and the plotted running mean."""


def load_steps(run_dir: Path) -> list[dict]:
    """The learner's step records, each step once: a restarted learner replays the steps after its
    checkpoint, and the replay's record is the step its policy holds (sao/audit.py)."""
    from sao.audit import lineage, metrics_lines

    return lineage(metrics_lines(run_dir / "learner"))


def load_evaluations(run_dir: Path) -> list[dict]:
    """The evaluator's results (`sao eval --out RUN_DIR/eval.jsonl`), in the order measured."""
    path = run_dir / "eval.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []


def evaluation_summary(results: list[dict]) -> list[str]:
    """The held-out score of the first and the last version evaluated, and the change, task by task
    where both have per-task scores (how many tasks went each way, and the chance of such a split
    under no change); one line per environment where the run evaluated several."""
    envs = by_env(results)
    lines = []
    for env, scored in envs.items():
        first, last = scored[0], scored[-1]
        name, before = headline(first)
        after = headline(last)[1]
        on = f" on {env}" if len(envs) > 1 else ""
        line = (f"held-out {name}{on} (sao eval, {len(scored)} versions): v{first['version']} {before:.3f} -> "
                f"v{last['version']} {after:.3f} ({after - before:+.3f}")
        if len(scored) > 1 and len(first.get("tasks", ())) == len(last.get("tasks", ())) > 0:
            c = paired_change(first["tasks"], last["tasks"])
            line += f"; of {len(first['tasks'])} tasks {c['gained']} gained, {c['lost']} lost, sign test p={c['p']:.2f}"
        lines.append(line + ")")
    return lines


def environment_summary(steps: list[dict], window: int) -> list[str]:
    """Per environment, where the run trained several: episodes, reward of the first and last
    steps, response length, DIS kept fraction of the last step that had the env."""
    envs = sorted({k.split("/")[1] for s in steps for k in s if k.startswith("env/") and k.endswith("/reward")})
    if len(envs) < 2:
        return []
    lines = []
    for env in envs:
        had = [s for s in steps if f"env/{env}/reward" in s]
        rewards = [s[f"env/{env}/reward"] for s in had]
        lines.append(f"env {env}: {sum(s[f'env/{env}/episodes'] for s in had)} episodes in {len(had)} steps, "
                     f"reward {_mean(rewards[:window]):+.3f} -> {_mean(rewards[-window:]):+.3f}, "
                     f"{_mean([s.get(f'env/{env}/response_tokens') for s in had]):.0f} response tokens, "
                     f"DIS kept {had[-1].get(f'env/{env}/dis_kept_frac', math.nan):.4f}")
    return lines


def _mean(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


RISE_STEPS = 5
"""Steps at each end of a run whose mean rewards `rise` compares."""


def rise(rewards: list[float], n: int = RISE_STEPS) -> float:
    """Mean reward of the last `n` steps minus that of the first `n`: did the run learn."""
    return _mean(rewards[-n:]) - _mean(rewards[:n]) if len(rewards) >= 2 * n else math.nan


def summary(run_dir: Path, steps: list[dict], window: int, lost: int = 0) -> str:
    """`lost`: step records beyond the lineage `steps`, trained after the checkpoint a restarted
    learner went back to."""
    rewards = [s.get("reward/mean", math.nan) for s in steps]
    lines = [f"run: {run_dir}", f"learner steps: {len(steps)}"]
    if lost:
        lines.append(f"steps lost to learner restarts: {lost} (trained after the checkpoint a restart went "
                     "back to; --checkpoint-every bounds them)")
    if steps:
        lines += [f"weights version: {steps[-1].get('weights/version')}",
                  f"trajectories trained: {sum(len(s.get('trajectory_ids', ())) for s in steps)}",
                  f"first reward (mean of steps 1-{min(window, len(steps))}): {_mean(rewards[:window]):+.3f}",
                  f"last reward (mean of the last {min(window, len(steps))} steps): {_mean(rewards[-window:]):+.3f}",
                  f"reward rise (mean of the last {RISE_STEPS} steps - mean of the first {RISE_STEPS}): " +
                  (f"{rise(rewards):+.3f}" if len(rewards) >= 2 * RISE_STEPS else f"- (needs {2 * RISE_STEPS} steps)"),
                  f"DIS kept fraction, last step: {steps[-1].get('dis/kept_frac', math.nan):.4f}",
                  f"staleness p99, highest over the steps: {max(s.get('stale/p99', 0) for s in steps):.0f}",
                  f"dropped as stale: {steps[-1].get('count/stale', 0)}",
                  f"dead letters counted by the learner: {steps[-1].get('count/dlq', 0)}",
                  f"episodes, mean over steps: {_mean([s.get('episode/turns') for s in steps]):.2f} turns, "
                  f"{_mean([s.get('episode/tool_calls') for s in steps]):.2f} tool calls "
                  f"({_mean([s.get('episode/tool_errors') for s in steps]):.2f} failed), "
                  f"{_mean([s.get('episode/response_tokens') for s in steps]):.0f} response tokens, of them "
                  f"{_mean([s.get('episode/observation_tokens') for s in steps]):.0f} observation",
                  "why episodes ended: " + ", ".join(
                      f"{k[4:]} {_mean([s.get(k, 0.0) for s in steps]):.0%}"
                      for k in sorted({k for s in steps for k in s if k.startswith("end/")}))]
    lines += environment_summary(steps, window)
    lines += evaluation_summary(load_evaluations(run_dir))
    meta = run_dir / "processes.json"
    if meta.exists():
        info = json.loads(meta.read_text())
        if "wall_s" in info:
            lines.append(f"wall time: {info['wall_s']:.0f} s")
        for name, p in info.get("processes", {}).items():
            lines.append(f"process {name}: {p['state']}, {p['restarts']} restart(s)")
            lines += [f"  {e}" for e in p["events"]]
    return "\n".join(lines) + "\n"


def plot(run_dir: Path, steps: list[dict], window: int) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 4, figsize=(17, 9.5))
    x = [s["step/index"] for s in steps]
    for ax, (key, title) in zip(axes.flat, PANELS):
        y = [s.get(key, math.nan) for s in steps]
        ax.plot(x, y, lw=1, alpha=0.6 if key == "reward/mean" else 1,
                label="all" if key == "value/explained_var" else None)
        if key == "value/explained_var":  # by third of the response: where the critic knows the return
            for part in ("first", "middle", "last"):
                ax.plot(x, [s.get(f"{key}_{part}", math.nan) for s in steps], lw=1, label=part)
            ax.legend(fontsize=8)
        if key == "reward/mean" and len(y) >= window:
            ax.plot(x[window - 1:], [_mean(y[i - window + 1:i + 1]) for i in range(window - 1, len(y))],
                    lw=2, label=f"running mean ({window})")
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("learner step")
    evaluation_panel(axes.flat[len(PANELS)], load_evaluations(run_dir))
    episode_panels(axes.flat[len(PANELS) + 1:], steps)
    fig.suptitle(str(run_dir))
    fig.tight_layout()
    path = run_dir / "report.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def evaluation_panel(ax, results: list[dict]) -> None:
    """Every evaluated version's held-out figures against the learner step that made it."""
    x = [r["step"] for r in results]
    names = [n for n in ("greedy/mean", "greedy/pass@1") if results and n in results[0]]
    names += sorted(n for n in (results[0] if results else {}) if n.startswith(("sampled/mean@", "sampled/pass@")))
    for name in names:
        ax.plot(x, [r.get(name, math.nan) for r in results], marker="o", lw=1, label=name)
    if names:
        ax.legend(fontsize=7)
    ax.set_title("held-out score (sao eval)")
    ax.set_xlabel("learner step")


def episode_panels(axes, steps: list[dict]) -> None:
    """What the episodes looked like, per learner step: turns and tool calls, lengths, the tokens
    that were context only, and why they ended."""
    x = [s["step/index"] for s in steps]
    series = [("episode turns and tool calls (mean per episode)", ("episode/turns", "episode/tool_calls",
                                                                   "episode/tool_errors")),
              ("response tokens per episode", ("episode/response_tokens_p50", "episode/response_tokens_p90",
                                               "episode/response_tokens_max")),
              ("observation tokens (masked) and trained share", ("episode/observation_tokens",
                                                                 "policy/trained_token_frac"))]
    for ax, (title, keys) in zip(axes, series):
        for key in keys:
            ax.plot(x, [s.get(key, math.nan) for s in steps], lw=1, label=key.split("/")[-1])
        ax.legend(fontsize=7)
        ax.set_title(title)
        ax.set_xlabel("learner step")
    ends = sorted({k for s in steps for k in s if k.startswith("end/")})
    ax = axes[len(series)]
    if ends:
        ax.stackplot(x, *[[s.get(k, 0.0) for s in steps] for k in ends], labels=[k[4:] for k in ends])
        ax.legend(fontsize=7, loc="lower left")
    ax.set_title("why episodes ended (share)")
    ax.set_xlabel("learner step")


def write(run_dir: Path, window: int = 10) -> str:
    from sao.audit import lineage, metrics_lines

    records = metrics_lines(run_dir / "learner")  # read once: the lineage and what it superseded
    steps = lineage(records)
    text = summary(run_dir, steps, window, lost=len(records) - len(steps))
    (run_dir / "summary.txt").write_text(text)
    plot(run_dir, steps, window)
    return text


def run(cfg: ReportConfig) -> None:
    if not (cfg.run_dir / "learner" / "metrics.jsonl").exists():
        raise SystemExit(f"sao report: {cfg.run_dir} has no learner/metrics.jsonl")
    print(write(cfg.run_dir, cfg.window), end="")
    print(f"report: {cfg.run_dir / 'report.png'}, {cfg.run_dir / 'summary.txt'}")

"""`sao stack`: `sao up` with the tiny model, no dashboard and the learning curves as
`<run-dir>/learning.png`; the plain form for scripts and tests (`make run` is `sao up`).

Starts Apache Kafka (unless `--kafka.bootstrap` or `SAO_KAFKA_BOOTSTRAP` names a cluster), then each service as its
own process: the learner, `--producers` producers and the prompt feeder; stops them all after
`--steps` learner steps.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from sao import up


@dataclass(kw_only=True)
class StackConfig(up.UpConfig):
    run_dir: Path = Path("runs/stack")
    """Learner metrics, checkpoints, weights, logs and the plot."""
    dashboard: bool = False
    """Live dashboard when the output is a terminal (else a progress line every 10 s)."""


def plot(run_dir: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steps = [json.loads(x) for x in (run_dir / "learner" / "metrics.jsonl").read_text().splitlines()]
    panels = [("reward/mean", "mean reward"), ("value/explained_var", "critic explained variance"),
              ("dis/kept_frac", "DIS kept fraction"), ("stale/p99", "staleness p99 (versions)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, title) in zip(axes, panels):
        ax.plot([s["step/index"] for s in steps], [s.get(key, float("nan")) for s in steps])
        ax.set_title(title)
        ax.set_xlabel("learner step")
    fig.tight_layout()
    path = run_dir / "learning.png"
    fig.savefig(path, dpi=100)
    return path


def run(cfg: StackConfig) -> None:
    up.run(cfg)
    print(f"learning curves: {plot(cfg.run_dir)}", flush=True)

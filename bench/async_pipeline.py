"""One configuration per algorithm of bench/async_stability.py through the real pipeline: an
embedded Kafka broker, `--producers` producer processes, the feeder and the learner, as `sao up`
starts them, with the learner dropping trajectories more than `--max-staleness` versions old.

Here the staleness is whatever the processes' timing makes it, which is what the in-process sweep
controls instead; this run confirms that each method trains end to end from the same trained start
(bench/pretrain.py) and reports the reward and the staleness the learner saw. All runs share one
broker, each under its own topic prefix and run folder.

Prints and writes `--out`.md: per method, the learner steps, the reward over the first and last 20
steps, the staleness (median of the steps' p50, the largest seen), trajectories dropped as too
stale, the DIS kept fraction, the critic's explained variance (last 20 steps) and the wall time.
`running_mean` keys its history globally here (`--update.running-mean-scope global`): the feeder's
prompt ids are all distinct, so per prompt it would never have a baseline.
Run: `python bench/async_pipeline.py [--steps 150] [--quick]`.
"""

from __future__ import annotations

import math
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import tyro  # noqa: E402

from bench.async_stability import ALGORITHMS, Algorithm  # noqa: E402
from bench.loop import finite_mean  # noqa: E402
from bench.pretrain import pretrained_start  # noqa: E402
from sao.broker import BrokerConfig, cluster  # noqa: E402
from sao.report import load_steps  # noqa: E402
from sao.up import UpConfig, run_up  # noqa: E402
from schemas.kafka import KafkaConfig  # noqa: E402

GROUP = 8  # rollouts per prompt of the GRPO variants, as in the sweep
EDGE = 20  # steps in the first and last reward windows


@dataclass(kw_only=True)
class AsyncPipelineConfig:
    """The runs; `main` picks `steps` and `start` from `quick` where they are left None."""

    quick: bool = False
    """20 steps per method, quick start"""
    steps: int | None = None
    """learner steps per method (default 150)"""
    algorithms: tuple[Algorithm, ...] = ALGORITHMS
    """methods to run, one `sao up` each"""
    max_staleness: int = 4
    """the learner's staleness bound"""
    producers: int = 2
    """producer processes"""
    batch: int = 16
    """trajectories per step, a multiple of 8"""
    lr: float = 3e-3
    """policy and critic learning rate"""
    start: Path | None = None
    """transformers folder (default: bench/pretrain.py's)"""
    run_dir: Path = Path("runs/async_pipeline")
    """each method's run folder, <run-dir>/<method>"""
    out: Path = Path("bench/results/async_pipeline")
    """writes OUT.md"""


def summary(steps: list[dict]) -> dict[str, str]:
    """One table row from a learner's metrics.jsonl records."""
    reward = [s.get("reward/mean", math.nan) for s in steps]
    return {"steps": str(len(steps)),
            "reward first 20": f"{finite_mean(reward[:EDGE]):.3f}",
            "reward last 20": f"{finite_mean(reward[-EDGE:]):.3f}",
            "staleness p50": f"{statistics.median(s.get('stale/p50', math.nan) for s in steps):.1f}",
            "staleness max": str(max(s.get("stale/max", 0) for s in steps)),
            "dropped stale": str(steps[-1].get("count/stale", 0)),
            "DIS kept": f"{finite_mean([s.get('dis/kept_frac') for s in steps]):.4f}",
            "EV last 20": "-" if math.isnan(ev := finite_mean([s.get("value/explained_var", math.nan)
                                                         for s in steps[-EDGE:]])) else f"{ev:.3f}"}


def main() -> None:
    args = tyro.cli(AsyncPipelineConfig, description=__doc__)
    steps = args.steps or (20 if args.quick else 150)
    start = (args.start or pretrained_start("llama", quick=args.quick)).resolve()
    config = (f"{start.name} on toy-target, {steps} steps x {args.batch} trajectories, "
              f"{args.producers} producers, --max-staleness {args.max_staleness}, lr {args.lr:g}, "
              f"warm-up 10  [{platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}]")
    print(f"async pipeline: {config}", flush=True)
    rows = {}
    with cluster(KafkaConfig(bootstrap=os.environ.get("SAO_KAFKA_BOOTSTRAP", "")), BrokerConfig(port=0)) as kafka:
        for algorithm in args.algorithms:
            run_dir = args.run_dir / algorithm
            shutil.rmtree(run_dir, ignore_errors=True)  # the learner would resume an old checkpoint
            cfg = UpConfig(
                steps=steps, producers=args.producers, env="toy-target", model=str(start),
                batch_trajectories=args.batch, group_size=GROUP if algorithm.startswith("grpo") else 1,
                run_dir=run_dir, dashboard=False, learner_threads=1,
                learner_flags=f"--update.algorithm {algorithm} --max-staleness {args.max_staleness} "
                              f"--update.lr-policy {args.lr} --update.lr-critic {args.lr}",
                kafka=KafkaConfig(bootstrap=kafka.bootstrap, topic_prefix=f"stability-{algorithm}"))
            if algorithm == "running_mean":
                # the feeder gives every prompt a fresh id, so a per-prompt history would stay
                # empty and every advantage 0: the global window of docs/algorithm.md §7's online setting
                cfg.learner_flags += " --update.running-mean-scope global"
            t0 = time.monotonic()
            run_up(cfg)
            rows[algorithm] = summary(load_steps(run_dir)) | {"wall s": f"{time.monotonic() - t0:.0f}"}
    head = ["method", *next(iter(rows.values()))]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += [f"| {a} | " + " | ".join(r.values()) + " |" for a, r in rows.items()]
    text = "\n".join(lines)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(
        f"`python bench/async_pipeline.py {' '.join(sys.argv[1:])}`: {config}\n\n{text}\n")
    print(f"wrote {args.out}.md")


if __name__ == "__main__":
    main()

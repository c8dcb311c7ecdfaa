"""`sao stack` (what `make run` runs): the whole pipeline on one machine, with a plot at the end.

Starts Apache Kafka (unless `SAO_KAFKA_BOOTSTRAP` points at a cluster), then each service as its
own process, exactly as they would run on separate machines: the learner, `--producers` producers
and the prompt feeder. The learner's progress lines stream to the terminal; when it has trained
`--steps` steps every process is stopped with SIGTERM and the learning curves are written to
`<run-dir>/learning.png`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from sao.broker import BrokerConfig, cluster, die_with_parent
from schemas.kafka import KafkaConfig, ensure_topics


@dataclass(kw_only=True)
class StackConfig:
    steps: int = 150
    """Learner steps before the stack stops."""
    producers: int = 2
    """Producer processes."""
    env: str = "toy-target"
    """Environment the producers play and the feeder generates prompts for."""
    model: str = "tiny-llama"
    """Model of the producers and the learner (tiny-llama runs anywhere in seconds)."""
    batch_trajectories: int = 16
    """Trajectories per learner step."""
    group_size: int = 1
    """Rollouts per prompt the feeder asks for (G >= 2 with `--learner-flags "--update.algorithm grpo"`)."""
    max_tokens: int = 8
    """Tokens per model turn."""
    run_dir: Path = Path("runs/stack")
    """Learner metrics, checkpoints, weights, logs and the plot."""
    learner_flags: str = "--update.warmup-steps 5 --update.lr-policy 3e-3 --update.lr-critic 3e-3"
    """Extra `sao learner` flags, space separated."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)
    broker: BrokerConfig = field(default_factory=lambda: BrokerConfig(port=0))


def _sao(*args: str) -> list[str]:
    return [sys.executable, "-m", "sao", *args]


def commands(cfg: StackConfig) -> dict[str, list[str]]:
    kafka = ["--kafka.bootstrap", cfg.kafka.bootstrap, "--kafka.topic-prefix", cfg.kafka.topic_prefix]
    cmds = {"learner": _sao("learner", "--run-dir", str(cfg.run_dir / "learner"),
                            "--weights-dir", str(cfg.run_dir / "weights"), "--model.name", cfg.model,
                            "--batch-trajectories", str(cfg.batch_trajectories),
                            "--max-steps", str(cfg.steps), *cfg.learner_flags.split(), *kafka)}
    for i in range(cfg.producers):
        # one seed for all: a tiny model's seed is its initial weights, which must be the learner's
        cmds[f"producer-{i}"] = _sao("producer", "--env", cfg.env, "--model", cfg.model, "--seed", "0",
                                     "--producer-id", f"producer-{i}", "--max-tokens", str(cfg.max_tokens),
                                     "--log-every-s", "10", *kafka)
    cmds["feeder"] = _sao("feed", "--env", cfg.env, "--max-unfinished", str(4 * cfg.batch_trajectories),
                          "--group-size", str(cfg.group_size), *kafka)
    return cmds


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


def run_stack(cfg: StackConfig) -> None:
    ensure_topics(cfg.kafka)
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    logs = cfg.run_dir / "logs"
    logs.mkdir(exist_ok=True)
    procs = {}
    env = {**os.environ, "SAO_LOG_LEVEL": os.environ.get("SAO_LOG_LEVEL", "WARNING")}
    try:
        for name, cmd in commands(cfg).items():
            out = sys.stderr if name == "learner" else open(logs / f"{name}.log", "w")
            procs[name] = subprocess.Popen(cmd, stdout=out, stderr=out, env=env, preexec_fn=die_with_parent)
            print(f"started {name} (pid {procs[name].pid})", flush=True)
        if procs["learner"].wait() != 0:
            raise SystemExit(f"learner failed; see the lines above and {logs}")
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for p in procs.values():
            try:
                p.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
    print(f"learning curves: {plot(cfg.run_dir)}", flush=True)


def run(cfg: StackConfig) -> None:
    with cluster(cfg.kafka, cfg.broker):
        run_stack(cfg)

"""Online learning under a shifting reward (docs/algorithm.md §8): the rewarded writing style changes twice.

Per method (SAO with its critic; `running_mean`, window 128, global), the whole live-reward path
runs as `sao` processes on one broker and fresh topics: the `writing` feeder and producer publish
unrewarded trajectories to the pending topic, `sao judge` scores them with the style judge, `sao
reward-join` joins them, and the learner trains on the joined stream and publishes weights back to
the producer. The criterion moves to the next of `--styles` every `--steps-per-phase` learner steps,
by a control message to the running judge (`sao judge set-criterion`): switching by learner step
rather than by the judge's reward count keeps the shift points where the plot puts them when the
producers run ahead of the learner. Afterwards the trained trajectories are read back from `sao.trajectories` and matched
to the learner's steps, which gives each step's style shares, its reward, and which criterion
scored it (a shift point is the first step trained mostly under the next criterion).

Prints a table (per method and phase: plateau reward = mean over the phase's last quarter; steps
from the shift until the 5-step trailing reward recovers 80 % of the previous phase's plateau) and
writes a PNG of the style shares and rewards with the shift points marked.
Run: `python bench/style_shift.py [--steps-per-phase 80 --batch 16 --model tiny|smollm2]`.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import save_figure  # noqa: E402
from consumers.control import set_criterion  # noqa: E402
from consumers.judge import completion_text  # noqa: E402
from consumers.judges import STYLES  # noqa: E402
from consumers.tokenizer import load_tokenizer  # noqa: E402
from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.kafka import KafkaConfig, ensure_topics  # noqa: E402
from tests.consumers.util import Service, read_topic, wait_until  # noqa: E402

METHODS = {"sao": ["--update.algorithm", "sao"],
           "running_mean": ["--update.algorithm", "running_mean", "--update.running-mean-scope", "global",
                            "--update.running-mean-window", "128"]}
Model = Literal["smollm2", "tiny"]
MODELS: dict[Model, tuple[list[str], list[str]]] = {  # the producer's and judge's flags, the learner's
    "tiny": (["--model", "tiny-llama-bytes"], ["--model.name", "tiny-llama", "--model.vocab-size", "260"]),
    "smollm2": (["--model", "smollm2"], ["--model.name", "smollm2"])}
TRAIL = 5


@dataclass(kw_only=True)
class StyleShiftConfig:
    """The phases, the model and the training of both methods."""

    styles: tuple[str, ...] = ("uppercase", "digits", "lowercase")
    """the rewarded styles in turn (consumers/judges.py STYLES)"""
    steps_per_phase: int = 80
    """learner steps under each style"""
    batch: int = 16
    """trajectories per step, and episodes in flight in the producer"""
    max_tokens: int = 16
    """most tokens per completion"""
    lr: float = 3e-3
    """policy and critic learning rate"""
    model: Model = "tiny"
    """tiny: a byte-level tiny Llama; smollm2: SmolLM2-135M"""
    timeout: float = 3600.0
    """seconds one method's run may take"""
    out: Path = Path("bench/results/style_shift.png")
    """where the PNG goes"""


def train(bootstrap: str, method: str, args: StyleShiftConfig, run_dir: Path) -> tuple[list[dict], dict]:
    """One method's run; the learner's step metrics and the trained trajectories by id."""
    kafka = KafkaConfig(bootstrap=bootstrap, topic_prefix=f"style{uuid.uuid4().hex[:6]}")
    ensure_topics(kafka)
    producer_model, learner_model = MODELS[args.model]
    steps = args.steps_per_phase * len(args.styles)
    procs = {
        "joiner": Service(kafka, "reward-join"),
        "judge": Service(kafka, "judge", *producer_model, "--criteria", args.styles[0]),
        "producer": Service(kafka, "producer", "--env", "writing", *producer_model, "--max-tokens",
                            str(args.max_tokens), "--concurrency", str(args.batch)),
        "learner": Service(kafka, "learner", *learner_model, *METHODS[method], "--batch-trajectories",
                           str(args.batch), "--max-steps", str(steps), "--run-dir", str(run_dir / "learner"),
                           "--weights-dir", str(run_dir / "weights"), "--update.warmup-steps", "5",
                           "--update.lr-policy", str(args.lr), "--update.lr-critic", str(args.lr)),
        "feed": Service(kafka, "feed", "--env", "writing", "--max-unfinished", str(2 * args.batch)),
    }
    metrics_file = run_dir / "learner" / "metrics.jsonl"
    try:
        for k, style in enumerate(args.styles[1:], start=1):
            wait_until(lambda: _steps(metrics_file) >= k * args.steps_per_phase or _ended(procs),
                       timeout=args.timeout, every=0.5)
            set_criterion(kafka, style)
        wait_until(lambda: _ended(procs), timeout=args.timeout, every=2)
        if procs["learner"].p.returncode != 0:
            raise RuntimeError({n: p.log(20) for n, p in procs.items()})
    finally:
        for p in procs.values():
            if p.p.poll() is None:
                p.stop()
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    metrics = [m for m in metrics if "trajectory_ids" in m]
    wanted = {i for m in metrics for i in m["trajectory_ids"]}
    trained = read_topic(kafka, T.TRAJECTORIES, 0, timeout=120, until=lambda ts: wanted <= {t.id for t in ts})
    return metrics, {t.id: t for t in trained}


def _steps(metrics_file: Path) -> int:
    return metrics_file.read_text().count("\n") if metrics_file.exists() else 0


def _ended(procs: dict) -> bool:
    return procs["learner"].p.poll() is not None or any(p.p.poll() not in (None, 0) for p in procs.values())


def per_step(metrics: list[dict], trajs: dict, tokenizer, styles: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Each step's reward, its share of each style, and the index of its majority criterion."""
    reward, shares, phase = [], {s: [] for s in styles}, []
    for m in metrics:
        ts = [trajs[i] for i in m["trajectory_ids"] if i in trajs]
        reward.append(m["reward/mean"])
        texts = [completion_text(t, tokenizer)[1] for t in ts]
        for s in styles:
            shares[s].append(np.mean([STYLES[s](x) for x in texts]) if texts else np.nan)
        criteria = collections.Counter(t.meta.get("reward_criterion") for t in ts)
        phase.append(styles.index(criteria.most_common(1)[0][0]) if criteria else -1)
    return {"reward": np.array(reward), "phase": np.array(phase), **{s: np.array(v) for s, v in shares.items()}}


def phase_table(curve: dict) -> list[tuple[int, float, int | None]]:
    """Per phase: (first step, plateau reward, steps to recover 80 % of the previous plateau)."""
    phase, reward = np.maximum.accumulate(curve["phase"]), curve["reward"]
    starts = [0] + [int(np.argmax(phase >= k)) for k in range(1, phase.max() + 1) if (phase >= k).any()]
    ends = starts[1:] + [len(reward)]
    trailing = np.convolve(reward, np.ones(TRAIL) / TRAIL, mode="full")[:len(reward)]
    rows, previous = [], None
    for a, b in zip(starts, ends):
        plateau = float(np.mean(reward[b - max((b - a) // 4, 1):b]))
        recover = None
        if previous is not None:
            hit = np.flatnonzero(trailing[a + TRAIL - 1:b] >= 0.8 * previous)
            recover = int(hit[0]) + TRAIL - 1 if hit.size else None
        rows.append((a, plateau, recover))
        previous = plateau
    return rows


def plot(curves: dict, styles: tuple[str, ...], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves) + 1, figsize=(5 * (len(curves) + 1), 3.8))
    for ax, (method, c) in zip(axes, curves.items()):
        for s in styles:
            ax.plot(c[s], label=s)
        ax.set(title=f"{method}: style share of completions", xlabel="learner step", ylabel="share")
        ax.legend(fontsize=8)
    for method, c in curves.items():
        axes[-1].plot(np.convolve(c["reward"], np.ones(TRAIL) / TRAIL, mode="valid"), label=method)
    axes[-1].set(title=f"reward ({TRAIL}-step mean)", xlabel="learner step", ylabel="reward")
    axes[-1].legend(fontsize=8)
    for ax in axes:
        for method, c in curves.items():
            for a, _, _ in phase_table(c)[1:]:
                ax.axvline(a, color="grey", ls="--" if method == "sao" else ":", lw=0.8)
    save_figure(fig, path, dpi=120)


def main() -> None:
    args = tyro.cli(StyleShiftConfig, description=__doc__)
    broker = None if "SAO_KAFKA_BOOTSTRAP" in os.environ else EmbeddedBroker(BrokerConfig(port=0)).start()
    bootstrap = os.environ.get("SAO_KAFKA_BOOTSTRAP") or broker.bootstrap
    tokenizer = load_tokenizer(MODELS[args.model][0][1])
    print(f"style_shift: styles {' -> '.join(args.styles)}, {args.steps_per_phase} steps per phase, batch "
          f"{args.batch}, model {args.model}, {args.max_tokens} tokens  [{platform.machine()}, {os.cpu_count()} "
          f"cores, {time.strftime('%Y-%m-%d')}]", flush=True)
    curves = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for method in METHODS:
                t0 = time.time()
                metrics, trajs = train(bootstrap, method, args, Path(tmp) / method)
                curves[method] = per_step(metrics, trajs, tokenizer, args.styles)
                print(f"  {method}: {len(metrics)} steps in {time.time() - t0:.0f} s", flush=True)
    finally:
        if broker:
            broker.close()
    print(f"{'method':<14}{'phase':<12}{'from step':>10}{'plateau':>9}{'recover 80%':>13}")
    for method, c in curves.items():
        for k, (a, plateau, recover) in enumerate(phase_table(c)):
            style = args.styles[k] if k < len(args.styles) else "?"
            rec = "-" if k == 0 else (f"{recover} steps" if recover is not None else "never")
            print(f"{method:<14}{style:<12}{a:>10}{plateau:>9.3f}{rec:>13}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    plot(curves, args.styles, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

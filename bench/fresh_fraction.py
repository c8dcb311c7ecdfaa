"""What `--min-fresh-frac` drops, measured on an asynchronous pipeline whose episodes span versions.

SAO judges staleness per token: an action token sampled more than `--max-staleness` versions before
the learner trains on it gives no policy gradient, and a whole episode is dropped only when less
than `--min-fresh-frac` of its action tokens are fresh. This bench measures what each threshold
would throw away, so the default is chosen from data rather than guessed.

The pipeline is the real services on an embedded broker, as bench/throughput.py runs them:
`--producers` `sao producer --backend sim` processes (`--concurrency` episodes in flight each,
lognormal turn lengths, `--tool-s` per tool step) playing `toy-multiturn` episodes of 1 to
`--max-turns` turns (a Zipf draw: most short, a long tail), and one `sao learner` on tiny-llama
stepping every `--batch` trajectories, with no staleness bound and no drop (`--max-staleness -1
--min-fresh-frac 0`), so that every episode is trained and the analysis sees all of them. Each
trajectory's per-token versions come back from `sao.trajectories`; the version it was trained at
from the learner's metrics (`trajectory_ids` of each step, the version before that step's update).
Then, for each bound B of `--bounds` and each threshold m of `--thresholds`, offline:

- stale episodes: the share with at least one action token older than B;
- dropped: the share of episodes with fresh fraction below m, and of the long ones (the top
  quarter by action tokens), which dropping whole episodes hits first;
- fresh tokens lost: fresh action tokens inside dropped episodes, over all fresh action tokens
  (what a drop throws away that the per-token mask would have kept);
- trained per fresh: action tokens of the kept episodes over their fresh ones, the forward and
  backward passes spent per token that gives policy gradient (at most 1 / m).

    .venv/bin/python bench/fresh_fraction.py [--steps 16] [--bounds 1 2 4 8] [--out bench/results/fresh_fraction.md]
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import tyro  # noqa: E402

from bench.throughput import spawn, steps_done, wait_for_groups  # noqa: E402
from learner.long_episodes import fresh_fraction  # noqa: E402
from learner.source import group_id  # noqa: E402
from sao.audit import lineage  # noqa: E402
from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.kafka import KafkaConfig, consumer_error, ensure_topics, make_consumer, make_producer, produce  # noqa: E402
from schemas.messages import Prompt, Trajectory  # noqa: E402


@dataclass(kw_only=True)
class FreshFractionConfig:
    steps: int = 16
    """Learner steps to run."""
    batch: int = 32
    """Trajectories per learner step."""
    producers: int = 2
    concurrency: int = 64
    """Episodes in flight per producer."""
    max_turns: int = 6
    """Most turns an episode has (1 to this many, a Zipf draw)."""
    median_tokens: float = 24
    """Median tokens per turn (lognormal, sigma --sigma)."""
    sigma: float = 1.0
    token_s: float = 0.02
    """Seconds per sampled token."""
    tool_s: float = 0.5
    """Seconds per tool step (each turn after the first)."""
    bounds: tuple[int, ...] = (1, 2, 4, 8)
    """--max-staleness values to analyse."""
    thresholds: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    """--min-fresh-frac values to analyse (1.0: every token fresh, as when a whole episode was judged
    by its oldest token)."""
    seed: int = 0
    out: Path = Path("bench/results/fresh_fraction.md")


def turns(rng: np.random.Generator, most: int) -> int:
    """1..most, P(n) ∝ 1/n^1.2: most episodes short, a long tail."""
    p = 1.0 / np.arange(1, most + 1) ** 1.2
    return int(rng.choice(np.arange(1, most + 1), p=p / p.sum()))


def run_pipeline(cfg: FreshFractionConfig, broker: str, work: Path) -> tuple[list[Trajectory], dict[str, int]]:
    """Every trajectory trained, and the learner version each was trained at."""
    kafka = KafkaConfig(bootstrap=broker, topic_prefix=f"fresh{uuid.uuid4().hex[:8]}")
    ensure_topics(kafka)
    run_dir = work / "learner"
    procs = [spawn(kafka, work / "learner.log", "learner", "--run-dir", str(run_dir), "--weights-dir",
                   str(work / "weights"), "--batch-trajectories", str(cfg.batch), "--max-steps", str(cfg.steps),
                   "--max-staleness", "-1", "--min-fresh-frac", "0", "--update.warmup-steps", "0")]
    for i in range(cfg.producers):
        procs.append(spawn(kafka, work / f"producer-{i}.log", "producer", "--backend", "sim", "--env", "toy-multiturn",
                           "--model", "tiny-llama", "--producer-id", f"p{i}", "--concurrency", str(cfg.concurrency),
                           "--max-tokens", "64", "--sim.median-tokens", str(cfg.median_tokens),
                           "--sim.sigma", str(cfg.sigma), "--sim.token-s", str(cfg.token_s),
                           "--sim.tool-s", str(cfg.tool_s)))
    rng = np.random.default_rng(cfg.seed)
    producer, consumer = make_producer(kafka), make_consumer(kafka, f"bench-{uuid.uuid4().hex}")
    consumer.subscribe([kafka.topic(T.TRAJECTORIES)])
    published, got = 0, {}
    try:
        wait_for_groups(kafka, {"sao-producers": cfg.producers, group_id(kafka): 1})
        while len(steps_done(run_dir)) < cfg.steps:
            if procs[0].poll() is not None:
                raise SystemExit(f"learner exited {procs[0].returncode}; see {work}/learner.log")
            if published - len(got) < 2 * cfg.producers * cfg.concurrency:  # the async pipeline: never wait
                p = Prompt(id=f"q{published}", env="toy-multiturn",
                           task={"targets": [int(x) for x in rng.integers(0, 4, turns(rng, cfg.max_turns))]})
                produce(producer, kafka.topic(T.PROMPTS), p.encode(), key=p.key)
                published += 1
                continue
            producer.flush(10)
            msg = consumer.poll(0.05)
            while msg is not None:
                if not consumer_error(msg):
                    t = Trajectory.decode(msg.value())
                    got[t.id] = t
                msg = consumer.poll(0)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(60)
        consumer.close()
        producer.flush(30)
        del producer  # destroyed now, while its broker is up: a client left to the collector after the
        gc.collect()  # broker closed hung the interpreter in its destructor (an import deadlocked on it)
    trained_at, version = {}, 0
    for step in lineage(steps_done(run_dir)):
        for tid in step["trajectory_ids"]:
            trained_at[tid] = version  # the policy the step's update started from
        version = step["weights/version"]
    return [got[i] for i in trained_at if i in got], trained_at


def analyse(trajs: list[Trajectory], trained_at: dict[str, int], bound: int, thresholds) -> list[dict]:
    fracs = np.array([fresh_fraction(trained_at[t.id], t, bound) for t in trajs])
    acted = np.array([int(t.action_mask.sum()) for t in trajs])
    fresh = fracs * acted
    long = acted >= np.percentile(acted, 75)
    rows = []
    for m in thresholds:
        dropped = fracs < m
        rows.append({"bound": bound, "threshold": m, "stale episodes": float(np.mean(fracs < 1.0)),
                     "dropped": float(dropped.mean()), "long dropped": float(dropped[long].mean()),
                     "fresh tokens lost": float(fresh[dropped].sum() / max(fresh.sum(), 1e-9)),
                     "trained per fresh": float(acted[~dropped].sum() / max(fresh[~dropped].sum(), 1e-9))})
    return rows


def main() -> None:
    cfg = tyro.cli(FreshFractionConfig, description=__doc__)
    started = time.monotonic()
    head = (f"bench/fresh_fraction.py {datetime.datetime.now().isoformat(timespec='seconds')}, {platform.machine()}, "
            f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory(prefix="sao-fresh-") as tmp:
        print(f"pipeline running: logs in {tmp}", flush=True)
        broker = EmbeddedBroker(BrokerConfig(data_dir=Path(tmp) / "kafka", port=0)).start()
        try:
            trajs, trained_at = run_pipeline(cfg, broker.bootstrap, Path(tmp))
        finally:
            broker.close()
    acted = np.array([int(t.action_mask.sum()) for t in trajs])
    span = np.array([len(set(t.versions[t.action_mask.astype(bool)].tolist())) for t in trajs])
    lag = np.array([trained_at[t.id] - int(t.versions[t.action_mask.astype(bool)].min()) for t in trajs])
    lines = [f"# {head}", "",
             f"{len(trajs)} trajectories trained over {cfg.steps} steps of {cfg.batch}; {cfg.producers} sim producers "
             f"x {cfg.concurrency} in flight; toy-multiturn, 1-{cfg.max_turns} turns (turns: mean "
             f"{np.mean([t.num_turns for t in trajs]):.2f}), {cfg.median_tokens:g} tokens a turn (median, sigma "
             f"{cfg.sigma:g}), {cfg.token_s * 1e3:g} ms/token, {cfg.tool_s:g} s a tool step; wall "
             f"{time.monotonic() - started:.0f} s.",
             f"Action tokens per episode: median {np.median(acted):.0f}, p90 {np.percentile(acted, 90):.0f}, "
             f"max {acted.max()}; versions sampled within one episode: mean {span.mean():.2f}, max {span.max()}; "
             f"oldest token's staleness at training: median {np.median(lag):.0f}, p90 {np.percentile(lag, 90):.0f}, "
             f"max {lag.max()}.", "",
             "| --max-staleness | --min-fresh-frac | stale episodes | dropped | long episodes dropped | fresh tokens lost "
             "| trained per fresh |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for bound in cfg.bounds:
        for r in analyse(trajs, trained_at, bound, cfg.thresholds):
            lines.append(f"| {r['bound']} | {r['threshold']:g} | {r['stale episodes']:.3f} | {r['dropped']:.3f} | "
                         f"{r['long dropped']:.3f} | {r['fresh tokens lost']:.3f} | {r['trained per fresh']:.2f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(text)


if __name__ == "__main__":
    main()

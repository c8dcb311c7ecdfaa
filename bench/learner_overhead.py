"""Tokens/s of the full `sao learner` service against the same steps in a bare in-memory loop.

The service path: trajectories pre-published to the embedded broker, consumed, decoded, checked
for staleness and duplicates, trained under FSDP2, checkpointed with offsets committed, and each
new policy written to the weight store and announced. The bare loop: the same model, the same
trajectories and the same `SAOUpdate` steps (also under FSDP2, world size 1), nothing else.
Publication: the training thread only snapshots the policy (`perf/publish_s`); encoding, writing and
announcing run on the publisher's thread. Both are timed from the end of their first step to the
end of their last (the first step pays one-off warm-up), and both with the embedded broker running
on the same cores (on 2 cores an idle Kafka costs the training thread several percent; the bare
loop is also timed without it). Target: ratio >= 0.98 at the defaults (issue 19: publication off
the training thread). The service runs five ways: with its default checkpoint interval,
checkpointing after every step, with publication but no checkpoint in the timed window, the same
with every update a file (none inline in its announcement, so the broker on these cores stores
200-byte announcements instead of the updates), and with neither checkpoints nor weight publication
(what Kafka consumption and step formation alone cost). The broker's own CPU seconds per step are
printed for each (it shares the cores here; it would not in a deployment).
Every path runs `--repeats` times, the paths taking turns with the bare loop. Two figures per path:
the fastest run against the fastest bare run, and the median of paired ratios (each run against the
bare run of its own turn, minutes apart), which slow spells of these shared cores move less.
`--paths` picks paths by key (defaults, every, no-ckpt, files, no-pub), so the target's two can run
more often in the same time. `--threads N` gives the training N intra-op threads (the bare loop and
the service alike): with fewer threads than cores the learner's background threads and the broker
get a core of their own, as a GPU learner's host cores are free of the training's compute; on 2
cores with 2 threads any CPU they take stalls both threads of every parallel region.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.shapes import synthetic  # noqa: E402
from learner.models import ModelConfig, build_models, build_policy  # noqa: E402
from learner.parallel import ParallelConfig, init_distributed  # noqa: E402
from learner.update import SAOUpdate, UpdateConfig  # noqa: E402
from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.config import ConfigError  # noqa: E402
from schemas.kafka import KafkaConfig, ensure_topics, make_producer, produce  # noqa: E402
from schemas.messages import Trajectory  # noqa: E402

PATHS = ("defaults", "every", "no-ckpt", "files", "no-pub")  # the service paths' keys, as `--paths` names them


@dataclass(kw_only=True)
class LearnerOverheadConfig:
    """The model, the steps and which service paths run."""

    steps: int = 21
    """21: the timed window (steps 2..21) holds two default checkpoints (every 10)"""
    batch: int = 16
    """trajectories per step"""
    length: int = 256
    """tokens per trajectory"""
    hidden: int = 256
    """width of the tiny Llama"""
    layers: int = 4
    """depth of the tiny Llama"""
    vocab: int = 2048
    """vocabulary of the tiny Llama"""
    repeats: int = 3
    """runs of each path, taking turns; the fastest counts"""
    service_flags: str = ""
    """extra `sao learner` flags, space separated"""
    paths: str = ",".join(PATHS)
    """service paths to run, comma separated, of: defaults, every, no-ckpt, files, no-pub"""
    threads: int = 0
    """intra-op threads of the training, bare and service alike (0: torch's default)"""

    def __post_init__(self):
        if unknown := set(self.paths.split(",")) - set(PATHS):
            raise ConfigError(f"--paths: unknown {sorted(unknown)}; known: {', '.join(PATHS)}")


def bare_loop(trajs: list[Trajectory], model: ModelConfig, update: UpdateConfig, batch: int) -> list[float]:
    _, _, device = init_distributed("cpu")
    torch.manual_seed(0)
    sao = SAOUpdate(*build_models(build_policy(model), True, ParallelConfig(), device), update)
    ends = []
    for i in range(0, len(trajs) - batch + 1, batch):
        sao.step([Trajectory.decode(t.encode()) for t in trajs[i:i + batch]])  # as fresh from the wire
        ends.append(time.perf_counter())
    return ends


def service(bootstrap: str, trajs: list[Trajectory], model: ModelConfig, batch: int,
            extra: list[str], env: dict[str, str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = KafkaConfig(bootstrap=bootstrap, topic_prefix=f"b{uuid.uuid4().hex[:6]}", settings={})
        ensure_topics(cfg)
        producer = make_producer(cfg)
        for t in trajs:
            produce(producer, cfg.topic(T.TRAJECTORIES), t.encode(), key=t.key)
        assert producer.flush(60) == 0
        cmd = [sys.executable, "-m", "sao", "learner", "--run-dir", f"{tmp}/learner",
               "--weights-dir", f"{tmp}/weights", "--kafka.bootstrap", cfg.bootstrap,
               "--kafka.topic-prefix", cfg.topic_prefix, "--batch-trajectories", str(batch),
               "--max-steps", str(len(trajs) // batch), "--max-staleness", "-1",
               "--model.name", model.name, "--model.vocab-size", str(model.vocab_size),
               "--model.hidden-size", str(model.hidden_size), "--model.num-layers", str(model.num_layers),
               "--update.warmup-steps", "0", *extra]
        subprocess.run(cmd, check=True, cwd=ROOT, stderr=subprocess.DEVNULL,
                       env={**os.environ, "SAO_LOG_LEVEL": "WARNING", **env})
        return [json.loads(x) for x in Path(f"{tmp}/learner/metrics.jsonl").read_text().splitlines()]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (Linux: /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    args = tyro.cli(LearnerOverheadConfig, description=__doc__)
    env = {}
    if args.threads:  # the bare loop runs in this process, the service in its own
        torch.set_num_threads(args.threads)
        env["OMP_NUM_THREADS"] = str(args.threads)
    model = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers)
    trajs = synthetic(args.steps * args.batch, args.length, args.vocab)
    tokens_per_step = args.batch * args.length

    def rate(ends: list[float]) -> float:
        return tokens_per_step * (len(ends) - 1) / (ends[-1] - ends[0])

    # Each path runs --repeats times, the paths taking turns, and the fastest run of each counts:
    # other work on these shared cores only ever slows a run down. The bare loop runs with the
    # embedded broker idle on the same cores, as the service has it, and once more alone.
    flags, never = args.service_flags.split(), str(10 * args.steps)
    paths = {"defaults": ("sao learner (Kafka, FSDP2)", flags),
             "every": ("  the same, checkpoint every step", [*flags, "--checkpoint-every", "1"]),
             "no-ckpt": ("  the same, no checkpoint", [*flags, "--checkpoint-every", never]),
             "files": ("  the same, no checkpoint, updates as files", [*flags, "--checkpoint-every", never,
                                                                        "--weights.inline-bytes", "0"]),
             "no-pub": ("  the same, no checkpoint, no publication",
                        [*flags, "--checkpoint-every", never, "--publish-every", never])}
    chosen = args.paths.split(",")
    cases = dict(paths[key] for key in paths if key in chosen)
    runs, bares = {name: [] for name in cases}, []
    broker_cpu: dict[str, list[float]] = {name: [] for name in cases}  # per step, each run
    with EmbeddedBroker(BrokerConfig(port=0)) as broker:
        pid = broker.nodes[0].proc.pid
        for _ in range(args.repeats):
            for name, extra in cases.items():
                before = cpu_seconds(pid)
                runs[name].append(service(broker.bootstrap, trajs, model, args.batch, extra, env))
                broker_cpu[name].append((cpu_seconds(pid) - before) / args.steps)
            bares.append(rate(bare_loop(trajs, model, UpdateConfig(warmup_steps=0), args.batch)))
    alone = max(rate(bare_loop(trajs, model, UpdateConfig(warmup_steps=0), args.batch))
                for _ in range(min(args.repeats, 3)))  # context, not the target: at most 3 runs
    bare = max(bares)

    def service_rate(steps: list[dict]) -> float:
        return rate([s["time"] for s in steps])

    best = {name: max(range(args.repeats), key=lambda i: service_rate(tries[i])) for name, tries in runs.items()}
    print(f"learner_overhead: tiny-llama h{args.hidden} L{args.layers} V{args.vocab}, {args.steps} steps "
          f"x {args.batch} trajectories x {args.length} tokens, {torch.get_num_threads()} training threads, "
          f"best of {args.repeats}, service flags [{args.service_flags}]  "
          f"[{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}]")
    print(f"{'path':<44}{'tokens/s':>10}{'ratio':>8}{'paired':>8}   each run's tokens/s (paired ratio)")
    print(f"{'bare SAOUpdate loop, broker idle alongside':<44}{bare:>10.0f}{1.0:>8.2f}{'':>8}   "
          f"{' '.join(f'{r:.0f}' for r in bares)}")
    for name, tries in runs.items():
        full, rates = service_rate(tries[best[name]]), [service_rate(t) for t in tries]
        paired = [r / b for r, b in zip(rates, bares)]
        print(f"{name:<44}{full:>10.0f}{full / bare:>8.2f}{np.median(paired):>8.2f}   "
              + " ".join(f"{r:.0f} ({q:.2f})" for r, q in zip(rates, paired))
              + ("   target >= 0.98" if name == paths["defaults"][0] else ""))
    print(f"{'bare SAOUpdate loop, no broker on the machine':<44}{alone:>10.0f}{alone / bare:>8.2f}")
    for name, i in best.items():
        steps = runs[name][i][1:]
        published = list({s["weights/published_version"]: s for s in steps if "weights/bytes" in s}.values())
        published = published if len(published) > 1 else []  # the start's anchor only: nothing published
        print(f"{name.strip()}: train step {np.mean([s['perf/train_s'] for s in steps]):.2f} s; "
              f"per step checkpoint+publish {np.mean([s['perf/step_s'] - s['perf/train_s'] for s in steps]):.3f} s "
              f"(of which the publication's snapshot {np.mean([s['perf/publish_s'] for s in steps]):.3f} s); "
              f"broker CPU {broker_cpu[name][i]:.3f} s per step (the whole run)"
              + (f"; update {np.mean([s['weights/bytes'] for s in published]) / 1e6:.1f} MB, "
                 f"{np.mean([s['weights/inline'] for s in published]):.0%} inline" if published else ""))


if __name__ == "__main__":
    main()

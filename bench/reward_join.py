"""The reward joiner's cost: joined trajectories/s and the latency it adds, against the bare Kafka path.

For 4 KB and 256 KB trajectories: first the bare path (`bench/kafka_path.py`'s produce -> consume,
burst for throughput, paced for latency) on one topic namespace; then, on another, a `sao
reward-join` process holding the trajectories already published to the pending topic while the
rewards are published, burst then paced. Latency through the joiner runs from a reward's produce
to its joined trajectory's consume (two broker hops plus the join); the bare path's is one hop.

Every case first sends a warm-up burst (`--warmup`): a broker started a moment ago spends its
first seconds of load compiling (its JIT threads took ~90 % of its CPU in a first 4 KB burst
through the joiner here; after 8,000 trajectories its CPU per trajectory had fallen 3x), which is
the broker's start-up, not the join. Beside each burst
the CPU seconds each process spent per trajectory (joiners, broker, this client) say which one
is the limit.
Targets (issue 20): >= 2,000 joined/s at 4 KB, joiner p99 <= 2x the bare p99 at 256 KB.
`--profile` also samples the joiner with py-spy through each burst and prints its busy time by layer.
Run: `python bench/reward_join.py [--count 3000 --instances 2 --profile --exactly-once]`; `SAO_KAFKA_BOOTSTRAP` if set
(then the broker's CPU is not reported).
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kafka_path import BYTES_PER_TOKEN, run_case  # noqa: E402
from consumers.rewards import RewardPublisher  # noqa: E402
from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from sao.demo import random_trajectory  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer, make_producer, produce  # noqa: E402
from schemas.messages import Reward  # noqa: E402
from tests.consumers.util import counts, joiner, wait_until  # noqa: E402


@dataclass(kw_only=True)
class RewardJoinConfig:
    """The bursts, the paced runs and the joiners."""

    count: int = 3000
    """trajectories of the 4 KB burst (256 KB: count/10)"""
    warmup: int = 10000
    """trajectories of the 4 KB warm-up burst before each measured one (256 KB: warmup/10)"""
    paced: int = 200
    """trajectories of each paced latency run"""
    instances: int = 1
    """joiner processes sharing the partitions"""
    profile: bool = False
    """sample the joiner with py-spy during each burst"""
    exactly_once: bool = False
    """run the joiner with faust's transactions"""


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes have used so far (Linux /proc)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


LAYERS = (("ours", ("consumers/", "schemas/")), ("faust", ("faust/", "mode/")), ("aiokafka", ("aiokafka/", "kafka/")),
          ("event loop and sockets", ("asyncio/", "selectors", "uvloop/")), ("codecs", ("msgpack/", "numpy/")))


class Profile:
    """py-spy sampling one process while it is in the block, then the share of its busy samples by
    layer (the leaf frame's package): `with Profile(pid):` prints it. py-spy must be installed
    (`pip install py-spy`); it is a measuring tool, not a dependency of the joiner."""

    def __init__(self, pid: int):
        self.pid, self.out = pid, Path(tempfile.mkdtemp(prefix="reward-join-")) / "samples.txt"

    def __enter__(self) -> Profile:
        spy = shutil.which("py-spy")
        if spy is None:
            raise SystemExit("--profile needs py-spy on PATH (pip install py-spy)")
        self.spy = subprocess.Popen([spy, "record", "-p", str(self.pid), "-r", "100", "--nonblocking",
                                     "--format", "raw", "-o", str(self.out)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached
        return self

    def __exit__(self, *exc) -> None:
        self.spy.send_signal(signal.SIGINT)  # py-spy writes its samples when interrupted
        self.spy.wait(60)
        shares, total = {}, 0
        for line in self.out.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            leaf = stack.rsplit(";", 1)[-1]
            layer = next((name for name, marks in LAYERS if any(m in leaf for m in marks)), "other")
            shares[layer] = shares.get(layer, 0) + int(n)
            total += int(n)
        print(f"  joiner CPU by layer ({total} busy samples at 100/s): "
              + ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1])))


class CpuMeter:
    """`with CpuMeter({"joiner": [pid], ...}) as m:` then `m.used[name]`, CPU seconds per group."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = {name: pids for name, pids in groups.items() if pids}

    def __enter__(self) -> CpuMeter:
        self.start = {name: cpu_seconds(pids) for name, pids in self.groups.items()}
        return self

    def __exit__(self, *exc) -> None:
        self.used = {name: cpu_seconds(pids) - self.start[name] for name, pids in self.groups.items()}


def publish_pending(cfg: KafkaConfig, size: int, ids: list[str]) -> None:
    template = random_trajectory(np.random.default_rng(size), size // BYTES_PER_TOKEN)
    template.reward = None
    producer = make_producer(cfg)
    for tid in ids:
        template.id = tid
        produce(producer, cfg.topic(T.PENDING), template.encode(), key=template.key)
    assert producer.flush(120) == 0


def reward_case(cfg: KafkaConfig, ids: list[str], pace_s: float = 0.0) -> dict:
    """Publish a reward for each id; time each joined trajectory's arrival."""
    sent, arrived, assigned, done = {}, {}, threading.Event(), threading.Event()

    def consume():
        consumer = make_consumer(cfg, f"bench-{uuid.uuid4().hex[:8]}", **{"auto.offset.reset": "latest"})
        consumer.subscribe([cfg.topic(T.TRAJECTORIES)], on_assign=lambda c, p: assigned.set())
        try:
            while len(arrived) < len(ids):
                msg = consumer.poll(0.5)
                if msg is not None and not msg.error():
                    arrived.setdefault(msg.key().decode(), time.time())
        finally:
            consumer.close()
            done.set()

    threading.Thread(target=consume, daemon=True).start()
    assigned.wait(60)
    time.sleep(1.0)
    publisher = RewardPublisher(cfg)
    publisher.send(Reward(trajectory_id="warm-up", reward=0.0))  # the producer id, before timing
    publisher.flush()
    t0 = time.time()
    for tid in ids:
        sent[tid] = time.time()
        publisher.send(Reward(trajectory_id=tid, reward=1.0))
        if pace_s:
            time.sleep(pace_s)
    publisher.flush()
    done.wait(300)
    lat = np.array([arrived[i] - sent[i] for i in arrived]) * 1e3
    return {"count": len(arrived), "traj_s": len(arrived) / (max(arrived.values()) - t0),
            "p50": np.percentile(lat, 50), "p99": np.percentile(lat, 99)}


def joined_case(cfg: KafkaConfig, size: int, count: int, warmup: int, paced: int, instances: int,
                cpu: dict[str, list[int]], extra: list[str], profile: bool) -> tuple[dict, dict, dict[str, float]]:
    """(burst, paced, CPU seconds per trajectory of the burst by process) through `instances` joiners."""
    procs = [joiner(cfg, *extra) for _ in range(instances)]
    try:
        for proc, _ in procs:
            wait_until(proc.ready, timeout=120)

        def waiting() -> float:
            return sum(counts(port).get("waiting", 0) for _, port in procs)

        rounds = {name: [f"{name}{i}" for i in range(n)] for name, n in (("w", warmup), ("b", count), ("p", paced))}
        publish_pending(cfg, size, [i for ids in rounds.values() for i in ids])
        wait_until(lambda: waiting() >= sum(map(len, rounds.values())), timeout=300, every=0.5)
        reward_case(cfg, rounds["w"])  # warm-up: the broker's JIT and the joiners' first batches
        with CpuMeter({**cpu, "joiner": [p.p.pid for p, _ in procs]}) as meter, \
                (Profile(procs[0][0].p.pid) if profile else contextlib.nullcontext()):
            burst = reward_case(cfg, rounds["b"])
        return burst, reward_case(cfg, rounds["p"], pace_s=0.02), {k: v / count for k, v in meter.used.items()}
    finally:
        for proc, _ in procs:
            proc.stop()


def main() -> None:
    args = tyro.cli(RewardJoinConfig, description=__doc__)
    broker = None if "SAO_KAFKA_BOOTSTRAP" in os.environ else EmbeddedBroker(BrokerConfig(port=0)).start()
    bootstrap = os.environ.get("SAO_KAFKA_BOOTSTRAP") or broker.bootstrap
    cpu = {"broker": [n.proc.pid for n in broker.nodes] if broker else [], "client": [os.getpid()]}
    print(f"reward_join: {broker.kind if broker else 'external'} broker  [{platform.machine()}, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, {args.instances} joiner(s) "
          f"{'exactly-once' if args.exactly_once else 'at-least-once'}]")
    print(f"{'payload':>9}{'path':>8}{'count':>7}{'traj/s':>9}{'p50 ms':>9}{'p99 ms':>9}   CPU ms per trajectory")
    try:
        for size, scale in ((4 << 10, 1), (256 << 10, 10)):
            count, warmup = max(args.count // scale, 50), args.warmup // scale
            bare_cfg = KafkaConfig(bootstrap=bootstrap, topic_prefix=f"bare{uuid.uuid4().hex[:6]}")
            ensure_topics(bare_cfg)
            run_case(bare_cfg, size, warmup)
            with CpuMeter(cpu) as meter:
                burst = run_case(bare_cfg, size, count)
            rows = {"bare": (burst, run_case(bare_cfg, size, args.paced, pace_s=0.02),
                             {k: v / count for k, v in meter.used.items()})}
            cfg = KafkaConfig(bootstrap=bootstrap, topic_prefix=f"join{uuid.uuid4().hex[:6]}")
            ensure_topics(cfg)
            rows["joiner"] = joined_case(cfg, size, count, warmup, args.paced, args.instances, cpu,
                                         ["--exactly-once"] if args.exactly_once else [], args.profile)
            for path, (b, p, used) in rows.items():
                print(f"{size:>9}{path:>8}{b['count']:>7}{b['traj_s']:>9.0f}{p['p50']:>9.1f}{p['p99']:>9.1f}   "
                      + "  ".join(f"{k} {v * 1e3:.2f}" for k, v in used.items()))
            (jb, jp, _), (bb, bp, _) = rows["joiner"], rows["bare"]
            print(f"{'':>9}{'ratio':>8}{'':>7}{jb['traj_s'] / bb['traj_s']:>9.2f}{jp['p50'] / bp['p50']:>9.2f}"
                  f"{jp['p99'] / bp['p99']:>9.2f}")
    finally:
        if broker:
            broker.close()


if __name__ == "__main__":
    main()

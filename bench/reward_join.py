"""The reward joiner's cost: joined trajectories/s and the latency it adds, against the bare Kafka path.

For 4 KB and 256 KB trajectories: first the bare path (`bench/kafka_path.py`'s produce -> consume,
burst for throughput, paced for latency) on one topic namespace; then, on another, a `sao
reward-join` process holding the trajectories already published to the pending topic while the
rewards are published, burst then paced. Latency through the joiner runs from a reward's produce
to its joined trajectory's consume (two broker hops plus the join); the bare path's is one hop.
Target (issue 11): joiner p99 <= 2x the bare p99, >= 1,000 joined/s at 4 KB.
Run: `python bench/reward_join.py [--count 3000 --exactly-once]`; `SAO_KAFKA_BOOTSTRAP` if set.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kafka_path import BYTES_PER_TOKEN, run_case  # noqa: E402
from consumers.rewards import RewardPublisher  # noqa: E402
from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from sao.demo import random_trajectory  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer, make_producer, produce  # noqa: E402
from schemas.messages import Reward  # noqa: E402
from tests.consumers.util import counts, joiner, wait_until  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=3000, help="trajectories of the 4 KB burst (256 KB: count/10)")
    ap.add_argument("--paced", type=int, default=200, help="trajectories of each paced latency run")
    ap.add_argument("--exactly-once", action="store_true", help="run the joiner with faust's transactions")
    args = ap.parse_args()
    broker = None if "SAO_KAFKA_BOOTSTRAP" in os.environ else EmbeddedBroker(BrokerConfig(port=0)).start()
    bootstrap = os.environ.get("SAO_KAFKA_BOOTSTRAP") or broker.bootstrap
    print(f"reward_join: {broker.kind if broker else 'external'} broker  [{platform.machine()}, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}, joiner "
          f"{'exactly-once' if args.exactly_once else 'at-least-once'}]")
    print(f"{'payload':>9}{'path':>8}{'count':>7}{'traj/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
    try:
        for size, count in ((4 << 10, args.count), (256 << 10, max(args.count // 10, 50))):
            bare_cfg = KafkaConfig(bootstrap=bootstrap, topic_prefix=f"bare{uuid.uuid4().hex[:6]}")
            ensure_topics(bare_cfg)
            burst, paced = run_case(bare_cfg, size, count), run_case(bare_cfg, size, args.paced, pace_s=0.02)
            rows = {"bare": (burst, paced)}
            cfg = KafkaConfig(bootstrap=bootstrap, topic_prefix=f"join{uuid.uuid4().hex[:6]}")
            ensure_topics(cfg)
            proc, port = joiner(cfg, *(["--exactly-once"] if args.exactly_once else []))
            try:
                wait_until(proc.ready, timeout=120)
                burst_ids = [f"b{i}" for i in range(count)]
                paced_ids = [f"p{i}" for i in range(args.paced)]
                publish_pending(cfg, size, burst_ids + paced_ids)
                wait_until(lambda: counts(port).get("waiting", 0) >= count + args.paced, timeout=300, every=0.5)
                rows["joiner"] = (reward_case(cfg, burst_ids), reward_case(cfg, paced_ids, pace_s=0.02))
            finally:
                proc.stop()
            for path, (b, p) in rows.items():
                print(f"{size:>9}{path:>8}{b['count']:>7}{b['traj_s']:>9.0f}{p['p50']:>9.1f}{p['p99']:>9.1f}")
            ratio = rows["joiner"][1]["p99"] / rows["bare"][1]["p99"]
            print(f"{'':>9}{'ratio':>8}{'':>7}{rows['joiner'][0]['traj_s'] / rows['bare'][0]['traj_s']:>9.2f}"
                  f"{rows['joiner'][1]['p50'] / rows['bare'][1]['p50']:>9.2f}{ratio:>9.2f}")
    finally:
        if broker:
            broker.close()


if __name__ == "__main__":
    main()

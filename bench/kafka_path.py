"""Trajectories through the embedded broker: throughput and produce -> consume latency.

For 4 KB and 256 KB trajectories, an idempotent producer (acks=all, lz4) publishes while a
consumer in another thread decodes each message. Throughput (trajectories/s, MB/s) comes from a
burst as fast as the producer goes; latency p50/p99 (encode -> produce -> broker -> fetch ->
decode) from a paced run at one trajectory per 20 ms, so it measures the path, not a queue.
Uses `SAO_KAFKA_BOOTSTRAP` if set.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from sao.demo import random_trajectory  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer, make_producer, produce  # noqa: E402
from schemas.messages import Trajectory  # noqa: E402

BYTES_PER_TOKEN = 13  # int32 token + uint8 mask + float32 log-prob + int32 version


def run_case(cfg: KafkaConfig, size: int, count: int, pace_s: float = 0.0) -> dict:
    topic = cfg.topic(T.TRAJECTORIES)
    latencies, done = [], threading.Event()
    assigned = threading.Event()

    def consume():
        consumer = make_consumer(cfg, f"bench-{uuid.uuid4().hex[:8]}", **{"auto.offset.reset": "latest"})
        consumer.subscribe([topic], on_assign=lambda c, parts: assigned.set())
        try:
            while len(latencies) < count:
                msg = consumer.poll(0.5)
                if msg is None or msg.error():
                    continue
                traj = Trajectory.decode(msg.value())
                latencies.append(time.time() - traj.timing["sent"])
        finally:
            consumer.close()
            done.set()

    threading.Thread(target=consume, daemon=True).start()
    assigned.wait(60)
    time.sleep(1.0)  # let the consumer's first fetch position settle at the log end
    rng = np.random.default_rng(size)
    template = random_trajectory(rng, size // BYTES_PER_TOKEN)
    producer = make_producer(cfg)
    # an idempotent producer's first send waits for its producer id; acquire it before timing
    produce(producer, cfg.topic(T.PROMPTS), b"warm-up")
    producer.flush(60)
    t0 = time.perf_counter()
    nbytes = 0
    for i in range(count):
        template.id = f"t{i}"
        template.timing = {"sent": time.time()}
        data = template.encode()
        nbytes += len(data)
        produce(producer, topic, data, key=template.key)
        if pace_s:
            time.sleep(pace_s)
    producer.flush(120)
    done.wait(300)
    elapsed = time.perf_counter() - t0
    lat = np.array(latencies) * 1e3
    return {"size": len(data), "count": len(latencies), "traj_s": len(latencies) / elapsed,
            "mb_s": nbytes / elapsed / 1e6, "p50": np.percentile(lat, 50), "p99": np.percentile(lat, 99)}


def main() -> None:
    broker = None
    if "SAO_KAFKA_BOOTSTRAP" in os.environ:
        bootstrap = os.environ["SAO_KAFKA_BOOTSTRAP"]
    else:
        broker = EmbeddedBroker(BrokerConfig(port=0)).start()
        bootstrap = broker.bootstrap
    try:
        cfg = KafkaConfig(bootstrap=bootstrap, topic_prefix=f"bench{uuid.uuid4().hex[:6]}")
        ensure_topics(cfg)
        print(f"kafka_path: {broker.kind if broker else 'external'} broker at {bootstrap}  "
              f"[{platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}]")
        print(f"{'payload':>9}{'count':>7}{'traj/s':>10}{'MB/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
        for size, count in ((4 << 10, 5000), (256 << 10, 400)):
            burst, paced = run_case(cfg, size, count), run_case(cfg, size, 200, pace_s=0.02)
            print(f"{burst['size']:>9}{burst['count']:>7}{burst['traj_s']:>10.0f}{burst['mb_s']:>9.1f}"
                  f"{paced['p50']:>9.1f}{paced['p99']:>9.1f}")
    finally:
        if broker:
            broker.close()


if __name__ == "__main__":
    main()

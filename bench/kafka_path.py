"""Trajectories through the embedded broker: throughput and produce -> consume latency.

For 4 KB and 256 KB trajectories, an idempotent producer (acks=all, lz4) publishes while a
consumer in another thread decodes each message. Throughput (trajectories/s, MB/s) comes from a
burst as fast as the producer goes; latency p50/p99 (encode -> produce -> broker -> fetch ->
decode) from a paced run at one trajectory per 20 ms, so it measures the path, not a queue.

Twice in one run: on an open broker, then on a secured one (`sao broker --secure`: TLS,
SASL/SCRAM-SHA-512, ACLs), the producer and the learner each as its own principal, so the last
lines are what security costs on this path. Uses `SAO_KAFKA_BOOTSTRAP` instead if set (once, as
its settings say).
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

from sao import access  # noqa: E402
from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from sao.demo import random_trajectory  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer, make_producer, produce  # noqa: E402
from schemas.messages import Trajectory  # noqa: E402

BYTES_PER_TOKEN = 13  # int32 token + uint8 mask + float32 log-prob + int32 version


def run_case(send: KafkaConfig, receive: KafkaConfig, group: str, size: int, count: int, pace_s: float = 0.0) -> dict:
    """`send` publishes, `receive` consumes in `group`: the producer's and the learner's clients."""
    topic = send.topic(T.TRAJECTORIES)
    latencies, done = [], threading.Event()
    assigned = threading.Event()

    def consume():
        consumer = make_consumer(receive, group, **{"auto.offset.reset": "latest"})
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
    producer = make_producer(send)
    # an idempotent producer's first send waits for its producer id; acquire it before timing
    # (on sao.dlq, which every principal may write and nobody here reads)
    produce(producer, send.topic(T.DLQ), b"warm-up")
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


def clients(broker: EmbeddedBroker | None, bootstrap: str) -> tuple[KafkaConfig, KafkaConfig, str]:
    """(the sender's config, the receiver's, its group): one open config, or on a secured broker
    the `producer` and `learner` principals on the topics their ACLs name."""
    if broker is None or broker.security is None:
        cfg = KafkaConfig(bootstrap=bootstrap, topic_prefix=f"bench{uuid.uuid4().hex[:6]}")
        ensure_topics(cfg)
        return cfg, cfg, f"bench-{uuid.uuid4().hex[:8]}"

    def principal(name: str) -> KafkaConfig:
        return KafkaConfig(bootstrap=bootstrap, settings=access.client_settings(name, broker.security.ca),
                           password_file=str(access.password_file(broker.access_dir, name)))
    return principal("producer"), principal("learner"), "sao-learner"


def measure(broker: EmbeddedBroker | None, bootstrap: str) -> list[tuple[dict, dict]]:
    send, receive, group = clients(broker, bootstrap)
    kind = "external" if broker is None else f"{broker.kind}, {'secured' if broker.security else 'open'}"
    print(f"kafka_path: {kind} broker at {bootstrap}  [{platform.machine()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d')}]")
    print(f"{'payload':>9}{'count':>7}{'traj/s':>10}{'MB/s':>9}{'p50 ms':>9}{'p99 ms':>9}")
    rows = []
    for size, count in ((4 << 10, 5000), (256 << 10, 400)):
        burst = run_case(send, receive, group, size, count)
        paced = run_case(send, receive, group, size, 200, pace_s=0.02)
        print(f"{burst['size']:>9}{burst['count']:>7}{burst['traj_s']:>10.0f}{burst['mb_s']:>9.1f}"
              f"{paced['p50']:>9.1f}{paced['p99']:>9.1f}")
        rows.append((burst, paced))
    return rows


def main() -> None:
    if "SAO_KAFKA_BOOTSTRAP" in os.environ:
        measure(None, os.environ["SAO_KAFKA_BOOTSTRAP"])
        return
    results = {}
    for secure in (False, True):
        with EmbeddedBroker(BrokerConfig(port=0, secure=secure)) as broker:
            results[secure] = measure(broker, broker.bootstrap)
    print("secured / open (TLS + SASL/SCRAM + ACLs against plaintext, same run):")
    for (open_burst, open_paced), (sec_burst, sec_paced) in zip(results[False], results[True]):
        print(f"  {open_burst['size']:>7} B: throughput x{sec_burst['traj_s'] / open_burst['traj_s']:.2f}, "
              f"latency p50 x{sec_paced['p50'] / open_paced['p50']:.2f}, p99 x{sec_paced['p99'] / open_paced['p99']:.2f}")


if __name__ == "__main__":
    main()

"""A visible produce -> consume round trip of trajectories through the embedded broker.

Starts Apache Kafka (unless `--kafka.bootstrap` or `SAO_KAFKA_BOOTSTRAP` names a cluster), creates every topic,
publishes random trajectories and reads them back, checking each is byte-identical.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from schemas import topics as T
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer, make_producer, produce
from schemas.messages import Trajectory, decode
from sao.broker import BrokerConfig, cluster, embedded_unless_named


@dataclass(kw_only=True)
class DemoConfig:
    trajectories: int = 20
    """How many trajectories to send round trip."""
    max_tokens: int = 4096
    """Longest random trajectory."""
    kafka: KafkaConfig = field(default_factory=embedded_unless_named)
    """The cluster; an empty `--kafka.bootstrap` (the default) starts an embedded broker."""
    broker: BrokerConfig = field(default_factory=lambda: BrokerConfig(port=0))


def random_trajectory(rng: np.random.Generator, n: int, i: int = 0) -> Trajectory:
    prompt_len = int(rng.integers(0, n + 1))
    mask = np.zeros(n, np.uint8)
    mask[prompt_len:] = rng.integers(0, 2, n - prompt_len)
    return Trajectory(
        id=f"traj-{i}", prompt_id=f"prompt-{i}", env="demo", producer_id="demo",
        tokens=rng.integers(0, 50_000, n, dtype=np.int32), action_mask=mask,
        rollout_logprobs=np.where(mask == 1, -rng.exponential(1.0, n), 0.0).astype(np.float32),
        versions=np.where(mask == 1, 0, -1).astype(np.int32), prompt_len=prompt_len,
        reward=float(rng.random()), num_turns=1)


def round_trip(cfg: DemoConfig) -> None:
    ensure_topics(cfg.kafka)
    topic = cfg.kafka.topic(T.TRAJECTORIES)
    rng = np.random.default_rng(0)
    sent = {}
    producer = make_producer(cfg.kafka)
    try:
        for i in range(cfg.trajectories):
            traj = random_trajectory(rng, int(rng.integers(1, cfg.max_tokens + 1)), i)
            traj.id = f"demo-{time.time_ns()}-{i}"
            sent[traj.id] = traj.encode()
            produce(producer, topic, sent[traj.id], key=traj.key)
            print(f"produced {traj.id}: {traj.num_tokens} tokens, {len(sent[traj.id])} bytes", flush=True)
        assert producer.flush(30) == 0, "undelivered trajectories"
    finally:
        producer.flush(30)
    consumer = make_consumer(cfg.kafka, f"sao-demo-{time.time_ns()}")
    consumer.subscribe([topic])
    try:
        deadline = time.monotonic() + 60
        while sent and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is None or msg.error():
                continue
            traj = decode(msg.value())
            if sent.pop(traj.id, None) == msg.value():
                print(f"consumed {traj.id} from partition {msg.partition()} offset {msg.offset()}: "
                      f"byte-identical, reward {traj.reward:.3f}", flush=True)
    finally:
        consumer.close()
    if sent:
        raise SystemExit(f"{len(sent)} trajectories did not come back")
    print(f"round trip OK: {cfg.trajectories} trajectories", flush=True)


def run(cfg: DemoConfig) -> None:
    with cluster(cfg.kafka, cfg.broker):
        round_trip(cfg)

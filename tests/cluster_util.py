"""Helpers of the tests that run a replicated cluster: what a topic's replication is."""

from __future__ import annotations

import time

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, ConfigResource

from schemas import topics as T
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer
from schemas.retry import retrying


def replication(bootstrap: str) -> dict[str, tuple[int, str]]:
    """topic -> (replicas of its partition 0, min.insync.replicas), for every topic of a fresh
    prefix and for the group offsets' topic."""
    cfg = KafkaConfig(bootstrap=bootstrap, topic_prefix="repl", settings={})
    ensure_topics(cfg)
    consumer = make_consumer(cfg, "finds-its-coordinator")  # which creates the group offsets' topic
    retrying(lambda: consumer.committed([TopicPartition(cfg.topic(T.PROMPTS), 0)], timeout=10))
    consumer.close()
    admin = AdminClient(cfg.client())
    names = [cfg.topic(t) for t in T.ALL] + ["__consumer_offsets"]
    md, configs = _described(admin, names)
    return {n: (len(md.topics[n].partitions[0].replicas), configs[n]["min.insync.replicas"].value) for n in names}


def _described(admin: AdminClient, names: list[str], timeout: float = 60.0):
    """(cluster metadata, topic -> configs) once the brokers asked know every topic of `names`:
    a topic created by one node (the group offsets' topic, by its coordinator) reaches the others a
    moment apart, and metadata and configs may be answered by different nodes."""
    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(timeout=30)
        missing = [n for n in names if n not in md.topics or not md.topics[n].partitions]
        if not missing:
            try:
                described = admin.describe_configs([ConfigResource("topic", n) for n in names])
                return md, {res.name: f.result() for res, f in described.items()}
            except KafkaException as e:
                if e.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise
                missing = [f"configs of {e.args[0].str()}"]
        if time.monotonic() > deadline:
            raise AssertionError(f"not known after {timeout:.0f} s: {missing}")
        time.sleep(0.5)

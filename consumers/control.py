"""The judges' control topic: `sao judge set-criterion` publishes, every running judge follows.

One partition keeps the switches ordered; every judge reads all of it (no shared group) and starts
from the last message, so a judge started after a switch uses the switched criterion. The topic
and its message are the judges' own protocol, not read by anything else, so they live here rather
than in `schemas/`; they move there if another package ever reads them.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import msgpack
from confluent_kafka import OFFSET_BEGINNING, KafkaException, TopicPartition

from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, consumer_error, ensure_topics, make_consumer, make_producer, produce_and_wait
from schemas.retry import retrying

CONTROL = T.Topic("judge.control", 1)


def encode(criterion: str) -> bytes:
    return msgpack.packb({"kind": "judge_criterion", "criterion": criterion, "created_at": time.time()})


def decode(data: bytes) -> str | None:
    """The criterion a control message sets; None for anything else (ignored, not fatal)."""
    try:
        m = msgpack.unpackb(data)
    except (ValueError, msgpack.UnpackException):
        return None
    ok = isinstance(m, dict) and m.get("kind") == "judge_criterion" and isinstance(m.get("criterion"), str)
    return m["criterion"] if ok else None


def set_criterion(kafka: KafkaConfig, criterion: str) -> None:
    ensure_topics(kafka, (CONTROL,))
    producer = make_producer(kafka)
    try:
        err = produce_and_wait(producer, kafka.topic(CONTROL), encode(criterion), b"criterion", timeout=30)
    except TimeoutError:
        raise TimeoutError("criterion switch not acknowledged by the broker within 30 s") from None
    if err is not None:
        raise KafkaException(err)


class CriterionFollower:
    """Reads the control topic; `latest()` is the criterion last set, or None if never set."""

    def __init__(self, kafka: KafkaConfig):
        ensure_topics(kafka, (CONTROL,))
        self.consumer = make_consumer(kafka, f"judge-control-{uuid.uuid4().hex[:8]}")
        topic = kafka.topic(CONTROL)
        # retried: a control topic created an instant ago is not in every broker's metadata yet
        _, high = retrying(lambda: self.consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10))
        # the last message is the state; earlier ones are history
        self.consumer.assign([TopicPartition(topic, 0, high - 1 if high > 0 else OFFSET_BEGINNING)])
        self.current: str | None = None

    def latest(self) -> str | None:
        while (msg := self.consumer.poll(0)) is not None:
            if not consumer_error(msg):
                self.current = decode(msg.value() or b"") or self.current
        return self.current

    def close(self) -> None:
        self.consumer.close()


@dataclass(kw_only=True)
class CriterionConfig:
    criterion: str = ""
    """The criterion every running judge switches to (a style name for the style judge); required."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)


def run(cfg: CriterionConfig) -> None:
    if not cfg.criterion:
        raise ConfigError("--criterion is required")
    set_criterion(cfg.kafka, cfg.criterion)
    print(f"judges switch to criterion {cfg.criterion!r} ({cfg.kafka.topic(CONTROL)})")

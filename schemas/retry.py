"""Admin-style Kafka reads (watermarks, a group's committed offsets) that ride out transient
broker states: a just-created topic electing its leader, a group coordinator still loading."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import KafkaError, KafkaException

R = TypeVar("R")

# not all flagged retriable by librdkafka, yet transient right after topics or groups appear
TRANSIENT = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
             KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION,
             KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
             KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError._TIMED_OUT}


def retrying(call: Callable[[], R], timeout: float = 60.0) -> R:
    """`call()`, retried with a bounded backoff while it fails with a transient Kafka error."""
    deadline, backoff = time.monotonic() + timeout, 0.1
    while True:
        try:
            return call()
        except KafkaException as e:
            err = e.args[0]
            if err.code() not in TRANSIENT and not err.retriable() or time.monotonic() > deadline:
                raise
            time.sleep(backoff)
            backoff = min(2 * backoff, 2.0)

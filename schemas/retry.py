"""The one rule for Kafka errors outside the clients' own retries: which are transient (retried with
a bounded backoff, `retrying`) and which are not (the caller stops with a clear message).

Transient: a just-created topic electing its leader, a leader or group coordinator moving to
another broker or still loading, a new leader whose high watermark has not caught up yet (its
offsets are withheld until it has), a broker down or unreachable for a while, a request timing out,
a consumer group rebalancing under a commit. Everything else (authentication, authorisation, a
topic that does not exist, a fatal client error) is not worth a retry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from confluent_kafka import KafkaError, KafkaException

R = TypeVar("R")

# not all flagged retriable by librdkafka, yet transient while topics, leaders or groups move
TRANSIENT = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
             KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_PARTITION,
             KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_NOT_AVAILABLE,
             KafkaError.COORDINATOR_LOAD_IN_PROGRESS, KafkaError._WAIT_COORD, KafkaError._TIMED_OUT,
             KafkaError._MSG_TIMED_OUT,
             KafkaError.REQUEST_TIMED_OUT, KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN,
             KafkaError._DESTROY_BROKER,
             KafkaError.NOT_ENOUGH_REPLICAS, KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND,
             KafkaError.OFFSET_NOT_AVAILABLE, KafkaError.FENCED_LEADER_EPOCH, KafkaError.UNKNOWN_LEADER_EPOCH,
             KafkaError.REBALANCE_IN_PROGRESS, KafkaError.ILLEGAL_GENERATION, KafkaError.UNKNOWN_MEMBER_ID}


OUTAGE_S = 300.0
"""How long a broker outage only delays work: the horizon of librdkafka's own retries (a produce
fails after `message.timeout.ms`, 5 minutes by default), and so that of `retrying`. Past it, a
service stops with the error, as it does at once on a fatal one."""


def transient(err: KafkaError) -> bool:
    """Whether waiting and trying again can fix `err`."""
    return not err.fatal() and (err.code() in TRANSIENT or err.retriable())


def retrying(call: Callable[[], R], timeout: float = OUTAGE_S) -> R:
    """`call()`, retried with a bounded backoff while it fails with a transient Kafka error, for up
    to `timeout` seconds."""
    deadline, backoff = time.monotonic() + timeout, 0.1
    while True:
        try:
            return call()
        except KafkaException as e:
            if not transient(e.args[0]) or time.monotonic() > deadline:
                raise
            time.sleep(backoff)
            backoff = min(2 * backoff, 2.0)

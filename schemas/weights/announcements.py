"""Announcements on `sao.weights` as Kafka carries them: the learner's `announcer` and the version it
goes on from (`newest_announced`), a follower's reader of the one partition (`weights_reader`), the
tail back to its newest anchors (`read_backlog`), each message decoded and, with trusted keys,
verified (`decode_announcement`), and the learner's store folder found through them (`learner_store`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from confluent_kafka import OFFSET_BEGINNING, TopicPartition

from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, consumer_error, make_consumer, produce_and_wait, read_ranges
from schemas.messages import SchemaError, Weights
from schemas.retry import retrying
from schemas.signing import refusal
from schemas.weights.chain import WeightsError, local_path

log = logging.getLogger(__name__)


def announcer(producer, topic: str, timeout_s: float = 60.0) -> Callable[[Weights], None]:
    """Produce an announcement and return once the broker has it; raise if it does not."""
    def announce(w: Weights) -> None:
        try:
            err = produce_and_wait(producer, topic, w.encode(), w.key, timeout=timeout_s)
        except TimeoutError as e:
            err = e
        if err is not None:
            raise RuntimeError(f"weights announcement v{w.version} not delivered within {timeout_s} s: {err}")
    return announce


def newest_announced(kafka: KafkaConfig, tail: int = 16) -> int:
    """The highest version among the last `tail` announcements on sao.weights, -1 if none: versions
    only increase along the topic, so this is the newest any producer may hold."""
    consumer = make_consumer(kafka, f"{kafka.topic_prefix}-versions-{uuid.uuid4().hex}")
    try:
        tp = TopicPartition(kafka.topic(T.WEIGHTS), 0)
        low, high = retrying(lambda: consumer.get_watermark_offsets(tp, timeout=5, cached=False))
        newest = -1
        try:
            for msg in read_ranges(consumer, tp.topic, {0: (max(low, high - tail), high)}, timeout=30):
                try:
                    newest = max(newest, Weights.decode(msg.value() or b"").version)
                except SchemaError:
                    pass  # not an announcement this learner can read: it names no version
        except TimeoutError as e:
            log.warning("newest announced version: %s; going by version %d", e, newest)
        return newest
    finally:
        consumer.close()


def weights_reader(kafka: KafkaConfig):
    """A consumer of `sao.weights` (one partition) from its beginning, in no group of its own
    that others share: every reader sees every announcement."""
    consumer = make_consumer(kafka, f"sao-weights-{uuid.uuid4().hex}")
    consumer.assign([TopicPartition(kafka.topic(T.WEIGHTS), 0, OFFSET_BEGINNING)])
    return consumer


def read_backlog(consumer, keep_anchors: int, decode: Callable[[object], Weights | None], stop: threading.Event,
                 poll_s: float) -> list[Weights]:
    """The announcements at the end of `consumer`'s one partition, back to the `keep_anchors`-th
    newest anchor (or the beginning), read newest window first, each offset once, each message
    through `decode` (None: skipped); the consumer is left at the end for a live loop."""
    tp = consumer.assignment()[0]
    low, high = retrying(lambda: consumer.get_watermark_offsets(tp, timeout=5, cached=False))
    got, end, window = [], high, 64
    while end > low and sum(w.base < 0 for w in got) < keep_anchors and not stop.is_set():
        start = max(low, end - window)
        msgs = read_ranges(consumer, tp.topic, {0: (start, end)}, stop=stop, poll_s=poll_s)
        got = [w for msg in msgs if (w := decode(msg)) is not None] + got
        end, window = start, 4 * window
    consumer.assign([TopicPartition(tp.topic, 0, high)])
    return got


def decode_announcement(msg, trusted: dict | None = None) -> tuple[Weights | None, str]:
    """(the announcement `msg` holds if it may be acted on, else None; "" or why not: `invalid`,
    or with `trusted` keys `unsigned`, `untrusted`, `forged` (schemas/signing.py)). No message or a
    transient error is (None, ""). A refused one is logged, not dead-lettered (every reader of the
    topic reads it: each would send its own copy)."""
    if msg is None or consumer_error(msg):
        return None, ""
    try:
        w = Weights.decode(msg.value() or b"")
    except SchemaError as e:
        log.error("invalid weights announcement at offset %d: %s", msg.offset(), e)
        return None, "invalid"
    if trusted is not None and (why := refusal(w, trusted)):
        log.error("weights announcement of version %d at offset %d refused: %s (key %s)", w.version,
                  msg.offset(), why, w.key_id or "none")
        return None, why
    return w, ""


def learner_store(kafka: KafkaConfig, stop: threading.Event, poll_s: float = 0.5,
                  trusted: dict | None = None) -> Path | None:
    """The learner's weight store folder, found through its first announcement on `sao.weights`
    (waiting for one: a producer may start before the learner); None once `stop` is set. The
    folder holds the `config.json` and `model.json` the learner writes at start (schemas/weights/store.py)."""
    consumer, next_log = weights_reader(kafka), time.monotonic()
    try:
        while not stop.is_set():
            msg = consumer.poll(poll_s)
            if msg is None or consumer_error(msg):
                if time.monotonic() >= next_log:
                    log.info("--model learner: waiting for the learner's first weights on %s", kafka.topic(T.WEIGHTS))
                    next_log += 30
                continue
            w, refused = decode_announcement(msg, trusted)  # with trusted keys, only the learner names its store
            if w is None:
                continue
            try:
                folder = local_path(w.store)
            except WeightsError as e:
                log.error("weights announcement at offset %d unusable: %s", msg.offset(), e)
                continue
            if (folder / "config.json").is_file() and (folder / "model.json").is_file():
                return folder
            raise ConfigError(f"--model learner: {folder} has no config.json and model.json; is the learner's "
                              "weights dir shared with this producer, and is the learner up to date?")
        return None
    finally:
        consumer.close()

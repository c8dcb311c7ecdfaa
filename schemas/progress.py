"""How far a consumer group is behind on a topic, read from Kafka alone, and the learner's progress
there: what the feeder's and producers' backpressure go by.

`GroupLag(kafka, topic, group).count()` is the messages of `topic` that `group` has not committed
past: Σ over partitions (high watermark − committed offset), a partition the group never committed
counted from its low watermark. The reader never joins the group (it only asks for its offsets).

The learner's own group commits only with a durable checkpoint (exactly once, learner/source.py),
every `--checkpoint-every` steps, too seldom to steer by; so after every step, and while it waits
for the rest of one, it also commits the positions it has read to a second group,
`<prefix>-learner-progress`, that nothing consumes with: `learner_lag(kafka)` is then the
trajectories on the topic it has not read yet (those a partial step holds, and those dead-lettered
or dropped as stale or duplicate, count as read).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from confluent_kafka import KafkaException, TopicPartition

from . import topics as T
from .kafka import KafkaConfig, make_consumer
from .retry import retrying

log = logging.getLogger(__name__)


def progress_group(kafka: KafkaConfig) -> str:
    """The group the learner commits its consumed positions to after every step (no member)."""
    return f"{kafka.topic_prefix}-learner-progress"


def unread_ranges(high: Mapping[int, int], low: Mapping[int, int],
                  committed: Mapping[int, int]) -> dict[int, tuple[int, int]]:
    """(first offset past the group's commit, high watermark) of each partition; a partition the
    group never committed (a negative offset), or whose commit retention deleted, from its low
    watermark."""
    return {p: (max(committed.get(p, -1), low.get(p, 0)), h) for p, h in high.items()}


def unfinished(high: Mapping[int, int], low: Mapping[int, int], committed: Mapping[int, int]) -> int:
    """Messages past the group's commits, over partitions."""
    return sum(h - start for start, h in unread_ranges(high, low, committed).values())


class GroupLag:
    """Reads how far one group is behind on one topic."""

    def __init__(self, kafka: KafkaConfig, topic: T.Topic, group: str):
        self.topic = kafka.topic(topic)
        self.consumer = make_consumer(kafka, group)  # never subscribes: reads the group's commits only
        parts = retrying(lambda: self.consumer.list_topics(self.topic, timeout=30)).topics[self.topic].partitions
        self.tps = [TopicPartition(self.topic, p) for p in sorted(parts)]

    def watermarks(self) -> dict[int, tuple[int, int]]:
        """(low, high) of every partition."""
        return {tp.partition: retrying(lambda: self.consumer.get_watermark_offsets(tp, timeout=5, cached=False))
                for tp in self.tps}

    def committed(self) -> list[TopicPartition]:
        return retrying(lambda: self.consumer.committed(self.tps, timeout=10))

    def _offsets(self) -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
        """(high, low, committed) of every partition."""
        marks = self.watermarks()
        committed = {tp.partition: tp.offset for tp in self.committed()}
        return {p: h for p, (_, h) in marks.items()}, {p: lo for p, (lo, _) in marks.items()}, committed

    def count(self) -> int:
        return unfinished(*self._offsets())

    def unread(self) -> dict[int, tuple[int, int]]:
        """(first offset past the group's commit, high watermark) of every partition."""
        return unread_ranges(*self._offsets())

    def close(self) -> None:
        self.consumer.close()


def learner_lag(kafka: KafkaConfig) -> GroupLag:
    """Trajectories the learner has not consumed yet (`.count()`), from its progress commits."""
    return GroupLag(kafka, T.TRAJECTORIES, progress_group(kafka))


class Backpressure:
    """`held` while the learner has `max_lag` or more trajectories left to consume, refreshed by a
    daemon thread every `every_s` (a producer's event loop never waits on the broker for it). A
    learner that is down holds its producers until it is back; a broker that does not answer
    leaves the last reading in place."""

    def __init__(self, kafka: KafkaConfig, max_lag: int, every_s: float = 1.0):
        self.max_lag, self.every_s = max_lag, every_s
        self.held, self.lag = False, 0
        self._stop = threading.Event()
        self._lag = learner_lag(kafka)
        self._thread = threading.Thread(target=self._run, name="backpressure", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.lag = self._lag.count()
            except KafkaException as e:
                log.warning("backpressure: learner lag unknown (%s); keeping the last reading", e.args[0])
                continue
            if (self.lag >= self.max_lag) != self.held:
                log.info("%s: the learner has %d trajectories left to consume (--max-lag %d)",
                         "holding new prompts" if not self.held else "taking prompts again", self.lag, self.max_lag)
            self.held = self.lag >= self.max_lag

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self.every_s + 30)
        self._lag.close()

"""Which prompt offsets a producer may commit when episodes finish out of order.

A producer with N episodes in flight delivers their trajectories in whatever order they finish.
Kafka keeps one committed position per partition, meaning "everything before this is done", so
the position may only move to the end of the contiguous prefix of delivered prompts: with
offsets 5, 6, 7 taken and 7 delivered first, nothing moves; once 5 is delivered the position is
6; once 6 is, 8. A producer killed at any moment has committed no undelivered prompt, and the
group hands every prompt past the position to another member (at least once; a prompt delivered
twice yields the same trajectory id, which the learner drops).
"""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException, TopicPartition

log = logging.getLogger(__name__)


class PromptOffsets:
    """Per-partition record of taken and delivered offsets; all calls on one thread."""

    def __init__(self):
        self._taken: dict[int, dict[int, bool]] = {}  # partition -> {offset: delivered}, in take order

    def take(self, partition: int, offset: int) -> None:
        self._taken.setdefault(partition, {})[offset] = False

    def deliver(self, partition: int, offset: int) -> int | None:
        """Mark a taken offset delivered; returns the partition's new commit position (the offset
        after the contiguous delivered prefix) when it moved, else None. Offsets of a partition
        revoked meanwhile are ignored."""
        taken = self._taken.get(partition)
        if taken is None or offset not in taken:
            return None
        taken[offset] = True
        position = None
        while taken and taken[first := next(iter(taken))]:  # offsets were taken in increasing order
            del taken[first]
            position = first + 1
        return position

    def forget(self, partition: int) -> None:
        """The partition was revoked or lost: its episodes' outcomes no longer move anything."""
        self._taken.pop(partition, None)


class OffsetCommitter:
    """The prompts topic's commit positions on the consumer, moved only over delivered prompts."""

    def __init__(self, consumer, topic: str):
        self.consumer, self.topic = consumer, topic
        self.taken = PromptOffsets()
        self.positions: dict[int, int] = {}  # partition -> last position computed

    def take(self, partition: int, offset: int) -> None:
        self.taken.take(partition, offset)

    def deliver(self, partition: int, offset: int) -> None:
        position = self.taken.deliver(partition, offset)
        if position is not None:
            self.positions[partition] = position
            self.consumer.commit(offsets=[TopicPartition(self.topic, partition, position)], asynchronous=True)

    def commit(self, partitions) -> None:
        """Commit the positions of `partitions` synchronously; a failure means a replay (at least once)."""
        offsets = [TopicPartition(self.topic, p, self.positions[p]) for p in partitions if p in self.positions]
        if offsets:
            try:
                self.consumer.commit(offsets=offsets, asynchronous=False)
            except KafkaException as e:
                log.warning("offset commit failed (%s); prompts may be replayed", e.args[0])

    def forget(self, partitions) -> None:
        for p in partitions:
            self.taken.forget(p)
            self.positions.pop(p, None)

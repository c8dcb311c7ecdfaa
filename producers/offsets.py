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
    """The prompts topic's commit positions on the consumer, moved only over delivered prompts.

    Commits are asynchronous, and one the broker refuses (its group coordinator still loading, or
    just moved to another node) is sent again: nothing else would, since the next commit waits for
    the next prompt, and a feeder holding prompts until these are committed would then wait forever.
    The consumer must be made with `on_commit=committer.on_commit`, so `consumer` is set after."""

    RETRY_S = 1.0
    """Least seconds between two resends of refused commits (a loading coordinator refuses them all)."""

    def __init__(self, topic: str):
        self.consumer, self.topic = None, topic
        self.taken = PromptOffsets()
        self.positions: dict[int, int] = {}  # partition -> last position computed
        self.refused: set[int] = set()  # partitions whose last commit the broker did not take
        self.resent_at = 0.0

    def take(self, partition: int, offset: int) -> None:
        self.taken.take(partition, offset)

    def deliver(self, partition: int, offset: int) -> None:
        position = self.taken.deliver(partition, offset)
        if position is not None:
            self.positions[partition] = position
            self.consumer.commit(offsets=[TopicPartition(self.topic, partition, position)], asynchronous=True)

    def on_commit(self, err, partitions: list[TopicPartition]) -> None:
        """The consumer's commit callback (runs inside its poll, on the service's thread)."""
        mine = [tp for tp in partitions if tp.topic == self.topic]
        errors = [err] if err is not None else [tp.error for tp in mine if tp.error is not None]
        if errors:
            log.warning("offset commit refused (%s); sending it again", errors[0])
            self.refused |= {tp.partition for tp in mine}

    def resend_refused(self, now: float) -> None:
        """Commit again the current positions of partitions whose commit was refused (call often)."""
        if not self.refused or now - self.resent_at < self.RETRY_S:
            return
        offsets = [TopicPartition(self.topic, p, self.positions[p]) for p in sorted(self.refused) if p in self.positions]
        self.refused.clear()
        self.resent_at = now
        if offsets:
            self.consumer.commit(offsets=offsets, asynchronous=True)

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
            self.refused.discard(p)

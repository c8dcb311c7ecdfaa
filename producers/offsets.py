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
import threading

from confluent_kafka import KafkaException, TopicPartition

from schemas.progress import GroupLag

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


class StalledFetches:
    """Restarts prompt partitions the Kafka client has stopped fetching.

    librdkafka can leave an assigned partition unfetched for good, with no error and no log line: a
    pause or resume that races the fetch start of a fresh assignment makes that start outdated, and
    it is dropped (confluentinc/librdkafka#2190 and #5591, both open). A rebalance after a broker
    restart, with every slot filling at once, is such a race. That partition's prompts would then
    never be played, and a feeder holding new prompts until those finish would stall the run.

    So the service reports, as it loops, whether it has a free slot. A partition whose position has
    not moved for `stall_s` seconds of free slots (with a free slot, a fetched prompt is taken within
    one poll) while the broker holds prompts past it is resumed and sought to the next prompt it
    owes: its position, or its committed offset when it has read nothing since it was assigned (the
    maintainer's workaround for #2190). What the broker holds (`lag`: the group's commits and the
    watermarks) is read by a daemon thread, so the service's loop never waits on the broker."""

    def __init__(self, consumer, lag: GroupLag, stall_s: float):
        self.consumer, self.lag, self.stall_s = consumer, lag, stall_s
        self.free_s = 0.0  # seconds with a free slot, summed over the service's life
        self.last: float | None = None  # when the last tick came
        self.next_check_s = 0.0
        self.moved: dict[int, tuple[int, float]] = {}  # partition -> (position, free_s when it last moved)
        self.waiting: dict[int, tuple[int, int]] = {}  # partition -> (first offset past the commit, end), at the last read
        self.restarted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="stalled-fetches", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while True:
            try:
                self.waiting = self.lag.unread()
            except KafkaException as e:  # a broker away: keep the last reading
                log.debug("prompts partitions' offsets unknown (%s)", e.args[0])
            if self._stop.wait(self.stall_s / 4):
                return

    def tick(self, free: bool, now: float) -> None:
        """Called on every pass of the service's loop; checks every `stall_s` / 4 seconds of free slots."""
        if self.last is not None and free:
            self.free_s += now - self.last
        self.last = now
        if self.free_s >= self.next_check_s:
            self.next_check_s = self.free_s + self.stall_s / 4
            self.check()

    def check(self) -> None:
        """Restart the stalled partitions."""
        assigned = [tp for tp in self.consumer.assignment() if tp.topic == self.lag.topic]
        partitions = {tp.partition for tp in assigned}
        self.moved = {p: v for p, v in self.moved.items() if p in partitions}
        for tp in self.consumer.position(assigned):
            position, since = self.moved.get(tp.partition, (None, self.free_s))
            if tp.offset != position:
                self.moved[tp.partition] = (tp.offset, self.free_s)
                continue
            owed, end = self.waiting.get(tp.partition, (0, 0))
            owed = tp.offset if tp.offset >= 0 else owed
            if self.free_s - since < self.stall_s or end <= owed:
                continue
            log.warning("prompts partition %d not read for %.0f s with free slots and %d prompts waiting; "
                        "restarting its fetch at offset %d", tp.partition, self.free_s - since, end - owed, owed)
            self.moved[tp.partition] = (tp.offset, self.free_s)  # not again for stall_s
            try:
                self.consumer.resume([tp])
                self.consumer.seek(TopicPartition(tp.topic, tp.partition, owed))
                self.restarted += 1
            except KafkaException as e:  # e.g. revoked meanwhile: the next check sees the new assignment
                log.warning("restarting prompts partition %d failed (%s)", tp.partition, e.args[0])

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        if not self._thread.is_alive():  # else it still waits on a broker that is away: the exit ends it
            self.lag.close()

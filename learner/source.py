"""The learner's side of `sao.trajectories`: prefetch and decode in a thread, form steps in order.

A background thread polls Kafka and decodes (bad bytes → `sao.dlq`), so decoding overlaps with
training and the learner never idles while data is queued; its queue is bounded, and when full it
pauses the partitions rather than stop polling. The training thread forms each step from that queue
in arrival order: drop duplicates by trajectory id, drop trajectories staler than `max_staleness`,
close at `batch_trajectories` or `batch_tokens`. Staleness is judged against the version at step
formation, so a step's composition does not depend on how far the prefetch thread ran ahead.

State (consumed positions and the ledger of trained ids) lives here with `state_dict()`, is saved
in the checkpoint, and is committed to Kafka only after that checkpoint is durable.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from dataclasses import dataclass, field

from confluent_kafka import OFFSET_INVALID, TopicPartition

from schemas import topics as T
from schemas.kafka import KafkaConfig, consumer_error, dead_letter, decode_or_dead_letter, make_consumer, make_producer
from schemas.messages import Limits, Trajectory

log = logging.getLogger(__name__)
GROUP = "sao-learner"


@dataclass(kw_only=True)
class Step:
    """One optimizer step's trajectories, in the order they were consumed."""

    trajectories: list[Trajectory] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    num_tokens: int = 0


def staleness(learner_version: int, traj: Trajectory) -> int:
    """learner_version − min(versions over action tokens) (SAO.md §6)."""
    return learner_version - max(traj.min_version, 0)


class TrajectorySource:
    def __init__(self, kafka: KafkaConfig, *, prefetch: int = 512, limits: Limits = Limits()):
        self.kafka, self.limits = kafka, limits
        self.topic = kafka.topic(T.TRAJECTORIES)
        self.positions: dict[int, int] = {}  # partition -> next offset to train
        self.trained: dict[str, int] = {}  # the ledger: trajectory id -> step index
        self.counts = collections.Counter()  # dlq, duplicate, stale
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # The prefetch thread makes every call on the consumer: confluent-kafka calls from a second
        # thread while it polls were seen to block indefinitely. Commits and watermarks go through it.
        self._to_commit: list[TopicPartition] | None = None
        self._watermarks: dict[int, int] = {}
        self._thread: threading.Thread | None = None
        self.consumer = None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"positions": dict(self.positions), "trained": dict(self.trained)}

    def load_state_dict(self, state: dict) -> None:
        self.positions = {int(p): int(o) for p, o in state["positions"].items()}
        self.trained = dict(state["trained"])

    # ------------------------------------------------------------------ prefetch thread
    def start(self) -> TrajectorySource:
        self.consumer = make_consumer(self.kafka, GROUP)
        self.consumer.subscribe([self.topic], on_assign=self._on_assign)
        self._thread = threading.Thread(target=self._prefetch, name="trajectory-prefetch", daemon=True)
        self._thread.start()
        return self

    def _on_assign(self, consumer, partitions: list[TopicPartition]) -> None:
        # the checkpoint's positions win over Kafka's committed offsets: a crash may have come
        # between the checkpoint and the commit
        for tp in partitions:
            tp.offset = self.positions.get(tp.partition, OFFSET_INVALID)
        consumer.assign(partitions)

    def _prefetch(self) -> None:
        dlq = make_producer(self.kafka)
        backlog: collections.deque = collections.deque()
        paused = False
        try:
            while not self._stop.is_set():
                while backlog and not self._queue.full():
                    self._queue.put(backlog.popleft())
                if backlog and not paused:
                    self.consumer.pause(self.consumer.assignment())
                elif not backlog and paused:
                    self.consumer.resume(self.consumer.assignment())
                paused = bool(backlog)
                with self._lock:
                    offsets, self._to_commit = self._to_commit, None
                if offsets:
                    self.consumer.commit(offsets=offsets, asynchronous=False)
                self._watermarks = self._high_watermarks()
                msg = self.consumer.poll(1.0)
                if msg is None:
                    continue
                if consumer_error(msg):
                    continue
                traj = decode_or_dead_letter(dlq, self.kafka, msg, expect=Trajectory, limits=self.limits)
                if traj is not None and traj.reward is None:
                    dead_letter(dlq, self.kafka, msg, "reward: trajectory on sao.trajectories has no reward")
                    traj = None
                backlog.append((msg.partition(), msg.offset(), traj, msg.value()))
        finally:
            with self._lock:  # the last checkpoint's commit may have come after the last poll
                if self._to_commit:
                    self.consumer.commit(offsets=self._to_commit, asynchronous=False)
            dlq.flush(10)

    # ------------------------------------------------------------------ step formation
    def next_step(self, *, step_index: int, version: int, max_staleness: int, batch_trajectories: int,
                  batch_tokens: int, stop: threading.Event) -> Step | None:
        """Block until a step is full; None if `stop` is set first (a partial step is discarded
        and its trajectories are consumed again after a restart)."""
        step, ids = Step(), set()
        snapshot = (dict(self.positions), collections.Counter(self.counts))
        while len(step.trajectories) < batch_trajectories and step.num_tokens < batch_tokens:
            try:
                partition, offset, traj, payload = self._queue.get(timeout=0.2)
            except queue.Empty:
                if stop.is_set():
                    self.positions, self.counts = snapshot
                    return None
                continue
            self.positions[partition] = offset + 1
            if traj is None:
                self.counts["dlq"] += 1
                continue
            lag = staleness(version, traj)
            if traj.id in self.trained or traj.id in ids:
                self.counts["duplicate"] += 1
            elif max_staleness >= 0 and lag > max_staleness:
                self.counts["stale"] += 1
            else:
                ids.add(traj.id)
                step.trajectories.append(traj)
                step.payloads.append(payload)
                step.staleness.append(lag)
                step.num_tokens += traj.num_tokens
        self.trained.update(dict.fromkeys(ids, step_index))
        return step

    # ------------------------------------------------------------------ Kafka offsets and lag
    def commit(self) -> None:
        """Commit the positions (call only after the checkpoint holding them is durable); the
        prefetch thread sends it before its next poll."""
        with self._lock:
            self._to_commit = [TopicPartition(self.topic, p, o) for p, o in self.positions.items()]

    def _high_watermarks(self) -> dict[int, int]:
        """Cached end offsets of the assigned partitions (no broker round trip)."""
        marks = {}
        for tp in self.consumer.assignment():
            _, high = self.consumer.get_watermark_offsets(tp, cached=True)
            if high >= 0:
                marks[tp.partition] = high
        return marks

    def lag(self) -> int:
        """Messages on the topic not yet formed into a step, as of the prefetch thread's last look."""
        return sum(max(high - self.positions.get(p, 0), 0) for p, high in self._watermarks.items())

    def queued(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)
        if self.consumer is not None:
            self.consumer.close()

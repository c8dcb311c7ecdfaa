"""The learner's side of `sao.trajectories`: prefetch, decode and check in a thread, form steps in order.

A background thread polls Kafka, decodes (bad bytes → `sao.dlq`) and checks each trajectory against
what this learner can train (learner/checks.py: untrainable → `sao.dlq` with the reason), so a step
is only ever formed from trainable trajectories and decoding overlaps with training. Its queue is
bounded, and when full it pauses the partitions rather than stop polling. The training thread forms
each step from that queue in arrival order by the rules of learner/formation.py (duplicates,
stale trajectories, whole groups, when a step is full), which hold no Kafka. Staleness is judged
against the version at step formation, so a step's composition does not depend on how far the
prefetch thread ran ahead.

The formation's state (consumed positions, held group members, the ledgers of recently trained and
dropped ids, which `sao audit` reads) is saved in the checkpoint, and committed to Kafka only after
that checkpoint is durable. One learner consumes a run: a second one in the group is fenced out.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable

from confluent_kafka import OFFSET_INVALID, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from learner.checks import Trainable, untrainable
from learner.formation import Formation, StepBatch, StepRule
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import (SESSION_TIMEOUT_S, FatalKafkaError, KafkaConfig, consumer_error, dead_letter,
                           dead_letter_record, decode_or_dead_letter, make_consumer, make_producer)
from schemas.messages import DeadLetter, Limits, Trajectory
from schemas.progress import progress_group
from schemas.retry import retrying, transient

log = logging.getLogger(__name__)


def group_id(kafka: KafkaConfig) -> str:
    """The learner's consumer group: one per run (topic prefix), `sao-learner` by default."""
    return f"{kafka.topic_prefix}-learner"


class SecondLearner(ConfigError):
    """Another consumer is in the learner's group: exactly one learner trains a run's trajectories
    (two would each train on part of the stream, silently), so this one stops."""


def other_members(kafka: KafkaConfig, group: str, me: str | None = None) -> list[str]:
    """The members of `group` other than member id `me`, as "client@host" (empty: none)."""
    admin = AdminClient(kafka.client(log_level=0))

    def describe():
        return admin.describe_consumer_groups([group], request_timeout=5)[group].result()
    try:
        members = retrying(describe).members
    except KafkaException as e:  # a group never joined may be unknown rather than empty
        if e.args[0].code() != KafkaError.GROUP_ID_NOT_FOUND:
            raise
        return []
    return [f"{m.client_id}@{m.host.lstrip('/')}" for m in members if m.member_id != me]


class TrajectorySource:
    """Kafka around `Formation`: the prefetch thread, the group and its fence, commits, dead letters."""

    def __init__(self, kafka: KafkaConfig, trainable: Trainable, *, prefetch: int = 512,
                 limits: Limits = Limits(), dedup_window: int = 1 << 16, group_wait_steps: int = 8):
        self.kafka, self.trainable, self.limits = kafka, trainable, limits
        self.topic = kafka.topic(T.TRAJECTORIES)
        self.formation = Formation(needs_groups=trainable.needs_groups, dedup_window=dedup_window,
                                   group_wait_steps=group_wait_steps, limits=limits)
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._assigned = threading.Event()  # the first assignment happened (or the thread failed)
        # The prefetch thread makes every call on the consumer: confluent-kafka calls from a second
        # thread while it polls were seen to block indefinitely. Commits and watermarks go through it.
        self._to_commit: list[TopicPartition] | None = None
        self._watermarks: dict[int, int] = {}
        self._thread: threading.Thread | None = None
        self.consumer = self.progress = None
        self._reported: dict[int, int] = {}  # the positions last committed to the progress group
        self.dlq = None  # a producer is thread-safe: the prefetch thread and step formation share it
        self.error: BaseException | None = None  # what stopped the prefetch thread

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return self.formation.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.formation.load_state_dict(state)

    @property
    def positions(self) -> dict[int, int]:
        return self.formation.positions

    @property
    def counts(self) -> collections.Counter:
        """dlq, duplicate, stale, partial_group, dead_step."""
        return self.formation.counts

    # ------------------------------------------------------------------ prefetch thread
    def claim(self) -> None:
        """Raise SecondLearner if another consumer is still in the group once a session timeout
        has passed (a SIGKILLed predecessor has expired by then; a live learner has not). Called
        before this learner touches anything shared; joining the group (`start`, `joined`) then
        makes the claim hold."""
        group, deadline = group_id(self.kafka), time.monotonic() + SESSION_TIMEOUT_S + 3
        while others := other_members(self.kafka, group):
            if time.monotonic() > deadline:
                raise SecondLearner(
                    f"group {group} on {self.topic} already has {', '.join(others)}: exactly one learner "
                    f"consumes a run's trajectories; stop the other one, or give this run its own "
                    f"--kafka.topic-prefix")
            time.sleep(0.5)

    def start(self) -> TrajectorySource:
        self.consumer = make_consumer(self.kafka, group_id(self.kafka))
        self.progress = make_consumer(self.kafka, progress_group(self.kafka))  # commits only, never joins
        self.dlq = make_producer(self.kafka)
        self.consumer.subscribe([self.topic], on_assign=self._on_assign)
        self._thread = threading.Thread(target=self._prefetch, name="trajectory-prefetch", daemon=True)
        self._thread.start()
        return self

    def joined(self, timeout: float = 120.0) -> None:
        """Block until the group has assigned this learner its partitions, alone in the group (a
        learner that raced this one's `claim` makes both stop here, before either publishes)."""
        if not self._assigned.wait(timeout):
            raise TimeoutError(f"group {group_id(self.kafka)} assigned no partitions within {timeout} s")
        if self.error is not None:
            raise self.error

    def _on_assign(self, consumer, partitions: list[TopicPartition]) -> None:
        # another member took part of the stream (a second learner that raced this one's start
        # check, or any consumer given this group): fenced, not rebalanced, since each would
        # then train on part of the stream
        if others := other_members(self.kafka, group_id(self.kafka), consumer.memberid()):
            raise SecondLearner(f"{', '.join(others)} joined group {group_id(self.kafka)} and took "
                                f"partitions of {self.topic}: exactly one learner consumes a run's "
                                f"trajectories; this one stops")
        # the checkpoint's positions win over Kafka's committed offsets: a crash may have come
        # between the checkpoint and the commit
        for tp in partitions:
            tp.offset = self.positions.get(tp.partition, OFFSET_INVALID)
        consumer.assign(partitions)
        self._assigned.set()

    def _prefetch(self) -> None:
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
                if offsets and not self._commit(offsets):
                    with self._lock:  # retried at the next turn, unless a newer checkpoint's came meanwhile
                        self._to_commit = self._to_commit or offsets
                self._watermarks = self._high_watermarks()
                msg = self.consumer.poll(1.0)
                if msg is None or consumer_error(msg):
                    continue
                backlog.append((msg.partition(), msg.offset(), self._check(msg), msg.value()))
        except BaseException as e:  # a fatal Kafka error or a fence: step formation re-raises it
            self.error = e
            self._assigned.set()
            if not isinstance(e, SecondLearner):  # that one says all there is to say
                log.exception("trajectory prefetch stopped")
        finally:
            with self._lock:  # the last checkpoint's commit may have come after the last poll
                if self._to_commit:
                    self._commit(self._to_commit)
            self.dlq.flush(10)

    def _commit(self, offsets: list[TopicPartition]) -> bool:
        """Whether Kafka took the offsets. A transient failure (the coordinator moving or down)
        only delays Kafka's copy: the checkpoint holds the positions, so the learner goes on."""
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
            return True
        except KafkaException as e:
            if not transient(e.args[0]):
                raise FatalKafkaError(f"Kafka: committing offsets of {self.topic} failed: {e.args[0].str()}") from e
            log.warning("committing offsets of %s: %s; retrying", self.topic, e.args[0].str())
            return False

    def _check(self, msg) -> Trajectory | None:
        """The trajectory if it decodes and this learner can train it; else None, dead-lettered."""
        traj = decode_or_dead_letter(self.dlq, self.kafka, msg, expect=Trajectory, limits=self.limits)
        if traj is not None and (reason := untrainable(traj, self.trainable)) is not None:
            dead_letter(self.dlq, self.kafka, msg, reason)
            return None
        return traj

    # ------------------------------------------------------------------ step formation
    def next_step(self, *, step_index: int, staleness: Callable[[Trajectory], int], fresh: Callable[[Trajectory], float],
                  min_fresh_frac: float, batch_trajectories: int, batch_tokens: int, stop: threading.Event,
                  poisoned: Callable[[list[str]], str | None] = lambda ids: None) -> StepBatch | None:
        """Block until a step is full; None if `stop` is set first (a partial step is discarded
        and its trajectories are consumed again after a restart). `staleness(traj)`: how many versions
        its stalest token is behind the learner's at this step's formation (a metric); `fresh(traj)`:
        the share of its action tokens within the staleness bound, dropped below `min_fresh_frac`. A step that
        `poisoned` names an error for is dead-lettered whole and the next one is formed in its place."""
        dropped: dict[str, list[str]] = {}  # what the formations of dead-lettered steps dropped
        while (step := self._form(step_index, staleness, fresh, min_fresh_frac, batch_trajectories, batch_tokens,
                                  stop)) is not None:
            for reason, ids in dropped.items():
                step.drop(reason, ids)
            self._report_progress()
            if (error := poisoned(step.ids)) is None:
                return step
            for e in step.entries:
                dead_letter_record(self.dlq, self.kafka, DeadLetter(
                    source_topic=self.topic, partition=e.partition, offset=e.offset, error=error,
                    payload=e.payload), key=e.traj.key)
            self.dlq.flush(30)
            self.counts["dead_step"] += 1
            dropped = step.dropped
        return None

    def _form(self, step_index: int, staleness: Callable[[Trajectory], int], fresh: Callable[[Trajectory], float],
              min_fresh_frac: float, batch_trajectories: int, batch_tokens: int,
              stop: threading.Event) -> StepBatch | None:
        formation = self.formation
        step = formation.open(step_index, StepRule(batch_trajectories=batch_trajectories, batch_tokens=batch_tokens,
                                                   min_fresh_frac=min_fresh_frac, staleness=staleness, fresh=fresh))
        while not formation.full(step):
            if stop.is_set():  # checked before taking more too: producers running ahead keep the queue full
                formation.abandon()
                return None
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                if isinstance(self.error, SecondLearner):
                    raise self.error
                if self.error is not None:
                    raise RuntimeError(f"trajectory prefetch stopped: {self.error}") from self.error
                # Waiting for the rest of a step: what this step holds and what was dead-lettered
                # counts as consumed, else a backpressure bound under one step would never open.
                self._report_progress()
                continue
            formation.offer(step, *item)
        return formation.close(step)

    def _report_progress(self) -> None:
        """Commit the positions consumed so far to the progress group, which only the feeder's and
        producers' backpressure reads (schemas/progress.py); never waited for, and a failure costs
        nothing but a late reading: restarts go by the checkpoint and the learner's own group."""
        if self.positions == self._reported or self.progress is None:  # None: fed by hand, never started
            return
        self._reported = dict(self.positions)
        offsets = [TopicPartition(self.topic, p, o) for p, o in self.positions.items()]  # never empty here
        try:
            self.progress.commit(offsets=offsets, asynchronous=True)
        except KafkaException as e:
            log.debug("progress commit: %s", e)

    # ------------------------------------------------------------------ Kafka offsets and lag
    def commit(self, positions: dict[int, int]) -> None:
        """Commit `positions`, those a durable checkpoint holds (`state_dict()["positions"]` as it
        was saved), never the live ones: a partition first read after the save is not in that
        checkpoint, and a restart from it must find Kafka's offset of that partition where it was.
        The prefetch thread sends it before its next poll, retrying while the broker cannot take it."""
        with self._lock:
            self._to_commit = [TopicPartition(self.topic, p, o) for p, o in positions.items()]

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
            self.progress.close()

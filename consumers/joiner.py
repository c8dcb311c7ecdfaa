"""`sao reward-join`: a faust app joining `sao.trajectories.pending` with `sao.rewards` by trajectory id.

Both topics are keyed by trajectory id and have the same partition count, so faust assigns
partition p of both (and of the tick topic) to one worker, and the one table of entries
(`consumers.join_rules`) is partitioned the same way, its changelog topic holding partition p's state.
Instances started with the same `--app-id` share the partitions; one that stops or dies hands its
partitions to the others, who rebuild the table from the changelog. Timeouts need a write in
partition p's context (faust writes the changelog of the event's partition), so each worker's timer
publishes a tick to every partition of a tick topic and the tick's agent sweeps that partition.

Delivery is at least once by default: after a crash, events since the last offset commit are
processed again; the table, restored from its changelog, recognises a trajectory or reward it has
already seen, but a join whose output was sent and whose table write was lost is emitted twice.
The learner drops such duplicates by trajectory id. `--exactly-once` turns on faust's transactions.

faust 0.15 can pass over an input message across a rebalance and then commit past it (`Backfill`),
so the agents do not take its stream to be contiguous: what it did not hand over is read directly.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, Literal

import faust
from confluent_kafka import KafkaException, TopicPartition
from faust.transport.drivers import aiokafka as faust_kafka

from consumers import join_rules
from consumers.metrics import JoinerMetrics
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, ServiceConfig, ensure_topics, make_consumer, read_ranges, replication_now
from schemas.messages import DeadLetter, Reward, SchemaError, Trajectory, decode
from schemas.retry import retrying

log = logging.getLogger(__name__)

# The joiner's own clock, private to it (so not in schemas.topics); created before faust starts so
# that the first partition assignment already co-partitions it with the two inputs.
TICKS = T.Topic("reward-join.ticks", T.PENDING.partitions, {"retention.ms": "60000"})
RETRY_S = 60.0
"""Seconds an agent retries a record whose handling raised before it gives up (`Joiner.retrying`)."""


@dataclass(kw_only=True)
class JoinerConfig(ServiceConfig):
    app_id: str = ""
    """Faust app id shared by every instance of one joiner ("" → `<topic prefix>.reward-join`)."""
    reward_timeout: float = 600.0
    """Seconds a pending trajectory waits for its outcome reward."""
    on_timeout: Literal["drop", "default"] = "drop"
    """What happens to a trajectory whose reward did not come: dropped, or given `--default-reward`."""
    default_reward: float = 0.0
    """Reward of a timed-out trajectory when `--on-timeout default`."""
    orphan_timeout: float = 600.0
    """Seconds a reward for a trajectory not seen yet waits for it."""
    remember: float = 3600.0
    """Seconds a closed trajectory id is remembered, to count late and duplicate rewards."""
    sweep_every: float = 1.0
    """Seconds between timeout sweeps of each partition."""
    store: Literal["memory", "rocksdb"] = "memory"
    """Table store: memory (rebuilt from the changelog at start) or rocksdb (on disk in `--data-dir`)."""
    data_dir: str = "runs/reward-join"
    """Faust's data directory (RocksDB files); one per instance on a host."""
    exactly_once: bool = False
    """Faust's exactly-once processing (Kafka transactions) instead of at-least-once. Works on Kafka
    4.1 (no duplicate after a SIGKILL), but faust 0.15's final commit on SIGTERM fails after traffic
    ("Not in the middle of a transaction") and the process may then hang: give it a grace period,
    then SIGKILL (nothing is lost; the open transaction is aborted)."""

    def __post_init__(self):
        if self.reward_timeout <= 0 or self.orphan_timeout <= 0:
            raise ConfigError("--reward-timeout and --orphan-timeout must be > 0")

    @property
    def timeouts(self) -> join_rules.Timeouts:
        return join_rules.Timeouts(reward_s=self.reward_timeout, orphan_s=self.orphan_timeout, remember_s=self.remember,
                             default_reward=self.default_reward if self.on_timeout == "default" else None)

    @property
    def app_name(self) -> str:
        return self.app_id or f"{self.kafka.topic_prefix}.reward-join"


class IdempotentProducer(faust_kafka.Producer):
    """faust 0.15's producer, idempotent with acks=all (schemas.kafka.make_producer's guarantee)
    under at-least-once too, where faust leaves idempotence off: a send aiokafka retries across a
    broker failure or a leader moving is written once, not twice."""

    def _settings_extra(self) -> dict:
        return {"acks": "all", "enable_idempotence": True}


class Joiner:
    """The faust app, its topics and table, and what each agent does with an event."""

    def __init__(self, cfg: JoinerConfig, metrics: JoinerMetrics):
        self.cfg, self.metrics = cfg, metrics
        Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)  # faust makes only the last level
        big = T.MAX_RECORD_BYTES
        self.app = app = faust.App(
            cfg.app_name, broker=[f"kafka://{b}" for b in cfg.kafka.bootstrap.split(",")], store=f"{cfg.store}://",
            broker_credentials=cfg.kafka.faust_credentials(),  # TLS and SASL as every other client has them
            datadir=cfg.data_dir, topic_partitions=T.PENDING.partitions,
            processing_guarantee="exactly_once" if cfg.exactly_once else "at_least_once",
            producer_max_request_size=big, consumer_max_fetch_size=big,
            # the topics faust creates itself (its leader topic) replicated as ours are
            topic_replication_factor=replication_now(cfg.kafka)[0],
            # a dead member's partitions move on within seconds, not after the 45 s default
            broker_session_timeout=6.0, broker_heartbeat_interval=0.5,
            broker_commit_every=100, broker_commit_interval=1.0, web_enabled=False,
            key_serializer="raw", value_serializer="raw")  # our own codec, on every topic and table
        app.transport.Producer = IdempotentProducer  # the one producer faust makes, on first use
        raw = dict(key_type=bytes, value_type=bytes)
        pending, rewards, self.ticks, self.out, self.dlq = (
            app.topic(cfg.kafka.topic(t), **raw) for t in (T.PENDING, T.REWARDS, TICKS, T.TRAJECTORIES, T.DLQ))
        self.entries = app.Table("entries", partitions=T.PENDING.partitions,
                                 extra_topic_configs={"max.message.bytes": str(big)}, **raw)
        self.changelog = Changelog(self.entries.changelog_topic_name, T.PENDING.partitions,
                                   {"cleanup.policy": "compact", "max.message.bytes": str(big)})
        self.index = Index(cfg.timeouts)
        self.backfill = Backfill(cfg.kafka, cfg.app_name)
        app.agent(pending, name="pending")(self.on_pending)
        app.agent(rewards, name="rewards")(self.on_reward)
        app.agent(self.ticks, name="ticks")(self.on_tick)
        app.timer(cfg.sweep_every)(self.tick)
        app.on_partitions_revoked.connect(self.on_revoked)

    def get(self, key: bytes) -> join_rules.Entry | None:
        raw = self.entries.get(key)
        return join_rules.Entry.decode(raw) if raw is not None else None

    async def dead_letter(self, record: Input, error: Exception) -> None:
        log.warning("dead letter from %s[%d]@%d: %s", record.topic, record.partition, record.offset, error)
        self.metrics.event("dlq")
        dl = DeadLetter(source_topic=record.topic, partition=record.partition, offset=record.offset,
                        error=str(error), payload=record.value or b"")
        await self.dlq.send(key=record.key, value=dl.encode())

    async def apply(self, key: bytes, result: join_rules.Result) -> None:
        entry, emit, what = result
        if emit is not None:
            # sent before the table write, so a crash between the two repeats the output (the
            # learner drops the repeat) rather than losing it
            await self.out.send(key=key, value=emit.encode())
        if entry is None:
            self.entries.pop(key, None)
        else:
            self.entries[key] = entry.encode()
        self.index.update(key, entry)
        self.metrics.event(what, latency=join_rules.latency_s(entry) if what == "joined" else None)

    async def on_pending(self, stream) -> None:
        await self.each(stream, self.pending)

    async def on_reward(self, stream) -> None:
        await self.each(stream, self.reward)

    async def each(self, stream, handle: Callable[[Input], Awaitable[None]]) -> None:
        """Each event, after whatever before it in its partition was not handled (`Backfill`); all
        in this event's context, so their table writes go to its changelog partition."""
        async for event in stream.events():
            m = event.message
            missed = await self.backfill.passed_over(m.topic, m.partition, m.offset)
            for record in [*missed, Input(topic=m.topic, partition=m.partition, offset=m.offset,
                                          timestamp=m.timestamp, key=event.key, value=event.value)]:
                await self.retrying(handle, record)
                self.backfill.handled(record)
            for _ in missed:
                self.metrics.event("backfilled")

    async def retrying(self, handle: Callable[[Input], Awaitable[None]], record: Input) -> None:
        """`handle(record)` until it succeeds, for up to `RETRY_S`. What raises here is the table or
        the broker, not the record (the handlers dead-letter bad records), and an agent that raises
        loses its event: faust restarts the agent without it and acknowledges it. Seen here: the
        table's changelog not yet in the consumer's metadata in the first second of a new app.
        A retry may send a joined trajectory twice; the learner drops the repeat by id."""
        deadline = time.monotonic() + RETRY_S
        while True:
            try:
                return await handle(record)
            except Exception as e:
                if time.monotonic() > deadline:
                    raise
                log.warning("%s[%d]@%d not handled (%r); retrying", record.topic, record.partition,
                            record.offset, e)
                await asyncio.sleep(0.5)

    async def pending(self, r: Input) -> None:
        try:
            traj = decode(r.value or b"")
            if not isinstance(traj, Trajectory) or traj.reward is not None:
                raise SchemaError("kind", "expected a trajectory without reward on the pending topic")
            if r.key != traj.key:  # its reward would land on another partition: never joined
                raise SchemaError("key", f"message key {r.key!r} is not the trajectory id {traj.id!r}")
        except SchemaError as e:
            await self.dead_letter(r, e)
            return
        await self.apply(r.key, join_rules.add_trajectory(self.get(r.key), r.value, traj, r.timestamp, time.time(),
                                                    r.partition))

    async def reward(self, r: Input) -> None:
        try:
            reward = Reward.decode(r.value or b"")
            if r.key != reward.key:
                raise SchemaError("key", f"message key {r.key!r} is not the trajectory id {reward.trajectory_id!r}")
            result = join_rules.add_reward(self.get(r.key), reward, r.timestamp, time.time(), r.partition)
        except SchemaError as e:
            await self.dead_letter(r, e)
            return
        await self.apply(r.key, result)

    async def on_tick(self, stream) -> None:
        async for event in stream.events():
            partition = event.message.partition
            if not self.index.built(partition):
                self.index.rebuild(partition, ((k, join_rules.Entry.decode(v, header_only=True))
                                               for k, v in self.entries.items()))
            now = time.time()
            for key in self.index.due(partition, now):
                entry = self.get(key)
                if entry is not None:
                    await self.apply(key, join_rules.expire(entry, self.cfg.timeouts, now))
            self.metrics.pending(self.index.pending())

    async def tick(self) -> None:
        for p in range(T.PENDING.partitions):
            await self.ticks.send(key=b"", value=b"", partition=p)
        self.metrics.tick()

    async def on_revoked(self, app, revoked, **kwargs) -> None:
        self.index.forget({tp.partition for tp in revoked})
        self.backfill.forget(revoked)


class Changelog(T.Topic):
    """A faust table's changelog topic: named after the app, not the topic prefix."""

    def name(self, prefix: str = "sao") -> str:
        return self.suffix


@dataclass(frozen=True, kw_only=True)
class Input:
    """An input message as the agents handle it, whether faust handed it over or `Backfill` read it."""

    topic: str
    partition: int
    offset: int
    timestamp: float  # seconds
    key: bytes | None
    value: bytes | None


class Backfill:
    """The input messages an agent was not shown. faust 0.15's stream drops an event fetched
    while the consumer's generation changes, and its commit then passes over a one-message gap at
    the head of the acknowledged offsets. Seen here: a reward never joined after one joiner was
    added and another killed (tests/consumers/test_joiner_recovery.py, about one run in five).
    Our input topics are written without transactions, so their offsets have no holes: per
    partition this keeps the next offset not yet handled (at the first event after an
    assignment, the group's committed offset) and reads back whatever lies between it and the
    event at hand, including one whose handling raised for good (`Joiner.retrying`)."""

    def __init__(self, kafka: KafkaConfig, group: str, timeout: float = 60.0):
        self.consumer = make_consumer(kafka, group)  # never subscribes: reads committed offsets and ranges
        self.timeout = timeout
        self.expected: dict[tuple[str, int], int] = {}
        self.lock = asyncio.Lock()  # the two agents share one client

    async def passed_over(self, topic: str, partition: int, offset: int) -> list[Input]:
        """The records of `topic[partition]` before `offset` not handled yet."""
        async with self.lock:
            start = self.expected.get((topic, partition))
            if start is None:
                start = self.expected[(topic, partition)] = await asyncio.to_thread(self._committed, topic, partition)
            if offset <= start:
                return []
            missed = await asyncio.to_thread(self._read, topic, partition, start, offset)
        log.warning("%s[%d] offsets %d..%d were not handled (faust passed over them, or their handling "
                    "raised); read them directly", topic, partition, start, offset - 1)
        return missed

    def close(self) -> None:
        self.consumer.close()

    def handled(self, record: Input) -> None:
        tp = (record.topic, record.partition)
        if tp in self.expected:  # else revoked meanwhile
            self.expected[tp] = max(self.expected[tp], record.offset + 1)

    def forget(self, tps) -> None:
        """Revoked partitions: when one comes back, faust starts it again from its committed offset."""
        for tp in tps:
            self.expected.pop((tp.topic, tp.partition), None)

    def _committed(self, topic: str, partition: int) -> int:
        tp = TopicPartition(topic, partition)

        def committed() -> int:
            [found] = self.consumer.committed([tp], timeout=self.timeout)
            if found.error is not None:
                raise KafkaException(found.error)
            return found.offset

        offset = retrying(committed)
        if offset >= 0:
            return offset
        low, _ = retrying(lambda: self.consumer.get_watermark_offsets(tp, timeout=self.timeout))
        return low  # nothing committed yet: faust starts at the earliest offset

    def _read(self, topic: str, partition: int, start: int, end: int) -> list[Input]:
        return [Input(topic=topic, partition=partition, offset=msg.offset(), timestamp=msg.timestamp()[1] / 1000,
                      key=msg.key(), value=msg.value())
                for msg in read_ranges(self.consumer, topic, {partition: (start, end)}, timeout=self.timeout)]


class Index:
    """This worker's deadlines by partition, kept beside the table so a sweep reads no entries;
    rebuilt from the table at the first sweep of a partition after it was (re)assigned. The count
    of open trajectories is kept as entries change: counting at every sweep cost 5 % of the
    joiner's CPU in a 8,000-trajectory burst (py-spy)."""

    def __init__(self, timeouts: join_rules.Timeouts):
        self.timeouts = timeouts
        self.deadlines: dict[int, dict[bytes, tuple[float, bool]]] = {}  # p -> key -> (deadline, open)
        self.open: dict[int, int] = {}  # p -> how many of its entries are open

    def built(self, partition: int) -> bool:
        return partition in self.deadlines

    def rebuild(self, partition: int, items) -> None:
        self.deadlines[partition], self.open[partition] = {}, 0
        for key, entry in items:
            if entry.partition == partition:
                self.update(key, entry)

    def update(self, key: bytes, entry: join_rules.Entry | None) -> None:
        if entry is None:
            for p, d in self.deadlines.items():
                self._set(p, key, None)
        elif entry.partition in self.deadlines:
            self._set(entry.partition, key, (entry.deadline(self.timeouts), entry.has_trajectory and not entry.closed))

    def _set(self, partition: int, key: bytes, value: tuple[float, bool] | None) -> None:
        d = self.deadlines[partition]
        old = d.pop(key, None) if value is None else d.get(key)
        if value is not None:
            d[key] = value
        self.open[partition] += (value is not None and value[1]) - (old is not None and old[1])

    def due(self, partition: int, now: float) -> list[bytes]:
        return [k for k, (t, _) in self.deadlines.get(partition, {}).items() if t <= now]

    def forget(self, partitions: set[int]) -> None:
        for p in partitions:
            self.deadlines.pop(p, None)
            self.open.pop(p, None)

    def pending(self) -> int:
        """Trajectories waiting for their reward in this worker's partitions."""
        return sum(self.open.values())


def run(cfg: JoinerConfig) -> None:
    metrics = JoinerMetrics(port=cfg.metrics_port, log_every_s=cfg.log_every_s)
    joiner = Joiner(cfg, metrics)
    # the table's changelog too, with its partitions visible before faust subscribes: one that
    # faust creates itself can sit in its consumer's metadata with no partitions for a minute or
    # more, and every table write fails meanwhile ("has 0 partitions")
    ensure_topics(cfg.kafka, (T.PENDING, T.REWARDS, T.TRAJECTORIES, T.DLQ, TICKS, joiner.changelog))
    app = joiner.app
    try:
        faust.Worker(app, loglevel=logging.getLevelName(logging.getLogger().level), quiet=True).execute_from_commandline()
    finally:
        joiner.backfill.close()
        metrics.close()

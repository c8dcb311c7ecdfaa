"""`sao reward-join`: a faust app joining `sao.trajectories.pending` with `sao.rewards` by trajectory id.

Both topics are keyed by trajectory id and have the same partition count, so faust assigns
partition p of both (and of the tick topic) to one worker, and the one table of entries
(`consumers.join`) is partitioned the same way, its changelog topic holding partition p's state.
Instances started with the same `--app-id` share the partitions; one that stops or dies hands its
partitions to the others, who rebuild the table from the changelog. Timeouts need a write in
partition p's context (faust writes the changelog of the event's partition), so each worker's timer
publishes a tick to every partition of a tick topic and the tick's agent sweeps that partition.

Delivery is at least once by default: after a crash, events since the last offset commit are
processed again; the table, restored from its changelog, recognises a trajectory or reward it has
already seen, but a join whose output was sent and whose table write was lost is emitted twice.
The learner drops such duplicates by trajectory id. `--exactly-once` turns on faust's transactions.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import faust

from consumers import join
from consumers.metrics import JoinerMetrics
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, ensure_topics
from schemas.messages import DeadLetter, Reward, SchemaError, Trajectory, decode

log = logging.getLogger(__name__)

# The joiner's own clock, private to it (so not in schemas.topics); created before faust starts so
# that the first partition assignment already co-partitions it with the two inputs.
TICKS = T.Topic("reward-join.ticks", T.PENDING.partitions, {"retention.ms": "60000"})


@dataclass(kw_only=True)
class JoinerConfig:
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
    metrics_port: int = 0
    """Prometheus /metrics port (0: off)."""
    log_every_s: float = 30.0
    """Seconds between log lines with the rates."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        if self.reward_timeout <= 0 or self.orphan_timeout <= 0:
            raise ConfigError("--reward-timeout and --orphan-timeout must be > 0")

    @property
    def timeouts(self) -> join.Timeouts:
        return join.Timeouts(reward_s=self.reward_timeout, orphan_s=self.orphan_timeout, remember_s=self.remember,
                             default_reward=self.default_reward if self.on_timeout == "default" else None)

    @property
    def app_name(self) -> str:
        return self.app_id or f"{self.kafka.topic_prefix}.reward-join"


class Joiner:
    """The faust app, its topics and table, and what each agent does with an event."""

    def __init__(self, cfg: JoinerConfig, metrics: JoinerMetrics):
        self.cfg, self.metrics = cfg, metrics
        Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)  # faust makes only the last level
        big = T.MAX_MESSAGE_BYTES + (1 << 20)
        self.app = app = faust.App(
            cfg.app_name, broker=f"kafka://{cfg.kafka.bootstrap}", store=f"{cfg.store}://",
            datadir=cfg.data_dir, topic_partitions=T.PENDING.partitions,
            processing_guarantee="exactly_once" if cfg.exactly_once else "at_least_once",
            producer_max_request_size=big, consumer_max_fetch_size=big,
            # a dead member's partitions move on within seconds, not after the 45 s default
            broker_session_timeout=6.0, broker_heartbeat_interval=0.5,
            broker_commit_every=100, broker_commit_interval=1.0, web_enabled=False,
            key_serializer="raw", value_serializer="raw")  # our own codec, on every topic and table
        raw = dict(key_type=bytes, value_type=bytes)
        pending, rewards, self.ticks, self.out, self.dlq = (
            app.topic(cfg.kafka.topic(t), **raw) for t in (T.PENDING, T.REWARDS, TICKS, T.TRAJECTORIES, T.DLQ))
        self.entries = app.Table("entries", partitions=T.PENDING.partitions,
                                 extra_topic_configs={"max.message.bytes": str(big)}, **raw)
        self.index = Index(cfg.timeouts)
        app.agent(pending, name="pending")(self.on_pending)
        app.agent(rewards, name="rewards")(self.on_reward)
        app.agent(self.ticks, name="ticks")(self.on_tick)
        app.timer(cfg.sweep_every)(self.tick)
        app.on_partitions_revoked.connect(self.on_revoked)

    def get(self, key: bytes) -> join.Entry | None:
        raw = self.entries.get(key)
        return join.Entry.decode(raw) if raw is not None else None

    async def dead_letter(self, event, error: Exception) -> None:
        m = event.message
        log.warning("dead letter from %s[%d]@%d: %s", m.topic, m.partition, m.offset, error)
        self.metrics.event("dlq")
        dl = DeadLetter(source_topic=m.topic, partition=m.partition, offset=m.offset, error=str(error),
                        payload=event.value or b"")
        await self.dlq.send(key=event.key, value=dl.encode())

    async def apply(self, key: bytes, result: join.Result) -> None:
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
        self.metrics.event(what, latency=join.latency_s(entry) if what == "joined" else None)

    async def on_pending(self, stream) -> None:
        async for event in stream.events():
            try:
                traj = decode(event.value or b"")
                if not isinstance(traj, Trajectory) or traj.reward is not None:
                    raise SchemaError("kind", "expected a trajectory without reward on the pending topic")
                if event.key != traj.key:  # its reward would land on another partition: never joined
                    raise SchemaError("key", f"message key {event.key!r} is not the trajectory id {traj.id!r}")
            except SchemaError as e:
                await self.dead_letter(event, e)
                continue
            key, m = event.key, event.message
            await self.apply(key, join.add_trajectory(self.get(key), event.value, traj, m.timestamp, time.time(),
                                                      m.partition))

    async def on_reward(self, stream) -> None:
        async for event in stream.events():
            key, m = event.key, event.message
            try:
                reward = Reward.decode(event.value or b"")
                if key != reward.key:
                    raise SchemaError("key", f"message key {key!r} is not the trajectory id {reward.trajectory_id!r}")
                result = join.add_reward(self.get(key), reward, m.timestamp, time.time(), m.partition)
            except SchemaError as e:
                await self.dead_letter(event, e)
                continue
            await self.apply(key, result)

    async def on_tick(self, stream) -> None:
        async for event in stream.events():
            partition = event.message.partition
            if not self.index.built(partition):
                self.index.rebuild(partition, ((k, join.Entry.decode(v, header_only=True))
                                               for k, v in self.entries.items()))
            now = time.time()
            for key in self.index.due(partition, now):
                entry = self.get(key)
                if entry is not None:
                    await self.apply(key, join.expire(entry, self.cfg.timeouts, now))
            self.metrics.pending(self.index.pending())

    async def tick(self) -> None:
        for p in range(T.PENDING.partitions):
            await self.ticks.send(key=b"", value=b"", partition=p)
        self.metrics.tick()

    async def on_revoked(self, app, revoked, **kwargs) -> None:
        self.index.forget({tp.partition for tp in revoked})


class Index:
    """This worker's deadlines by partition, kept beside the table so a sweep reads no entries;
    rebuilt from the table at the first sweep of a partition after it was (re)assigned."""

    def __init__(self, timeouts: join.Timeouts):
        self.timeouts = timeouts
        self.deadlines: dict[int, dict[bytes, tuple[float, bool]]] = {}  # p -> key -> (deadline, open)

    def built(self, partition: int) -> bool:
        return partition in self.deadlines

    def rebuild(self, partition: int, items) -> None:
        self.deadlines[partition] = {}
        for key, entry in items:
            if entry.partition == partition:
                self.update(key, entry)

    def update(self, key: bytes, entry: join.Entry | None) -> None:
        if entry is None:
            for d in self.deadlines.values():
                d.pop(key, None)
        elif entry.partition in self.deadlines:
            self.deadlines[entry.partition][key] = (entry.deadline(self.timeouts),
                                                    entry.has_trajectory and not entry.closed)

    def due(self, partition: int, now: float) -> list[bytes]:
        return [k for k, (t, _) in self.deadlines.get(partition, {}).items() if t <= now]

    def forget(self, partitions: set[int]) -> None:
        for p in partitions:
            self.deadlines.pop(p, None)

    def pending(self) -> int:
        """Trajectories waiting for their reward in this worker's partitions."""
        return sum(open_ for d in self.deadlines.values() for _, open_ in d.values())


def run(cfg: JoinerConfig) -> None:
    ensure_topics(cfg.kafka, (T.PENDING, T.REWARDS, T.TRAJECTORIES, T.DLQ, TICKS))
    metrics = JoinerMetrics(port=cfg.metrics_port, log_every_s=cfg.log_every_s)
    app = Joiner(cfg, metrics).app
    try:
        faust.Worker(app, loglevel=logging.getLevelName(logging.getLogger().level), quiet=True).execute_from_commandline()
    finally:
        metrics.close()

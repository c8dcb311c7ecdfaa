"""`sao audit`: account for every prompt and trajectory of a run, from the topics and the learner's records.

Reads sao.prompts, sao.trajectories.pending, sao.rewards, sao.trajectories and sao.dlq to their
current ends, the committed offsets of the producers' group (prompts) and of the reward joiner
(pending, rewards), the joiner's table changelog (which trajectories timed out), and the learner's
newest checkpoint (consumed positions, held group members, the ledgers of trained and dropped ids)
and `metrics.jsonl` (each step's trained and dropped ids). Then, id by id (sao/reconcile.py):

    prompts fed  = produced a trajectory + dead-lettered + in flight
    pending      = joined + dead-lettered + timed out + waiting for a reward + at the joiner
    trajectories = trained + dropped (stale, incomplete group) + held + dead-lettered + not yet trained

with duplicate copies on sao.trajectories counted apart (the learner drops them by id) and
nothing trained in two steps. "In flight" is proven, not assumed: a prompt counts as in flight only
past its partition's committed offset, which producers move only over delivered prompts. It prints
the table and exits 1 on any id it cannot explain, listing some.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
from confluent_kafka import TopicPartition

from sao.reconcile import Audit, Learned, Topics, reconcile
from schemas import topics as T
from schemas.kafka import KafkaConfig, make_consumer, read_ranges
from schemas.messages import DeadLetter, Prompt, Reward, SchemaError, Trajectory, decode
from schemas.progress import GroupLag
from schemas.retry import retrying


@dataclass(kw_only=True)
class AuditConfig:
    run_dir: Path = Path("runs/learner")
    """The learner's --run-dir: its checkpoints/ and metrics.jsonl."""
    producer_group: str = "sao-producers"
    """The producers' consumer group on sao.prompts (their --group)."""
    joiner_app: str = ""
    """The reward joiner's --app-id ("" → `<topic prefix>.reward-join`)."""
    show: int = 10
    """Unexplained ids listed of each kind."""
    timeout_s: float = 120.0
    """Seconds allowed to read one topic to its end."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    @property
    def joiner(self) -> str:
        return self.joiner_app or f"{self.kafka.topic_prefix}.reward-join"


@dataclass(frozen=True)
class Record:
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def read_topic(kafka: KafkaConfig, topic: str, timeout: float) -> list[Record]:
    """Every record on `topic` up to the ends its partitions had when the read began ([] if the
    topic does not exist)."""
    consumer = make_consumer(kafka, f"{kafka.topic_prefix}-audit-{uuid.uuid4().hex}")
    try:
        found = retrying(lambda: consumer.list_topics(topic, timeout=10)).topics[topic]
        if found.error is not None:
            return []
        ends = {p: retrying(lambda: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10))
                for p in found.partitions}
        return [Record(m.partition(), m.offset(), m.key(), m.value())
                for m in read_ranges(consumer, topic, ends, timeout=timeout, poll_s=1.0)]
    finally:
        consumer.close()


def committed(kafka: KafkaConfig, group: str, topic: T.Topic) -> dict[int, int]:
    """partition -> the group's committed offset on `topic` (absent: it committed nothing there)."""
    lag = GroupLag(kafka, topic, group)
    try:
        return {tp.partition: tp.offset for tp in lag.committed() if tp.offset >= 0}
    finally:
        lag.close()


def decoded(records: list[Record], kind: type) -> dict[tuple[int, int], object | None]:
    """(partition, offset) -> the decoded message of `kind`, None where it does not decode as one."""
    out = {}
    for r in records:
        try:
            m = decode(r.value or b"")
        except SchemaError:
            m = None
        out[(r.partition, r.offset)] = m if isinstance(m, kind) else None
    return out


def timed_out(records: list[Record]) -> set[str]:
    """Trajectory ids whose entry in the joiner's table is, last, closed by a timeout."""
    from consumers.join_rules import Entry

    last = {r.key: r.value for r in records}  # compacted or not, the newest value wins
    return {k.decode() for k, v in last.items() if v and Entry.decode(v, header_only=True).closed == "timeout"}


def read_topics(cfg: AuditConfig) -> Topics:
    k = cfg.kafka
    names = {t.suffix: k.topic(t) for t in (T.PROMPTS, T.PENDING, T.REWARDS, T.TRAJECTORIES, T.DLQ)}
    read = {suffix: read_topic(k, name, cfg.timeout_s) for suffix, name in names.items()}
    rewards = decoded(read[T.REWARDS.suffix], Reward)
    dead = [d for d in decoded(read[T.DLQ.suffix], DeadLetter).values() if d is not None]
    return Topics(
        names=names, prompts=decoded(read[T.PROMPTS.suffix], Prompt),
        pending=decoded(read[T.PENDING.suffix], Trajectory),
        trajectories=decoded(read[T.TRAJECTORIES.suffix], Trajectory),
        rewarded={m.trajectory_id: pos for pos, m in sorted(rewards.items()) if m is not None},
        dead=dead, dead_ids=dead_letter_ids(dead),
        producers=committed(k, cfg.producer_group, T.PROMPTS),
        joiner={t.suffix: committed(k, cfg.joiner, t) for t in (T.PENDING, T.REWARDS)},
        timed_out=timed_out(read_topic(k, f"{cfg.joiner}-entries-changelog", cfg.timeout_s)))


def dead_letter_ids(dead: list[DeadLetter]) -> dict[str, set[str]]:
    """source topic -> the trajectory ids its dead letters carry (a prompt's: the one it would have had)."""
    out: dict[str, set[str]] = {}
    for d in dead:
        try:
            m = decode(d.payload)
        except SchemaError:
            continue
        tid = m.trajectory_id if isinstance(m, Prompt) else m.id if isinstance(m, Trajectory) else None
        if tid is not None:
            out.setdefault(d.source_topic, set()).add(tid)
    return out


def metrics_lines(run_dir: Path) -> list[dict]:
    """The step records; a last line cut short by a SIGKILL (no newline yet) is not one."""
    path = run_dir / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def lineage(lines: list[dict]) -> list[dict]:
    """The steps the learner's policy holds: a restart from a checkpoint replays the steps after
    it, so a record of step i supersedes every earlier record of step i or later."""
    kept: list[dict] = []
    for m in lines:
        while kept and kept[-1]["step/index"] >= m["step/index"]:
            kept.pop()
        kept.append(m)
    return kept


def learned(run_dir: Path) -> Learned:
    found = sorted((run_dir / "checkpoints").glob("step*")) if (run_dir / "checkpoints").is_dir() else []
    source = (msgpack.unpackb((found[-1] / "learner.msgpack").read_bytes(), raw=False, strict_map_key=False)["source"]
              if found else {"positions": {}, "trained": [], "dropped": [], "held": {}})
    steps = lineage(metrics_lines(run_dir))
    return Learned(
        positions={int(p): o for p, o in source["positions"].items()},
        ledger=dict(source["trained"]), ledger_dropped={i: reason for i, reason, _ in source.get("dropped", [])},
        held={Trajectory.decode(payload).id for members in source["held"].values() for payload, _, _ in members},
        steps={m["step/index"]: m["trajectory_ids"] for m in steps},
        dropped={i: reason for m in steps for reason, ids in m.get("dropped_ids", {}).items() for i in ids})


def audit(cfg: AuditConfig) -> Audit:
    return reconcile(read_topics(cfg), learned(cfg.run_dir))


def run(cfg: AuditConfig) -> None:
    result = audit(cfg)
    print(result.table(cfg.show), flush=True)
    if not result.ok:
        raise SystemExit(1)

"""The reconciliation behind `sao audit`, as pure functions over what it read (no Kafka, no files).

Each id goes to the first category whose rule it meets, in the order the rules are listed; an id
no rule explains is reported. A record that does not decode has no id: it is named by its place
(`topic[partition]@offset`) and explained only by a dead letter from that place, or by not having
been reached yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

Position = tuple[int, int]  # (partition, offset)


@dataclass(kw_only=True)
class Topics:
    """What the topics and the groups' committed offsets say."""

    names: dict[str, str]
    """Topic suffix (`prompts`, ...) -> the run's topic name."""
    prompts: dict[Position, object | None]
    """Every record of sao.prompts: its Prompt, None where it does not decode as one."""
    pending: dict[Position, object | None]
    trajectories: dict[Position, object | None]
    rewarded: dict[str, Position]
    """Trajectory id -> the place of its newest reward on sao.rewards."""
    dead: list = field(default_factory=list)
    """The DeadLetters of sao.dlq."""
    dead_ids: dict[str, set[str]] = field(default_factory=dict)
    """Source topic -> trajectory ids its dead letters carry."""
    producers: dict[int, int] = field(default_factory=dict)
    """The producers' committed offsets on sao.prompts."""
    joiner: dict[str, dict[int, int]] = field(default_factory=dict)
    """Topic suffix (`trajectories.pending`, `rewards`) -> the joiner's committed offsets on it."""
    timed_out: set[str] = field(default_factory=set)
    """Trajectory ids the joiner's table holds as timed out."""


@dataclass(kw_only=True)
class Learned:
    """What the learner's newest checkpoint and its metrics say."""

    positions: dict[int, int]
    """Partition of sao.trajectories -> the next offset the checkpoint had not consumed."""
    ledger: dict[str, int]
    """The checkpoint's trained ids -> step index (bounded: recent ones)."""
    ledger_dropped: dict[str, str]
    """The checkpoint's dropped ids -> reason (likewise)."""
    held: set[str]
    """Ids held in the checkpoint until their group is whole."""
    steps: dict[int, list[str]]
    """Step index -> trained ids, over the steps the policy holds (`audit.lineage`)."""
    dropped: dict[str, str]
    """Dropped ids -> reason, over those steps."""


@dataclass(kw_only=True)
class Section:
    title: str
    rows: dict[str, int]
    unexplained: list[str]

    @property
    def total(self) -> int:
        return sum(self.rows.values()) + len(self.unexplained)


@dataclass(kw_only=True)
class Audit:
    sections: list[Section]
    duplicates: int
    """Copies of an id on sao.trajectories beyond its first (the learner drops them by id)."""
    trained_twice: dict[str, list[int]]
    """Id -> the steps it trained in, for every id that trained in more than one."""

    @property
    def ok(self) -> bool:
        return not self.trained_twice and not any(s.unexplained for s in self.sections)

    def table(self, show: int = 10) -> str:
        lines = []
        for s in self.sections:
            lines.append(f"{s.title:<50} {s.total:>8}")
            lines += [f"  {name:<48} {n:>8}" for name, n in [*s.rows.items(), ("unexplained", len(s.unexplained))]]
        lines.append(f"{'duplicate copies on trajectories (dropped by id)':<50} {self.duplicates:>8}")
        lines.append(f"{'trained in more than one step':<50} {len(self.trained_twice):>8}")
        for s in self.sections:
            if s.unexplained:
                lines.append(f"unexplained {s.title} ({len(s.unexplained)}): {', '.join(sorted(s.unexplained)[:show])}")
        if self.trained_twice:
            some = sorted(self.trained_twice.items())[:show]
            lines.append("trained twice: " + ", ".join(f"{i} (steps {steps})" for i, steps in some))
        lines.append("audit: every id accounted for" if self.ok else "audit: FAILED")
        return "\n".join(lines)


Rule = tuple[str, Callable[[str | None, list[Position]], bool]]


def classify(title: str, items: dict[str, tuple[str | None, list[Position]]], rules: list[Rule]) -> Section:
    """Each item (name -> (id or None, its places)) goes to its first rule's row."""
    rows, unexplained = dict.fromkeys((name for name, _ in rules), 0), []
    for name, (tid, places) in items.items():
        row = next((r for r, holds in rules if holds(tid, places)), None)
        if row is None:
            unexplained.append(name)
        else:
            rows[row] += 1
    return Section(title=title, rows=rows, unexplained=unexplained)


def items(topic: str, records: dict[Position, object | None], id_of: Callable[[object], str]) -> dict:
    """name -> (id, places): decoded records by id, the others by their place."""
    out: dict[str, tuple[str | None, list[Position]]] = {}
    for pos, m in sorted(records.items()):
        if m is None:
            out[f"{topic}[{pos[0]}]@{pos[1]}"] = (None, [pos])
        else:
            out.setdefault(id_of(m), (id_of(m), []))[1].append(pos)
    return out


def past(committed: dict[int, int], places: list[Position]) -> bool:
    """Whether some place is at or past the group's committed offset of its partition."""
    return any(o >= committed.get(p, 0) for p, o in places)


def reconcile(t: Topics, learner: Learned) -> Audit:
    dead_at = {(d.source_topic, d.partition, d.offset) for d in t.dead}

    def dead(topic: str) -> Callable[[str | None, list[Position]], bool]:
        name = t.names[topic]
        return lambda tid, places: tid in t.dead_ids.get(name, ()) or any((name, p, o) in dead_at for p, o in places)

    trajs = items(t.names["trajectories"], t.trajectories, lambda m: m.id)
    pending = items(t.names["trajectories.pending"], t.pending, lambda m: m.id)
    produced = {tid for tid, _ in (*trajs.values(), *pending.values()) if tid is not None}
    prompts = classify("prompts fed", items(t.names["prompts"], t.prompts, lambda m: m.trajectory_id), [
        ("produced a trajectory", lambda tid, _: tid in produced),
        ("dead-lettered", dead("prompts")),
        ("in flight (past the producers' commits)", lambda _, places: past(t.producers, places))])

    joiner_pending, joiner_rewards = (t.joiner.get(k, {}) for k in ("trajectories.pending", "rewards"))
    waiting = classify("pending (waiting for a live reward)", pending, [
        ("joined", lambda tid, _: tid in trajs),
        ("dead-lettered", dead("trajectories.pending")),
        ("timed out at the joiner (dropped)", lambda tid, _: tid in t.timed_out),
        ("no reward yet", lambda tid, _: tid is not None and tid not in t.rewarded),
        ("at the joiner (past its commits)", lambda tid, places: past(joiner_pending, places)
         or (tid in t.rewarded and past(joiner_rewards, [t.rewarded[tid]])))])

    dead_trajectory = dead("trajectories")
    steps_of: dict[str, set[int]] = {}
    for step, ids in learner.steps.items():
        for i in ids:
            steps_of.setdefault(i, set()).add(step)
    for i, step in learner.ledger.items():  # a poisoned step's ids are in the ledger, then dead-lettered
        if not dead_trajectory(i, trajs.get(i, (i, []))[1]):
            steps_of.setdefault(i, set()).add(step)
    dropped = {**learner.ledger_dropped, **learner.dropped}
    trained = classify("trajectories (sao.trajectories)", trajs, [
        ("trained", lambda tid, _: tid in steps_of),
        ("dropped as stale", lambda tid, _: dropped.get(tid) == "stale"),
        ("dropped, group incomplete", lambda tid, _: dropped.get(tid) == "partial_group"),
        ("held until its group is whole", lambda tid, _: tid in learner.held),
        ("dead-lettered", dead_trajectory),
        ("not yet trained (past the checkpoint)",
         lambda _, places: all(o >= learner.positions.get(p, 0) for p, o in places))])
    return Audit(sections=[prompts, waiting, trained],
                 duplicates=sum(len(places) - 1 for tid, places in trajs.values() if tid is not None),
                 trained_twice={i: sorted(s) for i, s in steps_of.items() if len(s) > 1})

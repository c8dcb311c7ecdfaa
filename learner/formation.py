"""Step formation, the pure core of the trajectory source (learner/source.py): what the learner does
with each consumed record, with no Kafka, no thread and no clock.

Records are offered in arrival order. A duplicate by trajectory id (trained recently, or already in
this step or a held group) is dropped; a trajectory too little of which is fresh
(`fresh(traj) < min_fresh_frac`) is dropped as stale; one a dead letter replaced counts and moves
the position on. With group baselines a group is taken only whole: its members wait in `held` until
all G have arrived, or until `group_wait_steps` steps have passed, when a partial group of at least
2 trains and a lone member is dropped. A step closes at `batch_trajectories` or `batch_tokens`.

The state (consumed positions, held members, the ledgers of recently trained and dropped ids) is
what the checkpoint keeps; the ledgers are bounded by age (`dedup_window` ids), since duplicates
come from a replayed prompt within a session timeout plus an episode of the original, at any offset.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas.messages import Limits, Trajectory


@dataclass(frozen=True)
class Consumed:
    """A consumed, decoded, trainable trajectory and where it came from."""

    traj: Trajectory
    payload: bytes
    partition: int
    offset: int


@dataclass(kw_only=True)
class StepBatch:
    """One optimizer step's trajectories, in the order they were consumed."""

    entries: list[Consumed] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    num_tokens: int = 0
    dropped: dict[str, list[str]] = field(default_factory=dict)
    """Ids consumed while forming this step and not trained, by reason (stale, duplicate,
    partial_group): the learner's record of them, which `sao audit` reconciles with the topic."""

    def drop(self, reason: str, ids: list[str]) -> None:
        if ids:
            self.dropped.setdefault(reason, []).extend(ids)

    @property
    def trajectories(self) -> list[Trajectory]:
        return [e.traj for e in self.entries]

    @property
    def payloads(self) -> list[bytes]:
        return [e.payload for e in self.entries]

    @property
    def ids(self) -> list[str]:
        return [e.traj.id for e in self.entries]


@dataclass(frozen=True, kw_only=True)
class StepRule:
    """When a step is full and what it admits, as the learner sets them at this step."""

    batch_trajectories: int
    batch_tokens: int
    min_fresh_frac: float = 0.0
    staleness: Callable[[Trajectory], int] = lambda traj: 0
    """Versions its stalest action token is behind the learner's now (a metric)."""
    fresh: Callable[[Trajectory], float] = lambda traj: 1.0
    """Share of its action tokens within the staleness bound."""


def remember(ledger: dict, entries: dict, window: int) -> None:
    """Add `entries` to an insertion-ordered ledger, then forget its oldest beyond `window`."""
    ledger.update(entries)
    while len(ledger) > window:
        del ledger[next(iter(ledger))]


class Formation:
    """The ledger and the step being formed: `open` a step, `offer` each record until `full`, then
    `close` it (or `abandon` it: every change since `open` is undone, and the records will be
    consumed again)."""

    def __init__(self, *, needs_groups: bool = False, dedup_window: int = 1 << 16, group_wait_steps: int = 8,
                 limits: Limits = Limits()):
        self.needs_groups, self.dedup_window, self.group_wait_steps = needs_groups, dedup_window, group_wait_steps
        self.limits = limits
        self.positions: dict[int, int] = {}  # partition -> next offset to train
        self.trained: dict[str, int] = {}  # the ledger: trajectory id -> step index, oldest first
        self.dropped: dict[str, tuple[str, int]] = {}  # id -> (StepBatch.dropped reason, step index), likewise
        self.held: dict[str, list[Consumed]] = {}  # group -> members waiting for the rest
        self.held_since: dict[str, int] = {}  # group -> step index its first member arrived at
        self.counts = collections.Counter()  # dlq, duplicate, stale, partial_group, dead_step
        self._open: tuple | None = None  # (step index, rule, ids seen, the state at `open`)

    def open(self, step_index: int, rule: StepRule) -> StepBatch:
        """A new step, with the groups that waited long enough already in it (or dropped)."""
        snapshot = (dict(self.positions), collections.Counter(self.counts),
                    {g: list(m) for g, m in self.held.items()}, dict(self.held_since))
        step = StepBatch()
        self._open = (step_index, rule, set(), snapshot)
        for group in [g for g, since in self.held_since.items() if step_index - since >= self.group_wait_steps]:
            members = self._release(group)
            if len(members) >= 2:
                self._take(step, members)
            else:
                self.counts["partial_group"] += len(members)
                step.drop("partial_group", [e.traj.id for e in members])
        self._open[2].update(e.traj.id for members in self.held.values() for e in members)
        return step

    def full(self, step: StepBatch) -> bool:
        rule = self._open[1]
        return len(step.entries) >= rule.batch_trajectories or step.num_tokens >= rule.batch_tokens

    def offer(self, step: StepBatch, partition: int, offset: int, traj: Trajectory | None, payload: bytes) -> None:
        """The record at `offset` of `partition`: its trajectory, or None where a dead letter took
        its place (bad bytes, or one this learner cannot train)."""
        step_index, _, seen, _ = self._open
        self.positions[partition] = offset + 1
        if traj is None:
            self.counts["dlq"] += 1
        elif traj.id in self.trained or traj.id in seen:
            self.counts["duplicate"] += 1
            step.drop("duplicate", [traj.id])
        else:
            seen.add(traj.id)
            entry = Consumed(traj, payload, partition, offset)
            if not self.needs_groups:
                self._take(step, [entry])
                return
            self.held.setdefault(traj.group, []).append(entry)
            self.held_since.setdefault(traj.group, step_index)
            if len(self.held[traj.group]) >= traj.group_size:
                self._take(step, self._release(traj.group))

    def close(self, step: StepBatch) -> StepBatch:
        """The step is formed: its ids join the ledgers."""
        step_index = self._open[0]
        remember(self.trained, dict.fromkeys(step.ids, step_index), self.dedup_window)
        remember(self.dropped, {i: (reason, step_index) for reason, ids in step.dropped.items() for i in ids},
                 self.dedup_window)
        self._open = None
        return step

    def abandon(self) -> None:
        """Undo everything since `open`: the step's records are consumed again after a restart."""
        self.positions, self.counts, self.held, self.held_since = self._open[3]
        self._open = None

    def _take(self, step: StepBatch, entries: list[Consumed]) -> None:
        rule = self._open[1]
        for e in entries:
            if rule.fresh(e.traj) < rule.min_fresh_frac:
                self.counts["stale"] += 1
                step.drop("stale", [e.traj.id])
                continue
            step.entries.append(e)
            step.staleness.append(rule.staleness(e.traj))
            step.num_tokens += e.traj.num_tokens

    def _release(self, group: str) -> list[Consumed]:
        del self.held_since[group]
        return self.held.pop(group)

    # ------------------------------------------------------------------ the checkpoint's part
    def state_dict(self) -> dict:
        return {"positions": dict(self.positions), "trained": list(self.trained.items()),
                "dropped": [(i, *why) for i, why in self.dropped.items()],
                "held": {g: [(e.payload, e.partition, e.offset) for e in members]
                         for g, members in self.held.items()},
                "held_since": dict(self.held_since)}

    def load_state_dict(self, state: dict) -> None:
        self.positions = {int(p): int(o) for p, o in state["positions"].items()}
        self.trained = dict(state["trained"])
        self.dropped = {i: (reason, step) for i, reason, step in state.get("dropped", [])}  # older: none
        self.held = {g: [Consumed(Trajectory.decode(payload, self.limits), payload, p, o) for payload, p, o in members]
                     for g, members in state["held"].items()}
        self.held_since = dict(state["held_since"])

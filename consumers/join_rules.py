"""The reward join as pure functions over one table entry per trajectory id (no Kafka, no faust).

An entry holds whatever has arrived for one trajectory id: the pending trajectory's bytes, its
outcome reward, per-turn rewards, and, once it is closed (joined or timed out), when and
how, so that a late or repeated reward is recognised and counted rather than joined twice. Each
function takes the entry (None: nothing seen yet) and returns the new entry (None: forget it), the
trajectory to emit (or None), and what happened, one word for the metrics.

Rules: either side may come first; the outcome reward (`Reward.token_index` None) closes the join,
so per-turn rewards must arrive before it (later ones are counted `late`); the first reward for a
slot (the outcome, or one token index) wins and the rest are counted `duplicate`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgpack

from schemas.messages import Reward, SchemaError, Trajectory

_LEN = struct.Struct("<I")


@dataclass(kw_only=True)
class Timeouts:
    reward_s: float
    """A trajectory waits this long for its outcome reward."""
    orphan_s: float
    """A reward for a trajectory not seen yet waits this long for it."""
    remember_s: float
    """A closed id is remembered this long, to count late and duplicate messages."""
    default_reward: float | None
    """Reward given to a timed-out trajectory; None drops it."""


@dataclass(kw_only=True)
class Entry:
    partition: int
    trajectory: bytes | None = None
    """The pending message's bytes, as they arrived."""
    trajectory_ts: float | None = None
    """Broker timestamp of the pending message (s); the latency metric counts from here."""
    trajectory_seen: float | None = None
    reward_seen: float | None = None
    outcome: list | None = None
    """[reward, broker timestamp, source, criterion] of the first outcome reward."""
    turns: dict[int, float] = field(default_factory=dict)
    closed: str = ""
    """"" while open; else joined | timeout."""
    closed_at: float = 0.0

    def encode(self) -> bytes:
        """A small header, then the trajectory bytes untouched: sweeps read headers only."""
        head = msgpack.packb({"p": self.partition, "ts": self.trajectory_ts, "ts_seen": self.trajectory_seen,
                              "r_seen": self.reward_seen, "o": self.outcome, "turns": list(self.turns.items()),
                              "c": self.closed, "c_at": self.closed_at, "has_t": self.trajectory is not None})
        return _LEN.pack(len(head)) + head + (self.trajectory or b"")

    @classmethod
    def decode(cls, data: bytes, header_only: bool = False) -> Entry:
        (n,) = _LEN.unpack_from(data)
        h = msgpack.unpackb(data[_LEN.size:_LEN.size + n], strict_map_key=False)
        trajectory = None if header_only or not h["has_t"] else bytes(data[_LEN.size + n:])
        return cls(partition=h["p"], trajectory=trajectory, trajectory_ts=h["ts"], trajectory_seen=h["ts_seen"],
                   reward_seen=h["r_seen"], outcome=h["o"], turns={int(i): r for i, r in h["turns"]},
                   closed=h["c"], closed_at=h["c_at"])

    @property
    def has_trajectory(self) -> bool:
        return self.trajectory_seen is not None

    def deadline(self, t: Timeouts) -> float:
        """When `expire` has something to do with this entry."""
        if self.closed:
            return self.closed_at + t.remember_s
        if self.has_trajectory:
            return self.trajectory_seen + t.reward_s
        return self.reward_seen + t.orphan_s


Result = tuple[Entry | None, Trajectory | None, str]


def add_trajectory(entry: Entry | None, payload: bytes, traj: Trajectory, ts: float, now: float,
                   partition: int) -> Result:
    entry = entry or Entry(partition=partition)
    if entry.closed or entry.has_trajectory:
        return entry, None, "duplicate_trajectory"  # a producer's redelivery, or our own replay
    entry.trajectory, entry.trajectory_ts, entry.trajectory_seen = payload, ts, now
    # per-turn rewards that came first were checked against nothing: drop those off action tokens
    entry.turns = {i: r for i, r in entry.turns.items() if _is_action(traj, i)}
    if entry.outcome is not None:
        return _close(entry, "joined", now), joined_with(traj, entry.outcome[0], entry), "joined"
    return entry, None, "waiting"


def add_reward(entry: Entry | None, reward: Reward, ts: float, now: float, partition: int) -> Result:
    """Raises SchemaError for a per-turn reward on a token the known trajectory did not act on."""
    entry = entry or Entry(partition=partition)
    if entry.closed:
        return entry, None, "late" if entry.closed != "joined" or reward.token_index is not None else "duplicate"
    if entry.reward_seen is None:
        entry.reward_seen = now
    traj = Trajectory.decode(entry.trajectory) if entry.has_trajectory else None
    if reward.token_index is not None:
        if traj is not None and not _is_action(traj, reward.token_index):
            raise SchemaError("token_index", f"{reward.token_index} is not an action token of {reward.trajectory_id}")
        if reward.token_index in entry.turns:
            return entry, None, "duplicate"
        entry.turns[reward.token_index] = reward.reward
        return entry, None, "turn"
    if entry.outcome is not None:
        return entry, None, "duplicate"
    entry.outcome = [reward.reward, ts, reward.source, reward.criterion]
    if traj is None:
        return entry, None, "waiting"
    return _close(entry, "joined", now), joined_with(traj, reward.reward, entry), "joined"


def expire(entry: Entry, t: Timeouts, now: float) -> Result:
    """What a sweep does to an entry past its deadline: time out, expire an orphan, or forget."""
    if entry.closed:
        return None, None, "forgotten"
    if not entry.has_trajectory:
        return None, None, "expired_reward"  # forgotten: a trajectory arriving later waits afresh
    traj = Trajectory.decode(entry.trajectory)
    out = None if t.default_reward is None else joined_with(traj, t.default_reward, entry)
    return _close(entry, "timeout", now), out, "timeout"


def joined_with(traj: Trajectory, reward: float, entry: Entry) -> Trajectory:
    """The trajectory with its outcome reward and the per-turn rewards merged in (its own win)."""
    own = {i for i, _ in traj.turn_rewards}
    traj.reward = float(reward)
    traj.turn_rewards = sorted([*traj.turn_rewards, *((i, r) for i, r in entry.turns.items() if i not in own)])
    if entry.outcome is not None:
        traj.meta = {**traj.meta, "reward_source": entry.outcome[2], "reward_criterion": entry.outcome[3]}
    return traj


def latency_s(entry: Entry) -> float | None:
    """Trajectory published → outcome reward published, by broker timestamps (0 if the reward came first)."""
    if entry.trajectory_ts is None or entry.outcome is None:
        return None
    return max(entry.outcome[1] - entry.trajectory_ts, 0.0)


def _close(entry: Entry, how: str, now: float) -> Entry:
    entry.closed, entry.closed_at, entry.trajectory = how, now, None  # the bytes are no longer needed
    return entry


def _is_action(traj: Trajectory, index: int) -> bool:
    return 0 <= index < traj.num_tokens and bool(traj.action_mask[index])

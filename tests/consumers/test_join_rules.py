"""The join rules as pure functions: either side first, duplicates, timeouts, per-turn merging."""

from __future__ import annotations

import random

import pytest

from consumers.join_rules import Entry, Timeouts, add_reward, add_trajectory, expire, latency_s
from consumers.joiner import Index
from schemas.messages import Reward, SchemaError, Trajectory
from tests.consumers.util import pending_trajectory

T = Timeouts(reward_s=10.0, orphan_s=5.0, remember_s=100.0, default_reward=None)


def _traj(entry, tid="t", now=0.0):
    traj = pending_trajectory(tid)
    return add_trajectory(entry, traj.encode(), Trajectory.decode(traj.encode()), ts=now, now=now, partition=3)


def _reward(entry, value, index=None, now=1.0):
    return add_reward(entry, Reward(trajectory_id="t", reward=value, token_index=index), ts=now, now=now, partition=3)


def test_trajectory_then_reward_and_reward_then_trajectory_join_the_same():
    e, out, what = _traj(None)
    assert (out, what) == (None, "waiting")
    e, out, what = _reward(e, 0.5, now=2.0)
    assert what == "joined" and out.reward == 0.5 and e.closed == "joined" and e.trajectory is None
    assert latency_s(e) == 2.0
    e2, out2, what2 = _reward(None, 0.5)
    assert what2 == "waiting" and out2 is None
    e2, out2, what2 = _traj(e2, now=3.0)
    assert what2 == "joined" and out2.encode() == out.encode() and latency_s(e2) == 0.0


def test_first_reward_wins_and_the_rest_are_duplicates_or_late():
    e, _, _ = _reward(None, 1.0)
    e, _, what = _reward(e, 2.0)
    assert what == "duplicate"
    e, out, _ = _traj(e)
    assert out.reward == 1.0
    assert _reward(e, 3.0)[2] == "duplicate" and _reward(e, 3.0, index=5)[2] == "late"
    assert _traj(e)[2] == "duplicate_trajectory"


def test_per_turn_rewards_are_merged_and_checked_against_the_action_tokens():
    e, _, _ = _reward(None, 0.25, index=7)
    e, _, _ = _reward(e, 0.9, index=1)  # a prompt token: dropped once the trajectory shows it
    e, _, _ = _traj(e)
    with pytest.raises(SchemaError, match="token_index"):
        _reward(e, 0.1, index=0)
    e, _, what = _reward(e, 0.5, index=5)
    assert what == "turn" and _reward(e, 0.6, index=5)[2] == "duplicate"
    e, out, _ = _reward(e, 1.0)
    assert out.turn_rewards == [(5, 0.5), (7, 0.25)] and out.reward == 1.0
    Trajectory.decode(out.encode())  # the codec accepts what the joiner emits


def test_timeouts_drop_or_default_and_orphan_rewards_are_forgotten():
    e, _, _ = _traj(None)
    assert e.deadline(T) == 10.0
    closed, out, what = expire(e, T, now=10.0)
    assert (out, what, closed.closed) == (None, "timeout", "timeout") and closed.deadline(T) == 110.0
    assert _reward(closed, 1.0)[2] == "late"
    e, _, _ = _traj(None)
    _, out, _ = expire(e, Timeouts(reward_s=1, orphan_s=1, remember_s=1, default_reward=-1.0), now=10.0)
    assert out.reward == -1.0
    orphan, _, _ = _reward(None, 1.0, now=2.0)
    assert orphan.deadline(T) == 7.0 and expire(orphan, T, now=7.0)[:2] == (None, None)
    assert expire(closed, T, now=110.0)[2] == "forgotten"


def test_entries_round_trip_and_headers_skip_the_trajectory_bytes():
    e, _, _ = _reward(None, 0.5, index=6)
    e, _, _ = _traj(e)
    back = Entry.decode(e.encode())
    assert back == e
    head = Entry.decode(e.encode(), header_only=True)
    assert head.trajectory is None and head.has_trajectory and head.turns == {6: 0.5}


def test_the_joiners_index_counts_open_trajectories_as_entries_come_and_go():
    """The sweep's count of open trajectories, kept as entries change, equals a recount over
    a random history of joins, closes, removals and partitions revoked and rebuilt."""
    index, entries, rng = Index(T), {}, random.Random(0)
    index.rebuild(0, []), index.rebuild(1, [])
    for step in range(2000):
        n = rng.randrange(50)
        key, action = f"t{n}".encode(), rng.random()
        if action < 0.6:
            entry = Entry(partition=n % 2,  # a key's partition never changes trajectory_seen=1.0 if rng.random() < 0.7 else None,
                          reward_seen=1.0, closed=rng.choice(["", "", "joined"]))
            entries[key] = entry
            index.update(key, entry)
        elif action < 0.95:
            entries.pop(key, None)
            index.update(key, None)
        else:  # a partition revoked, then assigned again and rebuilt from the table
            p = rng.randrange(2)
            index.forget({p})
            index.rebuild(p, entries.items())
        expected = sum(e.has_trajectory and not e.closed for k, e in entries.items() if index.built(e.partition))
        assert index.pending() == expected, step

"""Step formation with no Kafka (learner/formation.py): duplicates, staleness, dead letters, whole
groups, when a step closes, an abandoned step undone, and the ledgers bounded and checkpointed."""

from __future__ import annotations

import threading

from learner.formation import Formation, StepRule
from learner.source import TrajectorySource
from schemas.kafka import KafkaConfig
from tests.learner.test_checks import SPEC
from tests.schemas.test_messages import _traj as traj

RULE = StepRule(batch_trajectories=4, batch_tokens=1 << 20)


def form(f: Formation, step_index: int, records: list, rule: StepRule = RULE):
    """Offer `records` ((partition, offset, traj) each) until the step is full; the step and what
    was left unoffered."""
    step, left = f.open(step_index, rule), list(records)
    while left and not f.full(step):
        partition, offset, t = left.pop(0)
        f.offer(step, partition, offset, t, t.encode() if t is not None else b"")
    return f.close(step), left


def records(trajs, partition: int = 0, start: int = 0) -> list:
    return [(partition, start + i, t) for i, t in enumerate(trajs)]


def test_a_step_closes_at_its_trajectory_or_token_budget_in_arrival_order():
    f = Formation()
    step, left = form(f, 0, records([traj(id=f"t{i}") for i in range(6)]))
    assert step.ids == ["t0", "t1", "t2", "t3"] and len(left) == 2
    assert f.positions == {0: 4} and step.num_tokens == 4 * traj().num_tokens
    by_tokens = StepRule(batch_trajectories=100, batch_tokens=2 * traj().num_tokens)
    step, _ = form(f, 1, records([traj(id=f"u{i}") for i in range(6)], start=4), by_tokens)
    assert step.ids == ["u0", "u1"] and f.positions == {0: 6}


def test_duplicates_dead_letters_and_stale_ones_are_consumed_counted_and_not_trained():
    f = Formation()
    form(f, 0, records([traj(id=f"t{i}") for i in range(4)]))
    stale_ids = {"s0"}
    rule = StepRule(batch_trajectories=2, batch_tokens=1 << 20, min_fresh_frac=0.5,
                    fresh=lambda t: 0.2 if t.id in stale_ids else 1.0, staleness=lambda t: 7 if t.id == "n1" else 0)
    batch = [traj(id="t1"), None, traj(id="s0"), traj(id="n0"), traj(id="n0"), traj(id="n1")]
    step, left = form(f, 1, records(batch, partition=3), rule)
    assert step.ids == ["n0", "n1"] and step.staleness == [0, 7] and not left
    assert step.dropped == {"duplicate": ["t1", "n0"], "stale": ["s0"]}
    assert (f.counts["duplicate"], f.counts["dlq"], f.counts["stale"]) == (2, 1, 1)
    assert f.positions == {0: 4, 3: 6}
    assert f.dropped["s0"] == ("stale", 1) and f.trained["n1"] == 1


def test_an_abandoned_step_leaves_no_trace():
    f = Formation()
    form(f, 0, records([traj(id=f"t{i}") for i in range(4)]))
    before = f.state_dict(), dict(f.counts)
    step = f.open(1, RULE)
    for p, o, t in records([traj(id="t0"), traj(id="x")], start=4):
        f.offer(step, p, o, t, t.encode())
    f.abandon()
    assert (f.state_dict(), dict(f.counts)) == before
    step, _ = form(f, 1, records([traj(id=f"y{i}") for i in range(4)], start=4))
    assert step.ids == ["y0", "y1", "y2", "y3"]


def test_the_ledger_is_bounded_by_its_window_and_so_is_the_checkpoint():
    f = Formation(dedup_window=100)
    sizes = []
    for step in range(5_000):
        assert len(form(f, step, records([traj(id=f"t{4 * step + i}") for i in range(4)], start=4 * step))[0].ids) == 4
        sizes.append(len(f.state_dict()["trained"]))
    assert max(sizes) == 100 and sizes[-1] == 100
    assert [i for i, _ in f.state_dict()["trained"]][-1] == "t19999"


def test_group_baselines_train_only_whole_groups_and_release_a_late_partial_group():
    f = Formation(needs_groups=True, group_wait_steps=2)
    members = {g: [traj(id=f"{g}.{s}", group=g, group_size=3) for s in range(3)] for g in "abcde"}
    stream = records([members[g][s] for s in range(3) for g in "abc"] + members["d"][:2] + members["e"])
    step, stream = form(f, 0, stream, StepRule(batch_trajectories=6, batch_tokens=1 << 20))
    assert sorted(step.ids) == ["a.0", "a.1", "a.2", "b.0", "b.1", "b.2"]
    three = StepRule(batch_trajectories=3, batch_tokens=1 << 20)
    step, stream = form(f, 1, stream, three)
    assert sorted(step.ids) == ["c.0", "c.1", "c.2"]
    step, stream = form(f, 2, stream, three)
    assert sorted(step.ids) == ["e.0", "e.1", "e.2"] and set(f.held) == {"d"} and not stream
    again = Formation(needs_groups=True, group_wait_steps=2)
    again.load_state_dict(f.state_dict())  # the held members travel in the checkpoint
    assert [e.traj.id for e in again.held["d"]] == ["d.0", "d.1"]
    two = StepRule(batch_trajectories=2, batch_tokens=1 << 20)
    step = again.open(3, two)  # waited 1 step: still held, the step stays open
    assert not step.ids and set(again.held) == {"d"}
    again.abandon()
    step, _ = form(again, 4, [], two)  # waited 2 steps: trains partial
    assert sorted(step.ids) == ["d.0", "d.1"]
    lone = Formation(needs_groups=True, group_wait_steps=1)
    form(lone, 0, records([traj(id="z.0", group="z", group_size=3)]))
    step, _ = form(lone, 1, [])
    assert step.dropped == {"partial_group": ["z.0"]} and lone.counts["partial_group"] == 1


def test_the_source_forms_steps_from_its_queue_by_these_rules_and_a_stop_abandons_the_step():
    src = TrajectorySource(KafkaConfig(), SPEC)  # never started: fed by hand
    for offset, t in enumerate([traj(id="a"), traj(id="a"), traj(id="b")]):
        src._queue.put((0, offset, t, t.encode()))
    stop = threading.Event()
    step = src.next_step(step_index=0, staleness=lambda t: 0, fresh=lambda t: 1.0, min_fresh_frac=0.0,
                         batch_trajectories=2, batch_tokens=1 << 20, stop=stop)
    assert step.ids == ["a", "b"] and src.counts["duplicate"] == 1 and src.positions == {0: 3}
    src._queue.put((0, 3, traj(id="c"), b""))
    src._queue.put((0, 4, traj(id="d"), b""))  # a whole step waiting (producers ahead) does not outrun the stop
    stop.set()
    assert src.next_step(step_index=1, staleness=lambda t: 0, fresh=lambda t: 1.0, min_fresh_frac=0.0,
                         batch_trajectories=2, batch_tokens=1 << 20, stop=stop) is None
    assert src.positions == {0: 3} and not {"c", "d"} & set(src.formation.trained)  # consumed again after a restart

"""The audit's reconciliation as a pure function: a hand-built run where every rule explains one
id, the replay rule of the learner's metrics, and a random property: an id consumed by the learner
that no record explains is always reported."""

from __future__ import annotations

import random

from sao.audit import lineage
from sao.reconcile import Learned, Topics, reconcile
from schemas.messages import DeadLetter, Prompt, Trajectory
from tests.consumers.util import pending_trajectory

NAMES = {s: f"r.{s}" for s in ("prompts", "trajectories.pending", "rewards", "trajectories", "dlq")}


def _prompt(i: str) -> Prompt:
    return Prompt(id=i, env="toy-target")


def _traj(i: str) -> Trajectory:
    return pending_trajectory(f"{i}#0.0")


def _learned(**kw) -> Learned:
    return Learned(**{"positions": {}, "ledger": {}, "ledger_dropped": {}, "held": set(),
                      "steps": {}, "dropped": {}, **kw})


def test_each_rule_explains_its_id_and_the_rest_is_reported():
    prompts = {(0, o): _prompt(i) for o, i in enumerate(["made", "dead", "lost", "late"])}
    prompts[(1, 0)] = None  # undecodable, reported by place
    dead = [DeadLetter(source_topic="r.prompts", partition=0, offset=1, error="bad", payload=b""),
            DeadLetter(source_topic="r.trajectories", partition=0, offset=4, error="bad", payload=b"")]
    trajs = {(0, o): _traj(i) for o, i in enumerate(["made", "stale", "held", "twice", "dlq", "gone", "new"])}
    trajs[(1, 0)] = _traj("made")  # a duplicate copy
    topics = Topics(names=NAMES, prompts=prompts, pending={(0, 0): _traj("wait")}, trajectories=trajs,
                    rewarded={}, dead=dead, producers={0: 3, 1: 1})
    learner = _learned(positions={0: 6, 1: 1}, steps={0: ["made#0.0"], 1: ["twice#0.0"]},
                       ledger={"twice#0.0": 0}, held={"held#0.0"}, dropped={"stale#0.0": "stale"})
    result = reconcile(topics, learner)
    prompts_fed, pending, trained = result.sections
    assert prompts_fed.rows == {"produced a trajectory": 1, "dead-lettered": 1,
                                "in flight (past the producers' commits)": 1}
    assert sorted(prompts_fed.unexplained) == ["lost#0.0", "r.prompts[1]@0"]
    assert pending.rows["no reward yet"] == 1 and not pending.unexplained
    assert trained.rows == {"trained": 2, "dropped as stale": 1, "dropped, group incomplete": 0,
                            "held until its group is whole": 1, "dead-lettered": 1,
                            "not yet trained (past the checkpoint)": 1}
    assert trained.unexplained == ["gone#0.0"]
    assert result.duplicates == 1 and result.trained_twice == {"twice#0.0": [0, 1]}
    assert not result.ok and "unexplained prompts fed (2): lost#0.0, r.prompts[1]@0" in result.table()


def test_a_replayed_step_supersedes_the_records_after_its_checkpoint():
    records = [{"step/index": i, "trajectory_ids": [f"a{i}"]} for i in range(5)]
    records += [{"step/index": i, "trajectory_ids": [f"b{i}"]} for i in (3, 4, 5)]  # resumed at step 3
    assert [m["trajectory_ids"][0] for m in lineage(records)] == ["a0", "a1", "a2", "b3", "b4", "b5"]


def test_a_consumed_id_that_no_record_explains_is_always_reported():
    rng = random.Random(0)
    for _ in range(50):
        ids = [f"t{i}" for i in range(rng.randint(1, 30))]
        trajs = {(0, o): _traj(i) for o, i in enumerate(ids)}
        position = rng.randint(0, len(ids))
        explained = {i for i in ids[:position] if rng.random() < 0.8}
        learner = _learned(positions={0: position}, steps={0: [f"{i}#0.0" for i in explained]})
        result = reconcile(Topics(names=NAMES, prompts={}, pending={}, trajectories=trajs, rewarded={}), learner)
        assert sorted(result.sections[2].unexplained) == sorted(f"{i}#0.0" for i in set(ids[:position]) - explained)
        assert result.sections[2].total == len(ids)

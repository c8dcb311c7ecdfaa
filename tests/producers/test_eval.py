"""`sao eval` on the real broker with the hf engine and tiny models: which versions it scores (the
first, every Nth, the newest at a stop), that each score is of exactly that version's weights, that
a restart scores nothing twice, and that a version it cannot load is skipped, not fatal."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import numpy as np
import pytest

from producers.envs import make_env
from producers.evaluate.service import EvalConfig, run
from producers.evaluate.suite import Suite, figures
from producers.generate.hf import HFGenerator
from producers.models import load_model
from schemas import topics as T
from schemas.config import ConfigError
from schemas.messages import Evaluation, Trajectory, Weights
from schemas.weights import payload as W
from tests.producers.util import announce, read_topic, state_of, wait_until


class Run:
    """A learner's line as the evaluator sees it: a weight store describing tiny-llama, and
    versions announced as inline anchors or deltas, each a differently seeded model."""

    def __init__(self, kafka, tmp_path):
        self.kafka, self.tmp, self.states = kafka, tmp_path, {}
        self.store = tmp_path / "store"
        self.store.mkdir()
        model = load_model("tiny-llama", seed=0)
        (self.store / "config.json").write_text(model.config.to_json_string())
        (self.store / "model.json").write_text(json.dumps({"name": "tiny-llama"}))

    def publish(self, version: int, step: int, seed: int, base: int = -1, file_gone: bool = False) -> None:
        state = self.states[version] = state_of(load_model("tiny-llama", seed=seed))
        payload = W.anchor(state) if base < 0 else W.delta(state, self.states[base], base)[0]
        data, uri = payload.to_bytes(), ""
        if file_gone:  # announced as a file the evaluator will not find
            data, uri = b"", (self.tmp / f"gone-v{version}.safetensors").resolve().as_uri()
        announce(self.kafka, Weights(version=version, step=step, base=base, uri=uri, payload=data,
                                     num_bytes=payload.num_bytes, digest=W.digest(state), dtype="float32",
                                     store=self.store.resolve().as_uri()))


def evaluator(cfg: EvalConfig) -> tuple[threading.Event, threading.Thread, list]:
    stop, out = threading.Event(), []
    thread = threading.Thread(target=lambda: out.append(run(cfg, stop)), daemon=True)
    thread.start()
    return stop, thread, out


def results(kafka, n: int, timeout: float = 120) -> list[Evaluation]:
    return read_topic(kafka, T.EVALUATIONS, n, timeout=timeout)


def config(kafka, tmp_path, **kw) -> EvalConfig:
    settings = {"env": "toy-target", "backend": "hf", "tasks": 4, "samples": 2, "max_tokens": 6, "every": 3,
                "out": str(tmp_path / "eval.jsonl"), "kafka": kafka}
    return EvalConfig(**settings | kw)


def test_the_first_every_nth_and_at_a_stop_the_newest_version_are_scored_each_of_its_own_weights(kafka_cfg, tmp_path):
    line = Run(kafka_cfg, tmp_path)
    for v, seed in enumerate((0, 1, 2, 3)):
        line.publish(v, 2 * v, seed, base=v - 1)
    cfg = config(kafka_cfg, tmp_path)
    stop, thread, count = evaluator(cfg)
    try:
        got = results(kafka_cfg, 2)
        assert [e.version for e in got] == [0, 3] and [e.step for e in got] == [0, 6]
        line.publish(4, 8, seed=4, base=3)  # not due (every 3): scored only at the stop
        time.sleep(3)
        assert len(results(kafka_cfg, 3, timeout=3)) == 2
    finally:
        stop.set()
        thread.join(180)
    assert count == [3]
    got = results(kafka_cfg, 3)
    assert [e.version for e in got] == [0, 3, 4]
    assert {e.split for e in got} == {"all"} and {e.num_tasks for e in got} == {4}  # toy-target: 4 tasks, none held out
    assert {"greedy/mean", "sampled/mean@2", "sampled/pass@2", "episode/errors"} <= set(got[0].metrics)
    lines = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [0, 3, 4] and lines[1]["greedy/mean"] == got[1].metrics["greedy/mean"]
    # each task's greedy reward, in task order: what compares two versions task by task
    assert all(len(x["tasks"]) == 4 and sum(x["tasks"]) / 4 == pytest.approx(x["greedy/mean"]) for x in lines)
    assert all(x["task_turns"] == [1.0] * 4 and x["task_tool_calls"] == [0.0] * 4 for x in lines)  # one turn, no tool
    # v3's greedy figures are those of v3's weights, played here in-process
    model = load_model("tiny-llama", seed=0)
    model.load_state_dict({k: W.to_torch(t) for k, t in line.states[3].items()})
    local = dataclasses.replace(cfg, samples=0)
    suite = Suite(cfg=local, env=make_env("toy-target"), generator=HFGenerator(model, version=3), stops=(),
                  tasks=[{"target": t} for t in range(4)], split="all")
    mine = figures(local, asyncio.run(suite.play(3)), 3)
    assert mine["greedy/mean"] == pytest.approx(got[1].metrics["greedy/mean"])
    assert got[0].metrics["greedy/mean"] != got[1].metrics["greedy/mean"] or \
        got[1].metrics["greedy/mean"] != got[2].metrics["greedy/mean"]  # different weights, different scores


def test_versions_named_are_scored_exactly_oldest_first_then_it_stops_unasked(kafka_cfg, tmp_path):
    line = Run(kafka_cfg, tmp_path)
    for v, seed in enumerate((0, 1, 2, 3)):
        line.publish(v, 2 * v, seed, base=v - 1)
    stop, thread, count = evaluator(config(kafka_cfg, tmp_path, every=1, samples=0))  # the run's own
    assert [e.version for e in results(kafka_cfg, 2)] == [0, 3]  # behind: 1 and 2 skipped
    stop.set()
    thread.join(180)
    # the finished run scored again under another name, with samples: 4 is not announced yet
    again = config(kafka_cfg, tmp_path, name="rescored", versions="4,1,3", samples=3, out=str(tmp_path / "again.jsonl"))
    stop, thread, count = evaluator(again)
    try:
        wait_until(lambda: len(results(kafka_cfg, 4, timeout=2)) >= 4, timeout=120, every=0.5)
        assert thread.is_alive()  # waiting for version 4
        line.publish(4, 8, seed=4, base=3)
        thread.join(120)
        assert not thread.is_alive()  # it stops once 1, 3 and 4 are scored, with no stop asked for
    finally:
        stop.set()
        thread.join(180)
    assert count == [3]
    everything = results(kafka_cfg, 5)
    got = [e for e in everything if e.suite == "rescored"]
    assert [e.version for e in got] == [1, 3, 4] and all("sampled/mean@3" in e.metrics for e in got)
    assert [e.version for e in everything if e.suite == "heldout"] == [0, 3]
    assert got[1].metrics["greedy/mean"] == everything[1].metrics["greedy/mean"]  # v3 twice: one score
    assert [json.loads(x)["version"] for x in (tmp_path / "again.jsonl").read_text().splitlines()] == [1, 3, 4]


def test_a_version_named_beyond_the_anchors_held_is_skipped_and_the_rest_scored(kafka_cfg, tmp_path):
    line = Run(kafka_cfg, tmp_path)
    # anchors at 0, 1 and 64: the evaluator reads the topic's tail back to its second-newest anchor
    # (here the last 64 announcements), so nothing it holds reaches 0
    for v in range(65):
        line.publish(v, v, seed=v % 3, base=-1 if v in (0, 1, 64) else v - 1)
    stop, thread, count = evaluator(config(kafka_cfg, tmp_path, versions="0,3", samples=0))
    try:
        thread.join(120)
        assert not thread.is_alive()  # 0 is not waited for: it stops after scoring 3
    finally:
        stop.set()
        thread.join(180)
    assert count == [1] and [e.version for e in results(kafka_cfg, 1)] == [3]


def test_versions_must_be_version_numbers():
    for bad in ("1,x", "-1", "0;3"):
        with pytest.raises(ConfigError, match="--versions"):
            EvalConfig(versions=bad)
    assert EvalConfig(versions=" 24, 0,12,0").wanted == (0, 12, 24)


def test_a_restart_scores_nothing_twice_and_a_version_it_cannot_load_is_skipped(kafka_cfg, tmp_path):
    line = Run(kafka_cfg, tmp_path)
    line.publish(0, 0, seed=0)
    cfg = config(kafka_cfg, tmp_path, every=1, samples=0)
    stop, thread, count = evaluator(cfg)
    results(kafka_cfg, 1)
    stop.set()
    thread.join(180)
    assert count == [1]
    line.publish(1, 1, seed=1, base=0, file_gone=True)
    line.publish(2, 2, seed=2)
    stop, thread, count = evaluator(cfg)  # a new process: it learns what was scored from the topic
    try:
        wait_until(lambda: len(results(kafka_cfg, 2, timeout=2)) >= 2, timeout=120, every=0.5)
    finally:
        stop.set()
        thread.join(180)
    assert count == [1]
    assert [e.version for e in results(kafka_cfg, 3, timeout=5)] == [0, 2]


def _played(versions: list[int], reward: float | None) -> dict:
    n = len(versions) + 2
    mask = np.r_[[0, 0], np.ones(len(versions))].astype(np.uint8)
    traj = Trajectory(id="t", prompt_id="p", env="toy-target", producer_id="x", tokens=np.arange(n), action_mask=mask,
                      rollout_logprobs=np.zeros(n), versions=np.r_[[-1, -1], versions].astype(np.int32), prompt_len=2,
                      reward=reward)
    return {0: [traj]}


def test_a_score_mixing_versions_or_missing_a_reward_is_refused():
    cfg = EvalConfig(env="toy-target", samples=0)
    assert figures(cfg, _played([5, 5], 1.0), 5)["greedy/mean"] == 1.0
    with pytest.raises(RuntimeError, match="versions \\[5, 6\\]"):
        figures(cfg, _played([5, 6], 1.0), 5)
    with pytest.raises(ConfigError, match="--reward"):
        figures(cfg, _played([5, 5], None), 5)
    assert figures(cfg, {0: [None]}, 5) == {"greedy/mean": 0.0, "greedy/pass@1": 0.0, "episode/errors": 1.0}

"""The held-out split: by task content, the same in every process, and never published by the feeder."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producers.envs import make_env
from producers.feeder.service import FeedConfig, run as feed
from producers.heldout import evaluation_tasks, held_out, split_frac, task_key
from schemas import topics as T
from schemas.config import ConfigError
from tests.kafka_util import read_topic


def test_the_split_is_by_content_whatever_the_key_order():
    a, b = {"question": "What is 2 + 3?", "answer": 5}, {"answer": 5, "question": "What is 2 + 3?"}
    assert task_key(a) == task_key(b)
    assert all(held_out(a, f) == held_out(b, f) for f in (0.1, 0.5, 0.9))
    assert not held_out(a, 0.0) and held_out(a, 1.0)


@settings(max_examples=20, deadline=None)
@given(st.floats(0.05, 0.95), st.integers(0, 2**32))
def test_about_frac_of_all_tasks_are_held_out_and_a_larger_frac_holds_out_a_superset(frac, seed):
    rng = random.Random(seed)
    tasks = [{"n": rng.randrange(10**9)} for _ in range(4000)]
    held = [held_out(t, frac) for t in tasks]
    assert abs(sum(held) / len(tasks) - frac) < 0.04
    more = [held_out(t, min(frac + 0.05, 1.0)) for t in tasks]
    assert all(m for h, m in zip(held, more) if h)


def test_evaluation_tasks_are_distinct_held_out_and_the_same_for_a_seed():
    env = make_env("math")
    tasks = evaluation_tasks(env, 32, 0.2, seed=7)
    assert len(tasks) == 32 and len({task_key(t) for t in tasks}) == 32
    assert all(held_out(t, 0.2) for t in tasks)
    assert tasks == evaluation_tasks(env, 32, 0.2, seed=7)


def test_an_env_too_small_to_hold_out_is_evaluated_on_any_of_its_tasks():
    env = make_env("toy-target")  # four tasks
    assert split_frac(env, 0.3) == 0.0
    tasks = evaluation_tasks(env, 16, 0.3, seed=0)
    assert sorted(t["target"] for t in tasks) == [0, 1, 2, 3]  # every distinct task, not 16


def test_an_env_none_of_whose_drawn_tasks_is_held_out_is_refused():
    class One:
        name = "one"

        def sample_task(self, rng):
            return {"x": 1}

    frac = 0.5 if not held_out({"x": 1}, 0.5) else 0.0001
    with pytest.raises(ConfigError, match="no held-out task"):
        evaluation_tasks(One(), 4, frac, seed=0)


def test_the_feeder_never_publishes_a_held_out_task_from_the_generator(kafka_cfg):
    assert feed(FeedConfig(env="math", count=300, heldout_frac=0.25, max_lag=0, max_unfinished=400,
                           kafka=kafka_cfg)) == 300
    prompts = read_topic(kafka_cfg, T.PROMPTS, 300)
    assert len(prompts) == 300 and not [p for p in prompts if held_out(p.task, 0.25)]
    # what the evaluator takes at the same fraction is none of what was trained
    evaluated = {task_key(t) for t in evaluation_tasks(make_env("math"), 64, 0.25, seed=0)}
    assert evaluated and not evaluated & {task_key(p.task) for p in prompts}


def test_the_feeder_skips_a_datasets_held_out_rows(kafka_cfg, tmp_path):
    rows = [{"id": f"r{i}", "task": {"question": f"What is {i} + 1?", "answer": i + 1}} for i in range(200)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept = [r for r in rows if not held_out(r["task"], 0.3)]
    assert 100 < len(kept) < 180
    assert feed(FeedConfig(env="math", dataset=str(path), heldout_frac=0.3, max_lag=0, max_unfinished=400,
                           kafka=kafka_cfg)) == len(kept)
    assert sorted(p.id for p in read_topic(kafka_cfg, T.PROMPTS, len(kept))) == sorted(r["id"] for r in kept)


def test_a_feeder_holding_out_every_task_is_refused_at_start():
    with pytest.raises(ConfigError, match="--heldout-frac"):
        FeedConfig(env="math", heldout_frac=1.0)

"""Plug-in environments and rewards: by import path and by an installed package's `sao.envs` entry
point, through real producers on the broker into the learner; the text adapter's tokens; bad
plug-ins refused at start; a reward that fails one episode dead-letters that prompt only."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from producers.envs.base import Step
from producers.envs.chat import Chat
from producers.envs.text import text_step
from producers.episode import Player
from producers.feeder.service import Backlog, FeedConfig
from producers.feeder.service import run as feed
from producers.service import ProducerConfig, make_generator, make_parts
from producers.service import run as produce
from schemas import topics as T
from schemas.config import ConfigError
from schemas.messages import DeadLetter, Prompt, SchemaError
from schemas.tokenizers import load_tokenizer
from tests.learner.service_util import learner_cmd, metrics, run_learner
from tests.producers.util import REPO, make_prompts, publish_prompts, read_topic

GUESS = "examples.custom_env:GuessNumber"
BYTES = dict(model="tiny-llama-bytes", max_tokens=4, follow_weights=False)


def test_import_path_env_and_reward_from_examples_train_a_learner_step(kafka_cfg, tmp_path):
    feed(FeedConfig(env=GUESS, count=4, kafka=kafka_cfg))
    produce(ProducerConfig(env=GUESS, reward="examples.reward:score", max_turns=2, max_prompts=4, **BYTES,
                           kafka=kafka_cfg))
    trajs = read_topic(kafka_cfg, T.TRAJECTORIES, 4)
    assert len(trajs) == 4 and all(t.env == GUESS and t.reward in (0.0, 1.0) for t in trajs)
    assert all(t.meta["reward_source"] == "examples.reward:score" for t in trajs)
    run_learner(learner_cmd(kafka_cfg, tmp_path, "--model.name", "tiny-llama", "--model.vocab-size", "260",
                            "--batch-trajectories", "4", "--max-steps", "1"))
    [step] = metrics(tmp_path)
    assert sorted(step["trajectory_ids"]) == sorted(t.id for t in trajs)


PACKAGE = {
    "pyproject.toml": """
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "sao-count-env"
version = "0.1"

[project.entry-points."sao.envs"]
count-up = "sao_count_env:CountUp"
""",
    "sao_count_env/__init__.py": '''
"""A token-level Env: the reward is the share of action tokens above the task's threshold."""
import random
from producers.envs.base import Step


class Episode:
    max_turns = 1

    def __init__(self, tokenizer, task):
        self.prompt_ids = tokenizer.encode(f"count past {task['above']}", add_special_tokens=False)
        self.above = task["above"]

    def step(self, action_ids):
        return Step(reward=sum(t > self.above for t in action_ids) / len(action_ids), done=True)


class CountUp:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def sample_task(self, rng):
        return {"above": rng.randrange(256)}

    def episode(self, task):
        return Episode(self.tokenizer, task)


def odd_to_pending(task, text, trajectory):
    """A reward: the env's own for even thresholds; odd ones wait for a live reward."""
    return None if task["above"] % 2 else trajectory.reward
''',
}


def test_entry_point_env_from_an_installed_package_runs_through_sao_processes(kafka_cfg, tmp_path):
    for name, text in PACKAGE.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "--target", str(tmp_path / "site"), str(tmp_path / "pkg")], check=True, capture_output=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap,
           "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    tasks = [{"above": a} for a in (10, 11, 200, 201)]
    published = make_prompts("count-up", tasks)
    publish_prompts(kafka_cfg, published)
    out = subprocess.run([sys.executable, "-m", "sao", "producer", "--env", "count-up", "--model", "tiny-llama-bytes",
                          "--reward", "sao_count_env:odd_to_pending", "--max-tokens", "4", "--max-prompts", "4",
                          "--no-follow-weights"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    scored, pending = read_topic(kafka_cfg, T.TRAJECTORIES, 2), read_topic(kafka_cfg, T.PENDING, 2)
    assert sorted(t.env for t in scored + pending) == ["count-up"] * 4
    by_above = {t.prompt_id: t for t in scored + pending}
    assert len(by_above) == 4 and all(t.reward is None for t in pending)
    assert all(0.0 <= t.reward <= 1.0 and t.meta["reward_source"] == "sao_count_env:odd_to_pending" for t in scored)
    assert len(read_topic(kafka_cfg, T.TRAJECTORIES, 3, timeout=3)) == 2  # no odd threshold was scored
    # the feeder finds it too, and samples its tasks
    fed = subprocess.run([sys.executable, "-m", "sao", "feed", "--env", "count-up", "--count", "2"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=120)
    assert fed.returncode == 0, fed.stderr[-3000:]
    news = [p for p in read_topic(kafka_cfg, T.PROMPTS, 6) if p.id not in {q.id for q in published}]
    assert [p.env for p in news] == ["count-up"] * 2 and all(0 <= p.task["above"] < 256 for p in news)


def test_dataset_example_feeds_the_math_env_scored_by_the_reward_example(kafka_cfg):
    rows = (REPO / "examples" / "dataset.jsonl").read_text().splitlines()
    assert feed(FeedConfig(env="math", dataset=str(REPO / "examples" / "dataset.jsonl"), kafka=kafka_cfg)) == len(rows)
    produce(ProducerConfig(env="math", reward="examples.reward:score", max_prompts=len(rows), **BYTES, kafka=kafka_cfg))
    trajs = read_topic(kafka_cfg, T.TRAJECTORIES, len(rows))
    assert {"add-1", "sub-1", "mul-1", "dataset.jsonl:4", "dataset.jsonl:5"} == {t.prompt_id for t in trajs}
    assert all(t.reward in (0.0, 1.0) and t.meta["reward_source"] == "examples.reward:score" for t in trajs)


class Recording:
    """A text env (the test's own, by import path) that records the text each step received."""

    actions: list[str] = []

    def reset(self, task):
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task["say"]}]

    def step(self, action):
        Recording.actions.append(action)
        return f"heard {len(Recording.actions)}", 0.5, len(Recording.actions) == 3


def test_text_env_trains_the_sampled_ids_with_template_tokens_between_them():
    Recording.actions.clear()
    cfg = ProducerConfig(env="tests.producers.test_plugins:Recording", max_turns=5, **BYTES)
    tok = load_tokenizer(cfg.model)
    envs, params, _ = make_parts(cfg, tok)
    env = envs[cfg.env]
    assert env.name == cfg.env and not hasattr(env, "sample_task")  # no sampler: a dataset feeds it
    player = Player(envs=envs, generator=make_generator(cfg), params=params, producer_id="t")
    traj = asyncio.run(player.play(Prompt(id="p", env=cfg.env, task={"say": "hi"})))
    chat, ids, mask = Chat(tok), traj.tokens.tolist(), traj.action_mask
    spans = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask)) + 1)
    actions = [[ids[i] for i in s] for s in spans if mask[s[0]]]
    assert traj.num_turns == 3 and len(actions) == 3 and traj.reward == 0.5
    assert [chat.decode(a) for a in actions] == Recording.actions
    prompt = chat.prompt_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    expected = list(prompt)
    for n, a in enumerate(actions, 1):
        expected += a + (chat.observation_ids(a, f"heard {n}") if n < 3 else [])
    assert ids == expected and traj.prompt_len == len(prompt)
    # what re-tokenising the decoded text would have trained instead (random bytes are not UTF-8)
    assert any(chat.encode(chat.decode(a)) != a for a in actions)
    assert [r for _, r in traj.turn_rewards] == [0.5, 0.5]


def test_text_step_results_are_checked():
    assert text_step(("ok", 1, 0)) == ("ok", 1.0, False)
    for bad, field in (("ok", "step"), ((1, None, True), "step.observation"), (("o", "1", True), "step.reward")):
        with pytest.raises(SchemaError, match=field):
            text_step(bad)


class NonIntTokens:
    name = "x"

    def sample_task(self, rng):
        return {"n": rng.random()}

    def episode(self, task):
        return type("E", (), {"prompt_ids": [1, 2.5], "max_turns": 1})()


def reward_of_two(task, text):
    return 1.0


@pytest.mark.parametrize("flags, message", [
    (dict(env="no_such_module:Env"), "--env 'no_such_module:Env': cannot import no_such_module: ModuleNotFoundError"),
    (dict(env="examples.custom_env:Nope"), "module examples.custom_env has no attribute 'Nope'"),
    (dict(env="examples.custom_env:re"), "is a module, not a class or factory"),
    (dict(env="no-such-env"), "unknown env; built in: ['calc-agent', 'calc-agent-steps', 'math'"),
    (dict(env="tests.producers.test_plugins:NonIntTokens"), "prompt_ids must be a non-empty list of int token ids; found [2.5]"),
    (dict(env=GUESS, reward="tests.producers.test_plugins:reward_of_two"),
     "--reward 'tests.producers.test_plugins:reward_of_two': cannot be called as reward_of_two(task, text, trajectory)"),
    (dict(env=GUESS, reward="examples.reward:nope"), "module examples.reward has no attribute 'nope'"),
    (dict(env=GUESS, model="tiny-llama"), f"--env {GUESS} needs a tokenizer and --model tiny-llama has none"),
])
def test_bad_plug_ins_fail_at_start_naming_the_flag(flags, message):
    with pytest.raises(ConfigError) as e:
        cfg = ProducerConfig(**{"model": "tiny-llama-bytes", **flags})
        make_parts(cfg, load_tokenizer(cfg.model))
    assert message in str(e.value)


def test_sao_producer_refuses_a_bad_plug_in_in_one_line():
    out = subprocess.run([sys.executable, "-m", "sao", "producer", "--env", GUESS, "--model", "tiny-llama-bytes",
                          "--reward", "examples.reward:score.__name__"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith("sao producer: error: --reward 'examples.reward:score.__name__': a str, not")


def picky(task, text, trajectory):
    """A reward that fails on some tasks: each failure costs that prompt only."""
    match task["answer"]:
        case 1:
            return "high"
        case 2:
            return float("nan")
        case 3:
            raise KeyError("rubric")
        case 4:
            return None
    return 0.25


def test_a_reward_that_fails_an_episode_dead_letters_that_prompt_and_the_producer_goes_on(kafka_cfg):
    prompts = make_prompts("math", [{"question": f"q{a}", "answer": a} for a in (1, 2, 3, 4, 5, 6)])
    publish_prompts(kafka_cfg, prompts)
    produce(ProducerConfig(env="math", reward="tests.producers.test_plugins:picky", max_prompts=6, **BYTES,
                           kafka=kafka_cfg))
    letters = read_topic(kafka_cfg, T.DLQ, 3)
    assert all(isinstance(d, DeadLetter) for d in letters)
    dead = {d.payload: d.error for d in letters}
    errors = [dead[p.encode()] for p in prompts[:3]]
    assert "returned a str ('high'), not a number or None" in errors[0]
    assert "returned nan, not a finite number" in errors[1] and "raised KeyError: 'rubric'" in errors[2]
    [waiting] = read_topic(kafka_cfg, T.PENDING, 1)
    scored = read_topic(kafka_cfg, T.TRAJECTORIES, 2)
    assert waiting.prompt_id == prompts[3].id and waiting.reward is None
    assert sorted(t.prompt_id for t in scored) == sorted(p.id for p in prompts[4:])
    assert all(t.reward == 0.25 for t in scored)
    backlog = Backlog(kafka_cfg, "sao-producers")
    assert backlog.count() == 0  # every prompt, dead-lettered or not, committed
    backlog.close()


def test_a_raw_id_env_plug_in_gets_the_smoke_check_too():
    with pytest.raises(ConfigError, match="found \\[2.5\\]"):
        make_parts(ProducerConfig(env="tests.producers.test_plugins:NonIntTokens", model="tiny-llama"), None)
    envs, _, _ = make_parts(ProducerConfig(env="toy-multiturn", model="tiny-llama"), None)
    assert [env.name for env in envs.values()] == ["toy-multiturn"]


class Brittle(Recording):
    """A text env whose step fails on one task: that episode is unplayable (its prompt to the DLQ)."""

    def step(self, action):
        raise ZeroDivisionError("division by zero in the user's scorer")


def test_a_text_env_that_raises_costs_its_episode_not_the_producer():
    cfg = ProducerConfig(env="tests.producers.test_plugins:Brittle", **BYTES)
    envs, params, _ = make_parts(cfg, load_tokenizer(cfg.model))
    player = Player(envs=envs, generator=make_generator(cfg), params=params, producer_id="t")
    with pytest.raises(SchemaError, match="step: ZeroDivisionError: division by zero in the user's scorer"):
        asyncio.run(player.play(Prompt(id="p", env=cfg.env, task={"say": "hi"})))


class TokenEnv:
    """A token-level plug-in env (the Env protocol) whose step fails or returns what is not tokens."""

    name = "token-env"

    def __init__(self, mode: str = "raise"):
        self.mode = mode

    def sample_task(self, rng):
        return {"n": 1}

    def episode(self, task):
        mode = self.mode

        class Ep:
            prompt_ids, max_turns = [1, 2], 3

            def step(self, action_ids):
                if mode == "raise":
                    raise KeyError("scoreboard")
                return Step(observation=[1.5, 2.0])

        return Ep()


@pytest.mark.parametrize("mode, reason", [("raise", r"env.step: KeyError: 'scoreboard'"),
                                          ("floats", r"env.step.observation: expected int token ids")])
def test_a_token_env_step_that_fails_costs_its_episode_not_the_producer(mode, reason):
    cfg = ProducerConfig(env="tests.producers.test_plugins:TokenEnv", max_tokens=2, follow_weights=False)
    envs, params, _ = make_parts(cfg, None)
    env = envs[cfg.env]
    env.mode = mode
    player = Player(envs=envs, generator=make_generator(cfg), params=params, producer_id="t")
    with pytest.raises(SchemaError, match=reason):
        asyncio.run(player.play(Prompt(id="p", env=cfg.env, task={"n": 1})))

"""The environments users already have, each by its adapter (producers/envs/adapters.py) with the
example in examples/: a Gymnasium text env, a reasoning-gym dataset with its own scorer, a TRL-style
class whose methods are tools, and an OpenEnv server run here and reached over its own protocol;
then all four in one run through the pipeline: feeder, Kafka, one producer, the learner."""

from __future__ import annotations

import random
import subprocess
import sys
import time

import httpx
import pytest

from producers.envs import check_env, make_env
from producers.feeder.service import FeedConfig
from producers.feeder.service import run as feed
from producers.service import ProducerConfig
from producers.service import run as produce
from sao.broker import free_port
from schemas import topics as T
from schemas.config import ConfigError
from schemas.tokenizers import ByteTokenizer
from tests.learner.service_util import ROOT, learner_cmd, metrics, run_learner
from tests.producers.util import read_topic

GYM = "gym://examples.gym_env:sao-examples/GuessDigit-v0"
REASONING = "reasoning-gym://basic_arithmetic"
TRL = "examples.trl_env:Counter"
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def openenv_server():
    """examples/openenv_server.py: OpenEnv's own server (openenv-core), on a free port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "examples.openenv_server", "--port", str(port)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "the OpenEnv server did not come up"
        time.sleep(0.5)
    yield f"openenv://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(30)


def _play(env, task: dict, replies: list[str]):
    """The episode of `task` with the model's `replies`, turn by turn: its steps."""
    episode, steps = env.episode(task), []
    try:
        for reply in replies:
            steps.append(episode.step(TOK.encode(reply)))
            if steps[-1].done:
                break
    finally:
        episode.close()
    return steps


def test_a_gymnasium_text_env_plays_from_its_reset_seed_to_its_reward():
    env = make_env(GYM, tokenizer=TOK, max_turns=4)
    check_env(env)
    task = env.sample_task(random.Random(0))
    steps = _play(env, task, [str(d) for d in range(10)])  # 0, 1, 2, ...: found, or truncated at 4
    assert steps[-1].done and sum(s.reward for s in steps) == (1.0 if len(steps) < 4 else steps[-1].reward)
    hints = [TOK.decode(s.observation) for s in steps[:-1]]
    assert all("higher" in h or "lower" in h for h in hints)  # Gymnasium's observation, in the model's chat
    assert len(steps) <= 4  # max_episode_steps=4: truncated by Gymnasium itself
    with pytest.raises(ConfigError, match="gymnasium.make raised"):
        make_env("gym://NoSuchEnv-v9", tokenizer=TOK)


def test_a_reasoning_gym_dataset_is_scored_by_its_own_scorer():
    env = make_env(REASONING, tokenizer=TOK)
    task = env.sample_task(random.Random(3))
    import reasoning_gym
    entry = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=100_000)[task["index"]]
    [right] = _play(env, task, [f"It is <answer>{entry['answer']}</answer>"])
    [wrong] = _play(env, task, ["<answer>no idea</answer>"])
    assert (right.reward, right.done, wrong.reward) == (1.0, True, 0.0)
    with pytest.raises(ConfigError, match="reasoning-gym://no_such_dataset"):
        make_env("reasoning-gym://no_such_dataset", tokenizer=TOK)


def test_a_trl_style_class_offers_its_methods_as_tools_and_returns_their_errors():
    env = make_env(TRL, tokenizer=TOK, max_turns=6)
    task = {"prompt": "Reach 4, then say done.", "target": 4}
    prompt = TOK.decode(env.episode(task).prompt_ids)
    assert '"name": "increment"' in prompt and "Add to the counter" in prompt and "How much to add" in prompt
    assert "The counter is at 0." in prompt and "reset" not in prompt.split("Tools")[1]  # reset is no tool
    call = '<tool_call>{{"name": "increment", "arguments": {{"by": {}}}}}</tool_call>'
    steps = _play(env, task, [call.format(9), call.format(3), call.format(1), "done"])
    assert (steps[0].tool_errors, steps[1].tool_errors, steps[2].tool_errors) == (1, 0, 0)
    assert "by must be 1 to 3, got 9" in TOK.decode(steps[0].observation)  # the tool's exception, to the model
    assert TOK.decode(steps[2].observation).count("4") >= 1 and (steps[-1].done, steps[-1].reward) == (True, 1.0)
    assert _play(env, task, ["done"])[0].reward == 0.0  # answered at 0: not the target


def test_an_openenv_server_is_played_over_its_own_protocol_one_session_per_episode(openenv_server):
    env = make_env(openenv_server, tokenizer=TOK, max_turns=3)
    a, b = env.sample_task(random.Random(1)), env.sample_task(random.Random(2))
    first, second = env.episode(a), env.episode(b)  # two sessions at once, each its own environment
    try:
        word = TOK.decode(first.prompt_ids).split("'")[1]
        assert first.step(TOK.encode("hello")).reward == 0.0
        done = first.step(TOK.encode(f"ok: {word}"))
        assert (done.reward, done.done) == (1.0, True)
        assert not second.step(TOK.encode("hello")).done  # untouched by the other session
    finally:
        first.close()
        second.close()
    with pytest.raises(ConfigError, match="no OpenEnv server answered"):
        make_env(f"openenv://127.0.0.1:{free_port()}", tokenizer=TOK)


def test_all_four_train_through_the_pipeline_in_one_run(kafka_cfg, tmp_path, openenv_server):
    envs = [GYM, REASONING, TRL, openenv_server]
    mixture = ",".join(envs)
    feed(FeedConfig(env=mixture, count=16, kafka=kafka_cfg))
    produce(ProducerConfig(env=mixture, model="tiny-llama-bytes", max_tokens=8, max_turns=3, max_prompts=16,
                           follow_weights=False, kafka=kafka_cfg))
    trajs = read_topic(kafka_cfg, T.TRAJECTORIES, 16)
    assert {t.env for t in trajs} == set(envs), sorted({t.env for t in trajs})
    assert all(t.reward is not None for t in trajs) and max(t.num_turns for t in trajs) > 1
    run_learner(learner_cmd(kafka_cfg, tmp_path, "--model.name", "tiny-llama-bytes", "--batch-trajectories", "16",
                            "--max-steps", "1"))
    [step] = metrics(tmp_path)
    assert sorted(step["trajectory_ids"]) == sorted(t.id for t in trajs)
    assert all(step[f"env/{name}/episodes"] >= 1 for name in envs), {k: v for k, v in step.items() if "env/" in k}

"""Several environments in one run: the `--env NAME=WEIGHT,...` mixture, the feeder drawing each
prompt's env by weight, and a producer playing exactly the envs it was given."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from producers.envs import env_mixture, make_env
from producers.episode import Player
from producers.feeder.service import FeedConfig, prompts_from_envs
from producers.generate.base import SamplingParams
from producers.service import ProducerConfig
from schemas.config import ConfigError
from schemas.messages import Prompt, SchemaError


def test_a_mixture_names_each_env_once_with_a_positive_weight():
    assert env_mixture("toy-target") == {"toy-target": 1.0}
    assert env_mixture("toy-target=3, toy-multiturn") == {"toy-target": 3.0, "toy-multiturn": 1.0}
    assert env_mixture("examples.custom_env:GuessNumber=2") == {"examples.custom_env:GuessNumber": 2.0}
    for bad in ("", "a=0", "a=-1", "a=x", "a,a", "a=inf", ",a"):
        with pytest.raises(ConfigError, match="NAME\\[=WEIGHT\\]"):
            env_mixture(bad)


def test_the_feeder_draws_each_prompts_env_by_weight_and_the_same_seed_draws_the_same():
    def envs(seed: int) -> list[str]:
        stream = prompts_from_envs("toy-target=3,toy-multiturn=1", seed, [])
        return [next(stream).env for _ in range(800)]
    drawn = envs(0)
    share = Counter(drawn)["toy-target"] / len(drawn)
    assert 0.70 <= share <= 0.80, share  # 0.75 expected; 800 draws: sd 0.015
    assert envs(0) == drawn and envs(1) != drawn
    single = prompts_from_envs("toy-multiturn", 0, [])
    assert {next(single).env for _ in range(10)} == {"toy-multiturn"}


def test_configs_check_every_env_of_a_mixture():
    with pytest.raises(ConfigError, match="'nope': unknown env"):
        ProducerConfig(env="toy-target,nope")
    with pytest.raises(ConfigError, match="a --dataset feeds one env"):
        FeedConfig(env="toy-target=1,toy-multiturn=1", dataset="examples/dataset.jsonl")


def test_a_producer_plays_the_envs_it_was_given_and_refuses_the_others():
    envs = {name: make_env(name) for name in ("toy-target", "toy-multiturn")}
    player = Player(envs=envs, generator=None, params=SamplingParams(max_tokens=4), producer_id="p")
    with pytest.raises(SchemaError, match=r"plays \['toy-multiturn', 'toy-target'\], not 'writing'"):
        asyncio.run(player.play(Prompt(id="x", env="writing", task={})))

"""Tiny model builders: seeded, reproducible, and they leave the global RNG alone."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from learner.models import TINY_MODELS


@pytest.mark.parametrize("name", TINY_MODELS)
def test_same_seed_same_weights_other_seed_other_weights(name):
    build = TINY_MODELS[name]
    a, b, c = build(seed=0), build(seed=0), build(seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))


@pytest.mark.parametrize("name", TINY_MODELS)
def test_building_does_not_touch_the_global_rng(name):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    TINY_MODELS[name](seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_vocab_and_size_are_settable():
    model = TINY_MODELS["qwen3_moe"](vocab_size=96, hidden_size=48, num_experts=8)
    assert model.config.vocab_size == 96 and model.config.num_experts == 8
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 96)


def test_a_transformers_folder_builds_the_policy_with_its_weights(tmp_path):
    from learner.models import ModelConfig, build_policy
    source = TINY_MODELS["qwen3_moe"](seed=3)
    source.save_pretrained(tmp_path)
    policy = build_policy(ModelConfig(name=str(tmp_path)))
    assert type(policy) is type(source)
    assert all(torch.equal(p, q) for p, q in zip(policy.state_dict().values(), source.state_dict().values()))

"""The trained starting point (bench/pretrain.py): the quick mode's folder loads as a policy, succeeds
sometimes but not always, clearly more often than the untrained model, and is reused, not retrained;
the best possible critic of its text (`value_ceiling`) by hand and against text without modes.

Measured here (512 episodes, seed 0): the quick folder succeeds (reward >= 1/2) on 0.305 of
toy-target episodes at mean reward 0.296; the untrained tiny Llama on 0.104 at 0.244.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.pretrain import PretrainConfig, initial_model, pretrained_start, starting_reward, value_ceiling
from learner.models import ModelConfig, build_policy


def test_quick_start_loads_and_succeeds_sometimes(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        folder = pretrained_start("llama", quick=True, out=tmp_path / "start")
        trained = build_policy(ModelConfig(name=str(folder)))  # as `--model FOLDER` loads it
        reward, success = starting_reward(trained, "toy-target", episodes=256)
        _, success0 = starting_reward(initial_model(PretrainConfig()), "toy-target", episodes=256)
    finally:
        torch.set_num_threads(threads)
    assert 0.1 <= success <= 0.5 and 0.1 <= reward <= 0.5, (reward, success)
    assert success >= success0 + 0.1, f"trained {success:.3f}, untrained {success0:.3f}"
    weights = folder / "model.safetensors"
    written = weights.stat().st_mtime_ns
    assert pretrained_start("llama", quick=True, out=folder) == folder
    assert weights.stat().st_mtime_ns == written  # reused, not trained again


def test_value_ceiling_by_hand_when_tokens_ignore_the_mode():
    """p_stay = 0: every token hits independently, so the best V(s_k) knows only the k hits seen
    and explains k/L of the return's variance at token k: thirds of 3 tokens give 0, 1/3, 2/3."""
    ceiling = value_ceiling(PretrainConfig(p_stay=0.0), length=3, samples=40_000)
    for part, expected in {"first": 0.0, "middle": 1 / 3, "last": 2 / 3, "all": 1 / 3}.items():
        assert abs(ceiling[part] - expected) < 0.02, (part, ceiling)


def test_a_span_that_keeps_its_mode_lets_a_critic_know_the_return_early():
    independent = value_ceiling(PretrainConfig(p_stay=0.0))
    moded = value_ceiling(PretrainConfig())
    assert moded["first"] > independent["first"] + 0.3 and moded["all"] > independent["all"] + 0.2
    assert moded["first"] < moded["middle"] < moded["last"] <= 1.0

"""The trained starting point (bench/pretrain.py): the quick mode's folder loads as a policy, succeeds
sometimes but not always, clearly more often than the untrained model, and is reused, not retrained.

Measured here (512 episodes, seed 0): the quick folder succeeds (reward >= 1/2) on 0.305 of
toy-target episodes at mean reward 0.296; the untrained tiny Llama on 0.104 at 0.244.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from bench.pretrain import PretrainConfig, initial_model, pretrained_start, starting_reward
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

"""Baseline advantages of docs/algorithm.md §7: group-normalised and running mean, by hand."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from learner.baselines import RunningMean, group_normalised_advantage


def test_group_normalised_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 3.0, 1.0])
    adv = group_normalised_advantage(rewards, ["a", "a", "a", "b", "b"], eps=0.0)
    # group a: mean .5, unbiased std .5 → 1, −1, 0; group b: mean 2, std √2 → ±1/√2
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 2 ** -0.5, -(2 ** -0.5)]))


def test_group_of_one_and_constant_group_get_zero_advantage():
    adv = group_normalised_advantage(torch.tensor([0.7, 1.0, 1.0]), ["solo", "x", "x"])
    assert adv.tolist() == [0.0, 0.0, 0.0]


def test_running_mean_per_prompt_window():
    rm = RunningMean(window=2, per_prompt=True)
    assert rm.advantage(torch.tensor([1.0, 0.0]), ["a", "b"]).tolist() == [0.0, 0.0]
    assert rm.advantage(torch.tensor([0.0, 1.0]), ["a", "b"]).tolist() == [-1.0, 1.0]
    # history a = [1, 0], b = [0, 1]; a third reward pushes the first out of the window of 2
    assert rm.advantage(torch.tensor([1.0]), ["a"]).tolist() == [0.5]
    assert rm.advantage(torch.tensor([1.0]), ["a"]).tolist() == [0.5]  # history [0, 1]
    assert rm.advantage(torch.tensor([1.0]), ["a"]).tolist() == [0.0]  # history [1, 1]


def test_running_mean_global_shares_one_history_and_never_baselines_itself():
    rm = RunningMean(window=128, per_prompt=False)
    rm.advantage(torch.tensor([1.0, 0.0]), ["a", "b"])
    # baseline 0.5 for every prompt, computed before this batch's own rewards join
    assert rm.advantage(torch.tensor([1.0, 1.0]), ["c", "d"]).tolist() == [0.5, 0.5]


def test_running_mean_state_round_trip():
    rm = RunningMean(window=3, per_prompt=True)
    rm.advantage(torch.tensor([1.0, 2.0]), ["a", "a"])
    other = RunningMean(window=8, per_prompt=False)
    other.load_state_dict(rm.state_dict())
    assert other.window == 3 and other.per_prompt
    assert other.advantage(torch.tensor([3.0]), ["a"]).tolist() == pytest.approx([1.5])


def test_running_mean_per_prompt_on_prompts_that_never_repeat_reports_it_and_warns_once(caplog):
    rm = RunningMean(window=8, per_prompt=True)
    rm.advantage(torch.tensor([1.0]), ["seen"])
    assert rm.advantage(torch.tensor([0.0, 1.0]), ["seen", "new"]).tolist() == [-1.0, 0.0]
    assert rm.unseen == 0.5
    with caplog.at_level("WARNING", logger="learner.baselines"):
        for i in range(2 * RunningMean.WARN_AFTER):  # fresh ids every step: all advantages 0
            assert rm.advantage(torch.tensor([1.0, 0.0]), [f"u{i}a", f"u{i}b"]).tolist() == [0.0, 0.0]
    assert rm.unseen == 1.0
    assert [r.message.count("running-mean-scope global") for r in caplog.records] == [1]

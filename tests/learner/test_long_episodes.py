"""Long episodes the SAO way: staleness per token, the drop decision on the fresh share, and the
overlong policy for episodes cut at a token budget (hand-computed cases and properties), and the
policy loss taking masked tokens out of the gradient while keeping them in N."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.dis import dis_policy_loss
from learner.long_episodes import (depth, fresh_fraction, fresh_tokens, overlong, policy_tokens, staleness,
                                   token_staleness)
from schemas.messages import Trajectory


def episode(versions: list[int], finish: str = "stop", reward: float = 1.0) -> Trajectory:
    """A prompt token, then action tokens of `versions` (-1: an observation token)."""
    v = np.array([-1, *versions], np.int32)
    mask = (v >= 0).astype(np.uint8)
    return Trajectory(id="t", prompt_id="p", env="e", producer_id="x", tokens=np.arange(len(v)), action_mask=mask,
                      rollout_logprobs=np.zeros(len(v)), versions=v, prompt_len=1, reward=reward, finish_reason=finish)


def test_a_long_episode_is_judged_token_by_token():
    # three tool turns sampled by versions 2, 5 and 9; the learner is at 10, the bound 4
    ep = episode([2, 2, -1, -1, 5, 5, 5, -1, 9, 9, 9, 9])
    assert token_staleness(10, ep).tolist() == [-1, 8, 8, -1, -1, 5, 5, 5, -1, 1, 1, 1, 1]
    assert staleness(10, ep) == 8  # the stalest token, as the metric has always been
    assert fresh_tokens(10, ep, 4).tolist() == [False] * 9 + [True] * 4
    assert fresh_fraction(10, ep, 4) == pytest.approx(4 / 9)
    assert fresh_fraction(10, ep, 5) == pytest.approx(7 / 9) and fresh_fraction(10, ep, -1) == 1.0
    assert fresh_tokens(10, ep, -1).tolist() == (ep.action_mask == 1).tolist()


def test_versions_a_restart_undid_are_as_far_as_their_way_back_through_the_restored_one():
    # (3, 6): version 3 restored and published as 6; 4 and 5 were on the branch it undid
    assert depth(np.array([3, 4, 5, 6, 8]), [(3, 6)]).tolist() == [3, 2, 1, 3, 5]
    assert token_staleness(8, episode([4, 5, 6]), [(3, 6)]).tolist() == [-1, 3, 4, 2]


def test_overlong_episodes_keep_mask_or_pay_a_penalty():
    cut, done = episode([0, 0], "length", 0.5), episode([0, 0], "stop", 0.5)
    assert overlong(cut, "keep", 1.0) == (cut, True)
    assert overlong(cut, "mask", 1.0) == (cut, False)
    penalised, counts = overlong(episode([0, 0], "context", 0.5), "penalty", 1.0)
    assert counts and penalised.reward == -0.5
    assert overlong(done, "mask", 1.0) == (done, True) and overlong(done, "penalty", 1.0)[0].reward == 0.5
    trained, masks = policy_tokens(3, [cut, done], max_staleness=2, policy="mask", penalty=1.0)
    assert [m.tolist() for m in masks] == [[False, False, False], [False, False, False]]  # cut; 3 > 2 old
    trained, masks = policy_tokens(1, [cut, done], max_staleness=2, policy="mask", penalty=1.0)
    assert [m.tolist() for m in masks] == [[False, False, False], [False, True, True]]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-1, 20), min_size=1, max_size=30), st.integers(20, 30), st.integers(-1, 10))
def test_fresh_tokens_are_the_action_tokens_within_the_bound(versions, learner, bound):
    ep = episode(versions)
    fresh = fresh_tokens(learner, ep, bound)
    acted = ep.action_mask.astype(bool)
    assert not (fresh & ~acted).any()
    if bound >= 0:
        assert (fresh == (acted & (learner - ep.versions <= bound))).all()
    assert 0.0 <= fresh_fraction(learner, ep, bound) <= 1.0


def test_a_token_out_of_the_policy_gradient_still_counts_in_n():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -1.5]], requires_grad=True)
    rollout = logp.detach().clone()
    adv, mask = torch.ones(1, 4), torch.tensor([[True, True, True, False]])
    trainable = torch.tensor([[True, False, True, True]])
    loss, _ = dis_policy_loss(logp, rollout, adv, mask, 0.3, 5.0, trainable=trainable)
    loss.backward()
    assert loss.item() == pytest.approx((1.0 + 0.5) / 3)  # N = 3 action tokens, one of them masked
    assert logp.grad.tolist() == [[pytest.approx(-1 / 3), 0.0, pytest.approx(-1 / 3), 0.0]]

"""Skip-observation GAE (docs/algorithm.md §4): hand-computed cases and properties."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.gae import adaptive_lambda, skip_observation_gae, whiten

X = 9.0  # a value on a prompt / observation token: must never be read


def row(*xs):
    return torch.tensor([xs], dtype=torch.float32)


def mask(*xs):
    return torch.tensor([xs], dtype=torch.bool)


def test_no_observation_span_outcome_on_last_action_lambda_half():
    # [p, a, a, a]; V = .5 .4 .2; r = 1 on the last action; γ = 1, λ = 0.5
    # t3: δ = 1 − .2 = .8,            Â = .8
    # t2: δ = .2 − .4 = −.2,          Â = −.2 + .5·.8 = .2
    # t1: δ = .4 − .5 = −.1,          Â = −.1 + .5·.2 = 0
    adv, ret = skip_observation_gae(row(0, 0, 0, 1), row(X, .5, .4, .2), mask(0, 1, 1, 1),
                                    gamma=1.0, lam=0.5)
    torch.testing.assert_close(adv, row(0, 0.0, 0.2, 0.8))
    torch.testing.assert_close(ret, row(0, 0.5, 0.6, 1.0))


def test_one_observation_span_costs_one_gamma_lambda():
    # [p, a1, a2, o, o, a3]; V = .5 .4 · · .2; r = 1 on a3; γ = .9, λ = .5 (γλ = .45)
    # a3: δ = 1 − .2 = .8                      Â = .8
    # a2: δ = .9·.2 − .4 = −.22 (next is a3)   Â = −.22 + .45·.8 = .14
    # a1: δ = .9·.4 − .5 = −.14                Â = −.14 + .45·.14 = −.077
    rewards, values = row(0, 0, 0, 0, 0, 1), row(X, .5, .4, X, X, .2)
    m = mask(0, 1, 1, 0, 0, 1)
    adv, ret = skip_observation_gae(rewards, values, m, gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv, row(0, -0.077, 0.14, 0, 0, 0.8))
    torch.testing.assert_close(ret, row(0, 0.423, 0.54, 0, 0, 1.0))
    # λ = 1: discounted Monte-Carlo returns, γ per action step, none for the observation
    _, mc = skip_observation_gae(rewards, values, m, gamma=0.9, lam=1.0)
    torch.testing.assert_close(mc, row(0, 0.81, 0.9, 0, 0, 1.0))


def test_two_observation_spans_with_per_turn_rewards():
    # [p, a, o, a, a, o, o, a]: turn rewards .5 on pos 1, .25 on pos 4, outcome 1 on pos 7
    # V = .3 · .6 .2 · · .5; γ = 1, λ = .8
    # t7: δ = 1 − .5 = .5                 Â = .5
    # t4: δ = .25 + .5 − .2 = .55         Â = .55 + .8·.5 = .95
    # t3: δ = .2 − .6 = −.4               Â = −.4 + .8·.95 = .36
    # t1: δ = .5 + .6 − .3 = .8           Â = .8 + .8·.36 = 1.088
    rewards = row(0, .5, 0, 0, .25, 0, 0, 1)
    values = row(X, .3, X, .6, .2, X, X, .5)
    m = mask(0, 1, 0, 1, 1, 0, 0, 1)
    adv, ret = skip_observation_gae(rewards, values, m, gamma=1.0, lam=0.8)
    torch.testing.assert_close(adv, row(0, 1.088, 0, 0.36, 0.95, 0, 0, 0.5))
    torch.testing.assert_close(ret, row(0, 1.388, 0, 0.96, 1.15, 0, 0, 1.0))
    _, mc = skip_observation_gae(rewards, values, m, gamma=1.0, lam=1.0)
    torch.testing.assert_close(mc, row(0, 1.75, 0, 1.25, 1.25, 0, 0, 1.0))


def test_per_row_lambda_matches_rows_computed_alone():
    rewards = torch.tensor([[0, 0, 1, 0], [0, .5, 0, 1.]])
    values = torch.tensor([[0, .3, .1, 0], [0, .2, .4, .7]])
    m = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)  # row 0 right-padded
    adv, ret = skip_observation_gae(rewards, values, m, 1.0, torch.tensor([0.5, 0.8]))
    for b, lam in enumerate([0.5, 0.8]):
        a1, r1 = skip_observation_gae(rewards[b:b + 1], values[b:b + 1], m[b:b + 1], 1.0, lam)
        torch.testing.assert_close(adv[b:b + 1], a1)
        torch.testing.assert_close(ret[b:b + 1], r1)


def test_adaptive_lambda_is_one_minus_inverse_alpha_length():
    lam = adaptive_lambda(torch.tensor([1, 4, 100]), alpha=1.5)
    torch.testing.assert_close(lam, torch.tensor([1 / 3, 5 / 6, 1 - 1 / 150]))
    assert adaptive_lambda(torch.tensor([1]), alpha=0.5).item() == 0.0  # 1 − 2 clamped to 0


def test_whiten_normalises_action_tokens_only_with_the_steps_statistics():
    adv = torch.tensor([[5.0, 1.0, 3.0, 7.0]])
    m = torch.tensor([[False, True, True, False]])
    torch.testing.assert_close(whiten(adv, m, mean=2.0, std=1.0), torch.tensor([[0.0, -1.0, 1.0, 0.0]]))


sequences = st.lists(st.tuples(st.floats(-2, 2), st.floats(-2, 2)), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(actions=sequences, gaps=st.lists(st.integers(0, 3), min_size=12, max_size=12),
       gamma=st.floats(0.5, 1.0), lam=st.floats(0.0, 1.0))
def test_observation_spans_never_change_action_advantages(actions, gaps, gamma, lam):
    """Inserting observation tokens anywhere leaves every action token's Â and R unchanged."""
    r = torch.tensor([[a[0] for a in actions]])
    v = torch.tensor([[a[1] for a in actions]])
    dense_m = torch.ones_like(r, dtype=torch.bool)
    adv, ret = skip_observation_gae(r, v, dense_m, gamma, lam)
    sr, sv, sm = [], [], []
    for i, (ri, vi) in enumerate(actions):
        sr += [0.0] * gaps[i] + [ri]
        sv += [X] * gaps[i] + [vi]
        sm += [False] * gaps[i] + [True]
    s_m = torch.tensor([sm])
    s_adv, s_ret = skip_observation_gae(torch.tensor([sr]), torch.tensor([sv]), s_m, gamma, lam)
    torch.testing.assert_close(s_adv[s_m][None], adv)
    torch.testing.assert_close(s_ret[s_m][None], ret)
    assert (s_adv[~s_m] == 0).all() and (s_ret[~s_m] == 0).all()


@settings(max_examples=40, deadline=None)
@given(rewards=st.lists(st.floats(-1, 1), min_size=1, max_size=10))
def test_unit_gamma_lambda_returns_are_reward_to_go(rewards):
    r = torch.tensor([rewards])
    v = torch.rand_like(r)
    m = torch.ones_like(r, dtype=torch.bool)
    _, ret = skip_observation_gae(r, v, m, 1.0, 1.0)
    to_go = r.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(ret, to_go, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_zero_bootstrap_at_the_end(lam):
    # a single action token: Â = r − V whatever λ, since the next value is 0
    adv, _ = skip_observation_gae(row(0, 2.0), row(X, 0.5), mask(0, 1), 1.0, lam)
    torch.testing.assert_close(adv, row(0, 1.5))

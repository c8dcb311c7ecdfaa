"""DIS (docs/algorithm.md §3): the strict double-sided mask, zero gradient on masked tokens, the detached
weight, both presets, and the aggregations."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from learner.dis import PRESETS, aggregate, dis_keep, dis_policy_loss, ppo_clip_policy_loss


def exact_log(r: float) -> float:
    """A float32 d with exp(d) == float32(r) exactly, so the computed ratio sits on the boundary."""
    target = torch.tensor(r)
    d = torch.log(target)
    for _ in range(64):
        if torch.exp(d) == target:
            return d.item()
        d = torch.nextafter(d, torch.tensor(torch.inf if torch.exp(d) < target else -torch.inf))
    raise AssertionError(f"no float32 d with exp(d) == {r}")


@pytest.mark.parametrize("preset", ["reasoning", "coding"])
def test_mask_is_strict_at_both_boundaries(preset):
    low, high = PRESETS[preset]
    lo, hi = 1.0 - low, 1.0 + high
    ratio = torch.tensor([lo, torch.nextafter(torch.tensor(lo), torch.tensor(2.0)).item(), 1.0,
                          torch.nextafter(torch.tensor(hi), torch.tensor(0.0)).item(), hi,
                          0.0, 1e9])
    keep = dis_keep(ratio, low, high)
    assert keep.tolist() == [False, True, True, True, False, False, False]


def test_presets_are_the_papers():
    assert PRESETS == {"reasoning": (0.3, 5.0), "coding": (0.8, 3.0)}


def _loss_and_grad(logp_values, logp_rollout, adv, eps_low, eps_high, loss_agg="token_mean"):
    logp = torch.tensor([logp_values], requires_grad=True)
    m = torch.ones_like(logp, dtype=torch.bool)
    loss, stats = dis_policy_loss(logp, torch.tensor([logp_rollout]), torch.tensor([adv]), m,
                                  eps_low, eps_high, loss_agg)
    loss.backward()
    return loss, logp.grad[0], stats


@pytest.mark.parametrize("preset", ["reasoning", "coding"])
def test_boundary_and_outside_tokens_get_exactly_zero_gradient(preset):
    low, high = PRESETS[preset]
    # rollout log-prob 0, so ratio = exp(logp): the high boundary exactly, inside, far outside both
    logp = [exact_log(1.0 + high), 0.0, -0.1, -30.0, 30.0]
    if preset == "reasoning":
        logp.append(exact_log(1.0 - low))  # exp reaches 0.7 exactly; it never reaches 0.2
    n = len(logp)
    adv = [1.0, 2.0, -1.0, 3.0, -3.0, 0.5][:n]
    _, grad, stats = _loss_and_grad(logp, [0.0] * n, adv, low, high)
    kept = [1, 2]
    for i in range(n):
        if i in kept:
            r = torch.exp(torch.tensor(logp[i]))
            assert torch.isclose(grad[i], -r * adv[i] / n), i  # r·Â·∇logπ, normalised by N
        else:
            assert grad[i].item() == 0.0, i
    assert stats["kept_frac"].item() == pytest.approx(2 / n)


def test_sign_of_advantage_does_not_change_the_mask():
    logp = [0.5, -0.2, 2.0, -2.0, 0.1]
    rollout = [0.0] * 5
    adv = [1.0, 1.0, 1.0, 1.0, 1.0]
    _, g_pos, s_pos = _loss_and_grad(logp, rollout, adv, 0.3, 5.0)
    _, g_neg, s_neg = _loss_and_grad(logp, rollout, [-a for a in adv], 0.3, 5.0)
    assert torch.equal(g_pos == 0, g_neg == 0)
    assert (g_pos == 0).tolist() == [False, False, True, True, False]  # e², e⁻² leave the band
    torch.testing.assert_close(g_pos, -g_neg)
    assert s_pos["kept_frac"] == s_neg["kept_frac"]


def test_unit_ratios_give_the_plain_policy_gradient():
    """With π_θ = π_rollout every weight is 1: the gradient is that of −Σ Â·logπ / N."""
    torch.manual_seed(0)
    theta = torch.randn(5, 7, requires_grad=True)
    actions = torch.tensor([[1, 4, 2, 6, 0]])
    adv = torch.randn(1, 5)
    mask = torch.tensor([[True, True, False, True, True]])

    def logp_fn():
        return torch.log_softmax(theta, -1).gather(-1, actions.T).T  # (1, 5)

    loss, stats = dis_policy_loss(logp_fn(), logp_fn().detach(), adv, mask, 0.3, 5.0)
    (g_dis,) = torch.autograd.grad(loss, theta)
    plain = -(adv * logp_fn())[mask].sum() / mask.sum()
    (g_pg,) = torch.autograd.grad(plain, theta)
    torch.testing.assert_close(g_dis, g_pg, rtol=0, atol=1e-7)
    assert stats["kept_frac"].item() == 1.0 and stats["ratio_max"].item() == 1.0


def test_stats_report_low_and_high_fractions_and_log_prob_gap():
    logp = torch.tensor([[-1.0, 0.0, 0.0, 3.0]])
    rollout = torch.zeros(1, 4)
    m = torch.tensor([[True, True, True, False]])  # the off-action token is ignored
    _, stats = dis_policy_loss(logp, rollout, torch.ones(1, 4), m, 0.3, 5.0)
    assert stats["masked_low_frac"].item() == pytest.approx(1 / 3)  # e⁻¹ ≈ 0.37 ≤ 0.7
    assert stats["masked_high_frac"].item() == 0.0
    assert stats["kept_frac"].item() == pytest.approx(2 / 3)
    assert stats["ratio_min"].item() == pytest.approx(torch.exp(torch.tensor(-1.0)).item())
    assert stats["ratio_max"].item() == 1.0
    assert stats["abs_logp_diff"].item() == pytest.approx(1 / 3)


def test_non_finite_rollout_log_prob_on_a_masked_token_stays_out_of_the_loss():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    loss, _ = dis_policy_loss(logp, torch.tensor([[-1.0, -torch.inf]]), torch.ones(1, 2),
                              torch.ones(1, 2, dtype=torch.bool), 0.3, 5.0)
    loss.backward()
    assert torch.isfinite(loss) and logp.grad[0, 1].item() == 0.0


def test_aggregations_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[True, True, True, False], [True, False, False, False]])
    assert aggregate(x, m, "token_mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(x, m, "seq_mean_token_mean").item() == pytest.approx((2.0 + 4.0) / 2)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(x, m, "sum")


def test_seq_mean_token_mean_normalises_each_sequence_by_its_own_length():
    logp = torch.zeros(2, 3, requires_grad=True)
    m = torch.tensor([[True, True, True], [True, False, False]])
    loss, _ = dis_policy_loss(logp, torch.zeros(2, 3), torch.ones(2, 3), m, 0.3, 5.0,
                              "seq_mean_token_mean")
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1 / 6, -1 / 6, -1 / 6], [-1 / 2, 0, 0]]))


def test_ppo_clip_at_batch_start_is_the_plain_policy_gradient():
    logp = torch.tensor([[-0.5, -1.5, -2.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]])
    m = torch.ones(1, 3, dtype=torch.bool)
    loss, stats = ppo_clip_policy_loss(logp, logp.detach(), adv, m, 0.2)
    loss.backward()
    torch.testing.assert_close(logp.grad, -adv / 3)
    assert stats["clip_frac"].item() == 0.0


def test_ppo_clip_removes_the_gradient_of_a_clipped_token():
    logp = torch.tensor([[0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.0, 0.0]])  # ratio e ≈ 2.7 > 1.2 with Â > 0: clipped
    loss, stats = ppo_clip_policy_loss(logp, old, torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), 0.2)
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == pytest.approx(-0.5)
    assert stats["clip_frac"].item() == 0.5


@settings(max_examples=80, deadline=None)
@given(data=st.lists(st.tuples(st.floats(-4, 0), st.floats(-4, 0), st.floats(-3, 3), st.booleans()),
                     min_size=1, max_size=16),
       preset=st.sampled_from(["reasoning", "coding"]))
def test_gradient_is_ratio_times_advantage_on_kept_tokens_and_zero_elsewhere(data, preset):
    low, high = PRESETS[preset]
    logp = torch.tensor([[d[0] for d in data]], requires_grad=True)
    rollout = torch.tensor([[d[1] for d in data]])
    adv = torch.tensor([[d[2] for d in data]])
    m = torch.tensor([[d[3] for d in data]])
    loss, _ = dis_policy_loss(logp, rollout, adv, m, low, high)
    loss.backward()
    ratio = torch.exp(logp.detach() - rollout)
    keep = (ratio > 1 - low) & (ratio < 1 + high) & m
    expected = torch.where(keep, -ratio * adv / max(int(m.sum()), 1), 0.0)
    torch.testing.assert_close(logp.grad, expected)
    assert (logp.grad[~keep] == 0).all()

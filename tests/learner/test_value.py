"""The critic of docs/algorithm.md §5: zero head, attention frozen by module type for dense and MoE models,
the parameter report, the value loss, and the diagnostics that explain it: explained variance and
value/return correlation, overall and by position in the response."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import math

import numpy as np
import pytest
import torch

from learner.gae import skip_observation_gae
from learner.logprobs import collate
from learner.models import tiny_llama, tiny_qwen3_moe
from learner.update import SAOUpdate, UpdateConfig
from learner.value import (ValueModel, action_thirds, critic_values, explained_variance, format_report,
                           freeze_attention, is_attention, param_report, value_diagnostics, value_loss,
                           value_moments, value_moments_by_position, value_return_corr)
from schemas.messages import Trajectory

BUILDERS = {"llama": tiny_llama, "qwen3_moe": tiny_qwen3_moe}


def batch_of(n=4, seed=0):
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(n):
        mask = np.array([0, 0, 1, 1, 0, 1, 1], np.uint8)
        trajs.append(Trajectory(id=str(i), prompt_id=str(i), env="t", producer_id="t",
                                tokens=rng.integers(3, 64, 7), action_mask=mask,
                                rollout_logprobs=np.where(mask, -4.0, 0.0),
                                versions=np.where(mask, 0, -1), prompt_len=2,
                                reward=float(rng.random())))
    return trajs


def attention_params(model):
    return {n: p for m_name, m in model.named_modules() if is_attention(m)
            for n, p in m.named_parameters(prefix=m_name)}


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", BUILDERS)
def test_value_head_starts_at_zero(family):
    critic = ValueModel.from_policy(BUILDERS[family]())
    assert (critic.head.weight == 0).all() and (critic.head.bias == 0).all()
    values = critic_values(critic, collate(batch_of()))
    assert (values == 0).all()


@pytest.mark.parametrize("family", BUILDERS)
def test_critic_starts_from_the_policy_weights_without_sharing_them(family):
    policy = BUILDERS[family]()
    critic = ValueModel.from_policy(policy)
    for name, p in policy.base_model.named_parameters():
        q = critic.backbone.get_parameter(name)
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()


@pytest.mark.parametrize("family", BUILDERS)
def test_after_k_critic_updates_attention_is_bit_identical_and_mlp_moved(family):
    policy = BUILDERS[family](seed=4)
    critic = ValueModel.from_policy(policy)
    update = SAOUpdate(policy, critic, UpdateConfig(algorithm="sao", lr_critic=1e-2))
    before = snapshot(critic)
    metrics = update.step(batch_of())
    assert metrics["step/critic_updates"] == 2 and metrics["step/skipped"] == 0
    attention = attention_params(critic)
    assert len(attention) >= 8  # q, k, v, o in each of 2 layers at least
    for name in attention:
        assert torch.equal(critic.get_parameter(name), before[name]), name
    moved = [n for n, p in critic.named_parameters()
             if ("mlp" in n) and not torch.equal(p, before[n])]
    mlp = [n for n in before if "mlp" in n and "gate.weight" not in n]  # the router may not move
    assert set(mlp) <= set(moved)
    assert not torch.equal(critic.head.weight, before["head.weight"])
    # the policy's attention is not frozen
    assert all(p.requires_grad for p in attention_params(policy).values())


def test_full_critic_ablation_trains_attention():
    policy = tiny_llama(seed=4)
    critic = ValueModel.from_policy(policy)
    update = SAOUpdate(policy, critic, UpdateConfig(algorithm="sao_full_critic", lr_critic=1e-2))
    before = snapshot(critic)
    update.step(batch_of())
    changed = [n for n in attention_params(critic) if not torch.equal(critic.get_parameter(n), before[n])]
    assert changed


@pytest.mark.parametrize("family", BUILDERS)
def test_param_report_counts_by_module_kind(family):
    critic = ValueModel.from_policy(BUILDERS[family]())
    freeze_attention(critic)
    report = param_report(critic)
    n_attention = sum(p.numel() for p in attention_params(critic).values())
    assert report["attention"] == {"trainable": 0, "frozen": n_attention}
    assert report["value_head"] == {"trainable": critic.head.in_features + 1, "frozen": 0}
    for kind in ("mlp", "norm", "embedding"):
        assert report[kind]["trainable"] > 0 and report[kind]["frozen"] == 0
    total = sum(p.numel() for p in critic.parameters())
    assert report["total"]["trainable"] + report["total"]["frozen"] == total
    assert sum(v["trainable"] + v["frozen"] for k, v in report.items() if k != "total") == total
    if family == "qwen3_moe":
        assert report["router"]["trainable"] > 0
    assert "attention" in format_report(report) and format_report(report).splitlines()[-1].startswith("total")


def test_freezing_a_model_without_attention_refuses():
    with pytest.raises(ValueError, match="no attention module"):
        freeze_attention(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_freeze_by_explicit_type_for_other_families():
    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(2, 2)

    model = torch.nn.Sequential(Mixer(), torch.nn.Linear(2, 2))
    assert freeze_attention(model, attention_types=(Mixer,)) == 2
    assert not model[0].proj.weight.requires_grad and model[1].weight.requires_grad


def test_values_of_token_t_see_only_tokens_before_t():
    critic = ValueModel.from_policy(tiny_llama(seed=5))
    torch.nn.init.normal_(critic.head.weight)
    trajs = batch_of(1)
    v1 = critic_values(critic, collate(trajs))
    trajs[0].tokens[5] = (trajs[0].tokens[5] + 1) % 64  # change action token 5
    v2 = critic_values(critic, collate(trajs))
    assert torch.equal(v1[:, :6], v2[:, :6])  # V(s_5) is read before token 5
    assert not torch.equal(v1[:, 6], v2[:, 6])


def test_value_loss_by_hand_with_and_without_clipping():
    values = torch.tensor([[0.0, 1.0, 3.0]])
    returns = torch.tensor([[0.0, 2.0, 2.0]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    m = torch.tensor([[False, True, True]])
    assert value_loss(values, returns, m).item() == pytest.approx((1 + 1) / 2)
    # clip 0.5: clipped values 0.5, 0.5 → errors 2.25, 2.25; max with 1, 1 → 2.25
    assert value_loss(values, returns, m, values_old=old, clip=0.5).item() == pytest.approx(2.25)


def test_explained_variance_on_action_tokens():
    returns = torch.tensor([[9.0, 1.0, 2.0, 3.0]])
    m = torch.tensor([[False, True, True, True]])

    def ev(values, returns):
        return explained_variance({k: v.item() for k, v in value_moments(values, returns, m).items()})

    assert ev(returns, returns) == pytest.approx(1.0)
    assert ev(torch.zeros(1, 4), returns) == pytest.approx(0.0, abs=1e-6)
    # a constant offset leaves Var(R − V) = 0: everything is explained
    assert ev(returns + 0.5, returns) == pytest.approx(1.0)
    assert math.isnan(ev(returns, torch.ones(1, 4)))


def test_a_step_where_every_episode_failed_has_no_variance_to_explain():
    """All rewards 0: the critic's targets R = Â + V from skip-observation GAE are 0 up to V's
    rounding (~1e-7), and that noise divided into Var(R − V) once logged an explained variance of
    −1e14 (a run's step 12); it is NaN, as for any constant return, and so is the correlation."""
    g = torch.Generator().manual_seed(0)
    values = 0.3 * torch.randn(8, 150, generator=g)
    mask = torch.rand(8, 150, generator=g) > 0.3
    _, returns = skip_observation_gae(torch.zeros(8, 150), values, mask, gamma=1.0, lam=1.0)
    assert 0 < returns[mask].abs().max() < 1e-5  # rounding, not exactly zero
    d = value_diagnostics({k: v.item() for k, v in value_moments_by_position(values, returns, mask).items()})
    assert all(math.isnan(d[k]) for k in d), d
    # one solved episode makes the returns vary again: explained variance is finite and ≤ 1
    rewards = torch.zeros(8, 150)
    last = int(mask[0].nonzero().max())
    rewards[0, last] = 1.0
    _, returns = skip_observation_gae(rewards, values, mask, gamma=1.0, lam=1.0)
    ev = explained_variance({k: v.item() for k, v in value_moments(values, returns, mask).items()})
    assert -10 < ev <= 1


def test_value_moments_of_micro_batches_sum_to_the_steps():
    values, returns = torch.randn(4, 6), torch.randn(4, 6)
    m = torch.rand(4, 6) > 0.3
    n = int(m.sum())
    whole = value_moments_by_position(values, returns, m, num_tokens=n)
    parts = [value_moments_by_position(values[i:i + 2], returns[i:i + 2], m[i:i + 2], num_tokens=n)
             for i in (0, 2)]
    for k in whole:
        torch.testing.assert_close(parts[0][k] + parts[1][k], whole[k])


def test_action_thirds_by_hand():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 1],   # 6 actions, an observation between
                         [0, 0, 1, 1, 1, 1, 0, 0, 0],   # 4 actions, then padding
                         [0, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)  # 1 action
    assert action_thirds(mask).tolist() == [[-1, 0, 0, -1, -1, 1, 1, 2, 2],
                                            [-1, -1, 0, 0, 1, 2, -1, -1, -1],
                                            [-1, 0, -1, -1, -1, -1, -1, -1, -1]]


def test_diagnostics_by_position_by_hand():
    """A critic that knows the return only in the last third: EV 1 there, 0 in the first (V ≡ 0
    there, so its correlation is undefined); V = 2R + 3 in the middle correlates perfectly yet
    explains nothing (Var(R − V) = Var(R))."""
    returns = torch.tensor([[1.0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [0.5, 0.5, 0.5, 0.5, 0.5, 0.5]])
    mask = torch.ones(3, 6, dtype=torch.bool)
    values = torch.cat([torch.zeros(3, 2), 2 * returns[:, 2:4] + 3, returns[:, 4:]], dim=1)
    m = {k: v.item() for k, v in value_moments_by_position(values, returns, mask).items()}
    d = value_diagnostics(m)
    assert d["value/explained_var_first"] == pytest.approx(0.0, abs=1e-5)
    assert math.isnan(d["value/return_corr_first"])
    assert d["value/explained_var_middle"] == pytest.approx(0.0, abs=1e-5)
    assert d["value/return_corr_middle"] == pytest.approx(1.0)
    assert d["value/explained_var_last"] == pytest.approx(1.0)
    assert d["value/return_corr_last"] == pytest.approx(1.0)
    assert d["value/explained_var"] == pytest.approx(explained_variance(m))


@pytest.mark.parametrize("seed", range(5))
def test_diagnostics_equal_numpys_on_each_third(seed):
    g = torch.Generator().manual_seed(seed)
    returns = torch.rand(6, 12, generator=g)
    values = 0.5 * returns + 0.3 * torch.rand(6, 12, generator=g)
    mask = torch.rand(6, 12, generator=g) > 0.3
    d = value_diagnostics({k: v.item() for k, v in value_moments_by_position(values, returns, mask).items()})
    thirds = action_thirds(mask)
    for j, part in enumerate(("first", "middle", "last")):
        r, v = returns[thirds == j].double().numpy(), values[thirds == j].double().numpy()
        assert d[f"value/explained_var_{part}"] == pytest.approx(1 - np.var(r - v) / np.var(r), abs=1e-4)
        assert d[f"value/return_corr_{part}"] == pytest.approx(np.corrcoef(r, v)[0, 1], abs=1e-4)
    r, v = returns[mask].double().numpy(), values[mask].double().numpy()
    m = {k: x.item() for k, x in value_moments(values, returns, mask).items()}
    assert value_return_corr(m) == pytest.approx(np.corrcoef(r, v)[0, 1], abs=1e-4)

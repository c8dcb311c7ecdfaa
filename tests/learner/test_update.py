"""SAOUpdate (docs/algorithm.md §3–§5, §7): warm-up, the non-finite guard, baselines on the same path,
micro-batches equal to the one-shot step, checkpointable state, determinism, and its config."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import copy
import math
import random
import typing

import numpy as np
import pytest
import torch

from learner.gae import adaptive_lambda, skip_observation_gae
from learner.logprobs import collate, token_rewards
from learner.microbatch import plan_step
from learner.models import tiny_llama
from learner.algorithms import Algorithm, algorithm_settings
from learner.update import MicroBatch, SAOUpdate, UpdateConfig, guarded_step
from learner.value import ValueModel
from producers.envs import make_env
from producers.episode import play_tasks
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator
from schemas.config import ConfigError, from_env

REQUIRED_METRICS = {
    "loss/policy", "loss/value", "dis/kept_frac", "dis/masked_low_frac", "dis/masked_high_frac",
    "dis/ratio_mean", "dis/ratio_max", "dis/ratio_min", "dis/abs_logp_diff", "value/explained_var",
    "value/return_corr", *(f"value/{d}_{p}" for d in ("explained_var", "return_corr")
                           for p in ("first", "middle", "last")), "grad_norm/policy", "grad_norm/critic", "policy/entropy", "reward/mean", "step/skipped",
    "step/policy_updated"}


def build(algorithm="sao", seed=0, **kw):
    policy = tiny_llama(seed=seed)
    critic = ValueModel.from_policy(policy) if algorithm_settings(algorithm).uses_critic else None
    return SAOUpdate(policy, critic, UpdateConfig(algorithm=algorithm, **{"lr_policy": 1e-2, "lr_critic": 1e-2} | kw))


def rollouts(update, seed=0, num_prompts=4, group_size=1, env="toy-multiturn", max_tokens=3):
    """Trajectories sampled by the update's own policy (the on-policy, in-process case)."""
    return play_tasks(make_env(env, turn_rewards=True), HFGenerator(update.policy, seed=seed),
                      SamplingParams(max_tokens=max_tokens), random.Random(seed),
                      num_prompts=num_prompts, group_size=group_size, id_prefix=f"{seed}.{max_tokens}.")


def params_of(update):
    models = [update.policy] + ([update.critic] if update.critic is not None else [])
    return [p.detach().clone() for m in models for p in m.parameters()]


def advantages(update, trajs):
    """(adv, returns, values) of the whole step as one micro-batch, each (B, T) in step order."""
    plan = plan_step(trajs, 0, 1, 0, False)
    rows = plan.micro_batches[0]  # the longest first
    mb = MicroBatch(batch=collate([trajs[i] for i in rows]), rows=rows)
    update.advantages([mb], torch.tensor([token_rewards(t).sum() for t in trajs]), trajs, plan)
    order = torch.tensor(rows).argsort()
    return tuple(None if x is None else x[order] for x in (mb.adv, mb.returns, mb.values))


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_warm_up_trains_only_the_critic_for_ten_steps():
    update = build("sao")
    assert update.settings.warmup_steps == 10
    policy0 = [p.detach().clone() for p in update.policy.parameters()]
    critic0 = [p.detach().clone() for p in update.critic.parameters()]
    trajs = rollouts(update)
    for i in range(10):
        m = update.step(trajs)
        assert m["step/policy_updated"] == 0 and m["step/critic_updates"] == 2, i
    assert same(policy0, [p.detach() for p in update.policy.parameters()])
    assert not same(critic0, [p.detach() for p in update.critic.parameters()])
    assert update.policy_opt.state_dict()["state"] == {}
    m = update.step(trajs)
    assert m["step/policy_updated"] == 1
    assert not same(policy0, [p.detach() for p in update.policy.parameters()])


@pytest.mark.parametrize("algorithm", ["sao", "sao_full_critic"])
def test_gradient_norms_by_kind_make_up_the_total_and_a_frozen_attention_has_none(algorithm):
    update = build(algorithm, warmup_steps=0)
    m = update.step(rollouts(update))
    for model in ("policy", "critic"):
        kinds = {k.removeprefix(f"grad_norm/{model}_"): v for k, v in m.items()
                 if k.startswith(f"grad_norm/{model}_")}
        assert {"mlp", "norm", "embedding"} <= set(kinds), kinds
        assert ("attention" in kinds) == (model == "policy" or algorithm == "sao_full_critic"), kinds
        assert ("value_head" in kinds) == (model == "critic"), kinds
        assert math.sqrt(sum(v ** 2 for v in kinds.values())) == pytest.approx(m[f"grad_norm/{model}"], rel=1e-5)


def test_critic_gradient_clip_is_its_own():
    """A critic clip of 1e-12 leaves Adam's first steps ~1e-4·lr (g ≪ its ε), the default clip (the
    policy's 1.0) lets them move ~lr; the policy's step is the same under both."""
    trajs = rollouts(build("sao"))
    runs = {}
    for clip in (None, 1e-12):
        update = build("sao", warmup_steps=0, critic_max_grad_norm=clip)
        critic0 = [p.detach().clone() for p in update.critic.parameters()]
        update.step(trajs)
        moved = max((p.detach() - p0).abs().max().item()
                    for p, p0 in zip(update.critic.parameters(), critic0))
        runs[clip] = moved, [p.detach().clone() for p in update.policy.parameters()]
    lr = update.cfg.lr_critic
    assert runs[None][0] > 0.5 * lr and runs[1e-12][0] < 1e-3 * lr, (runs[None][0], runs[1e-12][0])
    assert same(runs[None][1], runs[1e-12][1])


def test_whitened_advantages_have_the_steps_mean_zero_and_std_one():
    trajs = rollouts(build("sao"), num_prompts=6)
    adv, _, _ = advantages(build("sao"), trajs)
    white, _, _ = advantages(build("sao", whiten_advantages=True), trajs)
    mask = collate(trajs).action_mask
    a = adv[mask].double()
    assert a.std() > 0
    torch.testing.assert_close(white[mask].double(), (a - a.mean()) / a.std(unbiased=False),
                               rtol=1e-5, atol=1e-5)
    assert (white[~mask] == 0).all()


def test_adaptive_lambda_counts_every_response_token_or_only_actions():
    """toy-multiturn puts 2 observation tokens between turns, so the two lengths differ."""
    trajs = rollouts(build("sao"), num_prompts=3)
    batch = collate(trajs)
    actions = batch.action_mask.sum(-1)
    assert (actions < batch.response_len).all()
    for length, l in (("response", batch.response_len), ("actions", actions)):
        adv, _, values = advantages(build("sao", lambda_length=length), trajs)
        expected, _ = skip_observation_gae(batch.rewards, values, batch.action_mask, 1.0,
                                           adaptive_lambda(l, 1.5))
        torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("env", ["toy-target", "toy-multiturn"])
def test_the_whole_reward_lands_on_the_last_generated_token_and_reaches_gae(env):
    """Stop tokens make the trajectories' lengths differ, so rows are padded: the outcome sits on
    each trajectory's last generated token, never on padding, and with V ≡ 0 (a fresh critic),
    γ = λ = 1, every action token's critic target is the whole reward (a port that placed it on
    padding passed ~0.6 % of it to GAE, docs/algorithm.md §9)."""
    update = build("sao")
    trajs = play_tasks(make_env(env), HFGenerator(update.policy, seed=1),
                       SamplingParams(max_tokens=6, stop_token_ids=tuple(range(3, 64, 5))),
                       random.Random(1), num_prompts=8)
    assert len({len(t.tokens) for t in trajs}) > 1 and any(t.reward > 0 for t in trajs)
    batch = collate(trajs)
    _, returns, values = advantages(update, trajs)
    assert (values == 0).all()
    for b, t in enumerate(trajs):
        last = len(t.tokens) - 1
        assert t.action_mask[last] == 1  # the episode ends on a generated token
        expected = torch.zeros(batch.tokens.shape[1])
        expected[last] = t.reward
        torch.testing.assert_close(batch.rewards[b], expected)
        acted = batch.action_mask[b]
        torch.testing.assert_close(returns[b][acted], torch.full((int(acted.sum()),), float(t.reward)))
        assert (returns[b][~acted] == 0).all()


@pytest.mark.parametrize("algorithm", ["sao", "grpo_dis", "running_mean"])
@pytest.mark.parametrize("poison", ["nan_reward", "inf_logprob"])
def test_non_finite_input_leaves_every_parameter_and_optimizer_state_unchanged(algorithm, poison):
    update = build(algorithm, warmup_steps=0)
    good = rollouts(update, group_size=2, num_prompts=2)
    assert update.step(good)["step/skipped"] == 0  # optimizers now have state to protect
    bad = copy.deepcopy(good)
    if poison == "nan_reward":
        bad[1].reward = math.nan
    else:
        acted = np.flatnonzero(bad[1].action_mask)
        bad[1].rollout_logprobs[acted[0]] = -np.inf
    before, opt_before = params_of(update), copy.deepcopy(update.state_dict())
    metrics = update.step(bad)
    assert metrics["step/skipped"] == 1 and metrics["step/policy_updated"] == 0
    assert same(before, params_of(update))
    after = update.state_dict()
    assert after["step"] == opt_before["step"] + 1
    for key in ("policy_opt", "critic_opt", "running_mean"):
        assert str(after.get(key)) == str(opt_before.get(key)), key


def test_guard_skips_a_finite_loss_with_a_non_finite_gradient():
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    loss = model(torch.ones(1, 3)).sum()
    loss.backward()
    assert guarded_step(model, opt, 1.0, loss)[0]  # a real step first
    before = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    w = model.weight
    loss = (w - w.detach()).abs().sqrt().sum()  # value 0, gradient ∞ at 0
    loss.backward()
    stepped, grad_norm = guarded_step(model, opt, 1.0, loss)
    assert torch.isfinite(loss) and not stepped and not math.isfinite(grad_norm)
    assert same(before, [p.detach() for p in model.parameters()])
    assert str(opt.state_dict()) == str(state)
    assert all(p.grad is None for p in model.parameters())


def test_sao_k1_takes_one_critic_step_and_sao_two():
    assert build("sao_k1").step(rollouts(build("sao_k1")))["step/critic_updates"] == 1
    metrics = build("sao").step(rollouts(build("sao")))
    assert metrics["step/critic_updates"] == 2
    assert REQUIRED_METRICS <= set(metrics)


def test_grpo_advantage_is_group_normalised_and_spread_over_action_tokens():
    update = build("grpo")
    trajs = rollouts(update, num_prompts=2, group_size=4)
    batch = collate(trajs)
    adv, returns, values = advantages(update, trajs)
    assert returns is None and values is None
    total = batch.rewards.sum(-1)
    for b in range(batch.size):
        group = [i for i in range(batch.size) if trajs[i].prompt_id == trajs[b].prompt_id]
        g = total[group]
        expected = (total[b] - g.mean()) / (g.std() + 1e-6)
        acted = batch.action_mask[b]
        torch.testing.assert_close(adv[b, acted], expected.expand(int(acted.sum())))
        assert (adv[b, ~acted] == 0).all()


def test_running_mean_starts_at_zero_advantage_then_uses_history():
    update = build("running_mean")
    trajs = rollouts(update, num_prompts=3)
    batch = collate(trajs)
    adv, _, _ = advantages(update, trajs)
    assert (adv == 0).all()  # no history yet
    total = batch.rewards.sum(-1)
    for t in trajs:
        t.reward += 0.5  # the same prompts score 0.5 higher: Â = 0.5 against the history
    batch2 = collate(trajs)
    adv2, _, _ = advantages(update, trajs)
    assert batch2.rewards.sum(-1).sub(total).allclose(torch.full((3,), 0.5))
    torch.testing.assert_close(adv2[batch2.action_mask], torch.full((int(batch2.action_mask.sum()),), 0.5))


@pytest.mark.parametrize("algorithm", ["sao", "grpo", "running_mean"])
def test_state_dict_round_trip_resumes_bit_identically(algorithm):
    batches = [rollouts(build(algorithm), seed=s, num_prompts=2, group_size=2) for s in range(3)]
    warm = {"warmup_steps": 1} if algorithm == "sao" else {}  # the others have no critic to warm
    a = build(algorithm, **warm)
    for trajs in batches:
        a.step(trajs)
    b = build(algorithm, **warm)
    for trajs in batches[:2]:
        b.step(trajs)
    saved = copy.deepcopy(b.state_dict())  # models, optimizers, counters: one state
    c = build(algorithm, seed=1, **warm)
    c.load_state_dict(saved)
    c.step(batches[2])
    assert same(params_of(a), params_of(c))
    assert c.state_dict()["step"] == 3


def test_the_policy_lr_ramps_over_its_first_updates_after_the_critic_warm_up():
    trajs = rollouts(build("sao"), num_prompts=2)
    ramped = build("sao", warmup_steps=1, lr_ramp=4)
    policy = [p.detach().clone() for p in ramped.policy.parameters()]
    assert "policy/lr" not in ramped.step(trajs)  # the critic warm-up: the policy neither moves nor has a rate
    assert same(policy, [p.detach() for p in ramped.policy.parameters()])
    assert [ramped.step(trajs)["policy/lr"] for _ in range(5)] == pytest.approx([0.25e-2, 0.5e-2, 0.75e-2, 1e-2, 1e-2])
    # Adam's first update moves each parameter by about its rate, whatever the gradient's size
    moved = []
    for ramp in (0, 4):
        update = build("sao", warmup_steps=0, lr_ramp=ramp)
        start = [p.detach().clone() for p in update.policy.parameters()]
        update.step(trajs)
        moved.append(max((p.detach() - q).abs().max().item() for p, q in zip(update.policy.parameters(), start)))
    assert moved[1] / moved[0] == pytest.approx(0.25, rel=0.02)


def test_the_value_head_takes_its_own_learning_rate():
    """Adam's first steps move a parameter by about its rate: the head by `lr_value_head` (or the
    critic's rate when unset), the rest of the critic by `lr_critic` either way."""
    trajs = rollouts(build("sao"), num_prompts=2)
    moved = {}
    for head_lr in (None, 1e-2):
        update = build("sao", warmup_steps=1, lr_critic=1e-4, lr_value_head=head_lr)
        start = {n: p.detach().clone() for n, p in update.critic.named_parameters()}
        update.step(trajs)
        shift = {n: (p.detach() - start[n]).abs().max().item() for n, p in update.critic.named_parameters()}
        moved[head_lr] = (max(v for n, v in shift.items() if n.startswith("head.")),
                          max(v for n, v in shift.items() if not n.startswith("head.")))
    assert 0.5e-4 < moved[None][0] < 3e-4 and 0.5e-2 < moved[1e-2][0] < 3e-2, moved
    assert moved[1e-2][1] == pytest.approx(moved[None][1], rel=1e-3) and moved[None][1] < 3e-4, moved
    with pytest.raises(ConfigError, match="lr-value-head"):
        UpdateConfig(algorithm="grpo_dis", lr_value_head=1e-2)
    with pytest.raises(ConfigError, match="lr-value-head"):
        UpdateConfig(lr_value_head=0.0)


def test_packed_and_padded_updates_agree():
    trajs = rollouts(build("sao"), num_prompts=4)
    ups = [build("sao", warmup_steps=0, packed=packed) for packed in (False, True)]
    ms = [u.step(trajs) for u in ups]
    assert ms[0]["loss/policy"] == pytest.approx(ms[1]["loss/policy"], rel=1e-4, abs=1e-6)
    for p, q in zip(params_of(ups[0]), params_of(ups[1])):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_algorithm_and_critic_must_agree():
    policy = tiny_llama()
    with pytest.raises(ValueError, match="needs"):
        SAOUpdate(policy, None, UpdateConfig(algorithm="sao"))
    with pytest.raises(ValueError, match="takes no"):
        SAOUpdate(policy, ValueModel.from_policy(policy), UpdateConfig(algorithm="grpo"))


def test_config_presets_overrides_validation_and_environment():
    assert UpdateConfig().eps == (0.3, 5.0)
    assert UpdateConfig(preset="coding").eps == (0.8, 3.0)
    assert UpdateConfig(preset="coding", eps_high=2.0).eps == (0.8, 2.0)
    assert UpdateConfig(algorithm="sao_k1").settings.critic_updates == 1
    assert UpdateConfig(algorithm="grpo").settings.warmup_steps == 0
    assert UpdateConfig(running_mean_scope="global").window == 128
    assert UpdateConfig().window == 8
    with pytest.raises(ConfigError, match="--update.lr-policy must be > 0"):
        UpdateConfig(lr_policy=0.0)
    with pytest.raises(ConfigError, match="--update.eps-low"):
        UpdateConfig(eps_low=1.5)
    with pytest.raises(ConfigError, match="--update.lr-ramp must be >= 0"):
        UpdateConfig(lr_ramp=-1)
    # a knob the algorithm cannot honour is refused, never silently overridden
    with pytest.raises(ConfigError, match="--update.critic-updates 3: --update.algorithm grpo has no critic"):
        UpdateConfig(algorithm="grpo", critic_updates=3)
    with pytest.raises(ConfigError, match="--update.warmup-steps 5: --update.algorithm running_mean has no critic"):
        UpdateConfig(algorithm="running_mean", warmup_steps=5)
    with pytest.raises(ConfigError, match="--update.critic-updates 2: sao_k1 is the one-update ablation"):
        UpdateConfig(algorithm="sao_k1", critic_updates=2)
    assert UpdateConfig(algorithm="sao", critic_updates=4, warmup_steps=3).settings.critic_updates == 4
    assert UpdateConfig(algorithm="sao", critic_updates=4, warmup_steps=3).settings.warmup_steps == 3
    assert UpdateConfig(algorithm="grpo", warmup_steps=0).settings.warmup_steps == 0
    cfg = from_env(UpdateConfig, {"SAO_ALGORITHM": "grpo_dis", "SAO_EPS_LOW": "0.5",
                                  "SAO_VALUE_CLIP": "none", "SAO_LOSS_AGG": "seq_mean_token_mean"})
    assert (cfg.algorithm, cfg.eps, cfg.value_clip, cfg.loss_agg) == (
        "grpo_dis", (0.5, 5.0), None, "seq_mean_token_mean")


def test_every_algorithm_runs_on_the_same_path():
    for algorithm in typing.get_args(Algorithm):
        update = build(algorithm, warmup_steps=0, kl_coef=0.1, entropy_coef=0.01,
                       value_clip=0.2, whiten_advantages=True)
        metrics = update.step(rollouts(update, num_prompts=2, group_size=2))
        assert metrics["step/skipped"] == 0 and metrics["step/policy_updated"] == 1, algorithm
        # V ≡ 0 at the start (zero head): its explained variance and correlation are undefined
        assert all(math.isfinite(v) for k, v in metrics.items() if not k.startswith(
            ("value/explained", "value/return_corr", "grad_norm/critic"))), (algorithm, metrics)


def test_vapo_is_sao_without_the_dis_mask():
    """Rollout log-probs e^5 below the policy's: DIS masks every token, so sao's policy gets no
    gradient; vapo's PPO clip against the batch-start weights ignores π_rollout and updates."""
    trajs = rollouts(build("sao"))
    for t in trajs:
        t.rollout_logprobs[t.action_mask.astype(bool)] -= 5.0
    sao, vapo = (build(a, warmup_steps=0).step(trajs) for a in ("sao", "vapo"))
    assert sao["dis/kept_frac"] == vapo["dis/kept_frac"] == 0 and sao["grad_norm/policy"] == 0
    assert vapo["grad_norm/policy"] > 0 and vapo["step/critic_updates"] == 2
    assert "value/explained_var" in vapo and "ppo/clip_frac" in vapo


def test_the_ppo_clip_binds_only_from_a_batchs_second_pass():
    """One pass compares the policy with itself (ratio 1, nothing clipped); a second pass, after a
    big first step, compares it with the batch-start weights, and the clip binds."""
    trajs = rollouts(build("grpo"), num_prompts=4, group_size=2)
    one = build("grpo", lr_policy=0.5).step(trajs)
    two = build("grpo", lr_policy=0.5, policy_epochs=2).step(trajs)
    assert one["ppo/clip_frac"] == 0.0 and one["step/policy_updated"] == 1
    assert two["ppo/clip_frac"] > 0.0 and two["step/policy_updated"] == 1
    # the passes step the policy twice: its weights differ from the one-pass run's
    a, b = build("grpo", lr_policy=0.5), build("grpo", lr_policy=0.5, policy_epochs=2)
    a.step(trajs)
    b.step(trajs)
    assert any(not torch.equal(x, y) for x, y in zip(a.policy.parameters(), b.policy.parameters()))
    with pytest.raises(ValueError, match="policy-epochs"):
        UpdateConfig(policy_epochs=0)


def test_each_algorithm_name_resolves_once_into_its_settings():
    table = {name: algorithm_settings(name, critic_updates=2, warmup_steps=10) for name in
             typing.get_args(Algorithm)}
    row = {n: (s.advantage, s.policy_loss, s.critic_updates, s.freeze_critic_attention, s.warmup_steps)
           for n, s in table.items()}
    assert row == {"sao": ("gae", "dis", 2, True, 10), "sao_k1": ("gae", "dis", 1, True, 10),
                   "sao_full_critic": ("gae", "dis", 2, False, 10),
                   "grpo": ("group", "ppo_clip", 0, False, 0), "grpo_dis": ("group", "dis", 0, False, 0),
                   "running_mean": ("running_mean", "dis", 0, False, 0),
                   "vapo": ("gae", "ppo_clip", 2, True, 10)}
    with pytest.raises(ValueError, match="--update.algorithm"):
        algorithm_settings("ppo")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("algorithm,extra", [
    ("sao", {}), ("sao", {"loss_agg": "seq_mean_token_mean", "whiten_advantages": True}),
    ("grpo_dis", {}), ("running_mean", {"kl_coef": 0.1, "entropy_coef": 0.01})])
def test_micro_batched_step_equals_the_one_shot_step(algorithm, extra, packed):
    """Losses divided by the step's counts: accumulated gradients equal the one-shot gradient."""
    torch.set_default_dtype(torch.float32)
    trajs = [t for n in (2, 3, 6) for t in rollouts(build(algorithm), seed=n, num_prompts=2,
                                                     group_size=2, max_tokens=n)]
    assert len({len(t.tokens) for t in trajs}) > 1  # different lengths: padding and packing differ
    budget = 2 * max(len(t.tokens) for t in trajs)
    # Adam's first step moves a weight by about lr·sign(g) whatever g's scale: 1e-3 keeps the
    # rounding of near-zero gradients under 1e-5, and the gradient norms check the scale
    ups = [build(algorithm, warmup_steps=0, packed=packed, micro_batch_tokens=tokens,
                 lr_policy=1e-3, lr_critic=1e-3, **extra) for tokens in (0, budget)]
    ms = [u.step(trajs) for u in ups]
    assert ms[0]["perf/micro_batches"] == 1 and ms[1]["perf/micro_batches"] >= 4
    keys = ["loss/policy", "grad_norm/policy", "dis/kept_frac", "adv/abs_mean", "policy/entropy",
            "dis/ratio_max"] + (["loss/value", "grad_norm/critic"] if algorithm == "sao" else [])
    for key in keys:
        assert ms[1][key] == pytest.approx(ms[0][key], rel=1e-5, abs=1e-6), key
    for p, q in zip(params_of(ups[0]), params_of(ups[1])):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-5)

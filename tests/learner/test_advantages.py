"""SAOUpdate computes the policy's advantages with the length-adaptive λ and the critic's targets
with λ = 1 (docs/algorithm.md §4), on the step's real micro-batches: a swap of the two fails here."""

from __future__ import annotations

import torch

from learner.gae import adaptive_lambda, skip_observation_gae
from learner.microbatch import plan_step
from learner.models import tiny_llama
from learner.update import SAOUpdate, UpdateConfig
from learner.value import ValueModel
from tests.learner.service_util import rollouts


def test_policy_gets_the_adaptive_lambda_and_the_critic_lambda_one():
    policy = tiny_llama(seed=0)
    critic = ValueModel.from_policy(tiny_llama(seed=0))
    with torch.no_grad():  # non-zero values, so that V_next − V_t terms matter too
        torch.manual_seed(1)
        critic.head.weight.normal_(0, 0.5)
        critic.head.bias.fill_(0.1)
    cfg = UpdateConfig(micro_batch_tokens=24)  # several micro-batches
    update = SAOUpdate(policy, critic, cfg)
    trajs = rollouts(6, seed=3)
    plan = plan_step(trajs, 0, 1, cfg.micro_batch_tokens, cfg.packed)
    mbs = [update._micro_batch(trajs, rows) for rows in plan.micro_batches]
    assert len(mbs) > 1
    returns = torch.tensor([float(t.reward) for t in trajs])
    update.advantages(mbs, returns, trajs, plan)
    for mb in mbs:
        b = mb.batch
        lam = adaptive_lambda(b.response_len, cfg.alpha)
        assert (lam < 1).all()  # short responses: λ well below 1, so the two differ
        adv, _ = skip_observation_gae(b.rewards, mb.values, b.action_mask, cfg.gamma, lam)
        _, target = skip_observation_gae(b.rewards, mb.values, b.action_mask, cfg.gamma, 1.0)
        torch.testing.assert_close(mb.adv, adv)
        torch.testing.assert_close(mb.returns, target)
        assert not torch.allclose(mb.adv + mb.values, mb.returns)  # λ = 1 targets differ from λ < 1 ones

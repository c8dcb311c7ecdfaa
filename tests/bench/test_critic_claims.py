"""bench/critic_claims.py's parts on a tiny Llama: each critic variant trains what it says, the
held-out explained variance is the textbook one, and the volatility measures and verdicts follow
from the numbers (the bench itself runs SmolLM2 for ~30 minutes; its results are committed)."""

import argparse
import math
import random

import numpy as np
import pytest
import torch

from bench.critic_claims import CRITICS, Variant, build, held_out_ev, verdicts, volatility
from learner.models import tiny_llama
from learner.parallel import init_distributed
from learner.value import param_kinds
from producers.envs import make_env
from producers.episode import play_tasks
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator

ARGS = argparse.Namespace(lr_policy=1e-3, lr_critic=1e-3)


@pytest.fixture(scope="module")
def device():
    return init_distributed("cpu")[2]


def trainable_kinds(model):
    return {k for k, ps in param_kinds(model).items() if any(p.requires_grad for p in ps)}


@pytest.mark.parametrize("critic", CRITICS)
def test_each_critic_trains_what_its_name_says_and_only_the_reference_run_trains_the_policy(critic, device):
    sao = build(Variant("concise", critic, 2), tiny_llama(seed=0), ARGS, device)
    expected = {"frozen attention": {"mlp", "norm", "embedding", "value_head"},
                "attention only": {"attention", "value_head"},
                "full": {"attention", "mlp", "norm", "embedding", "value_head"},
                "lora": {"mlp", "value_head"}}[critic]
    assert trainable_kinds(sao.critic) == expected
    if critic == "lora":  # only the adapters of the MLPs and the head
        names = [n for n, p in sao.critic.named_parameters() if p.requires_grad]
        assert all(".lora_" in n and "mlp" in n or n.startswith("head.") for n in names), names
    assert sao.cfg.critic_updates == 2 and sao.cfg.warmup_steps > 10 ** 6
    assert build(Variant("concise", critic, 1, policy_trains=True), tiny_llama(seed=0), ARGS,
                 device).cfg.warmup_steps == 0


def test_held_out_explained_variance_is_one_minus_the_residual_share_of_the_rewards(device):
    sao = build(Variant("concise", "full", 1), tiny_llama(seed=0), ARGS, device)
    trajs = play_tasks(make_env("toy-target"), HFGenerator(tiny_llama(seed=1), seed=0), SamplingParams(max_tokens=4),
                       random.Random(0), num_prompts=6, id_prefix="ev-")
    for i, t in enumerate(trajs):
        t.reward = float(i % 3)
    with torch.no_grad():  # a head that gives every state a value
        sao.critic.head.weight.normal_(0, 0.5)
        sao.critic.head.bias.fill_(0.3)
    v, r = [], []
    for t in trajs:  # V(s_t) of each action token by a forward of its own prefix
        ids = torch.tensor(t.tokens)[None]
        values = sao.critic(input_ids=ids, attention_mask=torch.ones_like(ids))[0]
        for pos in np.flatnonzero(t.action_mask):
            v.append(values[pos - 1].item())
            r.append(t.reward)
    v, r = np.array(v), np.array(r)
    expected = 1 - np.var(r - v) / np.var(r)
    assert held_out_ev(sao.critic, trajs, 4, device) == pytest.approx(expected, abs=1e-4)


def test_volatility_is_median_coefficient_of_variation_and_largest_over_median():
    med, cv, spike = volatility([1.0, 2.0, 3.0, 10.0])
    assert med == 2.5 and spike == 4.0
    assert cv == pytest.approx(np.std([1, 2, 3, 10], ddof=1) / 4.0)
    assert all(math.isnan(x) for x in volatility([1.0]))


def test_verdicts_follow_the_figures():
    def run(critic_norms, policy_norms=None, attention=None, mlp=None, ev=0.5):
        h = [{"grad_norm/critic": c} for c in critic_norms]
        for i, row in enumerate(h):
            if policy_norms:
                row["grad_norm/policy"] = policy_norms[i]
            if attention:
                row["grad_norm/critic_attention"], row["grad_norm/critic_mlp"] = attention[i], mlp[i]
        h[-1]["heldout/explained_var"] = ev
        return h

    steady, wild = [1.0, 1.1, 0.9, 1.0], [1.0, 9.0, 0.5, 4.0]
    runs = {Variant("concise", "frozen attention", 2, True): run(steady, steady, ev=0.4),
            Variant("concise", "frozen attention", 1): run(steady, ev=0.2),
            Variant("concise", "full", 2): run(wild, attention=wild, mlp=steady, ev=0.3),
            Variant("concise", "attention only", 2): run(wild)}
    text = verdicts(runs, settle=0)
    lines = [line for line in text.splitlines() if line.startswith("- ")]
    assert len(lines) == 6 and all(line.endswith("**holds**") for line in lines), text
    runs[Variant("concise", "frozen attention", 1)][-1]["heldout/explained_var"] = 0.9
    assert verdicts(runs, settle=0).splitlines()[-1].endswith("**the opposite holds**")
    runs[Variant("concise", "frozen attention", 1)][-1]["heldout/explained_var"] = 0.38
    assert verdicts(runs, settle=0).splitlines()[-1].endswith("**no clear difference**")

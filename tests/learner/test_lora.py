"""LoRA: only adapters train and travel, the critic's attention stays frozen, and producers serve
each new adapter version with the learner's log-probs."""

from __future__ import annotations

import asyncio
import math
import subprocess

import numpy as np
import pytest
import torch
import torch.distributed as dist

from learner.logprobs import collate, token_logprobs
from learner.lora import inject
from learner.models import ModelConfig, build_models, build_policy, tiny_llama
from learner.parallel import ParallelConfig, init_distributed
from learner.update import SAOUpdate, UpdateConfig
from learner.value import is_attention
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator
from producers.models import load_model
from schemas import topics as T
from schemas.messages import Trajectory
from schemas.weights.chain import fetch
from schemas.weights.follow import WeightSubscriber
from tests.learner.service_util import ROOT, announcements, final_policy, learner_cmd, ONE_PARTITION, publish, rollouts
from tests.producers.util import wait_until

LORA = ModelConfig(lora_rank=4, lora_alpha=8.0, lora_critic=True)


@pytest.fixture
def group_of_one():
    init_distributed("cpu")
    yield
    dist.destroy_process_group()


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_only_adapters_train_and_the_critic_keeps_its_attention_frozen(group_of_one):
    policy, critic = build_models(build_policy(LORA), True, ParallelConfig(), torch.device("cpu"), LORA.lora)
    update = SAOUpdate(policy, critic, UpdateConfig(warmup_steps=0, lr_policy=1e-2, lr_critic=1e-2))
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == set(LORA.lora.targets)  # every target adapted (…q_proj.lora_A.default.weight)
    in_attention = {n for m in critic.modules() if is_attention(m) for n, _ in m.named_parameters()}
    assert not any("lora" in n for n in in_attention)  # docs/algorithm.md §5: no adapter inside the critic's attention
    assert all(not p.requires_grad for m in critic.modules() if is_attention(m) for p in m.parameters())
    assert critic.head.weight.requires_grad and any("mlp" in n and "lora" in n for n, p in critic.named_parameters()
                                                     if p.requires_grad)
    before = {k: full(v).clone() for k, v in policy.state_dict().items()}
    trajs = rollouts(4, seed=3)
    logp0, _ = token_logprobs(policy, collate(trajs), temperature=1.0)
    base_logp, _ = token_logprobs(tiny_llama(seed=0), collate(trajs), temperature=1.0)
    torch.testing.assert_close(logp0, base_logp, rtol=0, atol=1e-5)  # B = 0: the adapted model starts as the base
    metrics = update.step(trajs)
    assert metrics["step/policy_updated"] == 1
    after = {k: full(v) for k, v in policy.state_dict().items()}
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed and all("lora" in k for k in changed)  # the base is bit-identical


def learner_logprobs(policy_state: dict, prompt: list[int], out) -> np.ndarray:
    """The learner's forward (token_logprobs) of a generation under the checkpointed LoRA policy."""
    model = tiny_llama(seed=99)
    inject(model, LORA.lora, LORA.lora.targets)
    model.load_state_dict(policy_state)
    tokens = np.array(prompt + out.token_ids.tolist(), np.int32)
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(out.token_ids))].astype(np.uint8)
    traj = Trajectory(id="x", prompt_id="x", env="x", producer_id="x", tokens=tokens, action_mask=mask,
                      rollout_logprobs=np.zeros(len(tokens), np.float32),
                      versions=np.where(mask == 1, 0, -1).astype(np.int32), prompt_len=len(prompt), reward=0.0)
    with torch.no_grad():
        logp, _ = token_logprobs(model.eval(), collate([traj]), temperature=1.0)
    return logp[0, len(prompt):].numpy()


def test_producers_serve_each_adapter_version_with_the_learners_logprobs(kafka_cfg, tmp_path):
    """A LoRA learner (float32 publication) trains 3 steps; a real hf producer follows. Every update
    after the anchor is inline and holds adapters only; the producer's log-probs move with each
    version, and on the last one equal the learner's own forward of its checkpoint within 1e-4."""
    gen = HFGenerator(load_model("tiny-llama", seed=0), seed=0)
    sub = WeightSubscriber(kafka_cfg, gen).start()
    prompt, params = [3, 1, 4, 1, 5], SamplingParams(max_tokens=16, seed=11)
    learner = subprocess.Popen(learner_cmd(
        kafka_cfg, tmp_path, "--batch-trajectories", "4", "--max-steps", "3", "--model.lora-rank", "4",
        "--model.lora-alpha", "8", "--model.lora-critic", "--update.lr-policy", "1e-2", "--weights.dtype", "float32"),
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    seen, batches = {}, rollouts(12, seed=5)
    try:
        assert sub.caught_up.wait(30)
        for v in (1, 2, 3):  # the learner steps once per 4 trajectories: one version at a time
            publish(kafka_cfg, T.TRAJECTORIES, [t.encode() for t in batches[4 * v - 4:4 * v]], key=ONE_PARTITION)
            wait_until(lambda: gen.version == v, timeout=120)
            seen[v] = asyncio.run(gen.generate(prompt, params))
        assert learner.wait(60) == 0
        ws = announcements(kafka_cfg)
    finally:
        sub.close()
        if learner.poll() is None:
            learner.kill()
    assert [w.version for w in ws] == [0, 1, 2, 3] and ws[0].base == -1
    for w in ws[1:]:
        payload, _ = fetch(w)
        moved = {n for n, spec in payload.tensors.items() if spec[3] != "same"}
        assert w.inline and moved and all(".lora_" in n for n in moved)  # adapters only
        adapters = sum(4 * math.prod(spec[1]) for n, spec in payload.tensors.items() if ".lora_" in n)
        assert w.num_bytes <= adapters + len(payload.header) < ws[0].num_bytes  # the base never travels again
    assert all((seen[v].versions == v).all() for v in seen) and sub.counts["rejected"] == 0
    for a, b in ((seen[1], seen[2]), (seen[2], seen[3])):  # same prompt, same seed: each version moved them
        assert not np.array_equal(a.token_ids, b.token_ids) or np.abs(a.logprobs - b.logprobs).max() > 1e-4
    expected = learner_logprobs(final_policy(tmp_path), prompt, seen[3])
    np.testing.assert_allclose(seen[3].logprobs, expected, atol=1e-4)
    assert np.abs(seen[3].logprobs - learner_logprobs_base(prompt, seen[3])).max() > 1e-3  # not the base's


def learner_logprobs_base(prompt: list[int], out) -> np.ndarray:
    model = tiny_llama(seed=0)
    ids = torch.tensor([prompt + out.token_ids.tolist()])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return logp.gather(-1, torch.from_numpy(out.token_ids).long()[:, None])[:, 0].numpy()

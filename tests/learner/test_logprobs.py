"""Collation of trajectories and per-token log-probs at temperature T, padded and packed."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import random

import numpy as np
import pytest
import torch

from learner.logprobs import chunked_target_logprobs, collate, model_inputs, target_logprobs, token_logprobs, token_rewards
from learner.models import tiny_llama, tiny_qwen3_moe
from producers.envs import make_env
from producers.episode import play_tasks
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator
from schemas.messages import Trajectory


def traj(tokens, mask, *, prompt_len, reward=1.0, turn_rewards=(), logp=None, tid="t", pid="p"):
    mask = np.array(mask, np.uint8)
    logp = np.where(mask, -1.0, 0.0) if logp is None else np.array(logp)
    return Trajectory(id=tid, prompt_id=pid, env="test", producer_id="test",
                      tokens=np.array(tokens), action_mask=mask, rollout_logprobs=logp,
                      versions=np.where(mask, 3, -1), prompt_len=prompt_len, reward=reward,
                      turn_rewards=list(turn_rewards))


def test_outcome_on_last_action_token_and_turn_rewards_on_theirs():
    t = traj([1, 5, 6, 2, 7, 8, 2], [0, 1, 1, 0, 1, 1, 0], prompt_len=1, reward=1.0,
             turn_rewards=[(2, 0.25)])
    assert token_rewards(t).tolist() == [0, 0, 0.25, 0, 0, 1.0, 0]


def test_collate_pads_right_and_aligns_every_tensor():
    a = traj([1, 5, 6], [0, 1, 1], prompt_len=1, reward=0.5, pid="a")
    b = traj([1, 4, 7, 2, 9], [0, 0, 1, 0, 1], prompt_len=2, reward=2.0, pid="b", turn_rewards=[(2, 1.0)])
    batch = collate([a, b])
    assert batch.tokens.tolist() == [[1, 5, 6, 0, 0], [1, 4, 7, 2, 9]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert batch.position_ids[0, :3].tolist() == [0, 1, 2]
    assert batch.action_mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 0, 1]]
    assert batch.logp_rollout.tolist() == [[0, -1, -1, 0, 0], [0, 0, -1, 0, -1]]
    assert batch.rewards.tolist() == [[0, 0, 0.5, 0, 0], [0, 0, 1.0, 0, 2.0]]
    assert batch.response_len.tolist() == [2, 3]


def test_collate_refuses_unscored_or_misplaced_rewards():
    with pytest.raises(ValueError, match="no reward"):
        collate([traj([1, 5], [0, 1], prompt_len=1, reward=None)])
    with pytest.raises(ValueError, match="not on an action token"):
        collate([traj([1, 5, 2], [0, 1, 0], prompt_len=1, turn_rewards=[(2, 1.0)])])
    with pytest.raises(ValueError, match="no action tokens"):
        collate([traj([1, 5], [0, 0], prompt_len=2)])


def test_target_logprobs_by_hand():
    logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])  # (2, V=2)
    logp, ent = target_logprobs(logits, torch.tensor([1, 0]), temperature=2.0)
    # token 1 from logits [0, 0] / 2: log ½; token 0 from [2, 0] / 2 = [1, 0]: 1 − log(e + 1)
    torch.testing.assert_close(logp, torch.tensor([np.log(0.5), 1 - np.log(np.e + 1)], dtype=torch.float32))
    assert ent[0].item() == pytest.approx(np.log(2.0))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_logprobs_and_entropy_and_their_gradients_equal_the_full_computation(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(100, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (100,))
    full = target_logprobs(hidden @ weight.T, targets, 0.7)
    part = chunked_target_logprobs(hidden, weight, targets, 0.7, chunk, entropy_grad=True)
    for a, b in zip(full, part):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    grads = [torch.autograd.grad((lp * 1.5 + ent).sum(), (hidden, weight)) for lp, ent in (full, part)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=0)
    assert not chunked_target_logprobs(hidden, weight, targets, 0.7, chunk)[1].requires_grad


def _reference_logprobs(model, tokens, temperature):
    """Each trajectory alone, unpadded: log_softmax(logits[t−1] / T)[x_t]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logp = torch.log_softmax(logits[:-1] / temperature, -1).gather(-1, torch.tensor(tokens[1:])[:, None])
    return torch.cat([torch.zeros(1), logp[:, 0]])


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3_moe])
@pytest.mark.parametrize("packed", [False, True])
def test_padded_and_packed_match_each_trajectory_alone(build, packed):
    model = build(seed=1)
    rng = np.random.default_rng(0)
    trajs = []
    for n, p in [(7, 2), (3, 1), (11, 4)]:
        mask = np.r_[np.zeros(p), rng.integers(0, 2, n - p)]
        mask[-1] = 1
        trajs.append(traj(rng.integers(3, 64, n), mask, prompt_len=p))
    batch = collate(trajs)
    logp, ent = token_logprobs(model, batch, temperature=0.7, packed=packed)
    for b, t in enumerate(trajs):
        n = len(t.tokens)
        ref = _reference_logprobs(model, t.tokens.tolist(), 0.7)
        acted = torch.from_numpy(t.action_mask.astype(bool))
        torch.testing.assert_close(logp[b, :n], torch.where(acted, ref, 0.0), atol=2e-5, rtol=1e-5)
        assert (logp[b, n:] == 0).all() and (ent[b, ~batch.action_mask[b]] == 0).all()


@pytest.mark.parametrize("packed", [False, True])
def test_token_logprobs_in_chunks_equal_the_full_logits_computation(packed):
    """Chunks of 3 action tokens from the hidden states against full (B, T, V) float32 logits."""
    model = tiny_qwen3_moe(seed=4)
    rng = np.random.default_rng(1)
    trajs = [traj(rng.integers(3, 64, n), np.r_[np.zeros(2), np.ones(n - 2)], prompt_len=2)
             for n in (9, 4, 13)]
    batch = collate(trajs)
    with torch.no_grad():
        logp, ent = token_logprobs(model, batch, temperature=0.8, packed=packed, chunk_tokens=3)
        logits = model(**model_inputs(batch, packed=False)).logits  # (B, T, V)
        full_logp, full_ent = target_logprobs(logits[:, :-1], batch.tokens[:, 1:], 0.8)
    acted = batch.action_mask[:, 1:]
    torch.testing.assert_close(logp[:, 1:], torch.where(acted, full_logp, 0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent[:, 1:], torch.where(acted, full_ent, 0.0), atol=1e-6, rtol=0)


def test_packed_forward_backpropagates_like_padded():
    model = tiny_llama(seed=2)
    batch = collate([traj([1, 5, 6, 7], [0, 1, 1, 1], prompt_len=1),
                     traj([1, 9, 8], [0, 0, 1], prompt_len=2)])
    grads = []
    for packed in (False, True):
        model.zero_grad()
        logp, _ = token_logprobs(model, batch, temperature=1.0, packed=packed)
        logp.sum().backward()
        grads.append(model.model.layers[0].mlp.up_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-5)


def test_learner_reproduces_the_generators_rollout_log_probs():
    """The ratio π_θ / π_rollout is 1 when the learner holds the rollout weights (docs/algorithm.md §3)."""
    model = tiny_llama(seed=3)
    env = make_env("toy-multiturn", turn_rewards=True)
    params = SamplingParams(temperature=0.7, max_tokens=4, seed=None)
    trajs = play_tasks(env, HFGenerator(model, seed=0), params, random.Random(0), num_prompts=4)
    batch = collate(trajs)
    logp, _ = token_logprobs(model, batch, temperature=0.7, packed=True)
    torch.testing.assert_close(logp, batch.logp_rollout, atol=2e-5, rtol=1e-5)

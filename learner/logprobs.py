"""From trajectories to tensors, and the per-token log-probs of a causal LM at temperature T.

`collate` turns `schemas.Trajectory` objects into one right-padded `Batch`; every per-token tensor
is aligned with `tokens`, so position t holds what concerns token t (its log-prob, its value, its
reward). The model forward can run padded, or packed: all real tokens in one row with positions
restarting at 0 per trajectory, which transformers turns into a block-diagonal causal mask. The
math after the forward always sees the padded (B, T) layout.

Reward placement (SAO.md §4): `Trajectory.reward`, the outcome, goes on the trajectory's last
action token. Earlier turns' rewards travel in `Trajectory.turn_rewards` as `(token_index, reward)`
pairs, `token_index` being the index in `tokens` of the last action token of that turn (the codec
checks it is one); the final turn's reward is the outcome and is not repeated there.

Deliberately absent: top-p / top-k truncation. Generators default it off (producers/generate), and
the learner's source dead-letters any trajectory sampled with it (learner/checks.py), since
recomputing without the same truncation would bias the ratio (SAO.md §3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from schemas.messages import Trajectory


@dataclass(kw_only=True)
class Batch:
    """A right-padded batch of B trajectories of at most T tokens."""

    tokens: Tensor  # (B, T) int64; padding is 0
    attention_mask: Tensor  # (B, T) bool, real tokens
    position_ids: Tensor  # (B, T) int64, 0.. per trajectory
    action_mask: Tensor  # (B, T) bool, tokens the policy sampled
    logp_rollout: Tensor  # (B, T) float32, 0 off actions
    versions: Tensor  # (B, T) int32, -1 off actions
    rewards: Tensor  # (B, T) float32, outcome and per-turn rewards on action tokens
    outcome: Tensor  # (B,) float32, Trajectory.reward
    response_len: Tensor  # (B,) int64, tokens after the prompt, observations included
    prompt_ids: tuple[str, ...]  # (B,) for running-mean baselines
    group_ids: tuple[str, ...]  # (B,) for group baselines: the rollouts of one prompt publication

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device)
                                            for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), Tensor)})


def token_rewards(traj: Trajectory) -> np.ndarray:
    """(T,) float32: the outcome on the last action token, `turn_rewards` on theirs."""
    if traj.reward is None:
        raise ValueError(f"trajectory {traj.id}: no reward yet (it belongs on the pending topic)")
    acted = np.flatnonzero(traj.action_mask)
    if acted.size == 0:
        raise ValueError(f"trajectory {traj.id}: no action tokens")
    rewards = np.zeros(len(traj.tokens), dtype=np.float32)
    for index, reward in traj.turn_rewards:
        if not (0 <= index < len(rewards)) or not traj.action_mask[index]:
            raise ValueError(f"trajectory {traj.id}: turn reward at {index} is not on an action token")
        rewards[index] += reward
    rewards[acted[-1]] += traj.reward
    return rewards


def collate(trajs: Sequence[Trajectory], *, device: torch.device | str = "cpu") -> Batch:
    """Right-pad trajectories into a `Batch`; raises ValueError on an unscored or action-less one."""
    B, T = len(trajs), max(len(t.tokens) for t in trajs)
    out = {name: np.zeros((B, T), dtype=dtype) for name, dtype in
           [("tokens", np.int64), ("attention_mask", bool), ("position_ids", np.int64),
            ("action_mask", bool), ("logp_rollout", np.float32), ("rewards", np.float32)]}
    out["versions"] = np.full((B, T), -1, dtype=np.int32)
    for b, traj in enumerate(trajs):
        n = len(traj.tokens)
        acted = traj.action_mask.astype(bool)
        out["tokens"][b, :n] = traj.tokens
        out["attention_mask"][b, :n] = True
        out["position_ids"][b, :n] = np.arange(n)
        out["action_mask"][b, :n] = acted
        out["logp_rollout"][b, :n] = np.where(acted, traj.rollout_logprobs, 0.0)
        out["versions"][b, :n] = traj.versions
        out["rewards"][b, :n] = token_rewards(traj)
    tensors = {k: torch.from_numpy(v).to(device) for k, v in out.items()}
    return Batch(**tensors,
                 outcome=torch.tensor([t.reward for t in trajs], dtype=torch.float32, device=device),
                 response_len=torch.tensor([len(t.tokens) - t.prompt_len for t in trajs], device=device),
                 prompt_ids=tuple(t.prompt_id for t in trajs),
                 group_ids=tuple(t.group or t.prompt_id for t in trajs))


def model_inputs(batch: Batch, packed: bool) -> dict[str, Tensor]:
    """Keyword arguments of a transformers forward: padded (B, T), or packed (1, N) real tokens
    with positions restarting per trajectory and no attention mask (so transformers detects the
    packing and masks across trajectories)."""
    if not packed:
        return {"input_ids": batch.tokens, "attention_mask": batch.attention_mask.long(),
                "position_ids": batch.position_ids}
    keep = batch.attention_mask
    return {"input_ids": batch.tokens[keep][None], "position_ids": batch.position_ids[keep][None]}


def unpack(x: Tensor, attention_mask: Tensor, packed: bool) -> Tensor:
    """(1, N, ...) packed model output back to (B, T, ...), zeros on padding; padded passes through."""
    if not packed:
        return x
    out = x.new_zeros(*attention_mask.shape, *x.shape[2:])
    out[attention_mask] = x[0]  # differentiable scatter
    return out


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """logp[:, t] = log_softmax(logits[:, t−1] / T)[tokens[:, t]] and the entropy of that
    distribution, in float32; column 0 (no context) is 0. logits (B, T, V) → two (B, T)."""
    logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # (B, T-1, V)
    logp = logp_all.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return F.pad(logp, (1, 0)), F.pad(entropy, (1, 0))


def token_logprobs(model: torch.nn.Module, batch: Batch, *, temperature: float,
                   packed: bool = False) -> tuple[Tensor, Tensor]:
    """logπ_θ(a_t|s_t) at temperature T and the policy entropy at s_t, both (B, T) and zero off
    action tokens (prompt and observation positions are context only; SAO.md §3, §4)."""
    logits = model(**model_inputs(batch, packed), use_cache=False).logits
    logits = unpack(logits, batch.attention_mask, packed)  # (B, T, V)
    logp, entropy = logprobs_from_logits(logits, batch.tokens, temperature)
    return (torch.where(batch.action_mask, logp, 0.0),
            torch.where(batch.action_mask, entropy, 0.0))

"""From trajectories to tensors, and the per-token log-probs of a causal LM at temperature T.

`collate` turns `schemas.Trajectory` objects into one right-padded `Batch`; every per-token tensor
is aligned with `tokens`, so position t holds what concerns token t (its log-prob, its value, its
reward). The model forward can run padded, or packed: all real tokens in one row with positions
restarting at 0 per trajectory, which transformers turns into a block-diagonal causal mask. The
math after the forward always sees the padded (B, T) layout.

Reward placement (docs/algorithm.md §4): `Trajectory.reward`, the outcome, goes on the trajectory's last
action token. Earlier turns' rewards travel in `Trajectory.turn_rewards` as `(token_index, reward)`
pairs, `token_index` being the index in `tokens` of the last action token of that turn (the codec
checks it is one); the final turn's reward is the outcome and is not repeated there.

Deliberately absent: top-p / top-k truncation. Generators default it off (producers/generate), and
the learner's source dead-letters any trajectory sampled with it (learner/checks.py), since
recomputing without the same truncation would bias the ratio (docs/algorithm.md §3).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from schemas.messages import Trajectory


@dataclass(kw_only=True)
class Batch:
    """A right-padded batch of B trajectories of at most T tokens."""

    tokens: Tensor  # (B, T) int64; padding is 0
    attention_mask: Tensor  # (B, T) bool, real tokens
    position_ids: Tensor  # (B, T) int64, 0.. per trajectory
    action_mask: Tensor  # (B, T) bool, tokens the policy sampled
    logp_rollout: Tensor  # (B, T) float32, 0 off actions
    rewards: Tensor  # (B, T) float32, outcome and per-turn rewards on action tokens
    response_len: Tensor  # (B,) int64, tokens after the prompt, observations included
    train_mask: Tensor | None = None  # (B, T) bool, action tokens whose policy gradient counts (fresh,
    # not in a masked truncated episode: learner/long_episodes.py); None: every action token

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


def collate(trajs: Sequence[Trajectory], *, device: torch.device | str = "cpu",
            masks: Sequence[np.ndarray] | None = None) -> Batch:
    """Right-pad trajectories into a `Batch`; `masks`: each trajectory's (T,) bool action tokens
    whose policy gradient counts (`train_mask`). Raises ValueError on an unscored or action-less one."""
    B, T = len(trajs), max(len(t.tokens) for t in trajs)
    out = {name: np.zeros((B, T), dtype=dtype) for name, dtype in
           [("tokens", np.int64), ("attention_mask", bool), ("position_ids", np.int64),
            ("action_mask", bool), ("logp_rollout", np.float32), ("rewards", np.float32)]}
    for b, traj in enumerate(trajs):
        n = len(traj.tokens)
        acted = traj.action_mask.astype(bool)
        out["tokens"][b, :n] = traj.tokens
        out["attention_mask"][b, :n] = True
        out["position_ids"][b, :n] = np.arange(n)
        out["action_mask"][b, :n] = acted
        out["logp_rollout"][b, :n] = np.where(acted, traj.rollout_logprobs, 0.0)
        out["rewards"][b, :n] = token_rewards(traj)
    if masks is not None:
        out["train_mask"] = np.zeros((B, T), dtype=bool)
        for b, mask in enumerate(masks):
            out["train_mask"][b, :len(mask)] = mask
    tensors = {k: torch.from_numpy(v).to(device) for k, v in out.items()}
    return Batch(**tensors, response_len=torch.tensor([len(t.tokens) - t.prompt_len for t in trajs], device=device))


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


def target_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """logp = log_softmax(logits / T)[target] and the entropy of that distribution, in float32.
    logits (…, V), targets (…) → two (…)."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # (…, V) float32
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def chunked_target_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                            chunk_tokens: int, entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """`target_logprobs(hidden @ weightᵀ, targets, T)`, `chunk_tokens` rows at a time.

    hidden (A, H), weight (V, H) the LM head, targets (A,) → two (A,). Under autograd each chunk is
    checkpointed: its (chunk, V) float32 logits are recomputed in backward instead of kept, so at
    most one chunk's logits exist at a time (128 × 8k tokens × 150k vocab would be 630 GB). The
    entropy is detached unless `entropy_grad`: a graph that backward never consumes would keep
    every chunk's recomputed logits alive until the step ends.
    """
    def chunk(h: Tensor, w: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        logp, entropy = target_logprobs(h @ w.T, t, temperature)
        return logp, entropy if entropy_grad else entropy.detach()

    outs = [checkpoint(chunk, h, weight, t, use_reentrant=False) if torch.is_grad_enabled()
            else chunk(h, weight, t)
            for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def output_rows(batch: Batch, packed: bool) -> Tensor:
    """(B, T) int64: the row of the flattened model output that holds token (b, t)."""
    if packed:  # real tokens in row-major order; padding positions get a row they never use
        return (batch.attention_mask.flatten().cumsum(0) - 1).view(batch.tokens.shape)
    return torch.arange(batch.tokens.numel(), device=batch.tokens.device).view(batch.tokens.shape)


# Index of no position: the forward then computes logits for none (`logits_to_keep`), only the
# hidden states, from which `token_logprobs` computes the log-probs of action tokens in chunks.
NO_LOGITS = torch.empty(0, dtype=torch.long)


def token_logprobs(model: torch.nn.Module, batch: Batch, *, temperature: float, packed: bool = False,
                   chunk_tokens: int = 1024, entropy_grad: bool = False) -> tuple[Tensor, Tensor]:
    """logπ_θ(a_t|s_t) at temperature T and the policy entropy at s_t, both (B, T) float32 and
    zero off action tokens (prompt and observation positions are context only; docs/algorithm.md §3, §4).

    Computed from the final hidden states, at action tokens only, `chunk_tokens` at a time: the
    float32 logits of the whole micro-batch never exist. The entropy carries a gradient only with
    `entropy_grad`. The LM head's weight is read after the forward; under FSDP2 it is the root
    unit's, which `parallelize` keeps unsharded until backward.
    """
    out = model(**model_inputs(batch, packed), use_cache=False, output_hidden_states=True,
                logits_to_keep=NO_LOGITS.to(batch.tokens.device))
    hidden = out.hidden_states[-1].flatten(0, 1)  # (B·T or N, H), after the final norm
    acted = batch.action_mask.clone()
    acted[:, 0] = False  # the first token has no context, hence no log-prob
    rows = output_rows(batch, packed)[:, :-1][acted[:, 1:]]  # (A,) the row predicting each action
    weight = model.get_output_embeddings().weight
    logp, entropy = chunked_target_logprobs(hidden[rows], weight, batch.tokens[acted], temperature,
                                            chunk_tokens, entropy_grad)
    logp_bt = logp.new_zeros(batch.tokens.shape)
    entropy_bt = entropy.new_zeros(batch.tokens.shape)
    logp_bt[acted], entropy_bt[acted] = logp, entropy  # differentiable scatters
    return logp_bt, entropy_bt

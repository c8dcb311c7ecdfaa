"""Is a decoded trajectory trainable by *this* learner? The second layer of validation.

The codec (schemas/messages.py) rejects what is malformed for anyone. What it cannot know is the
learner's model and settings, so a well-formed trajectory can still be untrainable here: a token id
beyond the vocabulary (an IndexError on CPU, a device-side assert that poisons the CUDA context on a
GPU), a sequence longer than the context window, sampling settings the learner does not recompute
with (a silently biased ratio, docs/algorithm.md §3). `untrainable` names the first such problem, or returns
None; the source sends the trajectory to `sao.dlq` with that reason before any step is formed, so
`collate` and the update never see it. Every check here is one `collate` or the model relies on.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas.messages import Trajectory

LOGPROB_SLACK = 1e-4
"""A log-prob may exceed 0 by float rounding, never by more."""


@dataclass(frozen=True, kw_only=True)
class Trainable:
    """What the learner can train: its model's vocabulary and context, its recomputation settings."""

    vocab_size: int
    max_seq_len: int
    temperature: float
    needs_groups: bool = False
    """Group baselines (grpo, grpo_dis): every trajectory must belong to a group of G ≥ 2."""
    max_group_size: int = 1 << 30
    """A group larger than a step can never be trained whole."""


def untrainable(traj: Trajectory, spec: Trainable) -> str | None:
    """The reason `traj` cannot be trained by a learner with `spec`, or None if it can."""
    n = traj.num_tokens
    if traj.reward is None:
        return "reward: trajectory on sao.trajectories has no reward"
    if n > spec.max_seq_len:
        return f"tokens: {n} tokens exceed --max-seq-len {spec.max_seq_len}"
    acted = traj.action_mask.view(np.bool_)
    if not acted.any():
        return "action_mask: no action tokens, nothing to train"
    if acted[0]:
        return "action_mask: the first token is an action, but nothing precedes it to condition on"
    low, high = int(traj.tokens.min()), int(traj.tokens.max())
    if low < 0 or high >= spec.vocab_size:
        return f"tokens: ids must lie in [0, {spec.vocab_size}) for this model, got [{low}, {high}]"
    if (np.where(acted, traj.rollout_logprobs, 0.0) > LOGPROB_SLACK).any():
        return "rollout_logprobs: a log-prob above 0 on an action token"
    if traj.temperature != spec.temperature:
        return (f"temperature: sampled at {traj.temperature}, the learner recomputes at "
                f"{spec.temperature} (--update.temperature); the ratio would be biased")
    if traj.top_p != 1.0 or traj.top_k != 0:
        return (f"top_p/top_k: sampled with top_p={traj.top_p}, top_k={traj.top_k}; the learner "
                "recomputes without truncation, so the ratio would be biased")
    if spec.needs_groups and traj.group_size < 2:
        return "group_size: a group baseline needs G >= 2 rollouts per prompt (sao feed --group-size)"
    if traj.group_size > spec.max_group_size:
        return f"group_size: {traj.group_size} exceeds the {spec.max_group_size} trajectories of a step"
    return None

"""Skip-observation GAE (docs/algorithm.md §4): advantages and critic targets over action tokens only.

A trajectory is `[prompt, a_0, o_0, a_1, …, a_n]`. The walk goes backwards over action tokens and
treats the last token of a_i and the first token of a_{i+1} as neighbours, so a whole observation
span costs one γλ. Prompt and observation tokens get zero advantage and zero return, and are
excluded from every loss by the action mask.

Deliberately absent: a bootstrap value at the end (episodes are complete, `next_value = 0`), and
advantage whitening (docs/algorithm.md §4 leaves it off; `whiten` exists for the `whiten_advantages` knob).
"""

from __future__ import annotations

import torch
from torch import Tensor


def adaptive_lambda(response_len: Tensor, alpha: float) -> Tensor:
    """λ = clamp(1 − 1/(α·l), 0, 1) per trajectory, l = tokens after the prompt (docs/algorithm.md §4)."""
    return (1.0 - 1.0 / (alpha * response_len.double().clamp(min=1))).clamp(0.0, 1.0).float()


def skip_observation_gae(rewards: Tensor, values: Tensor, action_mask: Tensor,
                         gamma: float, lam: float | Tensor) -> tuple[Tensor, Tensor]:
    """Â_t = δ_t + γλ·Â_next, δ_t = r_t + γ·V_next − V_t, R_t = Â_t + V_t; "next" = next action token.

    rewards, values: (B, T) float, aligned with the tokens (rewards sit on action tokens only);
    action_mask: (B, T) bool; lam: a float or a (B,) tensor (one λ per trajectory).
    Returns (adv, returns), both (B, T) and zero off action tokens. docs/algorithm.md §4.
    """
    B, T = rewards.shape
    lam = torch.as_tensor(lam, dtype=rewards.dtype, device=rewards.device).expand(B)
    adv = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(B)  # V of the next action token; 0 past the end
    next_adv = rewards.new_zeros(B)
    # A Python loop over T: cheap next to a forward pass, and it reads like the recursion.
    for t in reversed(range(T)):
        act = action_mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(act, a_t, 0.0)
        # Off action tokens the walk carries "next" across unchanged: that is the skip.
        next_value = torch.where(act, values[:, t], next_value)
        next_adv = torch.where(act, a_t, next_adv)
    returns = torch.where(action_mask, adv + values, 0.0)
    return adv, returns


def whiten(adv: Tensor, action_mask: Tensor, mean: float, std: float, eps: float = 1e-8) -> Tensor:
    """(Â − mean) / (std + eps) on action tokens, zero elsewhere (the `whiten_advantages` knob);
    mean and std are over the step's action tokens, which may span micro-batches and ranks."""
    return torch.where(action_mask, (adv - mean) / (std + eps), 0.0)

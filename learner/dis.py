"""Policy objectives: DIS, double-sided importance sampling (docs/algorithm.md §3), and the PPO clip of `grpo`.

DIS weights each action token by its ratio to the behaviour policy π_rollout (what the rollout
engine actually ran), and drops, rather than clamps, any token whose ratio leaves the open band
(1 − ε_low, 1 + ε_high). Deliberately absent:
- no PPO `min(...)`/clip on top of the mask, and the mask ignores the sign of Â (docs/algorithm.md §3);
- no recomputed π_θold: tracking it is infeasible when weights change mid-trajectory (docs/algorithm.md §2);
- no KL or entropy term here: the update adds them only when their coefficients are non-zero.

`ppo_clip_policy_loss` exists only for the `grpo` baseline (docs/algorithm.md §7), whose "old policy" is the
learner's own weights at batch start.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

LossAgg = Literal["token_mean", "seq_mean_token_mean"]

# ε_low, ε_high of docs/algorithm.md §3's presets.
PRESETS: dict[str, tuple[float, float]] = {"reasoning": (0.3, 5.0), "coding": (0.8, 3.0)}


def dis_ratio(logp: Tensor, logp_rollout: Tensor) -> Tensor:
    """r_t = exp(logπ_θ(a_t|s_t) − logπ_rollout(a_t|s_t)) (docs/algorithm.md §3)."""
    return torch.exp(logp - logp_rollout)


def dis_keep(ratio: Tensor, eps_low: float, eps_high: float) -> Tensor:
    """keep_t = 1 − ε_low < r_t < 1 + ε_high, strict at both ends (docs/algorithm.md §3)."""
    return (ratio > 1.0 - eps_low) & (ratio < 1.0 + eps_high)


def aggregate(x: Tensor, action_mask: Tensor, loss_agg: LossAgg, *, num_tokens: int | None = None,
              num_seqs: int | None = None) -> Tensor:
    """token_mean: Σ_bt x / N, N = action tokens in the step, masked ones included;
    seq_mean_token_mean: Σ_b (Σ_t x_bt / n_b) / B. Off-action entries never count (docs/algorithm.md §3).

    When x is one micro-batch of a step, `num_tokens` (N) and `num_seqs` (B) are the step's, so the
    micro-batches' results sum to the step's; by default they are x's own.
    """
    x = torch.where(action_mask, x, 0.0)
    n = action_mask.sum(-1).to(x.dtype)  # (B,)
    match loss_agg:
        case "token_mean":
            return x.sum() / (n.sum().clamp(min=1) if num_tokens is None else max(num_tokens, 1))
        case "seq_mean_token_mean":
            return (x.sum(-1) / n.clamp(min=1)).sum() / (len(n) if num_seqs is None else num_seqs)
    raise ValueError(f"loss_agg={loss_agg!r}: expected 'token_mean' or 'seq_mean_token_mean'")


def k3_kl(logp: Tensor, logp_rollout: Tensor) -> Tensor:
    """k3 estimate of KL(π_rollout ‖ π_θ) per token: r − 1 − log r, r = π_θ/π_rollout."""
    log_ratio = logp - logp_rollout
    return torch.exp(log_ratio) - 1.0 - log_ratio


@torch.no_grad()
def ratio_stats(logp: Tensor, logp_rollout: Tensor, action_mask: Tensor, eps_low: float,
                eps_high: float, num_tokens: int | None = None) -> dict[str, Tensor]:
    """Health numbers of the ratio to π_rollout over action tokens (docs/algorithm.md §3, §8: healthy runs mask
    roughly 0.04 %–0.6 % of tokens): means over N tokens (`num_tokens`, as in `aggregate`), and
    `ratio_max`/`ratio_min`. Masked reductions: no host sync, and no error when empty."""
    ratio = dis_ratio(logp, logp_rollout)

    def mean(x: Tensor) -> Tensor:
        return aggregate(x.float(), action_mask, "token_mean", num_tokens=num_tokens)

    return {
        "kept_frac": mean(dis_keep(ratio, eps_low, eps_high)),
        "masked_low_frac": mean(ratio <= 1.0 - eps_low),
        "masked_high_frac": mean(ratio >= 1.0 + eps_high),
        "ratio_mean": mean(ratio),
        "ratio_max": torch.where(action_mask, ratio, -torch.inf).max(),
        "ratio_min": torch.where(action_mask, ratio, torch.inf).min(),
        "abs_logp_diff": mean((logp - logp_rollout).abs()),
        "approx_kl": mean(k3_kl(logp, logp_rollout)),
    }


def dis_policy_loss(logp: Tensor, logp_rollout: Tensor, adv: Tensor, action_mask: Tensor,
                    eps_low: float, eps_high: float, loss_agg: LossAgg = "token_mean", *,
                    num_tokens: int | None = None, num_seqs: int | None = None,
                    trainable: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = −Σ_t stopgrad(keep_t·r_t)·Â_t·logπ_θ(a_t|s_t) / N (docs/algorithm.md §3).

    All inputs (B, T); logp carries the graph, the rest are data. A kept token's gradient is
    r_t·Â_t·∇logπ_θ; a masked token's is exactly zero. `trainable` (default: every action token)
    masks more tokens the same way: too stale, or of a masked truncated episode
    (learner/long_episodes.py); they still count in N. Returns (loss, ratio_stats).
    """
    # ratio against the behaviour policy
    ratio = dis_ratio(logp, logp_rollout)
    # strict double-sided mask; Â's sign plays no part
    keep = dis_keep(ratio, eps_low, eps_high) & (action_mask if trainable is None else action_mask & trainable)
    # detached weight: no gradient flows through the ratio itself
    w = torch.where(keep, ratio, 0.0).detach()
    # policy loss; `where` keeps a masked token out even when its logp or ratio is not finite
    per_token = torch.where(keep, -w * adv * logp, 0.0)
    loss = aggregate(per_token, action_mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    return loss, ratio_stats(logp, logp_rollout, action_mask, eps_low, eps_high, num_tokens)


def ppo_clip_policy_loss(logp: Tensor, logp_old: Tensor, adv: Tensor, action_mask: Tensor,
                         clip_eps: float, loss_agg: LossAgg = "token_mean", *,
                         num_tokens: int | None = None, num_seqs: int | None = None,
                         trainable: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """loss = −Σ_t min(r_t·Â_t, clip(r_t, 1 − ε, 1 + ε)·Â_t) / N, r_t = π_θ/π_old (docs/algorithm.md §7).

    π_old is the learner's own weights at batch start, not π_rollout: staleness of the rollout
    goes unnoticed, which is what makes vanilla GRPO fragile when asynchronous.
    """
    ratio = torch.exp(logp - logp_old)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = -torch.min(ratio * adv, clipped * adv)
    if trainable is not None:  # as in `dis_policy_loss`: out of the gradient, still in N
        per_token = torch.where(trainable, per_token, 0.0)
    loss = aggregate(per_token, action_mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        clip_frac = aggregate((ratio != clipped).float(), action_mask, "token_mean", num_tokens=num_tokens)
    return loss, {"clip_frac": clip_frac}

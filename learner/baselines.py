"""Baseline advantages of docs/algorithm.md §7, per trajectory: the group mean of `grpo` / `grpo_dis`, and the
running mean of `running_mean`. SAO's own advantage is skip-observation GAE (learner/gae.py).

Both take each trajectory's total reward (outcome plus per-turn rewards) and return one advantage
per trajectory; the update spreads it over the trajectory's action tokens. Deliberately absent:
any per-token credit assignment (that is what the critic adds).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def group_normalised_advantage(rewards: Tensor, group_ids: Sequence[str], eps: float = 1e-6) -> Tensor:
    """Â_i = (r_i − mean_G) / (std_G + eps) over the trajectories sharing i's prompt (docs/algorithm.md §7).

    rewards: (B,); std is the unbiased one. A group of one has no baseline and gets Â = 0, which
    is why GRPO needs G ≥ 2 rollouts of a prompt.
    """
    index = {g: i for i, g in enumerate(dict.fromkeys(group_ids))}
    group = torch.tensor([index[g] for g in group_ids], device=rewards.device)  # (B,)
    count = torch.bincount(group, minlength=len(index)).to(rewards.dtype)  # (G,)
    mean = torch.zeros_like(count).index_add_(0, group, rewards) / count
    sq = torch.zeros_like(count).index_add_(0, group, (rewards - mean[group]) ** 2)
    std = (sq / (count - 1).clamp(min=1)).sqrt()
    adv = (rewards - mean[group]) / (std[group] + eps)
    return torch.where(count[group] > 1, adv, 0.0)


class RunningMean:
    """Â_i = r_i − mean(last W rewards of i's key), key = prompt id or one global key (docs/algorithm.md §7).

    The baseline uses only rewards seen before this batch, so a trajectory never baselines itself;
    a key with no history yet gives Â = 0 (`unseen`: the last batch's fraction of those). Rewards
    of the batch join the history afterwards. Per prompt, a stream whose prompt ids never repeat
    (a feeder sampling tasks gives each a fresh id) trains nothing: that is warned about once.
    """

    WARN_AFTER = 20  # batches in a row with no history for any trajectory

    def __init__(self, window: int, per_prompt: bool):
        self.window = window
        self.per_prompt = per_prompt
        self.history: dict[str, deque[float]] = {}
        self.unseen, self._blind = 0.0, 0

    def _key(self, prompt_id: str) -> str:
        return prompt_id if self.per_prompt else ""

    def advantage(self, rewards: Tensor, prompt_ids: Sequence[str]) -> Tensor:
        """(B,) advantages for (B,) rewards; then records the rewards."""
        baseline = [sum(h) / len(h) if (h := self.history.get(self._key(p))) else r
                    for p, r in zip(prompt_ids, rewards.tolist())]
        self.unseen = sum(self._key(p) not in self.history for p in prompt_ids) / max(len(prompt_ids), 1)
        self._blind = self._blind + 1 if self.unseen == 1.0 else 0
        if self._blind == self.WARN_AFTER and self.per_prompt:
            log.warning("running_mean: no prompt id of the last %d steps was seen before, so every advantage "
                        "is 0 and nothing trains; prompts that never repeat need "
                        "--update.running-mean-scope global (docs/algorithm.md §7's online setting)", self.WARN_AFTER)
        for p, r in zip(prompt_ids, rewards.tolist()):
            self.history.setdefault(self._key(p), deque(maxlen=self.window)).append(r)
        return rewards - torch.tensor(baseline, dtype=rewards.dtype, device=rewards.device)

    def state_dict(self) -> dict:
        return {"window": self.window, "per_prompt": self.per_prompt,
                "history": {k: list(h) for k, h in self.history.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.window, self.per_prompt = state["window"], state["per_prompt"]
        self.history = {k: deque(h, maxlen=self.window) for k, h in state["history"].items()}

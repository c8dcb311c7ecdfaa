"""The algorithms of docs/algorithm.md §7 and what each name means for a step, resolved in one place.

| name | advantage | policy loss | critic | critic attention |
| --- | --- | --- | --- | --- |
| sao | skip-observation GAE | DIS | K updates, warm-up first | frozen |
| sao_k1 | skip-observation GAE | DIS | 1 update, warm-up first | frozen |
| sao_full_critic | skip-observation GAE | DIS | K updates, warm-up first | trains |
| grpo | group-normalised reward | PPO clip vs batch start | none | - |
| grpo_dis | group-normalised reward | DIS | none | - |
| running_mean | reward − running mean | DIS | none | - |
| vapo | skip-observation GAE | PPO clip vs batch start | K updates, warm-up first | frozen |

`vapo` is SAO without the DIS mask, the paper's critic-without-DIS comparison (docs/algorithm.md §8): stale
rollouts enter the loss with no correction for how far π_rollout drifted.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

Algorithm = Literal["sao", "sao_k1", "sao_full_critic", "grpo", "grpo_dis", "running_mean", "vapo"]


@dataclass(frozen=True, kw_only=True)
class AlgorithmSettings:
    """What an algorithm name means for a step (docs/algorithm.md §5, §7), resolved once by `algorithm_settings`."""

    advantage: Literal["gae", "group", "running_mean"]
    """Skip-observation GAE on the critic's values, the group-normalised reward, or the running mean."""
    policy_loss: Literal["dis", "ppo_clip"]
    """DIS against π_rollout, or the PPO clip against the learner's weights at batch start."""
    critic_updates: int
    """K critic optimizer steps per step; 0: there is no critic."""
    freeze_critic_attention: bool
    """Freeze the critic's attention (docs/algorithm.md §5)."""
    warmup_steps: int
    """Steps at the start that train only the critic."""

    @property
    def uses_critic(self) -> bool:
        return self.critic_updates > 0


def algorithm_settings(algorithm: Algorithm, critic_updates: int = 2,
                       warmup_steps: int = 10) -> AlgorithmSettings:
    """The one place an algorithm name is interpreted (docs/algorithm.md §7's table)."""
    sao = dict(advantage="gae", policy_loss="dis", critic_updates=critic_updates,
               freeze_critic_attention=True, warmup_steps=warmup_steps)
    baseline = dict(policy_loss="dis", critic_updates=0, freeze_critic_attention=False, warmup_steps=0)
    match algorithm:
        case "sao":
            return AlgorithmSettings(**sao)
        case "sao_k1":
            return AlgorithmSettings(**sao | {"critic_updates": 1})
        case "sao_full_critic":
            return AlgorithmSettings(**sao | {"freeze_critic_attention": False})
        case "grpo":
            return AlgorithmSettings(advantage="group", **baseline | {"policy_loss": "ppo_clip"})
        case "grpo_dis":
            return AlgorithmSettings(advantage="group", **baseline)
        case "running_mean":
            return AlgorithmSettings(advantage="running_mean", **baseline)
        case "vapo":
            return AlgorithmSettings(**sao | {"policy_loss": "ppo_clip"})
    raise ValueError(f"--update.algorithm {algorithm!r}: expected one of {typing.get_args(Algorithm)}")

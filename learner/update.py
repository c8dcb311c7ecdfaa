"""One learner step of SAO (SAO.md §3–§5) and of its baselines (§7), on the same code path.

`SAOUpdate.step(trajectories)` reads top to bottom in paper order:
1. refuse the whole step if a reward or an action token's rollout log-prob is not finite (nothing
   is touched, the step is reported as skipped); plan this rank's token-budget micro-batches of
   its token-balanced share (learner/microbatch.py);
2. advantages and critic targets, once, before any update: skip-observation GAE on the critic's
   values (λ length-adaptive for the policy, λ = 1 for the critic), or a baseline;
3. K critic steps on the same micro-batches (K = 2; `sao_k1`: 1), attention frozen unless
   `sao_full_critic`;
4. one policy step, except during the critic warm-up: DIS against π_rollout, or (`grpo`) the PPO
   clip against the learner's own weights at batch start.
Each optimizer step accumulates gradients over the micro-batches, every loss divided by the step's
global counts, so the step equals the one-shot step on any number of ranks and micro-batches.
It goes through `guarded_step`: loss and gradient norm must be finite, or the gradients are
dropped and the parameters and optimizer state stay bit-identical.

Deliberately absent by default: KL and entropy terms (coefficients 0), advantage whitening, and
staleness filtering (the streaming learner drops stale trajectories before they get here, §6).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.tensor import DTensor

from learner.baselines import RunningMean, group_normalised_advantage
from learner.dis import (PRESETS, LossAgg, aggregate, dis_policy_loss, k3_kl, ppo_clip_policy_loss,
                         ratio_stats)
from learner.gae import adaptive_lambda, skip_observation_gae, whiten
from learner.logprobs import Batch, collate, token_logprobs, token_rewards
from learner.microbatch import StepPlan, StepStats, plan_step
from learner.value import (ValueModel, critic_values, explained_variance, freeze_attention, value_loss,
                           value_moments)
from schemas.messages import Trajectory

Algorithm = Literal["sao", "sao_k1", "sao_full_critic", "grpo", "grpo_dis", "running_mean"]


@dataclass(frozen=True, kw_only=True)
class AlgorithmSettings:
    """What an algorithm name means for a step (SAO.md §5, §7), resolved once by `algorithm_settings`."""

    advantage: Literal["gae", "group", "running_mean"]
    """Skip-observation GAE on the critic's values, the group-normalised reward, or the running mean."""
    policy_loss: Literal["dis", "ppo_clip"]
    """DIS against π_rollout, or the PPO clip against the learner's weights at batch start."""
    critic_updates: int
    """K critic optimizer steps per step; 0: there is no critic."""
    freeze_critic_attention: bool
    """Freeze the critic's attention (SAO.md §5)."""
    warmup_steps: int
    """Steps at the start that train only the critic."""

    @property
    def uses_critic(self) -> bool:
        return self.critic_updates > 0


def algorithm_settings(algorithm: Algorithm, critic_updates: int = 2,
                       warmup_steps: int = 10) -> AlgorithmSettings:
    """The one place an algorithm name is interpreted (SAO.md §7's table)."""
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
    raise ValueError(f"--algorithm {algorithm!r}: expected one of {typing.get_args(Algorithm)}")


@dataclass(kw_only=True)
class UpdateConfig:
    """Knobs of one learner step; every "(our choice)" of SAO.md is one of them."""

    algorithm: Algorithm = "sao"
    """sao | sao_k1 (one critic step) | sao_full_critic (critic attention trains) | grpo (group
    advantage, PPO clip vs the learner at batch start) | grpo_dis (group advantage, DIS) |
    running_mean (running-mean baseline, DIS). SAO.md §7."""
    preset: Literal["reasoning", "coding"] = "reasoning"
    """DIS band: reasoning keeps 0.7 < r < 6.0, coding keeps 0.2 < r < 4.0 (SAO.md §3)."""
    eps_low: float | None = None
    """Override of the preset's ε_low."""
    eps_high: float | None = None
    """Override of the preset's ε_high."""
    loss_agg: LossAgg = "token_mean"
    """token_mean (N = action tokens in the step, masked included) | seq_mean_token_mean."""
    gamma: float = 1.0
    """Discount γ of skip-observation GAE (our choice; the paper is silent)."""
    alpha: float = 1.5
    """α of the policy's length-adaptive λ = 1 − 1/(α·l)."""
    critic_updates: int = 2
    """K critic optimizer steps per policy step, on the same batch (`sao_k1` uses 1)."""
    warmup_steps: int = 10
    """Steps at the start that train only the critic; critic algorithms only."""
    lr_policy: float = 1e-4
    """Policy learning rate; sized for tiny models (the paper uses 1e-6 at 30B)."""
    lr_critic: float = 5e-4
    """Critic learning rate; sized for tiny models (the paper uses 5e-6 at 30B)."""
    weight_decay: float = 0.0
    """AdamW weight decay of both optimizers."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip of each optimizer step."""
    value_clip: float | None = None
    """PPO-style value clipping range around the pre-update values; None = plain MSE."""
    whiten_advantages: bool = False
    """Normalise advantages over the step's action tokens (off: SAO.md §4)."""
    kl_coef: float = 0.0
    """Weight of a k3 KL(π_rollout ‖ π_θ) penalty on action tokens (no reference model is kept)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus on action tokens."""
    temperature: float = 1.0
    """T at which log-probs are recomputed; must equal the rollout engine's (SAO.md §3)."""
    ppo_clip_eps: float = 0.2
    """ε of the `grpo` baseline's PPO clip."""
    running_mean_scope: Literal["prompt", "global"] = "prompt"
    """`running_mean` keys its history per prompt id or globally (online settings)."""
    running_mean_window: int | None = None
    """W of `running_mean`; None = 8 per prompt, 128 global (SAO.md §7)."""
    packed: bool = False
    """Run forwards on a micro-batch's real tokens packed into one row instead of padded rows."""
    micro_batch_tokens: int = 8192
    """Token budget of one forward: a rank's share of a step is cut into micro-batches of at most
    this many tokens (rows × longest when padded), gradients accumulated; 0: one micro-batch."""
    logprob_chunk_tokens: int = 1024
    """Action tokens whose float32 logits exist at once when computing log-probs and entropy."""

    def __post_init__(self):
        for name in ("lr_policy", "lr_critic", "temperature", "max_grad_norm", "alpha",
                     "logprob_chunk_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if self.critic_updates < 1:
            raise ValueError(f"--critic-updates must be >= 1, got {self.critic_updates}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"--micro-batch-tokens must be >= 0, got {self.micro_batch_tokens}")
        low, high = self.eps
        if not (0 < low <= 1 and high > 0):
            raise ValueError(f"--eps-low must be in (0, 1] and --eps-high > 0, got {low}, {high}")

    @property
    def eps(self) -> tuple[float, float]:
        """(ε_low, ε_high): the preset, with any override."""
        low, high = PRESETS[self.preset]
        return (low if self.eps_low is None else self.eps_low,
                high if self.eps_high is None else self.eps_high)

    @property
    def settings(self) -> AlgorithmSettings:
        return algorithm_settings(self.algorithm, self.critic_updates, self.warmup_steps)

    @property
    def window(self) -> int:
        default = 8 if self.running_mean_scope == "prompt" else 128
        return self.running_mean_window or default


def all_finite(*xs: Tensor) -> bool:
    """True if every value is finite on every rank: one all-reduce when distributed, and a host
    sync either way."""
    bad = torch.stack([(~torch.isfinite(x)).any() for x in xs]).any().float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


def guarded_step(loss: Tensor, model: nn.Module, optimizer: torch.optim.Optimizer,
                 max_grad_norm: float) -> tuple[bool, float]:
    """Backward, clip, and step only if the loss and the total gradient norm are finite.

    Returns (stepped, grad_norm before clipping). Backward always runs, so every rank takes part
    in the same collectives; `clip_grad_norm_` of FSDP2 DTensors returns the global norm.
    """
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    stepped = all_finite(loss.detach(), grad_norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stepped, grad_norm.item()


class SAOUpdate:
    """The learner's optimizer state and `step(trajectories) -> metrics` (SAO.md §3–§5, §7).

    Owns the two optimizers, the step counter and the running-mean history (its `state_dict`);
    the caller owns and checkpoints the models. `critic` must be given for the critic algorithms
    and None for the baselines; its attention is frozen here unless `sao_full_critic`.
    """

    def __init__(self, policy: nn.Module, critic: ValueModel | None, cfg: UpdateConfig):
        if cfg.uses_critic != (critic is not None):
            need = "needs a" if cfg.uses_critic else "takes no"
            raise ValueError(f"algorithm {cfg.algorithm!r} {need} critic")
        self.policy, self.critic, self.cfg = policy, critic, cfg
        self.device = next(policy.parameters()).device
        if critic is not None and cfg.algorithm != "sao_full_critic":
            freeze_attention(critic)
        self.policy_opt = _adamw(policy, cfg.lr_policy, cfg.weight_decay)
        self.critic_opt = _adamw(critic, cfg.lr_critic, cfg.weight_decay) if critic else None
        self.running_mean = (RunningMean(cfg.window, cfg.running_mean_scope == "prompt")
                             if cfg.algorithm == "running_mean" else None)
        self.step_count = 0

    def step(self, trajs: list[Trajectory]) -> dict[str, float]:
        """One learner step on a batch of scored trajectories; returns namespaced metrics."""
        batch = collate(trajs, device=self.device)
        index, self.step_count = self.step_count, self.step_count + 1
        # reward/mean: the mean trajectory return, outcome plus any per-turn rewards
        metrics = {"step/index": index, "reward/mean": batch.rewards.sum(-1).mean().item(),
                   "step/skipped": 0, "step/policy_updated": 0, "step/critic_updates": 0}
        # 1. a NaN reward or a non-finite rollout log-prob poisons everything computed from it
        if not all_finite(batch.rewards, batch.logp_rollout[batch.action_mask]):
            return metrics | {"step/skipped": 1}
        # 2. advantages and critic targets, once, before any update
        adv, returns, values_old = self.advantages(batch)
        metrics |= {"adv/mean": adv[batch.action_mask].mean().item(),
                    "adv/abs_mean": adv[batch.action_mask].abs().mean().item()}
        # 3. K critic steps on the same batch
        critic_ok = True
        if self.critic is not None:
            critic_ok, critic_metrics = self._critic_steps(batch, returns, values_old)
            metrics |= critic_metrics
        # 4. one policy step, after the warm-up
        policy_ok, policy_metrics = self._policy_step(
            batch, adv, update=index >= self.cfg.policy_warmup_steps)
        return metrics | policy_metrics | {"step/skipped": int(not (critic_ok and policy_ok))}

    @torch.no_grad()
    def advantages(self, batch: Batch) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(adv, returns, values), each (B, T); returns and values are None without a critic."""
        cfg, mask = self.cfg, batch.action_mask
        values = returns = None
        if self.critic is not None:
            values = critic_values(self.critic, batch, packed=cfg.packed)
            lam = adaptive_lambda(batch.response_len, cfg.alpha)  # (B,)
            adv, _ = skip_observation_gae(batch.rewards, values, mask, cfg.gamma, lam)
            _, returns = skip_observation_gae(batch.rewards, values, mask, cfg.gamma, 1.0)
        else:
            total = batch.rewards.sum(-1)  # (B,) outcome plus per-turn rewards
            if self.running_mean is not None:
                seq_adv = self.running_mean.advantage(total, batch.prompt_ids)
            else:
                seq_adv = group_normalised_advantage(total, batch.group_ids)
            adv = torch.where(mask, seq_adv[:, None], 0.0)
        if cfg.whiten_advantages:
            adv = whiten(adv, mask)
        return adv, returns, values

    def _critic_steps(self, batch: Batch, returns: Tensor,
                      values_old: Tensor) -> tuple[bool, dict[str, float]]:
        cfg, mask = self.cfg, batch.action_mask
        applied, loss, grad_norm = 0, torch.tensor(math.nan), math.nan
        for _ in range(cfg.num_critic_updates):
            values = critic_values(self.critic, batch, packed=cfg.packed)
            loss = value_loss(values, returns, mask, values_old=values_old, clip=cfg.value_clip,
                              loss_agg=cfg.loss_agg)
            stepped, grad_norm = guarded_step(loss, self.critic, self.critic_opt, cfg.max_grad_norm)
            if not stepped:
                break
            applied += 1
        return applied == cfg.num_critic_updates, {
                "loss/value": loss.item(), "grad_norm/critic": grad_norm,
                "step/critic_updates": applied,
                "value/mean": values_old[mask].mean().item(),
                "value/explained_var": explained_variance(values_old, returns, mask).item()}

    def _policy_step(self, batch: Batch, adv: Tensor, update: bool) -> tuple[bool, dict[str, float]]:
        cfg, mask = self.cfg, batch.action_mask
        eps_low, eps_high = cfg.eps
        with torch.set_grad_enabled(update):
            logp, entropy = token_logprobs(self.policy, batch, temperature=cfg.temperature,
                                           packed=cfg.packed)
            # policy loss: DIS against π_rollout, or the PPO clip against the batch-start weights
            ppo_stats = {}
            if cfg.algorithm == "grpo":
                loss, ppo_stats = ppo_clip_policy_loss(logp, logp.detach(), adv, mask,
                                                       cfg.ppo_clip_eps, cfg.loss_agg)
                # grpo ignores π_rollout, but how far it drifted is still worth reporting
                stats = ratio_stats(logp, batch.logp_rollout, mask, eps_low, eps_high)
            else:
                loss, stats = dis_policy_loss(logp, batch.logp_rollout, adv, mask, eps_low, eps_high,
                                              cfg.loss_agg)
            # optional terms, skipped at 0 so an overflowing masked token cannot turn 0·inf into NaN
            if cfg.kl_coef:
                kl = aggregate(k3_kl(logp, batch.logp_rollout), mask, cfg.loss_agg)
                loss = loss + cfg.kl_coef * kl
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg.loss_agg)
        metrics = ({f"dis/{k}": v.item() for k, v in stats.items()}
                   | {f"ppo/{k}": v.item() for k, v in ppo_stats.items()})
        metrics |= {"loss/policy": loss.item(), "grad_norm/policy": math.nan,
                    "policy/entropy": entropy[mask].mean().item()}
        if not update:  # critic warm-up: the policy stays bit-identical
            return True, metrics
        stepped, grad_norm = guarded_step(loss, self.policy, self.policy_opt, cfg.max_grad_norm)
        return stepped, metrics | {"grad_norm/policy": grad_norm, "step/policy_updated": int(stepped)}

    def state_dict(self) -> dict:
        return {"step": self.step_count, "policy_opt": self.policy_opt.state_dict(),
                "critic_opt": self.critic_opt.state_dict() if self.critic_opt else None,
                "running_mean": self.running_mean.state_dict() if self.running_mean else None}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step"]
        self.policy_opt.load_state_dict(state["policy_opt"])
        if self.critic_opt:
            self.critic_opt.load_state_dict(state["critic_opt"])
        if self.running_mean:
            self.running_mean.load_state_dict(state["running_mean"])


def _adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                             weight_decay=weight_decay)

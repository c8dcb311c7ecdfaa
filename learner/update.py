"""One learner step of SAO (docs/algorithm.md §3–§5) and of its baselines (§7), on the same code path.

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
from collections import Counter
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

from learner.algorithms import Algorithm, AlgorithmSettings, algorithm_settings
from learner.baselines import RunningMean, group_normalised_advantage
from learner.dis import (PRESETS, LossAgg, aggregate, dis_keep, dis_policy_loss, dis_ratio, k3_kl,
                         ppo_clip_policy_loss, ratio_stats)
from learner.gae import adaptive_lambda, skip_observation_gae, whiten
from learner.logprobs import Batch, collate, token_logprobs, token_rewards
from learner.long_episodes import Overlong
from learner.microbatch import StepPlan, StepStats, plan_step
from learner.parallel import accumulate
from learner.telemetry import env_metrics, kept_by_env, kept_fracs
from learner.value import (ValueModel, critic_values, freeze_attention, param_kinds, value_diagnostics,
                           value_loss, value_moments_by_position)
from schemas.config import ConfigError
from schemas.messages import Trajectory

def flag(name: str) -> str:
    """The command-line flag of UpdateConfig field `name` (it is `sao learner`'s `--update`)."""
    return f"--update.{name.replace('_', '-')}"


@dataclass(kw_only=True)
class UpdateConfig:
    """Knobs of one learner step; every "(our choice)" of docs/algorithm.md is one of them."""

    algorithm: Algorithm = "sao"
    """sao | sao_k1 (one critic step) | sao_full_critic (critic attention trains) | grpo (group
    advantage, PPO clip vs the learner at batch start) | grpo_dis (group advantage, DIS) |
    running_mean (running-mean baseline, DIS) | vapo (sao with the PPO clip instead of DIS). docs/algorithm.md
    §7, §8. The PPO clip of grpo and vapo binds only from a batch's second pass
    (`--update.policy-epochs` ≥ 2); at one pass they train the plain policy gradient of their
    advantage, with no correction for stale rollouts."""
    preset: Literal["reasoning", "coding"] = "reasoning"
    """DIS band: reasoning keeps 0.7 < r < 6.0, coding keeps 0.2 < r < 4.0 (docs/algorithm.md §3)."""
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
    lambda_length: Literal["response", "actions"] = "response"
    """l of the adaptive λ: every token after the prompt, observations included (our choice, docs/algorithm.md
    §4), or the action tokens only (a synchronous SAO port's choice, docs/algorithm.md §9)."""
    critic_updates: int | None = None
    """K critic optimizer steps per policy step, on the same batch; default 2 (`sao_k1`: 1, and
    only 1). Refused for the algorithms without a critic."""
    warmup_steps: int | None = None
    """Steps at the start that train only the critic; default 10. Critic algorithms only (0 or
    unset for the others)."""
    lr_policy: float = 1e-4
    """Policy learning rate; sized for tiny models (the paper uses 1e-6 at 30B)."""
    lr_critic: float = 5e-4
    """Critic learning rate; sized for tiny models (the paper uses 5e-6 at 30B)."""
    lr_value_head: float | None = None
    """Learning rate of the critic's value head alone; None: `lr_critic`. The head starts at zero
    and reads features the policy's checkpoint already has, so it may take a larger rate than the
    backbone's MLPs (bench/critic_fit.py measures the critic's fit under either)."""
    lr_ramp: int = 0
    """Policy updates over which the policy's learning rate rises linearly to `lr_policy` (the
    n-th update of the policy, counted from the end of the critic warm-up, takes n/lr_ramp of it);
    0: the full rate from the first. Adam's first updates move every parameter by about the
    learning rate whatever the gradient's noise, as its second-moment estimate has few samples yet."""
    weight_decay: float = 0.0
    """AdamW weight decay of both optimizers."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip of each policy step, and of each critic step unless `critic_max_grad_norm`."""
    critic_max_grad_norm: float | None = None
    """Gradient-norm clip of each critic step; None: `max_grad_norm`. A critic's gradient is often
    far larger than the policy's (a verl SAO port clips it at 10, docs/algorithm.md §9)."""
    value_clip: float | None = None
    """PPO-style value clipping range around the pre-update values; None = plain MSE."""
    whiten_advantages: bool = False
    """Normalise advantages over the step's action tokens (off: docs/algorithm.md §4)."""
    kl_coef: float = 0.0
    """Weight of a k3 KL(π_rollout ‖ π_θ) penalty on action tokens (no reference model is kept)."""
    entropy_coef: float = 0.0
    """Weight of an entropy bonus on action tokens."""
    temperature: float = 1.0
    """T at which log-probs are recomputed; must equal the rollout engine's (docs/algorithm.md §3)."""
    overlong: Overlong = "keep"
    """Episodes cut at a token budget (finish reason length or context): keep (train them as any
    other), mask (no policy gradient from them: DAPO's overlong filtering) or penalty (their
    reward lowered by --update.overlong-penalty); learner/long_episodes.py."""
    overlong_penalty: float = 1.0
    """What `--update.overlong penalty` takes off a truncated episode's reward."""
    ppo_clip_eps: float = 0.2
    """ε of the PPO clip of `grpo` and `vapo`."""
    policy_epochs: int = 1
    """Policy optimizer passes over each batch (PPO's epochs). The PPO clip compares each pass with
    the batch-start weights, so it binds from the second pass on; DIS compares with π_rollout on
    every pass. Metrics are the last pass's."""
    running_mean_scope: Literal["prompt", "global"] = "prompt"
    """`running_mean` keys its history per prompt id or globally (online settings)."""
    running_mean_window: int | None = None
    """W of `running_mean`; None = 8 per prompt, 128 global (docs/algorithm.md §7)."""
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
                raise ConfigError(f"{flag(name)} must be > 0, got {getattr(self, name)}")
        for name in ("critic_max_grad_norm", "lr_value_head"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ConfigError(f"{flag(name)} must be > 0, got {getattr(self, name)}")
        if self.lr_ramp < 0:
            raise ConfigError(f"{flag('lr_ramp')} must be >= 0, got {self.lr_ramp}")
        if self.policy_epochs < 1:
            raise ConfigError(f"{flag('policy_epochs')} must be >= 1, got {self.policy_epochs}")
        if self.micro_batch_tokens < 0:
            raise ConfigError(f"{flag('micro_batch_tokens')} must be >= 0, got {self.micro_batch_tokens}")
        low, high = self.eps
        if not (0 < low <= 1 and high > 0):
            raise ConfigError(f"{flag('eps_low')} must be in (0, 1] and {flag('eps_high')} > 0, got {low}, {high}")
        self.settings  # noqa: B018 - an algorithm's knobs that cannot act as set are refused now

    @property
    def eps(self) -> tuple[float, float]:
        """(ε_low, ε_high): the preset, with any override."""
        low, high = PRESETS[self.preset]
        return (low if self.eps_low is None else self.eps_low,
                high if self.eps_high is None else self.eps_high)

    @property
    def critic_clip(self) -> float:
        """The gradient-norm clip of a critic step."""
        return self.max_grad_norm if self.critic_max_grad_norm is None else self.critic_max_grad_norm

    @property
    def settings(self) -> AlgorithmSettings:
        """What `algorithm` means for a step with these knobs; ConfigError naming a knob the
        algorithm cannot honour (a critic setting of an algorithm without a critic, K of sao_k1)."""
        critic = algorithm_settings(self.algorithm).uses_critic
        for name in ("critic_updates", "warmup_steps", "lr_value_head"):
            if not critic and getattr(self, name) not in (None, 0):
                raise ConfigError(f"{flag(name)} {getattr(self, name)}: --update.algorithm {self.algorithm} has no "
                                  "critic")
        if self.algorithm == "sao_k1" and self.critic_updates not in (None, 1):
            raise ConfigError(f"{flag('critic_updates')} {self.critic_updates}: sao_k1 is the one-update ablation; "
                              "use --update.algorithm sao for K updates")
        if critic and self.critic_updates is not None and self.critic_updates < 1:
            raise ConfigError(f"{flag('critic_updates')} must be >= 1, got {self.critic_updates}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"{flag('warmup_steps')} must be >= 0, got {self.warmup_steps}")
        return algorithm_settings(self.algorithm, 2 if self.critic_updates is None else self.critic_updates,
                                  10 if self.warmup_steps is None else self.warmup_steps)

    @property
    def window(self) -> int:
        default = 8 if self.running_mean_scope == "prompt" else 128
        return self.running_mean_window or default


def policy_lr(lr: float, ramp: int, update: int) -> float:
    """The policy's learning rate at its `update`-th update (0-based): `lr`, reached linearly over
    the first `ramp` updates (none: 0)."""
    return lr * min(1.0, (update + 1) / ramp) if ramp else lr


def all_finite(*xs: Tensor) -> bool:
    """True if every value is finite on every rank: one all-reduce when distributed, and a host
    sync either way."""
    bad = torch.stack([(~torch.isfinite(x)).any() for x in xs]).any().float()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return bad.item() == 0


def guarded_step(model: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float,
                 loss: Tensor) -> tuple[bool, float]:
    """Clip the accumulated gradients and step only if `loss` and the total gradient norm are
    finite on every rank; then drop the gradients either way.

    Returns (stepped, grad_norm before clipping). Call after every rank ran all its backwards;
    `clip_grad_norm_` of FSDP2 DTensors returns the global norm.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    stepped = all_finite(loss.detach(), grad_norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return stepped, grad_norm.item()


def grad_norms(kinds: dict[str, list[nn.Parameter]]) -> dict[str, float]:
    """The gradient norm of each group of parameters, before clipping (global under FSDP2: every
    rank holds the same groups); groups without gradients are left out. The groups of one model
    combine in quadrature to its total norm."""
    norms = {}
    for kind, params in kinds.items():
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            norm = torch.nn.utils.get_total_norm(grads)
            norms[kind] = norm.full_tensor() if isinstance(norm, DTensor) else norm
    # one host sync for all the kinds, not one each
    return dict(zip(norms, torch.stack(list(norms.values())).tolist())) if norms else {}


def step_is_finite(trajs: Sequence[Trajectory], totals: np.ndarray) -> bool:
    """Every trajectory's total reward and every action token's rollout log-prob is finite. Every
    rank holds the whole step, so every rank reaches the same answer without a collective."""
    return bool(np.isfinite(totals).all()) and all(
        np.isfinite(t.rollout_logprobs[t.action_mask.astype(bool)]).all() for t in trajs)


@dataclass(kw_only=True)
class MicroBatch:
    """A collated micro-batch and its advantage and critic targets (docs/algorithm.md §4), each (b, T)."""

    batch: Batch
    rows: list[int]
    """Indices of its trajectories in the step."""
    adv: Tensor | None = None
    returns: Tensor | None = None
    values: Tensor | None = None
    logp_old: Tensor | None = None
    """Log-probs under the batch-start weights, from the first policy pass: the PPO clip's π_old, kept
    only by the algorithms that clip."""


class SAOUpdate:
    """The learner's models, optimizers and `step(trajectories) -> metrics` (docs/algorithm.md §3–§5, §7).

    Its `state_dict` is the whole training state (sharded models and optimizers, step counter,
    running-mean history), the one format the service checkpoints. `critic` must be given for the
    critic algorithms and None for the baselines; its attention is frozen here unless
    `sao_full_critic`. Under torch.distributed each rank trains its share of every step.
    """

    def __init__(self, policy: nn.Module, critic: ValueModel | None, cfg: UpdateConfig):
        self.settings = s = cfg.settings
        if s.uses_critic != (critic is not None):
            need = "needs a" if s.uses_critic else "takes no"
            raise ValueError(f"algorithm {cfg.algorithm!r} {need} critic")
        self.policy, self.critic, self.cfg = policy, critic, cfg
        self.device = next(policy.parameters()).device
        if critic is not None and s.freeze_critic_attention:
            freeze_attention(critic)
        # gradient norms by parameter kind (docs/algorithm.md §5: a critic's attention gradients are the volatile ones)
        self.kinds = {name: {k: ps for k, ps in param_kinds(m).items() if any(p.requires_grad for p in ps)}
                      for name, m in (("policy", policy), ("critic", critic)) if m is not None}
        self.policy_opt = _adamw(policy, cfg.lr_policy, cfg.weight_decay)
        self.critic_opt = _adamw(critic, cfg.lr_critic, cfg.weight_decay, head_lr=cfg.lr_value_head) if critic else None
        self.running_mean = (RunningMean(cfg.window, cfg.running_mean_scope == "prompt")
                             if s.advantage == "running_mean" else None)
        distributed = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        self.step_count = 0
        self.rank_tokens = 0  # tokens this rank ran forward, over all steps: its shares

    def step(self, trajs: list[Trajectory], masks: list[np.ndarray] | None = None) -> dict[str, float]:
        """One learner step on a batch of scored trajectories; returns namespaced metrics. `masks`:
        each trajectory's (T,) action tokens whose policy gradient counts (learner/long_episodes.py);
        None: all of them."""
        cfg = self.cfg
        index, self.step_count = self.step_count, self.step_count + 1
        totals = np.array([token_rewards(t).sum() for t in trajs])  # (B,) outcome plus per-turn rewards
        metrics = {"step/index": index, "reward/mean": float(totals.mean()), "step/skipped": 0,
                   "step/policy_updated": 0, "step/critic_updates": 0} | env_metrics(trajs, totals)
        # 1. a NaN reward or a non-finite rollout log-prob poisons everything computed from it
        if not step_is_finite(trajs, totals):
            return metrics | {"step/skipped": 1}
        plan = plan_step(trajs, self.rank, self.world, cfg.micro_batch_tokens, cfg.packed)
        self.rank_tokens += plan.rank_tokens
        mbs = [self._micro_batch(trajs, rows, masks) for rows in plan.micro_batches]
        metrics |= {"perf/micro_batches": len(mbs), "perf/rank_tokens": plan.rank_tokens}
        # 2. advantages and critic targets, once, before any update
        metrics |= self.advantages(mbs, torch.tensor(totals, dtype=torch.float32), trajs, plan)
        # 3. K critic steps on the same micro-batches
        critic_ok = True
        if self.critic is not None:
            critic_ok, critic_metrics = self._critic_steps(mbs, plan)
            metrics |= critic_metrics
        # 4. one policy step, after the warm-up
        update = index >= self.settings.warmup_steps
        if update:
            lr = policy_lr(cfg.lr_policy, cfg.lr_ramp, index - self.settings.warmup_steps)
            for group in self.policy_opt.param_groups:
                group["lr"] = lr
            metrics["policy/lr"] = lr
        policy_ok, policy_metrics = self._policy_step(mbs, plan, update=update, envs=[t.env for t in trajs])
        acted = Counter()
        for t in trajs:
            acted[t.env] += int(t.action_mask.sum())
        policy_metrics = kept_fracs(policy_metrics, acted)
        return metrics | policy_metrics | {"step/skipped": int(not (critic_ok and policy_ok))}

    def _micro_batch(self, trajs: list[Trajectory], rows: list[int],
                     masks: list[np.ndarray] | None = None) -> MicroBatch:
        if rows:
            return MicroBatch(batch=collate([trajs[i] for i in rows], device=self.device,
                                            masks=None if masks is None else [masks[i] for i in rows]), rows=rows)
        # a rank with fewer micro-batches still runs the collectives: the step's shortest
        # trajectory, with no action token, so it adds nothing to any loss, gradient or metric
        rows = [min(range(len(trajs)), key=lambda i: len(trajs[i].tokens))]
        batch = collate([trajs[rows[0]]], device=self.device)
        batch.action_mask.zero_()
        return MicroBatch(batch=batch, rows=rows)

    @torch.no_grad()
    def advantages(self, mbs: list[MicroBatch], totals: Tensor, trajs: list[Trajectory],
                   plan: StepPlan) -> dict[str, float]:
        """Set each micro-batch's `adv` (and with a critic `returns`, `values`); returns the step's
        advantage and value metrics. `totals`: (B,) every trajectory's total reward."""
        cfg, stats = self.cfg, StepStats()
        if self.settings.advantage == "group":
            seq_adv = group_normalised_advantage(totals, [t.group or t.prompt_id for t in trajs])
        elif self.settings.advantage == "running_mean":
            seq_adv = self.running_mean.advantage(totals, [t.prompt_id for t in trajs])
        for mb in mbs:
            b, mask = mb.batch, mb.batch.action_mask
            if self.settings.advantage == "gae":
                mb.values = critic_values(self.critic, b, packed=cfg.packed)
                length = b.response_len if cfg.lambda_length == "response" else mask.sum(-1)
                lam = adaptive_lambda(length, cfg.alpha)  # (b,)
                mb.adv, _ = skip_observation_gae(b.rewards, mb.values, mask, cfg.gamma, lam)
                _, mb.returns = skip_observation_gae(b.rewards, mb.values, mask, cfg.gamma, 1.0)
                stats.add({"value/mean": _mean(mb.values, mask, plan)}
                          | value_moments_by_position(mb.values, mb.returns, mask, plan.num_tokens))
            else:  # one advantage per trajectory, computed from the whole step on every rank
                mb.adv = torch.where(mask, seq_adv[mb.rows].to(self.device)[:, None], 0.0)
            stats.add({"adv/mean": _mean(mb.adv, mask, plan), "adv2": _mean(mb.adv ** 2, mask, plan),
                       "adv/abs_mean": _mean(mb.adv.abs(), mask, plan)})
        step = stats.reduce()
        if cfg.whiten_advantages:
            std = math.sqrt(max(step["adv2"] - step["adv/mean"] ** 2, 0.0))
            for mb in mbs:
                mb.adv = whiten(mb.adv, mb.batch.action_mask, step["adv/mean"], std)
        metrics = {k: step[k] for k in ("adv/mean", "adv/abs_mean")}
        if self.settings.advantage == "gae":
            metrics |= {"value/mean": step["value/mean"]} | value_diagnostics(step)
        if self.running_mean is not None:  # every rank saw the whole step: no reduction
            metrics["baseline/unseen"] = self.running_mean.unseen
        return metrics

    def _critic_steps(self, mbs: list[MicroBatch], plan: StepPlan) -> tuple[bool, dict[str, float]]:
        cfg, K = self.cfg, self.settings.critic_updates
        applied, grad_norm, stats, by_kind = 0, math.nan, StepStats(), {}
        for _ in range(K):
            stats = StepStats()
            for mb in accumulate(self.critic, mbs):
                values = critic_values(self.critic, mb.batch, packed=cfg.packed)
                loss = value_loss(values, mb.returns, mb.batch.action_mask, values_old=mb.values,
                                  clip=cfg.value_clip, loss_agg=cfg.loss_agg,
                                  num_tokens=plan.num_tokens, num_seqs=plan.num_seqs)
                loss.backward()  # accumulates; reduce-scattered per micro-batch or once (accumulate)
                stats.add({"loss/value": loss})
            by_kind = grad_norms(self.kinds["critic"])
            stepped, grad_norm = guarded_step(self.critic, self.critic_opt, cfg.critic_clip,
                                              stats.sums["loss/value"])
            if not stepped:
                break
            applied += 1
        return applied == K, stats.reduce() | _by_kind("critic", by_kind) | {
            "grad_norm/critic": grad_norm, "step/critic_updates": applied}

    def _policy_step(self, mbs: list[MicroBatch], plan: StepPlan, update: bool,
                     envs: list[str]) -> tuple[bool, dict[str, float]]:
        """`--update.policy-epochs` optimizer steps on the batch (one forward pass, no step, during
        the critic warm-up); the metrics of the last. `envs`: each trajectory's environment."""
        for _ in range(self.cfg.policy_epochs if update else 1):
            stepped, metrics = self._policy_pass(mbs, plan, update, envs)
            if not stepped:
                break
        return stepped, metrics

    def _policy_pass(self, mbs: list[MicroBatch], plan: StepPlan, update: bool,
                     envs: list[str]) -> tuple[bool, dict[str, float]]:
        cfg, stats = self.cfg, StepStats()
        eps_low, eps_high = cfg.eps
        counts = dict(num_tokens=plan.num_tokens, num_seqs=plan.num_seqs)
        for mb in accumulate(self.policy, mbs):
            b, mask = mb.batch, mb.batch.action_mask
            with torch.set_grad_enabled(update):
                logp, entropy = token_logprobs(self.policy, b, temperature=cfg.temperature,
                                               packed=cfg.packed, chunk_tokens=cfg.logprob_chunk_tokens,
                                               entropy_grad=bool(cfg.entropy_coef))
                # policy loss: DIS against π_rollout, or the PPO clip against the batch-start weights
                if self.settings.policy_loss == "ppo_clip":
                    if mb.logp_old is None:  # the first pass: these are the batch-start weights
                        mb.logp_old = logp.detach()
                    loss, ppo = ppo_clip_policy_loss(logp, mb.logp_old, mb.adv, mask, cfg.ppo_clip_eps,
                                                     cfg.loss_agg, trainable=b.train_mask, **counts)
                    stats.add({f"ppo/{k}": v for k, v in ppo.items()})
                    # grpo ignores π_rollout, but how far it drifted is still worth reporting
                    dis = ratio_stats(logp, b.logp_rollout, mask, eps_low, eps_high, plan.num_tokens)
                else:
                    loss, dis = dis_policy_loss(logp, b.logp_rollout, mb.adv, mask, eps_low, eps_high,
                                                cfg.loss_agg, trainable=b.train_mask, **counts)
                # optional terms, skipped at 0 so an overflowing masked token cannot turn 0·inf into NaN
                if cfg.kl_coef:
                    loss = loss + cfg.kl_coef * aggregate(k3_kl(logp, b.logp_rollout), mask,
                                                          cfg.loss_agg, **counts)
                if cfg.entropy_coef:
                    loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg.loss_agg, **counts)
            if update:
                loss.backward()
            stats.maximum({"dis/ratio_max": dis.pop("ratio_max")})
            stats.minimum({"dis/ratio_min": dis.pop("ratio_min")})
            kept = dis_keep(dis_ratio(logp.detach(), b.logp_rollout), eps_low, eps_high) & mask
            stats.add({f"dis/{k}": v for k, v in dis.items()}
                      | {"loss/policy": loss, "policy/entropy": _mean(entropy, mask, plan)}
                      | kept_by_env(kept, [envs[i] for i in mb.rows], sorted(set(envs))))
        metrics = {"grad_norm/policy": math.nan}
        if not update:  # critic warm-up: the policy stays bit-identical
            return True, stats.reduce() | metrics
        by_kind = grad_norms(self.kinds["policy"])
        stepped, grad_norm = guarded_step(self.policy, self.policy_opt, cfg.max_grad_norm,
                                          stats.sums["loss/policy"])
        return stepped, stats.reduce() | _by_kind("policy", by_kind) | {"grad_norm/policy": grad_norm,
                                          "step/policy_updated": int(stepped)}

    def state_dict(self, *, optimizers: Collection[str] | None = None) -> dict:
        """The whole training state: the models' and optimizers' states as FSDP2 leaves them
        (DTensor shards, never gathered) and plain data. `optimizers`: which of "policy_opt",
        "critic_opt" to include; by default those that have stepped (building an unstepped
        optimizer's state takes a zero step, which would shift Adam's bias correction), a loader
        names those its checkpoint holds."""
        stepped = {name for name, opt in (("policy_opt", self.policy_opt), ("critic_opt", self.critic_opt))
                   if opt is not None and opt.state}
        optimizers = stepped if optimizers is None else set(optimizers)
        state = {"step": self.step_count, "policy": get_model_state_dict(self.policy),
                 "running_mean": self.running_mean.state_dict() if self.running_mean else None}
        if "policy_opt" in optimizers:
            state["policy_opt"] = get_optimizer_state_dict(self.policy, self.policy_opt)
        if self.critic is not None:
            state["critic"] = get_model_state_dict(self.critic)
            if "critic_opt" in optimizers:
                state["critic_opt"] = get_optimizer_state_dict(self.critic, self.critic_opt)
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step"]
        set_model_state_dict(self.policy, state["policy"])
        if "policy_opt" in state:
            set_optimizer_state_dict(self.policy, self.policy_opt, state["policy_opt"])
        if self.critic is not None:
            set_model_state_dict(self.critic, state["critic"])
            if "critic_opt" in state:
                set_optimizer_state_dict(self.critic, self.critic_opt, state["critic_opt"])
        if self.running_mean:
            self.running_mean.load_state_dict(state["running_mean"])


def _by_kind(model: str, norms: dict[str, float]) -> dict[str, float]:
    """grad_norm/<model>_<kind> metrics: the last optimizer step's, as grad_norm/<model>."""
    return {f"grad_norm/{model}_{kind}": v for kind, v in norms.items()}


def _mean(x: Tensor, mask: Tensor, plan: StepPlan) -> Tensor:
    """This micro-batch's part of the step's token mean of x over action tokens."""
    return aggregate(x, mask, "token_mean", num_tokens=plan.num_tokens)


def _adamw(model: nn.Module, lr: float, weight_decay: float, head_lr: float | None = None) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; with `head_lr`, the value head's at that rate."""
    params = [p for p in model.parameters() if p.requires_grad]
    if head_lr is not None:
        head = {id(p) for p in model.head.parameters()}
        params = [{"params": [p for p in params if id(p) not in head]},
                  {"params": [p for p in params if id(p) in head], "lr": head_lr}]
    # fused: one kernel per parameter group, without the foreach path's parameter-sized temporaries
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)

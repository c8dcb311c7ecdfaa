"""The value model (critic) of docs/algorithm.md §5: the policy's backbone plus a zero-initialised scalar head,
with attention frozen; its loss, and the diagnostics that explain it: explained variance and
value/return correlation, overall and by third of each response's action tokens.

Attention is found by module type, not by parameter names: transformers names every attention
block class `<Family>Attention` (LlamaAttention, Qwen3MoeAttention, MistralAttention, …), and
freezing the whole module freezes q/k/v/o, their biases and any q/k norms inside it (our choice:
they only act inside attention). MLPs, MoE experts and routers, the other norms, the embeddings
and the value head train. A family whose attention class is named otherwise is passed explicitly
as `attention_types`; freezing nothing raises rather than silently training everything.

Deliberately absent: the policy's LM head (a critic has no use for it) and a separate critic
checkpoint format (the critic is an nn.Module like any other; the checkpointer saves it).
"""

from __future__ import annotations

import copy
import math
from collections import defaultdict

import torch
from torch import Tensor, nn

from learner.dis import LossAgg, aggregate
from learner.logprobs import Batch, model_inputs, unpack


class ValueModel(nn.Module):
    """V(s_t) for every token position: backbone → last hidden state → Linear(hidden, 1)."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)  # V ≡ 0 at start (docs/algorithm.md §5)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: nn.Module) -> ValueModel:
        """A critic initialised from the policy's current weights (a deep copy of its backbone)."""
        return cls(copy.deepcopy(policy.base_model), policy.config.hidden_size)

    def forward(self, **inputs: Tensor) -> Tensor:
        """Per-position value (…, T) in float32 of the state after reading each token."""
        hidden = self.backbone(**inputs, use_cache=False).last_hidden_state
        # the head computes in fp32 under a bf16 backbone (FSDP2 hands it bf16 parameters);
        # `[..., 0]` would be a view, which FSDP2 warns about on every step (in-place ops on a
        # root output view skip its hooks)
        w, b = self.head.weight, self.head.bias
        return torch.nn.functional.linear(hidden.float(), w.float(), b.float()).squeeze(-1).clone()


def critic_values(critic: ValueModel, batch: Batch, *, packed: bool = False) -> Tensor:
    """values[:, t] = V(s_t), s_t = tokens[:, :t], the state in which a_t was sampled; (B, T),
    zero off action tokens. The same alignment as `token_logprobs`."""
    v = unpack(critic(**model_inputs(batch, packed)), batch.attention_mask, packed)  # (B, T)
    v = torch.nn.functional.pad(v[:, :-1], (1, 0))  # V of the prefix before token t
    return torch.where(batch.action_mask, v, 0.0)


# ---------------------------------------------------------------------------- freezing by type


def is_attention(module: nn.Module, attention_types: tuple[type, ...] = ()) -> bool:
    """True for a transformers attention block (class name ends in `Attention`) or a given type."""
    return isinstance(module, attention_types) or type(module).__name__.endswith("Attention")


def freeze_attention(model: nn.Module, attention_types: tuple[type, ...] = ()) -> int:
    """Set requires_grad=False on every parameter of every attention module; returns how many
    tensors attention holds (frozen now or already, as under LoRA). Raises if the model has no
    attention module by that test."""
    frozen = 0
    for module in model.modules():
        if is_attention(module, attention_types):
            for p in module.parameters():
                frozen += 1
                p.requires_grad_(False)
    if frozen == 0:
        raise ValueError(f"no attention module found in {type(model).__name__}; pass attention_types")
    return frozen


def _kind(module: nn.Module, in_attention: bool, in_mlp: bool) -> str:
    name = type(module).__name__
    if in_attention:
        return "attention"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if "Norm" in name:
        return "norm"
    if "Router" in name:
        return "router"
    return "mlp" if in_mlp else "other"


def _owned(module: nn.Module, attention_types: tuple[type, ...],
           in_attention: bool = False, in_mlp: bool = False):
    """(kind, parameter) for every parameter under `module`, kind from the modules that own it."""
    name = type(module).__name__
    in_attention = in_attention or is_attention(module, attention_types)
    in_mlp = in_mlp or "MLP" in name or "SparseMoe" in name or name.endswith("Experts")
    for p in module.parameters(recurse=False):
        yield _kind(module, in_attention, in_mlp), p
    for child in module.children():
        yield from _owned(child, attention_types, in_attention, in_mlp)


def param_kinds(model: nn.Module, attention_types: tuple[type, ...] = ()) -> dict[str, list[nn.Parameter]]:
    """Every parameter once (tied weights once), grouped by the kind of module that owns it:
    attention, mlp (dense MLPs and MoE experts), router, norm, embedding, value_head, other (the LM
    head). The groups of `param_report` and of the learner's gradient norms by kind."""
    kinds: dict[str, list[nn.Parameter]] = defaultdict(list)
    head = set(model.head.parameters()) if isinstance(model, ValueModel) else set()
    seen: set[nn.Parameter] = set()
    for kind, p in _owned(model, attention_types):
        if p not in seen:
            seen.add(p)
            kinds["value_head" if p in head else kind].append(p)
    return dict(kinds)


def param_report(model: nn.Module, attention_types: tuple[type, ...] = ()) -> dict[str, dict[str, int]]:
    """{kind: {"trainable": n, "frozen": n}} in parameter counts, by `param_kinds`; plus "total"."""
    report: dict[str, dict[str, int]] = defaultdict(lambda: {"trainable": 0, "frozen": 0})
    for kind, params in param_kinds(model, attention_types).items():
        for p in params:
            for row in (kind, "total"):
                report[row]["trainable" if p.requires_grad else "frozen"] += p.numel()
    return dict(report)


def format_report(report: dict[str, dict[str, int]]) -> str:
    """The trainable-parameter table, one line per module kind (docs/algorithm.md §5: it must be printable)."""
    lines = [f"{'kind':<12}{'trainable':>12}{'frozen':>12}"]
    rows = sorted(report.items(), key=lambda kv: kv[0] == "total")  # total last
    lines += [f"{k:<12}{v['trainable']:>12,}{v['frozen']:>12,}" for k, v in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- loss and health


def value_loss(values: Tensor, returns: Tensor, action_mask: Tensor, *,
               values_old: Tensor | None = None, clip: float | None = None,
               loss_agg: LossAgg = "token_mean", num_tokens: int | None = None,
               num_seqs: int | None = None) -> Tensor:
    """MSE on action tokens: agg((V_t − R_t)²); with `clip`, agg(max((V_t − R_t)²,
    (V_old + clamp(V_t − V_old, ±clip) − R_t)²)), PPO-style (docs/algorithm.md §5). `num_tokens`/`num_seqs`:
    the step's counts when this is one micro-batch (see `aggregate`)."""
    err = (values - returns) ** 2
    if clip is not None:
        v_clipped = values_old + (values - values_old).clamp(-clip, clip)
        err = torch.max(err, (v_clipped - returns) ** 2)
    return aggregate(err, action_mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)


POSITIONS = ("first", "middle", "last")


def action_thirds(action_mask: Tensor) -> Tensor:
    """(B, T) int64: 0, 1 or 2 for an action token in the first, middle or last third of its
    trajectory's action tokens (the k-th of n, from 0, is in third ⌊3k/n⌋); −1 off action tokens."""
    k = action_mask.long().cumsum(-1) - 1
    n = action_mask.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(action_mask, 3 * k // n, -1)


@torch.no_grad()
def value_moments(values: Tensor, returns: Tensor, action_mask: Tensor,
                  num_tokens: int | None = None) -> dict[str, Tensor]:
    """Means over N action tokens of 1 (the share n of the N tokens that `action_mask` selects),
    R, R², V, V², R·V, R − V and (R − V)²: sums over micro-batches and ranks give the step's, from
    which `explained_variance` and `value_return_corr` follow, for any subset of the tokens."""
    def mean(x: Tensor) -> Tensor:
        return aggregate(x, action_mask, "token_mean", num_tokens=num_tokens)

    err = returns - values
    return {"n": mean(torch.ones_like(values)), "r": mean(returns), "r2": mean(returns ** 2),
            "v": mean(values), "v2": mean(values ** 2), "rv": mean(returns * values),
            "e": mean(err), "e2": mean(err ** 2)}


@torch.no_grad()
def value_moments_by_position(values: Tensor, returns: Tensor, action_mask: Tensor,
                              num_tokens: int | None = None) -> dict[str, Tensor]:
    """`value_moments` over all action tokens, and over each third of every trajectory's action
    tokens under keys `<moment>@first|middle|last`: how well the critic knows the return early in a
    response, where it has seen few of the tokens that decide it, and late."""
    thirds = action_thirds(action_mask)
    out = value_moments(values, returns, action_mask, num_tokens)
    for j, part in enumerate(POSITIONS):
        out |= {f"{k}@{part}": v for k, v in value_moments(values, returns, thirds == j, num_tokens).items()}
    return out


def _variance(m: dict[str, float], x: str, *scales: str) -> float:
    """Var(x) from the means of x and x² over a share n of the tokens; 0 when it is rounding noise,
    relative to the mean square of x and of the `scales` x was computed from."""
    if m["n"] <= 0:
        return 0.0
    mean, square = m[x] / m["n"], m[x + "2"] / m["n"]
    var = square - mean ** 2  # E[x²] − E[x]² of a constant is rounding noise, not variance
    size = square + sum(m[s + "2"] / m["n"] for s in scales)
    return var if var > 1e-6 * (size + 1e-12) else 0.0


def _return_variance(m: dict[str, float]) -> float:
    """Var(R): R = Â + V carries V's rounding, so a step whose rewards are all equal (every episode
    failed) has returns that vary by ~1e-7·|V|, which must not count as variance to explain."""
    return _variance(m, "r", "v")


def explained_variance(m: dict[str, float]) -> float:
    """1 − Var(R − V) / Var(R) over action tokens, from `value_moments`; NaN when R does not vary."""
    var_r = _return_variance(m)
    return 1.0 - _variance(m, "e") / var_r if var_r else math.nan


def value_return_corr(m: dict[str, float]) -> float:
    """Pearson correlation of V and R over action tokens, from `value_moments`: unlike the explained
    variance it ignores V's scale and offset, so it shows whether the critic ranks states right
    before it has their level; NaN when V or R does not vary."""
    var_r, var_v = _return_variance(m), _variance(m, "v")
    if not (var_r and var_v):
        return math.nan
    cov = m["rv"] / m["n"] - m["r"] * m["v"] / m["n"] ** 2
    return cov / math.sqrt(var_r * var_v)


def value_diagnostics(m: dict[str, float]) -> dict[str, float]:
    """value/explained_var and value/return_corr, overall and `_first|_middle|_last` by position,
    from `value_moments_by_position`'s step sums."""
    out = {"value/explained_var": explained_variance(m), "value/return_corr": value_return_corr(m)}
    for part in POSITIONS:
        sub = {k.removesuffix("@" + part): v for k, v in m.items() if k.endswith("@" + part)}
        out |= {f"value/explained_var_{part}": explained_variance(sub),
                f"value/return_corr_{part}": value_return_corr(sub)}
    return out

"""The value model (critic) of SAO.md §5: the policy's backbone plus a zero-initialised scalar head,
with attention frozen; its loss and explained variance.

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
        nn.init.zeros_(self.head.weight)  # V ≡ 0 at start (SAO.md §5)
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
    tensors were frozen. Raises if the model has no attention module by that test."""
    frozen = 0
    for module in model.modules():
        if is_attention(module, attention_types):
            for p in module.parameters():
                frozen += p.requires_grad
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


def param_report(model: nn.Module, attention_types: tuple[type, ...] = ()) -> dict[str, dict[str, int]]:
    """{kind: {"trainable": n, "frozen": n}} in parameter counts, kind one of attention, mlp
    (dense MLPs and MoE experts), router, norm, embedding, value_head, other; plus "total"."""
    report: dict[str, dict[str, int]] = defaultdict(lambda: {"trainable": 0, "frozen": 0})
    head = set(model.head.parameters()) if isinstance(model, ValueModel) else set()
    seen: set[nn.Parameter] = set()  # tied weights count once
    for kind, p in _owned(model, attention_types):
        if p in seen:
            continue
        seen.add(p)
        for row in ("value_head" if p in head else kind, "total"):
            report[row]["trainable" if p.requires_grad else "frozen"] += p.numel()
    return dict(report)


def format_report(report: dict[str, dict[str, int]]) -> str:
    """The trainable-parameter table, one line per module kind (SAO.md §5: it must be printable)."""
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
    (V_old + clamp(V_t − V_old, ±clip) − R_t)²)), PPO-style (SAO.md §5). `num_tokens`/`num_seqs`:
    the step's counts when this is one micro-batch (see `aggregate`)."""
    err = (values - returns) ** 2
    if clip is not None:
        v_clipped = values_old + (values - values_old).clamp(-clip, clip)
        err = torch.max(err, (v_clipped - returns) ** 2)
    return aggregate(err, action_mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)


@torch.no_grad()
def value_moments(values: Tensor, returns: Tensor, action_mask: Tensor,
                  num_tokens: int | None = None) -> dict[str, Tensor]:
    """Means over N action tokens of R, R², R − V and (R − V)²: sums over micro-batches and ranks
    give the step's, from which `explained_variance` follows."""
    def mean(x: Tensor) -> Tensor:
        return aggregate(x, action_mask, "token_mean", num_tokens=num_tokens)

    err = returns - values
    return {"r": mean(returns), "r2": mean(returns ** 2), "e": mean(err), "e2": mean(err ** 2)}


def explained_variance(m: dict[str, float]) -> float:
    """1 − Var(R − V) / Var(R) over action tokens, from `value_moments`; NaN when R does not vary."""
    var_r = m["r2"] - m["r"] ** 2
    # E[R²] − E[R]² of constant returns is rounding noise, not variance
    return 1.0 - (m["e2"] - m["e"] ** 2) / var_r if var_r > 1e-6 * (m["r2"] + 1e-12) else math.nan

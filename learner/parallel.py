"""FSDP2 composition and the process group: one code path for world size 1 and N.

`torchrun --nproc-per-node N -m learner.service` sets RANK/WORLD_SIZE/MASTER_ADDR; a plain
`sao learner` runs as a group of one. CUDA ranks use NCCL, CPU ranks gloo.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass(kw_only=True)
class ParallelConfig:
    device: str = "cpu"
    """cpu | cuda (each rank takes cuda:LOCAL_RANK)."""
    mixed_precision: bool = False
    """bf16 parameters and fp32 gradient reduction in FSDP2 (GPUs)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward (GPUs, long sequences)."""


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """(rank, world_size, device); starts a single-process group when not launched by torchrun."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the `layers` ModuleList of transformers' decoder families
    (found by name and type, so a critic wrapping a backbone works the same)."""
    for name, module in model.named_modules():
        if name.split(".")[-1] == "layers" and isinstance(module, nn.ModuleList):
            return list(module)
    raise ValueError(f"cannot find the decoder blocks of {type(model).__name__}")


def parallelize(model: nn.Module, cfg: ParallelConfig) -> nn.Module:
    """Shard `model` with FSDP2, in this order (torchtitan's):
    1. activation checkpointing per block (it must wrap the block before FSDP hooks onto it);
    2. `fully_shard` each decoder block, so its parameters are gathered only while it runs;
    3. `fully_shard` the root: embeddings, final norm and heads form the last unit.
    """
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.mixed_precision else MixedPrecisionPolicy()
    if cfg.activation_checkpointing:
        from torch.distributed._composable import checkpoint
        for block in decoder_blocks(model):
            checkpoint(block)
    for block in decoder_blocks(model):
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU (a collective: every rank calls it; rank 0 gets tensors)."""
    return get_model_state_dict(model, options=_FULL)


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    return get_optimizer_state_dict(model, optimizer, options=_FULL)


def load_full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def broadcast_bytes(items: list[bytes] | None, device: torch.device) -> list[bytes] | None:
    """Rank 0's list of byte strings (or None) on every rank, as tensors (no pickling)."""
    rank = dist.get_rank()
    n = torch.tensor([-1 if items is None else len(items)], dtype=torch.int64, device=device)
    dist.broadcast(n, 0)
    if n.item() < 0:
        return None
    lengths = (torch.tensor([len(b) for b in items], dtype=torch.int64, device=device) if rank == 0
               else torch.empty(int(n), dtype=torch.int64, device=device))
    dist.broadcast(lengths, 0)
    data = (torch.frombuffer(bytearray(b"".join(items)), dtype=torch.uint8).to(device) if rank == 0
            else torch.empty(int(lengths.sum()), dtype=torch.uint8, device=device))
    if data.numel():
        dist.broadcast(data, 0)
    if rank == 0:
        return items
    flat, out, start = data.cpu().numpy().tobytes(), [], 0
    for length in lengths.tolist():
        out.append(flat[start:start + length])
        start += length
    return out

"""FSDP2 composition and the process group: one code path for world size 1 and N.

`torchrun --nproc-per-node N -m learner.service` sets RANK/WORLD_SIZE/MASTER_ADDR; a plain
`sao learner` runs as a group of one. CUDA ranks use NCCL, CPU ranks gloo. Models are sharded on
the meta device, then allocated and loaded shard by shard (`materialise`); the only full copies
of the weights are rank 0's host copy of its source weights at start and its snapshot of the
policy in the published dtype at each publication (`gather_buckets`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from schemas.process import native_bf16
from schemas.weights import payload as W


@dataclass(kw_only=True)
class ParallelConfig:
    device: str = "cpu"
    """cpu | cuda (each rank takes cuda:LOCAL_RANK)."""
    mixed_precision: bool | None = None
    """The policy in bf16 compute: bf16 parameters in forward and backward, fp32 master weights and
    gradient reduction in FSDP2; None: on for cuda, off for cpu, where its recomputed log-probs then
    match a float32 engine's and the importance ratios are exact (bench/learner_precision.py)."""
    critic_mixed_precision: bool | None = None
    """The same for the critic, whose values enter no importance ratio; None: as the policy, and on
    for a cpu with native bf16 (AVX512-BF16 or AMX: 1.34x the learner's tokens/s on SmolLM2, ratios
    still exact; on AVX2 bf16 is 14x slower; bench/learner_precision.py)."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in backward (GPUs, long sequences)."""
    gather_once: bool | None = None
    """Keep parameters gathered and gradients unreduced across an optimizer step's micro-batches:
    one all-gather and one reduce-scatter per step instead of two and one per micro-batch, holding
    the full parameters and gradients meanwhile; None: on for cpu (gloo), off for cuda."""

    def bf16(self, critic: bool = False) -> bool:
        """Whether the policy (or the critic) computes in bf16, the None defaults resolved."""
        policy = self.device == "cuda" if self.mixed_precision is None else self.mixed_precision
        if not critic:
            return policy
        if self.critic_mixed_precision is not None:
            return self.critic_mixed_precision
        return policy or (self.device == "cpu" and native_bf16())


def init_distributed(device: str) -> tuple[int, int, torch.device]:
    """(rank, world_size, device); starts a single-process group when not launched by torchrun."""
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if "RANK" in os.environ:  # torchrun's
            dist.init_process_group(backend)
        else:  # a group of one; the environment stays as it was, for any child process
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
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


def recompute_in_backward(block: nn.Module) -> None:
    """Activation checkpointing of one block through the public `torch.utils.checkpoint`
    (non-reentrant, the form FSDP2 supports): its forward keeps only its inputs, and backward
    runs it again."""
    from torch.utils.checkpoint import checkpoint

    forward = block.forward
    block.forward = lambda *args, **kwargs: checkpoint(forward, *args, use_reentrant=False, **kwargs)


def parallelize(model: nn.Module, cfg: ParallelConfig, bf16: bool) -> nn.Module:
    """Shard `model` with FSDP2, in this order (torchtitan's):
    1. activation checkpointing per block (it must wrap the block before FSDP hooks onto it);
    2. `fully_shard` each decoder block, so its parameters are gathered only while it runs;
    3. `fully_shard` the root: embeddings, final norm and heads form the last unit. Tied
       embeddings and LM head must share one unit, hence not torchtitan's separate units; it
       stays unsharded from forward to backward, which `token_logprobs` relies on to read the LM
       head's weight after the forward.
    Every unit reduces gradients by sum, not mean: each rank's loss is already divided by the
    step's global token count (learner/microbatch.py).
    """
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if bf16 else MixedPrecisionPolicy())
    if cfg.activation_checkpointing:
        for block in decoder_blocks(model):
            recompute_in_backward(block)
    units = [fully_shard(block, mp_policy=mp) for block in decoder_blocks(model)]
    units.append(fully_shard(model, mp_policy=mp, reshard_after_forward=False))
    for unit in units:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    model.gather_once = cfg.device == "cpu" if cfg.gather_once is None else cfg.gather_once  # read by accumulate
    return model


def accumulate(model: nn.Module, micro_batches: list) -> Iterator:
    """Yield one optimizer step's micro-batches, around which the caller runs forward and backward.

    With `gather_once` (see ParallelConfig), the blocks stay gathered after each forward and
    backward and gradients accumulate unreduced on every rank, until the last micro-batch's
    backward reduce-scatters them once and reshards; the summed gradient is the same. Every rank
    has the same number of micro-batches (learner/update.py pads the shorter shares), so all
    agree on which is last."""
    if not getattr(model, "gather_once", False):
        yield from micro_batches
        return
    blocks = decoder_blocks(model)
    for block in blocks:
        block.set_reshard_after_forward(False, recurse=False)
    try:
        for i, mb in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            yield mb
    finally:  # back to per-forward resharding; frees what a step without backward left gathered
        for block in blocks:
            block.set_reshard_after_forward(True, recurse=False)
            block.reshard()
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)


def materialise(model: nn.Module, state: dict[str, torch.Tensor] | None, device: torch.device) -> None:
    """Allocate a sharded meta-device model on `device` and load its weights from rank 0's full
    `state` (None on the other ranks): each rank keeps only its shards (torchtitan's path)."""
    model.to_empty(device=device)
    reset_buffers(model, device)
    # a copy: set_model_state_dict replaces the given dict's values with the loaded shards
    set_model_state_dict(model, dict(state) if dist.get_rank() == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def reset_buffers(model: nn.Module, device: torch.device) -> None:
    """Recompute non-persistent buffers (rotary inverse frequencies), which `to_empty` leaves as
    uninitialised memory and no state dict carries: rebuild each owning module on `device`."""
    for module in model.modules():
        own = [n for n, b in module.named_buffers(recurse=False) if n in module._non_persistent_buffers_set]
        if own:
            with torch.device(device):
                fresh = type(module)(config=module.config)
            for name in own:
                getattr(module, name).copy_(getattr(fresh, name))


def gather_buckets(model: nn.Module, dtype: torch.dtype,
                   bucket_bytes: int = 1 << 28) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The full state dict in state-dict order, a bucket of about `bucket_bytes` at a time, as
    copies in `dtype` on rank 0's CPU (empty lists elsewhere): training may go on mutating the
    parameters. Cast before the device-to-host copy, so a bf16 snapshot moves half of fp32's bytes.
    A collective: every rank iterates it to the end."""
    rank, bucket, size = dist.get_rank() if dist.is_initialized() else 0, [], 0
    for name, t in get_model_state_dict(model).items():
        full = t.full_tensor() if isinstance(t, DTensor) else t  # an all-gather on every rank
        if rank == 0:
            bucket.append((name, full.detach().to(dtype=dtype, copy=True).cpu()))
        size += full.numel() * full.element_size()
        del full
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if size:
        yield bucket


def snapshot(model: nn.Module, dtype: torch.dtype, bucket_bytes: int,
             rename: Callable[[str], str] = lambda name: name) -> W.State:
    """Rank 0: the policy's full state in `dtype` on the host, named by `rename`; {} on the other
    ranks. A collective (every rank gathers each tensor)."""
    return {rename(name): W.from_torch(t) for bucket in gather_buckets(model, dtype, bucket_bytes) for name, t in bucket}


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

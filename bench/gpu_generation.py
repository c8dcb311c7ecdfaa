"""The hf generator backend on a GPU: tokens/s against requests in flight, and the exactness of its
rollout log-probs under dynamic batching against the learner's recomputation.

    python3 bench/gpu_generation.py [--concurrency 1 16 64] [--tokens 128]

Random weights of SmolLM2-135M's shape in float32 (nothing downloaded). Each level submits
`concurrency` requests of exactly `--tokens` tokens at once (random 32-token prompts, T = 1) to one
`HFGenerator`, which batches their decode steps; tokens/s is the level's total over its wall time,
as a ratio to one request at a time in the same run. Then, for the largest level's generations, the
learner's log-probs of the same sequences (one full forward each, `learner.logprobs`) against the
rollout log-probs the generator recorded: the importance ratio depends on their agreement.
Imports nothing Kafka- or CLI-related.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.shapes import SMOLLM2_135M  # noqa: E402
from learner.logprobs import collate, token_logprobs  # noqa: E402
from producers.generate.base import SamplingParams  # noqa: E402
from producers.generate.hf import HFGenerator  # noqa: E402
from schemas.messages import Trajectory  # noqa: E402


@dataclass(kw_only=True)
class GpuGenerationConfig:
    """The levels and the request length."""

    concurrency: tuple[int, ...] = (1, 16, 64)
    """requests in flight, one level each; ratios are to the first"""
    tokens: int = 128
    """tokens per request"""


def run_level(gen: HFGenerator, n: int, tokens: int, rng: np.random.Generator) -> tuple[float, list]:
    params = SamplingParams(max_tokens=tokens, temperature=1.0)
    prompts = [rng.integers(0, SMOLLM2_135M.vocab_size, 32).tolist() for _ in range(n)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = [f.result() for f in [gen.submit(p, params) for p in prompts]]
    torch.cuda.synchronize()
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0), list(zip(prompts, outs))


def recompute_gap(model, samples: list) -> float:
    """Largest |learner log-prob − rollout log-prob| over every sampled token."""
    worst = 0.0
    for i, (prompt, out) in enumerate(samples):
        n = len(prompt) + len(out.token_ids)
        traj = Trajectory(id=f"g{i}", prompt_id="p", env="bench", producer_id="bench",
                          tokens=np.r_[prompt, out.token_ids].astype(np.int32),
                          action_mask=np.r_[np.zeros(len(prompt)), np.ones(len(out.token_ids))].astype(np.uint8),
                          rollout_logprobs=np.r_[np.zeros(len(prompt)), out.logprobs].astype(np.float32),
                          versions=np.r_[np.full(len(prompt), -1), out.versions].astype(np.int32),
                          prompt_len=len(prompt), reward=0.0)
        batch = collate([traj], device=next(model.parameters()).device)
        with torch.no_grad():
            logp, _ = token_logprobs(model, batch, temperature=1.0)
        gap = (logp - batch.logp_rollout)[batch.action_mask].abs().max().item()
        worst = max(worst, gap)
        assert n == batch.tokens.shape[1]
    return worst


def main() -> None:
    args = tyro.cli(GpuGenerationConfig, description=__doc__)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_generation needs CUDA; on CPU use bench/generation.py")
    from transformers import LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(SMOLLM2_135M).to("cuda", torch.float32).eval()
    gen = HFGenerator(model, seed=0, max_batch=max(args.concurrency))
    rng = np.random.default_rng(0)
    run_level(gen, 1, 8, rng)  # warm-up: kernels, allocator
    rates, samples = {}, []
    for n in args.concurrency:
        rates[n], samples = run_level(gen, n, args.tokens, rng)
    print(f"gpu_generation: hf backend, SmolLM2-135M shape (random, fp32), {torch.cuda.get_device_name()}, "
          f"{args.tokens} tokens per request")
    for n, r in rates.items():
        print(f"  {n:>3} in flight: {r:9,.0f} tokens/s  ({r / rates[args.concurrency[0]]:.1f}x one at a time)")
    gap = recompute_gap(model, samples[:16])
    print(f"  rollout vs learner log-prob, {min(16, len(samples))} batched generations: max |gap| {gap:.2e}")
    gen.close()


if __name__ == "__main__":
    main()

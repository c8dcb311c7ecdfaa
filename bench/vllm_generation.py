"""vLLM against the hf backend on SmolLM2-135M-Instruct, one run, side by side:

1. tokens/s against the number of requests in flight N, for the vllm backend (float32 and bf16
   engines) and the hf backend (float32); targets: vllm ÷ hf at N = 16 >= 3, vllm N = 16 ÷ N = 1 >= 6;
2. |log p_rollout − log p_learner| per sampled token, each engine against the learner's float32
   forward (transformers, the same weights), and the DIS kept fraction that implies at SAO's two
   presets (reasoning 0.7 < r < 6, coding 0.2 < r < 4; docs/algorithm.md §3), for a policy that has not moved;
3. the pause a weight update causes (the engine stopped between decode steps), apart from the whole
   update (checking, then staging while the engine decodes on: reading, and on CPU re-packing a
   shadow of the model), with requests in flight.

    .venv/bin/python bench/vllm_generation.py [--concurrency 1 4 16] [--tokens 64] [--out bench/results/vllm_generation.md]
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from bench.generation import QUESTION, tokens_per_s  # noqa: E402
from producers.envs.chat import Chat  # noqa: E402
from producers.generate.base import SamplingParams  # noqa: E402
from producers.generate.hf import HFGenerator  # noqa: E402
from producers.generate.vllm import VLLMConfig, VLLMGenerator  # noqa: E402
from producers.models import engine_folder, load_model  # noqa: E402
from schemas.tokenizers import load_tokenizer  # noqa: E402

PRESETS = {"reasoning": (0.3, 5.0), "coding": (0.8, 3.0)}  # (eps_low, eps_high), docs/algorithm.md §3


@dataclass(kw_only=True)
class VLLMGenerationConfig:
    """The levels, the request length and where the tables go."""

    concurrency: tuple[int, ...] = (1, 4, 16)
    """requests in flight, one level each; ratios are of the last to the first"""
    tokens: int = 64
    """tokens per request"""
    out: Path = REPO / "bench" / "results" / "vllm_generation.md"
    """where the tables go"""


def kept(gaps_signed: np.ndarray, eps: tuple[float, float]) -> float:
    """The share of tokens DIS keeps: 1 − eps_low < r < 1 + eps_high, r = exp(log p_learner − log p_rollout)."""
    ratio = np.exp(gaps_signed)
    return float(((ratio > 1 - eps[0]) & (ratio < 1 + eps[1])).mean())


def signed_gaps(model, prompt: list[int], outs) -> np.ndarray:
    """log p_learner − log p_rollout of every sampled token, the learner a float32 transformers forward."""
    with torch.no_grad():
        out = []
        for o in outs:
            ids = prompt + o.token_ids.tolist()
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, len(prompt) - 1:-1].float(), -1)
            out.append((logp.gather(-1, torch.from_numpy(o.token_ids.astype(np.int64))[:, None])[:, 0]
                        - torch.from_numpy(o.logprobs)).numpy())
    return np.concatenate(out)


def sample(gen, prompt: list[int], n: int, tokens: int) -> list:
    async def run():
        return await asyncio.gather(*(gen.generate(prompt, SamplingParams(max_tokens=tokens, seed=i)) for i in range(n)))
    return asyncio.run(run())


def pause_with_requests_in_flight(gen: VLLMGenerator, prompt: list[int], path: str, version: int) -> tuple[float, float]:
    """(seconds paused, seconds of the whole update) of one swap made while 8 requests decode."""
    async def run():
        requests = [asyncio.ensure_future(gen.generate(prompt, SamplingParams(max_tokens=128, seed=i))) for i in range(8)]
        await asyncio.sleep(1.0)
        t0 = time.perf_counter()
        await asyncio.to_thread(gen.load_weights, path, version)
        total = time.perf_counter() - t0
        await asyncio.gather(*requests)
        return gen.last_pause_s, total
    return asyncio.run(run())


def main() -> None:
    args = tyro.cli(VLLMGenerationConfig, description=__doc__)
    torch.set_num_threads(1)  # the hf backend's best on a shared 2-core machine (bench/generation.py)
    head = (f"SmolLM2-135M-Instruct, {args.tokens} tokens per request, T = 1 [{platform.machine()} "
            f"{torch.backends.cpu.get_cpu_capability()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f} at start, {datetime.date.today()}]")
    print(head, flush=True)
    prompt = Chat(load_tokenizer("smollm2")).prompt_ids([{"role": "user", "content": QUESTION}])
    learner = load_model("smollm2")
    rows, gaps, pauses = {}, {}, {}
    hf = HFGenerator(learner, seed=0)
    rows["hf float32"] = [tokens_per_s(hf, prompt, args.tokens, n) for n in args.concurrency]
    hf.close()
    folder = engine_folder("smollm2")
    for dtype in ("float32", "bfloat16"):
        gen = VLLMGenerator(folder, seed=0, cfg=VLLMConfig(dtype=dtype, max_model_len=1024))
        rows[f"vllm {dtype}"] = [tokens_per_s(gen, prompt, args.tokens, n) for n in args.concurrency]
        gaps[dtype] = signed_gaps(learner, prompt, sample(gen, prompt, 16, args.tokens))
        if dtype == "float32":
            update = folder / "bench-update.safetensors"
            save_file({k: v.detach().clone().contiguous() for k, v in learner.state_dict().items()}, str(update))
            pauses = [pause_with_requests_in_flight(gen, prompt, str(update), v) for v in (1, 2, 3)]
            update.unlink()
        gen.close()
        print(f"{dtype} done", flush=True)
    lines = [f"# vLLM against hf: {head}", "", "Command: `.venv/bin/python bench/vllm_generation.py`", "",
             "| backend | " + " | ".join(f"N = {n} tok/s" for n in args.concurrency) + " | N = max ÷ N = 1 |",
             "|---" * (len(args.concurrency) + 2) + "|"]
    for name, r in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{x:.1f}" for x in r) + f" | {r[-1] / r[0]:.2f} |")
    n_max = args.concurrency[-1]
    lines += ["", f"vllm float32 ÷ hf at N = {n_max}: **{rows['vllm float32'][-1] / rows['hf float32'][-1]:.2f}x** "
              f"(bf16: {rows['vllm bfloat16'][-1] / rows['hf float32'][-1]:.2f}x); vllm float32 N = {n_max} ÷ N = 1: "
              f"**{rows['vllm float32'][-1] / rows['vllm float32'][0]:.2f}x**", "",
              "| engine | tokens | max abs gap | mean | p50 | p99 | kept (reasoning) | kept (coding) |",
              "|---|---|---|---|---|---|---|---|"]
    for dtype, g in gaps.items():
        a = np.abs(g)
        lines.append(f"| vllm {dtype} | {len(g)} | {a.max():.2e} | {a.mean():.2e} | {np.median(a):.2e} | "
                     f"{np.percentile(a, 99):.2e} | {kept(g, PRESETS['reasoning']):.4f} | {kept(g, PRESETS['coding']):.4f} |")
    lines += ["", "| weight update with 8 requests in flight | paused s | whole update s | pause ÷ update |",
              "|---|---|---|---|"]
    for i, (paused, total) in enumerate(pauses, 1):
        lines.append(f"| update {i} (vllm float32) | {paused:.3f} | {total:.3f} | {paused / total:.2f} |")
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()

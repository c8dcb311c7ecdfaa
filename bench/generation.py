"""Generation tokens/s against the number of requests in flight (1, 4, 16, 64), per backend, as a
ratio to one request at a time measured in the same run.

- `hf`: the model in-process; concurrent requests share decode steps (dynamic batching).
- `http`: the same model behind `sao serve` (a separate process, as deployed), through the
  async client; the server batches concurrent requests the same way. Its start-up is not counted.
- `sim`: the load-test backend (`--sim-token-s` per token, every request exactly `--tokens` long);
  shows what the harness itself sustains, since simulated requests do not slow each other.

Each level runs `concurrency` requests at once, each of exactly `--tokens` tokens (no stop token),
after one warm-up request. A math chat prompt of the model's chat template.

    .venv/bin/python bench/generation.py [--models smollm2] [--backends hf sim] [--concurrency 1 4 16 64] [--tokens 64]
"""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402

from producers.envs.chat import Chat  # noqa: E402
from producers.generate.base import SamplingParams  # noqa: E402
from producers.generate.hf import HFGenerator  # noqa: E402
from producers.generate.http import HttpGenerator  # noqa: E402
from producers.generate.sim import SimConfig, SimGenerator  # noqa: E402
from producers.models import load_model  # noqa: E402
from schemas.tokenizers import load_tokenizer  # noqa: E402

QUESTION = "A hall has 12 rows of 18 chairs and 34 people sit down. How many chairs are free?"


@dataclass(kw_only=True)
class GenerationConfig:
    """The sweep: every backend at every level."""

    models: tuple[str, ...] = ("smollm2",)
    """models of the hf and http backends"""
    backends: tuple[Literal["hf", "http", "sim"], ...] = ("hf", "sim")
    """backends to measure"""
    concurrency: tuple[int, ...] = (1, 4, 16, 64)
    """requests in flight, one level each; ratios are to the first"""
    tokens: int = 64
    """tokens per request"""
    sim_token_s: float = 0.002
    """seconds per token of the sim backend"""
    threads: int = 1
    """torch threads; 1 by default because on a shared machine two intra-op threads wait at every barrier for a core another process holds (measured here: 30x slower)"""


def tokens_per_s(gen, prompt: list[int], tokens: int, concurrency: int) -> float:
    """Tokens/s of `concurrency` requests of `tokens` tokens run at once, after a warm-up call."""
    params = SamplingParams(temperature=1.0, max_tokens=tokens)

    async def measure() -> float:
        await gen.generate(prompt, SamplingParams(temperature=1.0, max_tokens=4))
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(gen.generate(prompt, params) for _ in range(concurrency)))
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)

    return asyncio.run(measure())


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sao", "serve", "--model", model, "--port", str(port),
                             "--no-follow-weights"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"sao serve --model {model} did not come up")
        time.sleep(0.5)


def sweep(label: str, gen, prompt: list[int], args: GenerationConfig) -> None:
    base = None
    for n in args.concurrency:
        rate = tokens_per_s(gen, prompt, args.tokens, n)
        base = base or rate
        print(f"{label:<26} {n:>11} {rate:>10.1f} {rate / base:>12.2f}", flush=True)


def main() -> None:
    args = tyro.cli(GenerationConfig, description=__doc__)
    torch.set_num_threads(args.threads)
    print(f"# bench/generation.py  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"# host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), float32, CPU, "
          f"load average {os.getloadavg()[0]:.1f} at start (a shared machine: other jobs compete)")
    print(f"# each level: N requests at once, {args.tokens} tokens each, T=1.0, no stop token")
    print(f"{'backend / model':<26} {'concurrency':>11} {'tokens/s':>10} {'vs N=1':>12}")
    for name in args.models:
        prompt = Chat(load_tokenizer(name)).prompt_ids([{"role": "user", "content": QUESTION}])
        if "hf" in args.backends:
            gen = HFGenerator(load_model(name), seed=0)
            sweep(f"hf {name}", gen, prompt, args)
            gen.close()
        if "http" in args.backends:
            proc, url = start_server(name)
            try:
                sweep(f"http {name}", HttpGenerator(url), prompt, args)
            finally:
                proc.terminate()
                proc.wait(30)
    if "sim" in args.backends:
        sim = SimGenerator(SimConfig(median_tokens=args.tokens, sigma=0.0, token_s=args.sim_token_s))
        sweep(f"sim {args.sim_token_s * 1e3:g} ms/token", sim, [1, 2, 3], args)


if __name__ == "__main__":
    main()

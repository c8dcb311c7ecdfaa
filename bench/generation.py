"""Generation tokens/s of the `hf` backend in-process, and the same model behind `sao serve` over
HTTP (a separate process, as deployed), as a ratio to in-process.

For each model: a math chat prompt, `--repeats` generations of exactly `--tokens` tokens (no stop
token, so every call decodes the same length), one client, requests in sequence. The server runs
`sao serve --no-follow-weights` on loopback; its start-up time is not counted.

    .venv/bin/python bench/generation.py [--models smollm2 tiny-llama-bytes] [--tokens 64] [--repeats 4]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import torch  # noqa: E402

from producers.envs.chat import Chat  # noqa: E402
from producers.generate.base import SamplingParams  # noqa: E402
from producers.generate.hf import HFGenerator  # noqa: E402
from producers.generate.http import HttpGenerator  # noqa: E402
from producers.models import load_model, load_tokenizer  # noqa: E402

QUESTION = "A hall has 12 rows of 18 chairs and 34 people sit down. How many chairs are free?"


def tokens_per_s(gen, prompt: list[int], tokens: int, repeats: int) -> tuple[float, float]:
    """(tokens/s, seconds) over `repeats` generations of `tokens` tokens, after one warm-up call."""
    params = SamplingParams(temperature=1.0, max_tokens=tokens)
    gen.generate(prompt, SamplingParams(temperature=1.0, max_tokens=4))
    t0, n = time.perf_counter(), 0
    for _ in range(repeats):
        out = gen.generate(prompt, params)
        n += len(out.token_ids)
    dt = time.perf_counter() - t0
    return n / dt, dt


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "sao", "serve", "--model", model, "--port", str(port),
                             "--no-follow-weights"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["smollm2", "tiny-llama-bytes"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=4)
    args = ap.parse_args()
    print(f"# bench/generation.py  {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"# host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads), float32, CPU, "
          f"load average {os.getloadavg()[0]:.1f} at start (a shared machine: other jobs compete)")
    print(f"# {args.repeats} x {args.tokens} tokens per model and backend, T=1.0, no stop token, sequential")
    print(f"{'model':<18} {'prompt':>6} {'in-process tok/s':>17} {'http tok/s':>11} {'http/in-process':>16}")
    for name in args.models:
        tokenizer = load_tokenizer(name)
        prompt = Chat(tokenizer).prompt_ids([{"role": "user", "content": QUESTION}])
        local, _ = tokens_per_s(HFGenerator(load_model(name), seed=0), prompt, args.tokens, args.repeats)
        proc, url = start_server(name)
        try:
            remote, _ = tokens_per_s(HttpGenerator(url), prompt, args.tokens, args.repeats)
        finally:
            proc.terminate()
            proc.wait(30)
        print(f"{name:<18} {len(prompt):>6} {local:>17.1f} {remote:>11.1f} {remote / local:>16.3f}", flush=True)


if __name__ == "__main__":
    main()

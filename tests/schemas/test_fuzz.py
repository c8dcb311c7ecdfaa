"""Fuzzing `decode`: only SchemaError ever escapes, in bounded time and memory."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from sao.demo import random_trajectory
from schemas.messages import DeadLetter, Prompt, Reward, SchemaError, Weights, decode

ROOT = Path(__file__).resolve().parents[2]
N_CASES = 12_000
# A valid message decodes into at most ~2x its size (the bytes plus views); anything beyond this
# bound for a few-KB input would mean a length field was trusted.
MEMORY_BOUND = 1 << 20
TIME_BOUND_S = 0.5  # a generous per-message ceiling, far above the ~50 us a decode takes


def _seeds() -> list[bytes]:
    rng = np.random.default_rng(1)
    return [
        *(random_trajectory(rng, n, i).encode() for i, n in enumerate([0, 1, 7, 64, 300])),
        Prompt(id="p", env="math", task={"a": 1, "q": "2+2"}).encode(),
        Reward(trajectory_id="t", reward=0.5).encode(),
        Weights(version=3, step=3, uri="file:///w", digest="0" * 64, num_bytes=10).encode(),
        DeadLetter(source_topic="x", partition=0, offset=1, error="e", payload=b"\x00\xff").encode(),
    ]


def _mutate(rnd: random.Random, seeds: list[bytes]) -> bytes:
    data = bytearray(rnd.choice(seeds))
    match rnd.randrange(6):
        case 0:  # random bytes
            return rnd.randbytes(rnd.randrange(0, 64))
        case 1:  # bit flips
            for _ in range(rnd.randrange(1, 8)):
                if data:
                    i = rnd.randrange(len(data))
                    data[i] ^= 1 << rnd.randrange(8)
        case 2:  # truncation
            del data[rnd.randrange(len(data) + 1):]
        case 3:  # splice of two valid messages
            other = rnd.choice(seeds)
            data = data[: rnd.randrange(len(data) + 1)] + other[rnd.randrange(len(other) + 1):]
        case 4:  # overwrite a byte with a msgpack header that claims a huge length
            if data:
                i = rnd.randrange(len(data))
                data[i:i + 5] = rnd.choice([b"\xc6", b"\xdd", b"\xdf", b"\xdb"]) + b"\xff\xff\xff\xff"
        case 5:  # duplicate a slice
            i, j = sorted(rnd.randrange(len(data) + 1) for _ in range(2))
            data[j:j] = data[i:j]
    return bytes(data)


def fuzz() -> dict:
    """Decode N_CASES mutated messages; the outcome counts and the worst time and memory of one."""
    rnd = random.Random(1234)
    seeds = _seeds()
    outcomes = {"ok": 0, "schema_error": 0}
    worst_time, worst_mem = 0.0, 0
    tracemalloc.start()
    try:
        for _ in range(N_CASES):
            data = _mutate(rnd, seeds)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            t0 = time.perf_counter()
            try:
                decode(data)
                outcomes["ok"] += 1
            except SchemaError:
                outcomes["schema_error"] += 1
            # any other exception fails the test with its traceback
            worst_time = max(worst_time, time.perf_counter() - t0)
            worst_mem = max(worst_mem, tracemalloc.get_traced_memory()[1] - base - 2 * len(data))
    finally:
        tracemalloc.stop()
    return {"outcomes": outcomes, "worst_time": worst_time, "worst_mem": worst_mem}


def test_only_schema_error_escapes_in_bounded_time_and_memory():
    # A fresh interpreter: tracemalloc counts every thread's allocations, and in the suite's process
    # the background threads of earlier tests' clients would be measured as the decoder's.
    run = subprocess.run([sys.executable, "-c", "import json, tests.schemas.test_fuzz as f; print(json.dumps(f.fuzz()))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    outcomes, worst_mem, worst_time = result["outcomes"], result["worst_mem"], result["worst_time"]
    assert sum(outcomes.values()) == N_CASES
    assert outcomes["schema_error"] > N_CASES // 2, outcomes  # the mutations really were invalid
    assert worst_mem < MEMORY_BOUND, f"a decode allocated {worst_mem} bytes beyond its input"
    assert worst_time < TIME_BOUND_S, f"a decode took {worst_time:.3f}s"

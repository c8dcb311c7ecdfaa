"""Codec throughput for a 32k-token trajectory against a plain copy of the same payload.

Prints encode/decode MB/s and their ratio to `bytearray(payload)` (a memcpy) measured in the same
run. Targets: decode >= 0.5x of the copy (near zero-copy), encode >= 0.25x. Two regimes: `hot`
reuses one payload (it stays in cache, as in a micro-benchmark), `cold` cycles through 256 distinct
payloads (~110 MB, beyond the 32 MB L3 here, as messages fresh from the network are).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sao.demo import random_trajectory  # noqa: E402
from schemas.messages import Trajectory  # noqa: E402


def best_rate(fn, items: list, nbytes: int, seconds: float = 2.0) -> float:
    """MB/s of the fastest pass over `items` (noise on a shared machine only ever slows a pass)."""
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        best = min(best, (time.perf_counter() - t0) / len(items))
    return nbytes / best / 1e6


def main() -> None:
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(256):
        traj = random_trajectory(rng, 32768, i)
        traj.prompt_len = 0
        trajs.append(traj)
    payloads = [t.encode() for t in trajs]
    n = len(payloads[0])
    print(f"codec: 32768-token trajectory, {n / 1e6:.2f} MB payload  "
          f"[{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}]")
    print(f"{'regime':<7}{'operation':<11}{'MB/s':>9}{'x copy':>9}{'target':>9}")
    for regime, k in (("hot", 1), ("cold", 256)):
        copy = best_rate(bytearray, payloads[:k] * (256 // k), n)
        enc = best_rate(Trajectory.encode, trajs[:k] * (256 // k), n)
        dec = best_rate(Trajectory.decode, payloads[:k] * (256 // k), n)
        print(f"{regime:<7}{'copy':<11}{copy:>9.0f}{1.0:>9.2f}{'':>9}")
        print(f"{regime:<7}{'encode':<11}{enc:>9.0f}{enc / copy:>9.2f}{'>=0.25':>9}")
        print(f"{regime:<7}{'decode':<11}{dec:>9.0f}{dec / copy:>9.2f}{'>=0.50':>9}")


if __name__ == "__main__":
    main()

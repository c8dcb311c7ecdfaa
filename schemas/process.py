"""What every service process shares beyond the wire: stopping cleanly on a signal, calling into
an event loop from the process's other threads, and what the CPU it runs on can do."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import threading
from collections.abc import Callable
from pathlib import Path


def stop_on_signals(stop: threading.Event | None = None) -> threading.Event:
    """An event set by SIGTERM or SIGINT, so a service loop can finish its current unit of work
    and close its clients. Handlers can only be installed from the main thread; elsewhere (a
    service run inside a test's thread) the caller's `stop` is the only way to end the loop."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    return stop


def threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable) -> Callable:
    """`fn` made callable from another thread (an engine, a Kafka callback), run on `loop`. It
    never raises into that thread: a call after the loop closed (the server stopped) is dropped."""
    def call(*args) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed
            loop.call_soon_threadsafe(fn, *args)
    return call


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (`avx2`, `avx512f`, `avx512_bf16`, `amx_bf16`,
    ...); empty where /proc/cpuinfo does not exist. torch's own capability probe says `AVX512` on
    CPUs with and without native bf16 alike, so kernels that need the distinction ask here."""
    info = Path("/proc/cpuinfo")
    return frozenset(info.read_text().split()) if info.exists() else frozenset()


def native_bf16() -> bool:
    """The CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); without, torch converts every bf16
    matmul in software and bf16 runs slower than float32 (bench/learner_precision.py)."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})

"""Peak resident memory of this process over a block of code, for the CPU memory benchmarks."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import threading
import time


def rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """`with PeakRSS() as m: ...` then `m.before` and `m.added` (peak minus before), in bytes.
    Freed pages go back to the OS first (`malloc_trim`), so reuse of the allocator's free lists
    does not hide growth; the peak is sampled every millisecond. Start the process with
    MALLOC_MMAP_THRESHOLD_=65536 so that glibc maps every tensor on its own and returns it when
    freed: the resident set then follows the live tensors."""

    def __enter__(self) -> PeakRSS:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        self.before = self.peak = rss()
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._sampler.join()
        self.peak = max(self.peak, rss())

    @property
    def added(self) -> int:
        return self.peak - self.before


def in_fresh_process(target, *args):
    """`target(*args, queue)` in a spawned process (nothing allocated before it counts); returns what
    it put on the queue."""
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    result = q.get()
    p.join()
    return result

"""The watchdog of a process's vLLM engine: vLLM's EngineCore has no way to notice that the process
which spawned it died (its Worker does, through a pipe from the EngineCore), so a producer killed
by SIGKILL would leave an engine holding gigabytes and both cores.

Run as a script of its own (`python -S watchdog.py PID`, standard library only), in a session of
its own, started before the engine: while process PID lives it notes PID's engine processes every
`POLL_S`, so an engine that is still starting is noted too; once PID is gone it SIGKILLs each
one noted that is still an engine process (a pid the system gave to another process is left alone).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

POLL_S = 0.5
"""Seconds between two looks at the guarded process's engine processes."""


def engine_processes(root: int) -> list[int]:
    """vLLM's processes (named `VLLM::EngineCore`, `VLLM::Worker`, ...) below process `root`."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        children = []
        try:  # per thread: whichever spawned it
            tasks = list(Path(f"/proc/{pid}/task").glob("*/children"))
        except OSError:  # it exited after its parent listed it: nothing below it any more
            tasks = []
        for task in tasks:
            try:
                children += task.read_text().split()
            except OSError:
                pass
        for child in map(int, children):
            todo.append(child)
            if is_engine(child):
                found.append(child)
    return found


def is_engine(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::")
    except OSError:
        return False


def reap(root: int, grace_s: float) -> list[int]:
    """Give `root`'s engine processes `grace_s` to exit, then SIGKILL those left; returns them."""
    deadline = time.monotonic() + grace_s
    while engine_processes(root) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = engine_processes(root)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def guard(parent: int, poll_s: float = POLL_S) -> None:
    """Note `parent`'s engine processes while it lives; once it is gone, kill them."""
    noted: set[int] = set()
    while os.getppid() == parent:
        noted.update(engine_processes(parent))
        time.sleep(poll_s)
    for pid in noted:
        if is_engine(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    guard(int(sys.argv[1]))

"""The vLLM engine watchdog (producers/generate/watchdog.py) with real processes: a process killed
while its engine was starting leaves no engine behind, and nothing that is not an engine is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from producers.generate import watchdog
from tests.producers.util import wait_until

# The guarded process: its watchdog first, as VLLMGenerator starts it, then an "engine" (a process
# named VLLM::EngineCore, as vLLM names its own) and a helper that is not one.
PARENT = """
import os, subprocess, sys, time
subprocess.Popen([sys.executable, "-S", sys.argv[1], str(os.getpid())], start_new_session=True)
engine = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 600"])
other = subprocess.Popen(["sleep", "600"])
print(engine.pid, other.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_an_engine_still_starting_is_killed_with_the_process_that_started_it():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, watchdog.__file__], stdout=subprocess.PIPE, text=True)
    engine, other = map(int, parent.stdout.readline().split())
    try:
        wait_until(lambda: watchdog.engine_processes(parent.pid) == [engine])
        time.sleep(3 * watchdog.POLL_S)  # the watchdog's own look (it may still be starting: a loaded machine)
        os.kill(parent.pid, signal.SIGKILL)  # no chance to shut anything down
        parent.wait(10)
        wait_until(lambda: not alive(engine), timeout=10)
        assert alive(other)  # not an engine: left alone
    finally:
        for pid in (engine, other):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_engine_processes_that_outlive_a_shutdown_are_reaped_after_their_grace():
    """`reap` (VLLMGenerator.close, after vLLM's own shutdown): an engine that exits within the grace
    is waited for, one that does not is killed, and nothing else is touched."""
    quits = subprocess.Popen(["bash", "-c", "exec -a VLLM::Worker sleep 1"])
    stuck = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 600"])
    other = subprocess.Popen(["sleep", "600"])
    try:
        wait_until(lambda: sorted(watchdog.engine_processes(os.getpid())) == sorted([quits.pid, stuck.pid]))
        start = time.monotonic()
        assert watchdog.reap(os.getpid(), grace_s=4.0) == [stuck.pid]
        assert time.monotonic() - start >= 4.0
        assert stuck.wait(10) == -signal.SIGKILL and quits.wait(10) == 0 and other.poll() is None
        assert watchdog.reap(os.getpid(), grace_s=4.0) == []  # none left: no wait
    finally:
        for p in (quits, stuck, other):
            p.kill()


def test_processes_that_exit_while_the_tree_is_read_are_no_error():
    """A child listed by its parent may exit before its own threads are read (an engine's helpers
    come and go); the watchdog died of that once during a `sao eval`, leaving its engines unguarded.
    A shell starting a process after another keeps such a window open all the time: unmended, the
    walk raised FileNotFoundError within a second here."""
    churn = subprocess.Popen(["bash", "-c", "while :; do /bin/true; done"])
    try:
        deadline, walks = time.monotonic() + 5, 0
        while time.monotonic() < deadline:
            assert watchdog.engine_processes(os.getpid()) == []
            walks += 1
        assert walks > 100  # the race was given its chance
    finally:
        churn.kill()
        churn.wait(10)

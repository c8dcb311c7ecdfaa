"""Child processes of `sao up`: start each service, restart one that crashes (a bounded number of
times), and stop them all, leaving none behind.

A child that exits 0 has finished (the learner at `--max-steps`, a feeder with a count); one that
exits otherwise, or dies by a signal, crashed. Every child dies with its parent (PR_SET_PDEATHSIG),
so even a SIGKILLed `sao up` leaves no process.
"""

from __future__ import annotations

import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from sao.broker import die_with_parent


@dataclass
class Child:
    name: str
    cmd: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    state: str = "starting"
    """starting | running | restarting | done | crashed | failed (out of restarts) | stopped."""
    events: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


class Supervisor:
    def __init__(self, cmds: dict[str, list[str]], log_dir: Path, env: dict[str, str], max_restarts: int = 3,
                 child_env: dict[str, dict[str, str]] | None = None):
        log_dir.mkdir(parents=True, exist_ok=True)
        self.children = {name: Child(name, cmd, log_dir / f"{name}.log") for name, cmd in cmds.items()}
        self.env = env
        self.child_env = child_env or {}
        self.max_restarts = max_restarts

    def _start(self, c: Child) -> None:
        with open(c.log, "ab") as out:
            c.proc = subprocess.Popen(c.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env={**self.env, **self.child_env.get(c.name, {})},
                                      preexec_fn=die_with_parent)
        c.state = "running"

    def start(self) -> None:
        for c in self.children.values():
            self._start(c)

    def poll(self) -> list[str]:
        """Check every child once; restart the crashed ones. Returns this round's events."""
        events = []
        for c in self.children.values():
            if c.state != "running" or (rc := c.proc.poll()) is None:
                continue
            if rc == 0:
                c.state = "done"
                continue
            why = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}"
            if c.restarts >= self.max_restarts:
                c.state = "failed"
                events.append(f"{c.name} crashed ({why}); gave up after {c.restarts} restarts, see {c.log}")
            else:
                c.restarts += 1
                events.append(f"{c.name} crashed ({why}); restart {c.restarts}/{self.max_restarts}")
                self._start(c)
            c.events.append(events[-1])
        return events

    def stop(self, names: list[str] | None = None, timeout: float = 30.0) -> None:
        """SIGTERM every live child (of `names`, default all), then SIGKILL what has not exited
        within `timeout`."""
        live = [c for c in self.children.values() if c.proc and c.proc.poll() is None and (names is None or c.name in names)]
        for c in live:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for c in live:
            try:
                c.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
            c.state = "stopped" if c.state == "running" else c.state

    def summary(self) -> dict:
        return {c.name: {"state": c.state, "restarts": c.restarts, "events": c.events, "log": str(c.log)}
                for c in self.children.values()}

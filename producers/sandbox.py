"""Run untrusted model-written Python in a separate, locked-down process.

Each `Sandbox.run(code)` starts, through `unshare`, a fresh process tree in new mount, network
and PID namespaces:

    unshare --mount --net --pid --fork --mount-proc --kill-child   (as root, our process group)
      sh -c SETUP          hide host directories under empty tmpfs, make / read-only,
                           private tmpfs working directory, write the code there
        prlimit ...        CPU seconds, address space, process count, file size, open files, no core
          setpriv ...      drop to an unprivileged uid (fresh per run), no capabilities, no_new_privs
            python3 -I -S main.py

What is contained, and how (each property has its own test in tests/producers/test_sandbox.py):
- time: a wall-clock timeout kills the whole process group; RLIMIT_CPU backs it up. When the
  namespace's first process dies, the kernel kills every process left in the PID namespace, so
  children that `setsid()` out of the process group die too.
- fork bombs: RLIMIT_NPROC for a uid used by no one else (root would ignore the limit, hence the
  uid switch), plus the PID-namespace kill above.
- memory: RLIMIT_AS per process (`MemoryError`, not the OOM killer). NOT contained: total memory
  of all the processes together, bounded only by `max_procs × max_memory_bytes` (no cgroup).
- disk: RLIMIT_FSIZE per file and a size-capped tmpfs as the only writable place; the rest of
  the file system is mounted read-only.
- reading files: /root, /home, /work, /tmp, /var/tmp, /dev/shm, /run, /mnt, /srv, /opt and the
  producer's own directories are hidden under empty tmpfs, and the code runs as a uid that owns
  nothing. NOT contained: world-readable system files (/etc/passwd, /usr, /proc/cpuinfo, /sys).
- network: a new network namespace with only a downed loopback, so no TCP, UDP or abstract-socket
  reach to the host, the broker or anything else. If the kernel does not allow `unshare`, the
  sandbox refuses to run at all (`SandboxUnavailable`), never falls back to running unisolated.
- environment: none of the producer's variables; only PATH and HOME=/tmp.
- output: stdout and stderr go to one file capped by RLIMIT_FSIZE; the result keeps the first
  `max_output_bytes` of it.

Requires root (to create the namespaces and mounts) and util-linux (`unshare`, `prlimit`,
`setpriv`). The interpreter runs with `-I -S -u`: the standard library only, no site-packages,
unbuffered so stdout and stderr interleave in program order.
"""

from __future__ import annotations

import logging
import os
import random
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

_REPO = Path(__file__).resolve().parents[1]


class SandboxUnavailable(RuntimeError):
    """The kernel or the machine does not allow isolated execution; nothing was run."""


@dataclass(kw_only=True)
class SandboxConfig:
    timeout_s: float = 10.0
    """Wall-clock limit of one run, in seconds."""
    max_memory_bytes: int = 1 << 30
    """Address-space limit (RLIMIT_AS) of each sandboxed process."""
    max_procs: int = 16
    """Most processes the sandbox uid may run at once (RLIMIT_NPROC)."""
    max_file_bytes: int = 16 << 20
    """Largest file the code may write, its output included (RLIMIT_FSIZE)."""
    max_disk_bytes: int = 64 << 20
    """Size of the private tmpfs working directory."""
    max_output_bytes: int = 4096
    """Output kept in the result (and the observation); the rest is cut."""
    max_open_files: int = 64
    """RLIMIT_NOFILE of each sandboxed process."""
    python: str = "/usr/bin/python3"
    """Interpreter run inside the sandbox; must be outside the hidden directories."""
    uid_base: int = 200_000
    """Each run gets a uid in [uid_base, uid_base + 50000) that owns nothing on the host."""
    hide: tuple[str, ...] = ("/root", "/home", "/work", "/tmp", "/var/tmp", "/dev/shm", "/run",
                             "/mnt", "/srv", "/opt")
    """Host directories replaced by an empty tmpfs inside the sandbox (plus the repository)."""
    unshare: str = "/usr/bin/unshare"
    """The util-linux unshare binary."""


@dataclass(kw_only=True)
class SandboxResult:
    exit_code: int | None  # None when killed by a signal
    signal: str | None  # e.g. "SIGKILL"
    output: str  # stdout and stderr interleaved, cut at max_output_bytes
    truncated: bool
    timed_out: bool
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def format_result(res: SandboxResult) -> str:
    """The observation text a model sees after its code ran."""
    lines = [res.output.rstrip("\n")] if res.output.strip() else []
    if res.truncated:
        lines.append("[output truncated]")
    if res.timed_out:
        lines.append(f"[killed: wall-clock timeout after {res.duration_s:.1f}s]")
    elif res.signal:
        lines.append(f"[killed by {res.signal}]")
    elif res.exit_code:
        lines.append(f"[exit code {res.exit_code}]")
    return "\n".join(lines) if lines else "[no output]"


def _setup_script(cfg: SandboxConfig, uid: int, hidden: list[str]) -> str:
    """The shell run as root inside the new namespaces, ending in the unprivileged interpreter."""
    cpu = max(1, int(cfg.timeout_s) + 1)
    q = shlex.quote
    lines = ["set -e", "mount -o remount,bind,ro /"]  # private mount namespace: the host is untouched
    lines += [f"mount -t tmpfs -o size=64k,mode=0755 tmpfs {q(d)}" for d in hidden]
    lines += [f"mount -t tmpfs -o size={cfg.max_disk_bytes},mode=0755,nosuid,nodev tmpfs /tmp",
              "mkdir -m 0700 /tmp/work", "cat > /tmp/work/main.py",
              f"chown -R {uid}:{uid} /tmp/work", "cd /tmp/work",
              # no exec: sh stays PID 1 of the namespace, so the code gets ordinary signal semantics
              f"/usr/bin/prlimit --as={cfg.max_memory_bytes} --cpu={cpu} --nproc={cfg.max_procs}"
              f" --fsize={cfg.max_file_bytes} --nofile={cfg.max_open_files} --core=0"
              f" -- /usr/bin/setpriv --reuid={uid} --regid={uid} --clear-groups --no-new-privs"
              f" --inh-caps=-all --bounding-set=-all -- {q(cfg.python)} -I -S -u main.py"]
    return "\n".join(lines)


class Sandbox:
    """Runs code with the limits of `SandboxConfig`; safe to call from any one thread at a time."""

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        self._hidden = self._hidden_dirs()
        self._probe()

    def _hidden_dirs(self) -> list[str]:
        dirs = {os.path.realpath(d) for d in (*self.cfg.hide, _REPO) if os.path.isdir(d)}
        dirs = {d for d in dirs if not any(d.startswith(p + "/") for p in dirs)}  # parent hides it
        python = os.path.realpath(self.cfg.python)
        for d in dirs:
            if python.startswith(d.rstrip("/") + "/"):
                raise SandboxUnavailable(f"--sandbox.python {self.cfg.python} lies in {d}, which the "
                                         "sandbox hides; point it at an interpreter outside it")
        if not os.access(python, os.X_OK):
            raise SandboxUnavailable(f"--sandbox.python {self.cfg.python} is not an executable")
        return sorted(dirs)

    def _probe(self) -> None:
        """Refuse loudly, up front, when the isolated chain cannot run: one real run of a no-op."""
        try:
            res = self.run("print('sandbox-ok')")
        except OSError as e:
            raise SandboxUnavailable(f"cannot start {self.cfg.unshare}: {e}; refusing to execute "
                                     "model code unisolated") from e
        if res.output.strip() != "sandbox-ok" or not res.ok:
            raise SandboxUnavailable(
                f"the sandbox could not run a no-op ({format_result(res)!r}); this kernel or "
                "container does not allow mount/network/PID namespaces (unshare) for this user, so "
                "the sandbox refuses to execute code rather than run it unisolated")

    def run(self, code: str) -> SandboxResult:
        cfg = self.cfg
        uid = cfg.uid_base + random.randrange(50_000)
        # setpriv --pdeathsig: unshare dies with the calling thread, so a producer killed mid-run
        # leaves nothing behind (--kill-child passes the SIGKILL on to the namespace).
        cmd = ["/usr/bin/setpriv", "--pdeathsig", "KILL", "--", cfg.unshare, "--mount", "--net",
               "--pid", "--fork", "--mount-proc", "--kill-child",
               "--", "/bin/sh", "-c", _setup_script(cfg, uid, self._hidden)]
        with tempfile.TemporaryFile() as out:
            t0 = time.monotonic()
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                                    env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, cwd="/",
                                    start_new_session=True)
            timed_out = False
            try:
                proc.communicate(code.encode(), timeout=cfg.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                if proc.returncode is None:  # timed out, or interrupted: nothing may outlive us
                    _kill_namespace(proc)
            duration = time.monotonic() - t0
            out.seek(0)
            raw = out.read(cfg.max_output_bytes + 1)
        text = raw[:cfg.max_output_bytes].decode(errors="replace")
        rc = proc.returncode
        if timed_out:  # we killed it; unshare's own complaint about that is not the code's output
            text = text.removesuffix("unshare: sigprocmask unblock failed: Invalid argument\n")
            return SandboxResult(exit_code=None, signal="SIGKILL", output=text, truncated=len(raw) >
                                 cfg.max_output_bytes, timed_out=True, duration_s=duration)
        # the namespace's sh reports code killed by signal N as 128 + N
        sig = signal.Signals(rc - 128).name if 128 < rc < 128 + 65 else None
        return SandboxResult(exit_code=None if sig else rc, signal=sig, output=text,
                             truncated=len(raw) > cfg.max_output_bytes, timed_out=False,
                             duration_s=duration)

def _kill_namespace(proc: subprocess.Popen) -> None:
    """SIGKILL the namespace's first process and wait for unshare to reap it.

    The kernel kills every other process of a PID namespace when its first process dies, and that
    process is reaped only once they are all gone, so when `wait` returns nothing is left.
    """
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    try:
        init = [int(p) for p in children.read_text().split()]
    except OSError:
        init = []
    for pid in init:
        os.kill(pid, signal.SIGKILL)
    if not init:  # not forked yet: kill unshare itself; --kill-child covers a late fork
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()

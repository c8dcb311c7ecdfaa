"""Run untrusted model-written Python in a separate, locked-down process.

Each `Sandbox.run(code)` starts, through `unshare`, a fresh process tree in new mount, network
and PID namespaces, inside a cgroup of its own:

    sh: join the run's cgroup (producers/cgroup.py), then exec
    unshare --mount --net --pid --fork --mount-proc --kill-child   (as root)
      sh -c SETUP          build a new root from the allowlist (read-only binds), a private tmpfs
                           /tmp, the namespace's /proc, four /dev nodes; write the code there
        chroot ROOT sh     cd /tmp/work, then
          prlimit ...      CPU seconds, address space, process count, file size, open files, no core
            setpriv ...    drop to an unprivileged uid (fresh per run), no capabilities, no_new_privs
              python3 -I -S main.py

What is contained, and how (each property has its own test in tests/producers/test_sandbox.py):
- reading files: the code's root file system holds only `allow` (by default the interpreter, its
  standard library and shared libraries: /usr/bin, /usr/lib, /usr/lib64 and the /bin, /lib,
  /lib64 links, plus /etc/ld.so.cache), read-only, and an empty private /tmp. Everything else
  (/etc, /root, /home, /var, /srv, /opt, a weights volume, any folder made after this was written)
  does not exist there. NOT contained: whatever world-readable files lie in the allowed trees,
  and /proc of its own PID namespace (CPU and memory totals of the host, its own processes only).
- memory: the run's processes together get at most `max_total_memory_bytes` (cgroup; the OOM
  killer stops them inside the group and the host keeps its memory), and each process at most
  `max_memory_bytes` of address space (`MemoryError` rather than the OOM killer for one big
  allocation). Swap is not counted on hosts without swap accounting.
- CPU: the run's processes together get `max_cpus` CPUs (cgroup quota); RLIMIT_CPU per process.
- time: a wall-clock timeout kills the whole process group; RLIMIT_CPU backs it up. When the
  namespace's first process dies, the kernel kills every process left in the PID namespace, so
  children that `setsid()` out of the process group die too.
- fork bombs: the cgroup's pids limit, RLIMIT_NPROC for a uid used by no other run (root would
  ignore the limit, hence the uid switch), and the PID-namespace kill above.
- disk: RLIMIT_FSIZE per file and a size-capped tmpfs as the only writable place.
- network: a new network namespace with only a downed loopback, so no TCP, UDP or abstract-socket
  reach to the host, the broker or anything else.
- environment: none of the producer's variables; only PATH and HOME=/tmp.
- output: stdout and stderr go to one file capped by RLIMIT_FSIZE; the result keeps the first
  `max_output_bytes` of it.
- other runs: runs may go on at once (a producer's episodes in flight); each has its own
  namespaces, root, /tmp, uid and cgroup, so they cannot see, signal or starve each other.

If the kernel does not allow `unshare`, or no cgroup (v2, else v1) with memory, cpu and pids can be
made, the sandbox refuses to run at all (`SandboxUnavailable`), never falls back to running
unisolated; `--sandbox.cgroup off` is the explicit opt-out of the cgroup (per-process limits only).
Requires root (namespaces, mounts, cgroups) and util-linux (`unshare`, `prlimit`, `setpriv`). The
interpreter runs with `-I -S -u`: the standard library only, no site-packages, unbuffered so
stdout and stderr interleave in program order.
"""

from __future__ import annotations

import itertools
import logging
import os
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from producers.cgroup import CgroupUnavailable, RunGroup, parents

log = logging.getLogger(__name__)

_DEVICES = ("null", "zero", "random", "urandom")


class SandboxUnavailable(RuntimeError):
    """The kernel or the machine does not allow isolated execution; nothing was run."""


@dataclass(kw_only=True)
class SandboxConfig:
    timeout_s: float = 10.0
    """Wall-clock limit of one run, in seconds."""
    max_memory_bytes: int = 1 << 30
    """Address-space limit (RLIMIT_AS) of each sandboxed process."""
    max_total_memory_bytes: int = 1 << 30
    """Memory of all the run's processes together (cgroup)."""
    max_cpus: float = 1.0
    """CPUs the run's processes may use together (cgroup quota)."""
    cgroup: Literal["auto", "v2", "v1", "off"] = "auto"
    """cgroup version for the run's total memory/CPU bound: auto (v2, else v1), or off to opt out
    explicitly (then memory is bounded only per process)."""
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
    """Interpreter run inside the sandbox; must lie in the allowlist."""
    uid_base: int = 200_000
    """Each run gets a uid in [uid_base, uid_base + 50000) that owns nothing on the host."""
    allow: tuple[str, ...] = ("/usr/bin", "/usr/lib", "/usr/lib64", "/bin", "/lib", "/lib64",
                              "/etc/ld.so.cache")
    """The only host paths in the code's root (read-only; missing ones are skipped)."""
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
    peak_memory_bytes: int | None = None  # of all its processes together (None: no cgroup)
    oom_kills: int = 0  # processes stopped by the total memory bound

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
    if res.oom_kills:
        lines.append(f"[memory limit: {res.oom_kills} process(es) killed]")
    elif res.exit_code:
        lines.append(f"[exit code {res.exit_code}]")
    return "\n".join(lines) if lines else "[no output]"


def _root_lines(allow: list[str]) -> list[str]:
    """Shell that builds the code's root at $R from the allowlist: links as links, the rest bound
    read-only."""
    q, lines = shlex.quote, []
    for path in allow:
        dest = '"$R"' + q(path)  # $R expands, the path stays quoted
        lines.append(f'mkdir -p "$R"{q(os.path.dirname(path))}')
        if os.path.islink(path):
            lines.append(f"ln -s {q(os.readlink(path))} {dest}")
            continue
        lines.append(f"mkdir -p {dest}" if os.path.isdir(path) else f"touch {dest}")
        lines.append(f"mount --bind {q(path)} {dest} && mount -o remount,bind,ro,nosuid,nodev {dest}")
    return lines


def _setup_script(cfg: SandboxConfig, uid: int, allow: list[str], program: str | None = None,
                  cpu_s: float | None = None) -> str:
    """The shell run as root inside the new namespaces, ending in the unprivileged interpreter
    running `main.py`: the code read from stdin, or `program` (stdin is then the program's own)."""
    cpu = max(1, int(cpu_s or cfg.timeout_s) + 1)
    q = shlex.quote
    write = "cat > $R/tmp/work/main.py" if program is None else f"printf %s {q(program)} > $R/tmp/work/main.py"
    lines = ["set -e", "mount -t tmpfs -o size=64k,mode=0700 tmpfs /mnt",  # private mount namespace
             "R=/mnt/root", "mkdir $R", "mount -t tmpfs -o size=1m,mode=0755 tmpfs $R"]
    lines += _root_lines(allow)
    lines += ["mkdir $R/dev $R/proc $R/tmp"]
    lines += [f"touch $R/dev/{d} && mount --bind /dev/{d} $R/dev/{d}" for d in _DEVICES]
    lines += ["mount -t proc -o nosuid,nodev,noexec proc $R/proc",  # this PID namespace's
              f"mount -t tmpfs -o size={cfg.max_disk_bytes},mode=0755,nosuid,nodev tmpfs $R/tmp",
              "mkdir -m 0700 $R/tmp/work", write, f"chown -R {uid}:{uid} $R/tmp/work",
              "mount -o remount,ro $R",
              # no exec: sh stays PID 1 of the namespace, so the code gets ordinary signal semantics
              "/usr/sbin/chroot $R /bin/sh -c " + q(
                  f"cd /tmp/work && exec /usr/bin/prlimit --as={cfg.max_memory_bytes} --cpu={cpu}"
                  f" --nproc={cfg.max_procs} --fsize={cfg.max_file_bytes} --nofile={cfg.max_open_files}"
                  f" --core=0 -- /usr/bin/setpriv --reuid={uid} --regid={uid} --clear-groups"
                  f" --no-new-privs --inh-caps=-all --bounding-set=-all -- {q(cfg.python)} -I -S -u main.py")]
    return "\n".join(lines)


class Sandbox:
    """Runs code with the limits of `SandboxConfig`; safe to call from many threads at once."""

    def __init__(self, cfg: SandboxConfig | None = None):
        self.cfg = cfg or SandboxConfig()
        self._allow = self._allowed()
        self._uids = itertools.count(os.getpid() * 7919)  # distinct per run of this process
        self._cgroups = None if self.cfg.cgroup == "off" else self._cgroup_parents()
        self._probe()

    def _allowed(self) -> list[str]:
        allow = [p for p in self.cfg.allow if os.path.lexists(p)]
        python = os.path.realpath(self.cfg.python)
        real = [os.path.realpath(p) for p in allow]
        if not any(python == r or python.startswith(r.rstrip("/") + "/") for r in real):
            raise SandboxUnavailable(f"--sandbox.python {self.cfg.python} lies outside the sandbox's "
                                     f"allowlist {allow}; point it at an interpreter inside it")
        if not os.access(python, os.X_OK):
            raise SandboxUnavailable(f"--sandbox.python {self.cfg.python} is not an executable")
        return allow

    def _cgroup_parents(self):
        try:
            return parents(self.cfg.cgroup)
        except (CgroupUnavailable, OSError) as e:
            raise SandboxUnavailable(f"{e}: the sandbox cannot bound a run's total memory and CPU, so it "
                                     "refuses to execute code; run as root on a host with cgroups, or "
                                     "opt out explicitly with --sandbox.cgroup off") from e

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

    def command(self, program: str | None = None, cpu_s: float | None = None) -> tuple[list[str], RunGroup | None]:
        """The command line of one isolated interpreter (module docstring) and its cgroup (None
        with `--sandbox.cgroup off`), which the caller closes once the process is gone."""
        cfg = self.cfg
        uid = cfg.uid_base + next(self._uids) % 50_000
        # setpriv --pdeathsig: unshare dies with the thread that started it, so a producer killed
        # mid-run leaves nothing behind (--kill-child passes the SIGKILL on to the namespace).
        cmd = ["/usr/bin/setpriv", "--pdeathsig", "KILL", "--", cfg.unshare, "--mount", "--net",
               "--pid", "--fork", "--mount-proc", "--kill-child",
               "--", "/bin/sh", "-c", _setup_script(cfg, uid, self._allow, program, cpu_s)]
        group = None
        if self._cgroups is not None:
            group = RunGroup.create(*self._cgroups, memory_bytes=cfg.max_total_memory_bytes,
                                    cpus=cfg.max_cpus, pids=cfg.max_procs + 8)  # + the setup's own
            cmd = ["/bin/sh", "-c", group.join_script(), "sh", *cmd]
        return cmd, group

    def run(self, code: str) -> SandboxResult:
        cmd, group = self.command()
        try:
            res = self._execute(cmd, code)
            if group is not None:
                res.peak_memory_bytes, res.oom_kills = group.peak_memory(), group.oom_kills()
            return res
        finally:
            if group is not None:
                group.close()

    def _execute(self, cmd: list[str], code: str) -> SandboxResult:
        cfg = self.cfg
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
                    kill_namespace(proc)
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

def kill_namespace(proc: subprocess.Popen) -> None:
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

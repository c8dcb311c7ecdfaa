"""A cgroup per sandbox run: its processes together get at most `memory_bytes` of memory (the
OOM killer stops them inside the group, not on the host) and `cpus` CPUs, `pids` processes.

Works with whichever the host offers: cgroup v2 (one unified hierarchy whose `cgroup.controllers`
lists memory, cpu and pids) or cgroup v1 (one hierarchy per controller, each mounted on its own).
The run's group is created under this process's own group of each hierarchy, so the host's limits
on us still apply above it. A process joins by writing its pid into `cgroup.procs` before it
starts the sandboxed code (`join_script`), so everything the code forks is inside from the start.

A process killed by SIGKILL cannot remove its groups; the next one to create a group removes
those of owners no longer alive (`sweep`), and a random part in each name keeps a reused pid from
meeting a group its earlier owner left.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CONTROLLERS = ("memory", "cpu", "pids")
_PERIOD_US = 100_000
_PREFIX = "sao-sandbox-"


class CgroupUnavailable(RuntimeError):
    """Neither a usable cgroup v2 nor v1 hierarchy with memory, cpu and pids."""


def _own_path(controller: str) -> str:
    """This process's group in `controller`'s v1 hierarchy, or in the unified one ("" key)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            return path
    raise CgroupUnavailable(f"this process is in no {controller or 'cgroup v2'} group")


def _mounts(fstype: str) -> list[tuple[Path, set[str]]]:
    out = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, where, kind, options, *_ = line.split()
        if kind == fstype:
            out.append((Path(where), set(options.split(","))))
    return out


def _under(mount: Path, own: str) -> Path:
    """Our group's directory in `mount`; its root when the mount shows a cgroup namespace's view."""
    path = mount / own.lstrip("/")
    return path if path.is_dir() else mount


def parents(version: str = "auto") -> tuple[str, dict[str, Path]]:
    """("v2", {"": dir}) or ("v1", {controller: dir}): where this host lets us make run groups."""
    if version in ("auto", "v2"):
        for mount, _ in _mounts("cgroup2"):
            base = _under(mount, _own_path(""))
            if _delegates(base):
                return "v2", {"": base}
        if version == "v2":
            raise CgroupUnavailable("no cgroup v2 group of this process delegates memory, cpu and pids")
    found = {}
    for mount, options in _mounts("cgroup"):
        for c in CONTROLLERS:
            if c in options:
                found[c] = _under(mount, _own_path(c))
    missing = [c for c in CONTROLLERS if c not in found or not os.access(found[c], os.W_OK)]
    if missing:
        raise CgroupUnavailable(f"no writable cgroup (v2, or v1 {', '.join(missing)}) for this process")
    return "v1", found


def _delegates(base: Path) -> bool:
    """Whether run groups made under v2 group `base` get memory, cpu and pids: enabled in its
    `cgroup.subtree_control` already, or enabled now (refused while processes live in `base`
    itself, v2's no-internal-processes rule)."""
    control = base / "cgroup.subtree_control"
    try:
        if not set(CONTROLLERS) <= set(control.read_text().split()):
            control.write_text(" ".join(f"+{c}" for c in CONTROLLERS))
        return set(CONTROLLERS) <= set(control.read_text().split())
    except OSError:
        return False


@dataclass(kw_only=True)
class RunGroup:
    """One run's group, in every hierarchy it needs; `close` removes it."""

    version: str
    dirs: list[Path]

    @classmethod
    def create(cls, version: str, bases: dict[str, Path], *, memory_bytes: int, cpus: float,
               pids: int) -> RunGroup:
        name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        for base in bases.values():
            sweep(base)
        quota = max(1000, int(cpus * _PERIOD_US))
        if version == "v2":
            d = bases[""] / name
            d.mkdir()
            group = cls(version=version, dirs=[d])
            _write(d, {"memory.max": memory_bytes, "memory.swap.max": 0, "memory.oom.group": 1,
                       "cpu.max": f"{quota} {_PERIOD_US}", "pids.max": pids})
            return group
        group = cls(version=version, dirs=[])
        for controller, settings in (
                ("memory", {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes}),
                ("cpu", {"cpu.cfs_period_us": _PERIOD_US, "cpu.cfs_quota_us": quota}),
                ("pids", {"pids.max": pids})):
            d = bases[controller] / name
            d.mkdir()
            group.dirs.append(d)
            _write(d, settings)
        return group

    def join_script(self) -> str:
        """Shell that moves itself into the group, then execs its arguments."""
        files = " ".join(shlex.quote(str(d / "cgroup.procs")) for d in self.dirs)
        return f'echo $$ | tee {files} >/dev/null && exec "$@"'

    def _memory_dir(self) -> Path:
        return self.dirs[0]  # v2: the one group; v1: memory comes first

    def peak_memory(self) -> int:
        """Most memory the run's processes held at once, in bytes."""
        d = self._memory_dir()
        return int(_read(d, "memory.peak" if self.version == "v2" else "memory.max_usage_in_bytes") or 0)

    def oom_kills(self) -> int:
        """Processes the OOM killer stopped inside the group."""
        d = self._memory_dir()
        text = _read(d, "memory.events" if self.version == "v2" else "memory.oom_control") or ""
        counts = dict(line.split() for line in text.splitlines() if line.count(" ") == 1)
        return int(counts.get("oom_kill", 0))

    def close(self) -> None:
        """Kill anything left, then remove the group (a dying process holds it a moment)."""
        for d in self.dirs:
            for pid in (_read(d, "cgroup.procs") or "").split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for _ in range(100):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY until the last process is reaped
                    time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(base: Path, min_age_s: float = 60.0) -> list[Path]:
    """Remove the empty run groups under `base` whose owner is dead (killed before it could close
    them), older than `min_age_s` (a group's owner in another pid namespace may look dead here; the
    age leaves its run the time to join). A group still holding a process is left: rmdir refuses it."""
    removed = []
    for d in base.glob(f"{_PREFIX}*"):
        try:
            owner = int(d.name[len(_PREFIX):].split("-", 1)[0])
            if _alive(owner) or time.time() - d.stat().st_mtime < min_age_s:
                continue
            d.rmdir()
        except (ValueError, OSError):  # not ours, gone meanwhile, or busy
            continue
        removed.append(d)
    return removed


def _write(d: Path, settings: dict) -> None:
    for name, value in settings.items():
        if (d / name).exists():  # e.g. memsw only with swap accounting, memory.peak on newer kernels
            (d / name).write_text(str(value))


def _read(d: Path, name: str) -> str | None:
    try:
        return (d / name).read_text()
    except OSError:
        return None

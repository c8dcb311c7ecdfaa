"""Files written whole or not at all (the one write-to-a-temporary-name-then-rename of the project),
and the numbered files and folders the stores keep."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path


def atomic_file(path: Path, write: Callable[[Path], None] | bytes, *, mode: int | None = None,
                durable: bool = True) -> int:
    """Write `path` whole or not at all: `write(tmp)` (or the bytes given) to a temporary name
    beside it, created with `mode` if given (0o600 for a secret: it is never readable by others,
    not even for an instant), fsynced unless not `durable`, then renamed over `path` (the rename fsynced too). A crash leaves
    the old file or the new one, never half of one. Returns the file's size."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    if mode is not None:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode))
    if isinstance(write, bytes):
        tmp.write_bytes(write)
    else:
        write(tmp)
    if durable:
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    size = tmp.stat().st_size
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)  # the rename itself must survive a crash
    return size


def fsync_dir(path: Path) -> None:
    """Make the entries of folder `path` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def numbered(root: Path, pattern: str) -> list[tuple[int, Path]]:
    """(number, path) of each entry of `root` whose name matches `pattern` whole (its group 1 the
    number), in order of number."""
    rx = re.compile(pattern)
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := rx.fullmatch(p.name)))

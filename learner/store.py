"""Durable files of the learner: the weight store producers load from, and training checkpoints.

Both write atomically (temporary file, fsync, rename, fsync of the folder), so a reader or a
restart sees a whole file or none, and both keep only the last K. Checkpoints are written off the
training thread.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils._pytree import tree_map

from schemas.messages import Weights


def atomic_file(path: Path, write: Callable[[Path], None]) -> tuple[str, int]:
    """`write(tmp)` then fsync and rename over `path`; returns the file's (sha256, size)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    with open(tmp, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()  # from the page cache: cheap
        os.fsync(f.fileno())
    size = tmp.stat().st_size
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself must survive a crash
    finally:
        os.close(dir_fd)
    return digest, size


def _numbered(root: Path, pattern: str) -> list[tuple[int, Path]]:
    rx = re.compile(pattern)
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := rx.fullmatch(p.name)))


class WeightStore:
    """`v{version:08d}.safetensors` files of the policy's full state dict (transformers names)."""

    def __init__(self, root: Path, keep: int = 3):
        self.root, self.keep = Path(root), keep
        self.root.mkdir(parents=True, exist_ok=True)

    def save(self, state: dict[str, torch.Tensor], version: int, step: int) -> Weights:
        """Write version `version` and return its announcement (uri, sha256, size, dtype)."""
        seen, tensors = set(), {}
        for name, t in state.items():
            t = t.detach().contiguous()
            if t.data_ptr() in seen:  # tied weights share storage; safetensors wants each once
                t = t.clone()
            seen.add(t.data_ptr())
            tensors[name] = t
        path = self.root / f"v{version:08d}.safetensors"
        sha256, num_bytes = atomic_file(path, lambda tmp: save_file(tensors, tmp))
        self._prune()
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
        return Weights(version=version, step=step, uri=path.resolve().as_uri(),
                       sha256=sha256, num_bytes=num_bytes,
                       dtype=",".join(dtypes))

    def _prune(self) -> None:
        for _, path in _numbered(self.root, r"v(\d+)\.safetensors")[:-self.keep]:
            path.unlink(missing_ok=True)


class Checkpointer:
    """`step{N:08d}.pt` files holding everything a restart needs; it owns the save interval.

    `save` snapshots the state (a copy of every tensor, so training may go on mutating the
    originals) and writes it in a background thread; `then` runs once the file is durable, which
    is where the caller commits Kafka offsets. One write is in flight at a time; `wait` joins it.
    Loaded with `weights_only=True`: tensors and plain containers only, nothing else unpickled.
    """

    def __init__(self, root: Path, every: int = 1, keep: int = 2):
        self.root, self.every, self.keep = Path(root), every, keep
        self.root.mkdir(parents=True, exist_ok=True)
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: dict, then: Callable[[], None] = lambda: None) -> None:
        snapshot = tree_map(lambda x: x.detach().clone() if isinstance(x, torch.Tensor) else x, state)
        self.wait()
        self._writer = threading.Thread(target=self._write, args=(step, snapshot, then),
                                        name="checkpoint-writer")
        self._writer.start()

    def _write(self, step: int, state: dict, then: Callable[[], None]) -> None:
        try:
            atomic_file(self.root / f"step{step:08d}.pt", lambda tmp: torch.save(state, tmp))
            for _, old in _numbered(self.root, r"step(\d+)\.pt")[:-self.keep]:
                old.unlink(missing_ok=True)
            then()
        except BaseException as e:  # re-raised in the training thread by the next wait()
            self._error = e

    def wait(self) -> None:
        """Block until the write in flight is durable; raise if it failed."""
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError("checkpoint write failed") from error

    def latest(self) -> dict | None:
        found = _numbered(self.root, r"step(\d+)\.pt")
        return torch.load(found[-1][1], weights_only=True) if found else None

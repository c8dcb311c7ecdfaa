"""Durable files of the learner: the weight store producers load from, and training checkpoints.

Both write atomically (temporary file, fsync, rename, fsync of the folder), so a reader or a
restart sees a whole file or none, and both keep only the last K.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save as safetensors_bytes

from schemas.messages import Weights


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself must survive a crash
    finally:
        os.close(dir_fd)


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
        data = safetensors_bytes(tensors)
        path = self.root / f"v{version:08d}.safetensors"
        atomic_write(path, data)
        self._prune()
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
        return Weights(version=version, step=step, uri=path.resolve().as_uri(),
                       sha256=hashlib.sha256(data).hexdigest(), num_bytes=len(data),
                       dtype=",".join(dtypes))

    def _prune(self) -> None:
        for _, path in _numbered(self.root, r"v(\d+)\.safetensors")[:-self.keep]:
            path.unlink(missing_ok=True)


class Checkpointer:
    """`step{N:08d}.pt` files holding everything a restart needs; it owns the save interval.

    Loaded with `weights_only=True`: tensors and plain containers only, nothing else unpickled.
    """

    def __init__(self, root: Path, every: int = 1, keep: int = 2):
        self.root, self.every, self.keep = Path(root), every, keep
        self.root.mkdir(parents=True, exist_ok=True)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: dict) -> Path:
        buf = io.BytesIO()
        torch.save(state, buf)
        path = self.root / f"step{step:08d}.pt"
        atomic_write(path, buf.getvalue())
        for _, old in _numbered(self.root, r"step(\d+)\.pt")[:-self.keep]:
            old.unlink(missing_ok=True)
        return path

    def latest(self) -> dict | None:
        found = _numbered(self.root, r"step(\d+)\.pt")
        return torch.load(found[-1][1], weights_only=True) if found else None

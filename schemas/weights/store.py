"""The weight store: the payload files producers load from, written by the publisher's thread.

Each write is atomic (temporary file, fsync, rename, fsync of the parent), so a reader sees a whole
payload or none; the last K anchors and the chains after them are kept.
"""

from __future__ import annotations

import json
from pathlib import Path

from schemas.files import atomic_file, numbered
from schemas.weights.payload import Payload


class WeightStore:
    """Payload files of the policy: `v{version:08d}.safetensors` anchors and
    `v{version:08d}.delta.safetensors` deltas (updates small enough travel inline and have none).
    Keeps the last `keep` anchors and every file after the oldest of them, so a late producer
    finds an anchor and the chain after it."""

    def __init__(self, root: Path, keep: int = 3):
        self.root, self.keep = Path(root), keep
        self.root.mkdir(parents=True, exist_ok=True)

    def save(self, version: int, payload: Payload) -> Path:
        """Write `payload` as version `version`, atomically; returns its path."""
        path = self.root / f"v{version:08d}{'' if payload.base < 0 else '.delta'}.safetensors"

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                payload.write(f)

        atomic_file(path, write)
        self._prune()
        return path

    def newest(self) -> int:
        """The highest version in the store, -1 if it holds none."""
        found = self._versions()
        return found[-1][0] if found else -1

    def describe(self, config, model: str, lora=None) -> None:
        """Write what producers started with `--model learner` build before loading a version:
        `config.json` (the architecture) and `model.json` (the `--model.name` whose tokenizer
        they load, and the LoRA rank and alpha `sao export` writes an adapter with). Written at
        every start, so the store always describes the model it holds. The weights are plain
        float32/bf16 tensors, so a GGUF source's quantization_config is left out."""
        fields = {k: v for k, v in json.loads(config.to_json_string()).items() if k != "quantization_config"}
        described = {"name": model} | ({"lora": {"rank": lora.rank, "alpha": lora.alpha}} if lora else {})
        atomic_file(self.root / "config.json", lambda tmp: tmp.write_text(json.dumps(fields, indent=2)))
        atomic_file(self.root / "model.json", lambda tmp: tmp.write_text(json.dumps(described)))

    def _versions(self) -> list[tuple[int, Path]]:
        return numbered(self.root, r"v(\d+)(?:\.delta)?\.safetensors")

    def _prune(self) -> None:
        anchors = numbered(self.root, r"v(\d+)\.safetensors")
        if len(anchors) > self.keep:
            oldest_kept = anchors[-self.keep][0]
            for version, path in self._versions():
                if version < oldest_kept:
                    path.unlink(missing_ok=True)

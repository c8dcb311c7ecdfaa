"""Test helpers: publish weights the way the learner does (safetensors file + announcement)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from schemas import topics as T
from schemas.kafka import KafkaConfig, make_producer, produce
from schemas.messages import Weights


def write_weights(model: torch.nn.Module, path: Path) -> Path:
    """The model's full state dict (HF names) as one safetensors file."""
    save_file({k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}, str(path))
    return path


def announcement(path: Path, version: int, *, sha256: str | None = None) -> Weights:
    data = path.read_bytes()
    return Weights(version=version, step=version, uri=path.resolve().as_uri(),
                   sha256=sha256 or hashlib.sha256(data).hexdigest(), num_bytes=len(data))


def publish(kafka: KafkaConfig, w: Weights | bytes) -> float:
    """Announce on the weights topic; returns the time it was acknowledged."""
    producer = make_producer(kafka)
    value = w if isinstance(w, bytes) else w.encode()
    produce(producer, kafka.topic(T.WEIGHTS), value, key=b"w")
    assert producer.flush(30) == 0
    return time.time()


def wait_until(predicate, timeout: float = 30.0, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(every)

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


def read_topic(kafka: KafkaConfig, topic: T.Topic, n: int, timeout: float = 60.0, until=None) -> list:
    """The first n decoded messages of a topic (all partitions), read by a throwaway group;
    with `until`, read until `until(messages)` holds instead."""
    import uuid

    from schemas.kafka import make_consumer
    from schemas.messages import decode

    consumer = make_consumer(kafka, f"test-read-{uuid.uuid4().hex}")
    consumer.subscribe([kafka.topic(topic)])
    out, deadline = [], time.monotonic() + timeout
    try:
        while not (until(out) if until else len(out) >= n) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                out.append(decode(msg.value()))
    finally:
        consumer.close()
    return out


def publish_prompts(kafka: KafkaConfig, values: list) -> None:
    """Publish prompts (or raw bytes) to the prompts topic and wait for the acks."""
    producer = make_producer(kafka)
    for v in values:
        if isinstance(v, bytes):
            produce(producer, kafka.topic(T.PROMPTS), v, key=b"raw")
        else:
            produce(producer, kafka.topic(T.PROMPTS), v.encode(), key=v.key)
    assert producer.flush(30) == 0

"""Test helpers: publish weights the way the learner does (safetensors file + announcement),
prompts, read topics, and run `sao producer` as a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import torch

from schemas import topics as T
from schemas import weights as W
from schemas.kafka import KafkaConfig, make_producer, produce
from schemas.messages import Prompt, Weights

REPO = Path(__file__).resolve().parents[2]


def state_of(model: torch.nn.Module) -> W.State:
    """The model's full state dict (HF names) as the learner publishes it, in its own dtype."""
    return {k: W.from_torch(v.detach().clone()) for k, v in model.state_dict().items()}


def write_weights(model: torch.nn.Module, path: Path) -> Path:
    """The model's state as an anchor payload file (a safetensors file any reader opens)."""
    with open(path, "wb") as f:
        W.anchor(state_of(model)).write(f)
    return path


def announcement(path: Path, version: int, *, digest: str | None = None) -> Weights:
    """The announcement of the anchor file at `path`, as the learner makes it."""
    payload, views = W.decode(path.read_bytes())
    return Weights(version=version, step=version, uri=path.resolve().as_uri(), dtype="float32",
                   digest=digest or W.digest(W.apply(payload, views, None)), num_bytes=path.stat().st_size)


def full_forward_logprobs(model, tokens, n_new, temperature):
    """log_softmax(logits / T) of each generated token, from one uncached forward."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    steps = logits[len(tokens) - n_new - 1:-1] / temperature
    return torch.log_softmax(steps, -1).gather(-1, torch.tensor(tokens[-n_new:])[:, None])[:, 0]


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


def make_prompts(env: str, tasks: list[dict]) -> list[Prompt]:
    return [Prompt(id=f"p{i}-{uuid.uuid4().hex[:6]}", env=env, task=t) for i, t in enumerate(tasks)]


def publish_prompts(kafka: KafkaConfig, values: list) -> list[tuple[int, int]]:
    """Publish prompts (or raw bytes) to the prompts topic, wait for the acks, and return each
    one's (partition, offset)."""
    producer = make_producer(kafka)
    where: dict[int, tuple[int, int]] = {}
    for i, v in enumerate(values):
        def acked(err, msg, i=i):
            assert err is None, err
            where[i] = (msg.partition(), msg.offset())
        if isinstance(v, bytes):
            produce(producer, kafka.topic(T.PROMPTS), v, key=b"raw", on_delivery=acked)
        else:
            produce(producer, kafka.topic(T.PROMPTS), v.encode(), key=v.key, on_delivery=acked)
    assert producer.flush(30) == 0
    return [where[i] for i in range(len(values))]


class Proc:
    """A `sao producer` child process whose log lines are collected as they come."""

    def __init__(self, kafka_cfg, name: str, *args: str):
        env = {**os.environ, "SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap,
               "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix, "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen([sys.executable, "-m", "sao", "producer", "--producer-id", name, *args],
                                  cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.p.stderr), daemon=True).start()

    def started(self) -> list[str]:
        if self.p.poll() not in (None, 0, -signal.SIGKILL):
            raise RuntimeError(f"producer exited {self.p.returncode}:\n{''.join(self.lines[-30:])}")
        return [line.split("prompt ")[1].split()[0] for line in self.lines if "episode start" in line]

    def stop(self, sig=signal.SIGTERM, timeout=60) -> int:
        self.p.send_signal(sig)
        return self.p.wait(timeout)

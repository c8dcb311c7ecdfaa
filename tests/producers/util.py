"""Helpers of the producer tests: weights published the way the learner does (a safetensors file
and its announcement), prompts, and reference log-probs; the Kafka and child-process helpers are
tests/kafka_util.py's."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import torch

from schemas import topics as T
from schemas.kafka import KafkaConfig
from schemas.messages import Prompt, Weights
from schemas.weights import payload as W
from tests.kafka_util import REPO, producer_process, publish, read_topic, wait_until  # noqa: F401 (re-exported)


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


def announce(kafka: KafkaConfig, w: Weights | bytes) -> float:
    """Announce on the weights topic; returns the time it was acknowledged."""
    publish(kafka, T.WEIGHTS, [w], key=b"w")
    return time.time()


def make_prompts(env: str, tasks: list[dict]) -> list[Prompt]:
    return [Prompt(id=f"p{i}-{uuid.uuid4().hex[:6]}", env=env, task=t) for i, t in enumerate(tasks)]


def publish_prompts(kafka: KafkaConfig, values: list) -> list[tuple[int, int]]:
    """Publish prompts (or raw bytes) to the prompts topic, wait for the acks, and return each
    one's (partition, offset)."""
    return publish(kafka, T.PROMPTS, values, key=b"raw")



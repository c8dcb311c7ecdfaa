"""`sao feed`: publish prompts to `sao.prompts` with backpressure.

Prompts come from a JSONL file (one object per line: `{"task": {...}}`, optionally with `id` and
`env`, or a bare task map) or from the environment's own task generator. A file row keeps one
prompt id across epochs (its `id`, else `<file name>:<line>`), so per-prompt baselines see its
history; each epoch is a new `attempt`, so its rollouts are new trajectories, not duplicates.
`--group-size G` publishes every prompt G times (samples 0..G-1 of one group) for the group
baselines (grpo, grpo_dis), which the learner trains only as whole groups. The feeder keeps the
number of unfinished prompts (published, not yet committed by the producers' group) at or below
`max_unfinished`, so prompts wait in the feeder rather than pile up in the topic while producers
are slow or absent:

    unfinished = Σ over partitions (high watermark − committed offset of group `sao-producers`)

with a partition the group never committed counted from its low watermark. A bad JSONL line is
logged, counted and skipped.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import TopicPartition

from producers.envs import ENVS, make_env
from producers.retry import retrying
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import FatalKafkaError, KafkaConfig, ensure_topics, make_consumer, make_producer, produce
from schemas.messages import Prompt
from schemas.process import stop_on_signals

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class FeedConfig:
    env: str = "toy-target"
    """Environment of the prompts (and their generator when no --jsonl is given)."""
    jsonl: str = ""
    """JSONL file of prompts; empty: sample tasks from the environment."""
    count: int = 0
    """Prompt messages to publish in all (0: every epoch of the file, or forever from the generator)."""
    epochs: int = 1
    """Passes over the JSONL file."""
    group_size: int = 1
    """Rollouts per prompt: G >= 2 for the group baselines, 1 for SAO (one rollout per prompt)."""
    max_unfinished: int = 64
    """Most prompts published but not yet finished by the producers."""
    group: str = "sao-producers"
    """Consumer group whose committed offsets mark prompts finished."""
    seed: int = 0
    """Seed of the task generator."""
    poll_s: float = 0.5
    """Seconds between backpressure checks while the bound is reached."""
    wait_done: bool = False
    """After the last prompt, wait until every prompt is finished."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        if self.env not in ENVS:
            raise ConfigError(f"--env {self.env!r}: unknown; known: {sorted(ENVS)}")
        for name in ("max_unfinished", "epochs", "group_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


def unfinished(high: Mapping[int, int], low: Mapping[int, int], committed: Mapping[int, int]) -> int:
    """Prompts published but not committed, over partitions; a negative committed offset means
    the group never committed there."""
    return sum(h - max(committed.get(p, -1), low.get(p, 0)) for p, h in high.items())


def prompts_from_jsonl(path: Path, env: str, errors: list[str]) -> Iterator[Prompt]:
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                task = obj.get("task", obj) if isinstance(obj, dict) else None
                if not isinstance(task, dict):
                    raise ValueError("expected a JSON object (a task, or {\"task\": {...}})")
                yield Prompt(id=str(obj.get("id") or f"{path.name}:{n}"), env=obj.get("env", env), task=task)
            except ValueError as e:
                errors.append(f"{path}:{n}: {e}")
                log.error("skipping %s:%d: %s", path, n, e)


def prompts_from_env(env_name: str, seed: int) -> Iterator[Prompt]:
    env, rng = make_env(env_name), random.Random(seed)
    while True:
        yield Prompt(id=f"{env_name}-{uuid.uuid4().hex}", env=env_name, task=env.sample_task(rng))


def fan_out(prompts: Iterator[Prompt], group_size: int) -> Iterator[Prompt]:
    """Each prompt as the `group_size` samples of one group."""
    for p in prompts:
        for sample in range(group_size):
            yield dataclasses.replace(p, sample=sample, group_size=group_size)


class Backlog:
    """Reads the unfinished count of one group on the prompts topic."""

    def __init__(self, kafka: KafkaConfig, group: str):
        self.topic = kafka.topic(T.PROMPTS)
        self.consumer = make_consumer(kafka, group)  # never subscribes: reads the group's commits only
        parts = self.consumer.list_topics(self.topic, timeout=30).topics[self.topic].partitions
        self.tps = [TopicPartition(self.topic, p) for p in sorted(parts)]

    def count(self) -> int:
        marks = {tp.partition: retrying(lambda: self.consumer.get_watermark_offsets(tp, timeout=5, cached=False))
                 for tp in self.tps}
        committed = {tp.partition: tp.offset
                     for tp in retrying(lambda: self.consumer.committed(self.tps, timeout=10))}
        return unfinished({p: h for p, (_, h) in marks.items()}, {p: lo for p, (lo, _) in marks.items()},
                          committed)

    def close(self) -> None:
        self.consumer.close()


def run(cfg: FeedConfig, stop: threading.Event | None = None) -> int:
    """Publish prompts; returns how many were published."""
    stop = stop_on_signals(stop)
    ensure_topics(cfg.kafka)
    errors: list[str] = []
    if cfg.jsonl:
        epochs = (prompts_from_jsonl(Path(cfg.jsonl), cfg.env, errors if e == 0 else []) for e in range(cfg.epochs))
        tasks = (dataclasses.replace(p, attempt=e) for e, rows in enumerate(epochs) for p in rows)
    else:
        tasks = prompts_from_env(cfg.env, cfg.seed)
    source = fan_out(tasks, cfg.group_size)
    producer, backlog = make_producer(cfg.kafka), Backlog(cfg.kafka, cfg.group)
    topic, sent, exhausted, failed = cfg.kafka.topic(T.PROMPTS), 0, False, []

    def delivered() -> None:  # the idempotent producer has retried already: the prompt is not on the topic
        if failed:
            raise FatalKafkaError(f"prompt delivery failed: {failed[0]}")

    try:
        while not stop.is_set() and not exhausted:
            producer.flush(30)  # the watermarks must include what we sent
            delivered()
            room = cfg.max_unfinished - backlog.count()
            for _ in range(max(room, 0)):
                prompt = None if cfg.count and sent >= cfg.count else next(source, None)
                if prompt is None:
                    exhausted = True
                    break
                produce(producer, topic, prompt.encode(), key=prompt.key,
                        on_delivery=lambda err, _: err is not None and failed.append(err))
                sent += 1
            if room <= 0:
                stop.wait(cfg.poll_s)
        producer.flush(30)
        delivered()
        log.info("published %d prompts (%d bad lines skipped)", sent, len(errors))
        while cfg.wait_done and not stop.is_set() and (left := backlog.count()) > 0:
            log.info("waiting for %d unfinished prompts", left)
            stop.wait(cfg.poll_s)
    finally:
        producer.flush(30)
        backlog.close()
    return sent


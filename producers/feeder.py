"""`sao feed`: publish prompts to `sao.prompts` with backpressure.

Prompts come from a dataset (`--dataset FILE.jsonl|.parquet`, epochs, optional shuffling:
producers/datasets.py) or from the environment's own task generator.
Each epoch of a dataset is a new `attempt`, so its rollouts are new trajectories, not duplicates.
`--group-size G` publishes every prompt G times (samples 0..G-1 of one group) for the group
baselines (grpo, grpo_dis), which the learner trains only as whole groups. The feeder keeps the
number of unfinished prompts (published, not yet committed by the producers' group) at or below
`max_unfinished`, so prompts wait in the feeder rather than pile up in the topic while producers
are slow or absent:

    unfinished = Σ over partitions (high watermark − committed offset of group `sao-producers`)

with a partition the group never committed counted from its low watermark.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import random
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import TopicPartition

from producers.datasets import dataset_prompts, load_rows
from producers.envs import env_factory, make_env
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
    """Environment of the prompts (and their generator when no --dataset is given): a built-in
    name, a `sao.envs` entry point or module:attr, as `sao producer --env` takes it."""
    dataset: str = ""
    """JSONL or Parquet file of prompts (row schema: producers/datasets.py); empty: sample tasks
    from the environment."""
    epochs: int = 1
    """Passes over the dataset."""
    shuffle: bool = False
    """Visit the dataset's rows in a new order each epoch (seeded by --seed)."""
    count: int = 0
    """Prompt messages to publish in all (0: every epoch of the dataset, or forever from the generator)."""
    group_size: int = 1
    """Rollouts per prompt: G >= 2 for the group baselines, 1 for SAO (one rollout per prompt)."""
    max_unfinished: int = 64
    """Most prompts published but not yet finished by the producers."""
    group: str = "sao-producers"
    """Consumer group whose committed offsets mark prompts finished."""
    seed: int = 0
    """Seed of the task generator, or of the dataset's shuffling."""
    poll_s: float = 0.5
    """Seconds between backpressure checks while the bound is reached."""
    wait_done: bool = False
    """After the last prompt, wait until every prompt is finished."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        env_factory(self.env)  # an unknown name or a plug-in that does not import fails here
        for name in ("max_unfinished", "epochs", "group_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.max_unfinished < self.group_size:
            raise ConfigError(f"--max-unfinished {self.max_unfinished} cannot hold one group of "
                              f"--group-size {self.group_size}")
        if self.dataset and not Path(self.dataset).is_file():
            raise ConfigError(f"--dataset {self.dataset}: no such file")


def unfinished(high: Mapping[int, int], low: Mapping[int, int], committed: Mapping[int, int]) -> int:
    """Prompts published but not committed, over partitions; a negative committed offset means
    the group never committed there."""
    return sum(h - max(committed.get(p, -1), low.get(p, 0)) for p, h in high.items())


def prompts_from_env(env_name: str, seed: int) -> Iterator[Prompt]:
    env, rng = make_env(env_name), random.Random(seed)
    while True:
        yield Prompt(id=f"{env_name}-{uuid.uuid4().hex}", env=env_name, task=env.sample_task(rng))


def fan_out(prompt: Prompt, group_size: int) -> list[Prompt]:
    """The prompt as the `group_size` samples of one group."""
    return [dataclasses.replace(prompt, sample=s, group_size=group_size) for s in range(group_size)]


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


def groups(cfg: FeedConfig, errors: list[str]) -> Iterator[list[Prompt]]:
    """What the feeder publishes, one task's group of prompts at a time."""
    if cfg.dataset:
        tasks = dataset_prompts(load_rows(Path(cfg.dataset), cfg.env, errors), cfg.epochs, cfg.seed, cfg.shuffle)
    else:
        tasks = prompts_from_env(cfg.env, cfg.seed)
    return (fan_out(p, cfg.group_size) for p in tasks)


def run(cfg: FeedConfig, stop: threading.Event | None = None) -> int:
    """Publish prompts; returns how many were published."""
    stop = stop_on_signals(stop)
    ensure_topics(cfg.kafka)
    errors: list[str] = []
    source, producer, backlog = groups(cfg, errors), make_producer(cfg.kafka), Backlog(cfg.kafka, cfg.group)
    topic, sent, exhausted, failed = cfg.kafka.topic(T.PROMPTS), 0, False, []

    def delivered() -> None:  # the idempotent producer has retried already: the prompt is not on the topic
        if failed:
            raise FatalKafkaError(f"prompt delivery failed: {failed[0]}")

    try:
        while not stop.is_set() and not exhausted:
            producer.flush(30)  # the watermarks must include what we sent
            delivered()
            room = (cfg.max_unfinished - backlog.count()) // cfg.group_size  # whole groups only
            if cfg.count:
                room = min(room, (cfg.count - sent) // cfg.group_size)
            batch = list(itertools.islice(source, max(room, 0)))
            for prompt in (p for group in batch for p in group):
                produce(producer, topic, prompt.encode(), key=prompt.key,
                        on_delivery=lambda err, _: err is not None and failed.append(err))
            sent += len(batch) * cfg.group_size
            # the source ran dry, or no further group fits in --count
            exhausted = len(batch) < room or bool(cfg.count and sent + cfg.group_size > cfg.count)
            if room <= 0:
                stop.wait(cfg.poll_s)
        producer.flush(30)
        delivered()
        log.info("published %d prompts (%d bad rows skipped)", sent, len(errors))
        while cfg.wait_done and not stop.is_set() and (left := backlog.count()) > 0:
            log.info("waiting for %d unfinished prompts", left)
            stop.wait(cfg.poll_s)
    finally:
        producer.flush(30)
        backlog.close()
    return sent

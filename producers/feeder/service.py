"""`sao feed`: publish prompts to `sao.prompts` with backpressure.

Prompts come from a dataset (`--dataset FILE.jsonl|.parquet`, epochs, optional shuffling:
producers/feeder/datasets.py) or from the environment's own task generator.
Each epoch of a dataset is a new `attempt`, so its rollouts are new trajectories, not duplicates.
`--group-size G` publishes every prompt G times (samples 0..G-1 of one group) for the group
baselines (grpo, grpo_dis), which the learner trains only as whole groups. The feeder keeps the
number of unfinished prompts (published, not yet committed by the producers' group) at or below
`max_unfinished`, so prompts wait in the feeder rather than pile up in the topic while producers
are slow or absent:

    unfinished = Σ over partitions (high watermark − committed offset of group `sao-producers`)

with a partition the group never committed counted from its low watermark (schemas/progress.py);
and, against a learner that falls behind, unfinished prompts plus the trajectories the learner has
not consumed yet (its progress group's commits) at or below `max_lag`: a learner that is slow, or
down, holds the prompts here until it catches up, and rollouts never age into stale ones.

A dataset feed resumes where it stopped, even after SIGKILL, and never publishes a sample twice.
Its position (the next group to publish: epoch × rows + index in that epoch's order) is kept in
Kafka, as the commit metadata of consumer group `sao-feed.<feed id>` on the prompts topic, written
after every batch is acknowledged, with each partition's high watermark as the commit's offset.
Every prompt it publishes carries headers `sao-feed` (the feed id) and `sao-feed-sample`
(`<position>.<sample>`). A restart reads its position, then the prompts topic from the committed
offsets to the end: the samples published after the last commit (a batch the broker acknowledged
before the feeder died) are skipped, the rest of the batch is published. The feed id defaults to
the dataset's name and content hash with the shuffling seed, so editing the file or reshuffling
starts a new feed; `--from-start` starts a feed over.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import re
import random
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import TopicPartition

from schemas.boundary import Bounds, call_sync
from producers.feeder.datasets import dataset_prompts, load_rows
from producers.envs import env_factory, env_mixture, make_env
from producers.heldout import MAX_DRAWS_PER_TASK, held_out, split_frac
from schemas.retry import retrying
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import FatalKafkaError, KafkaConfig, ensure_topics, make_producer, produce, read_ranges
from schemas.messages import Prompt, SchemaError
from schemas.process import stop_on_signals
from schemas.progress import GroupLag, learner_lag

log = logging.getLogger(__name__)

MAX_BAD_TASKS = 100


@dataclass(kw_only=True)
class FeedConfig:
    env: str = "toy-target"
    """Environment of the prompts (and their generator when no --dataset is given): a built-in
    name, a `sao.envs` entry point or module:attr, as `sao producer --env` takes it; or a mixture
    `NAME=WEIGHT,...` whose generators each prompt is drawn from by weight (no --dataset then)."""
    dataset: str = ""
    """JSONL or Parquet file of prompts (row schema: producers/feeder/datasets.py); empty: sample tasks
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
    max_lag: int = 256
    """Most trajectories ahead of the learner: prompts not yet finished plus trajectories it has not
    consumed yet (its progress commits, schemas/progress.py). Prompts wait here while the learner is
    that far behind, so rollouts do not age into stale ones (2 steps' worth suits; 0: no bound)."""
    group: str = "sao-producers"
    """Consumer group whose committed offsets mark prompts finished."""
    seed: int = 0
    """Seed of the task generator, or of the dataset's shuffling."""
    poll_s: float = 0.5
    """Seconds between backpressure checks while the bound is reached."""
    wait_done: bool = False
    """After the last prompt, wait until every prompt is finished."""
    feed_id: str = ""
    """Name under which a dataset feed keeps its position in Kafka (default: the dataset's name,
    content hash and shuffling seed)."""
    from_start: bool = False
    """Publish a dataset feed from its first row again instead of resuming at its saved position."""
    heldout_frac: float = 0.0
    """Share of all tasks held out for `sao eval`, by content (producers/heldout.py): never
    published here, from the env's generator or from --dataset. Give the evaluator the same
    (`sao up` does); 0: train on every task."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        mixture = env_mixture(self.env)
        if self.dataset and len(mixture) > 1:
            raise ConfigError(f"--env {self.env}: a --dataset feeds one env (its rows may name their own)")
        for name in mixture:
            env_factory(name)  # an unknown name or a plug-in that does not import fails here
            if not self.dataset and not callable(getattr(make_env(name), "sample_task", None)):
                raise ConfigError(f"--env {name}: has no sample_task(rng) to make prompts from; give it --dataset")
        for name in ("max_unfinished", "epochs", "group_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.heldout_frac < 1:
            raise ConfigError(f"--heldout-frac must be in [0, 1) (1 would hold out every task), got {self.heldout_frac}")
        if self.max_lag < 0:
            raise ConfigError(f"--max-lag must be >= 0 (0: no bound), got {self.max_lag}")
        if self.max_unfinished < self.group_size:
            raise ConfigError(f"--max-unfinished {self.max_unfinished} cannot hold one group of "
                              f"--group-size {self.group_size}")
        if self.dataset and not Path(self.dataset).is_file():
            raise ConfigError(f"--dataset {self.dataset}: no such file")
        if self.dataset and not self.feed_id:
            with open(self.dataset, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()[:12]
            self.feed_id = (f"{Path(self.dataset).stem}-{digest}-{f'seed{self.seed}' if self.shuffle else 'ordered'}"
                            + (f"-heldout{self.heldout_frac:g}" if self.heldout_frac else ""))  # other rows, other positions
        if not re.fullmatch(r"[A-Za-z0-9._-]{0,200}", self.feed_id):
            raise ConfigError(f"--feed-id {self.feed_id!r}: use at most 200 of A-Z a-z 0-9 . _ -")


def prompts_from_env(env_name: str, seed: int, errors: list[str], timeout_s: float = 120.0,
                     heldout_frac: float = 0.0) -> Iterator[Prompt]:
    """Prompts of the env's own tasks but the held-out ones. `sample_task` is a plug-in call
    (schemas/boundary.py): a task it fails to make, or one that cannot travel as a prompt, is
    skipped and counted in `errors`; MAX_BAD_TASKS failures in a row mean it never will, and stop
    the feed, as do MAX_DRAWS_PER_TASK held-out tasks in a row."""
    env, rng = make_env(env_name), random.Random(seed)
    bounds, failures, held = Bounds(plugin=f"env {env_name}", timeout_s=timeout_s), 0, 0
    frac = split_frac(env, heldout_frac)
    while True:
        try:
            task = call_sync(bounds, "env.sample_task", env.sample_task, rng)
            if held_out(task, frac):
                if (held := held + 1) >= MAX_DRAWS_PER_TASK:
                    raise ConfigError(f"--heldout-frac {frac}: the last {held} tasks of {env_name} were all held out")
                continue
            held = 0
            prompt = Prompt(id=f"{env_name}-{uuid.uuid4().hex}", env=env_name, task=task)
            Prompt.decode(prompt.encode())  # the task must be a map the codec carries
        except (SchemaError, TypeError, ValueError, OverflowError) as e:  # msgpack: types it cannot encode
            errors.append(f"task: {e}")
            log.warning("task skipped: %s", e)
            if (failures := failures + 1) >= MAX_BAD_TASKS:
                raise ConfigError(f"--env {env_name}: its last {failures} tasks all failed; the last: {e}") from e
            continue
        failures = 0
        yield prompt


def prompts_from_envs(spec: str, seed: int, errors: list[str], heldout_frac: float = 0.0) -> Iterator[Prompt]:
    """Prompts of the mixture `spec` (producers.envs.env_mixture): each drawn from one env's
    generator, the env chosen by weight; one env alone is its generator."""
    mixture = env_mixture(spec)
    streams = [prompts_from_env(name, seed + i, errors, heldout_frac=heldout_frac) for i, name in enumerate(mixture)]
    if len(streams) == 1:
        yield from streams[0]
        return
    rng = random.Random(f"mixture-{seed}")
    while True:
        yield next(rng.choices(streams, weights=list(mixture.values()))[0])


def fan_out(prompt: Prompt, group_size: int) -> list[Prompt]:
    """The prompt as the `group_size` samples of one group."""
    return [dataclasses.replace(prompt, sample=s, group_size=group_size) for s in range(group_size)]


class Backlog(GroupLag):
    """Reads the unfinished count of one group on the prompts topic."""

    def __init__(self, kafka: KafkaConfig, group: str):
        super().__init__(kafka, T.PROMPTS, group)


FEED_HEADER, SAMPLE_HEADER = "sao-feed", "sao-feed-sample"


class FeedMark(Backlog):
    """A dataset feed's position, kept as the commits of group `sao-feed.<feed id>` (module docstring)."""

    def __init__(self, kafka: KafkaConfig, feed_id: str):
        super().__init__(kafka, f"sao-feed.{feed_id}")
        self.feed_id = feed_id
        self.saved: int | None = None
        # a restart's samples published past its saved position are not behind it until it passes them
        self.behind = 0

    def save(self, position: int) -> None:
        """Mark every acknowledged prompt as behind us: `position` is the next group to publish.
        A position already saved, or short of samples a restart found published, is not saved."""
        if position == self.saved or position < self.behind:
            return
        meta = json.dumps({"position": position})
        offsets = [TopicPartition(self.topic, p, high, metadata=meta) for p, (_, high) in self.watermarks().items()]
        retrying(lambda: self.consumer.commit(offsets=offsets, asynchronous=False))
        self.saved = position

    def load(self) -> tuple[int, set[tuple[int, int]]]:
        """The saved position, and the (position, sample) pairs at or past it already published."""
        committed = [tp for tp in self.committed() if tp.offset >= 0 and tp.metadata]
        if not committed:
            return 0, set()
        position = json.loads(committed[0].metadata)["position"]
        published = {(g, s) for g, s in self._published_since(committed) if g >= position}
        self.behind = max((g for g, _ in published), default=-1) + 1
        return position, published

    def _published_since(self, starts: list[TopicPartition]) -> Iterator[tuple[int, int]]:
        """(position, sample) of this feed's prompts from each committed offset to the end."""
        ends = {p: high for p, (_, high) in self.watermarks().items()}
        for msg in read_ranges(self.consumer, self.topic, {tp.partition: (tp.offset, ends[tp.partition]) for tp in starts},
                               poll_s=1.0):
            headers = dict(msg.headers() or ())
            if headers.get(FEED_HEADER) == self.feed_id.encode():
                g, s = headers[SAMPLE_HEADER].decode().split(".")
                yield int(g), int(s)


def groups(cfg: FeedConfig, errors: list[str], start: int = 0,
           published: set[tuple[int, int]] = frozenset()) -> Iterator[tuple[int, list[Prompt]]]:
    """What the feeder publishes, one task's group of prompts at a time with its position, from
    position `start` on and without the (position, sample) pairs already `published` (a group
    published whole comes out empty, so positions stay consecutive)."""
    if cfg.dataset:
        tasks = dataset_prompts(training_rows(cfg, errors), cfg.epochs, cfg.seed, cfg.shuffle)
    else:
        tasks = prompts_from_envs(cfg.env, cfg.seed, errors, heldout_frac=cfg.heldout_frac)
    for position, prompt in itertools.islice(enumerate(tasks), start, None):
        yield position, [p for p in fan_out(prompt, cfg.group_size) if (position, p.sample) not in published]


def training_rows(cfg: FeedConfig, errors: list[str]) -> list[Prompt]:
    """The dataset's rows but the held-out ones."""
    rows, frac = load_rows(Path(cfg.dataset), cfg.env, errors), split_frac(make_env(cfg.env), cfg.heldout_frac)
    kept = [r for r in rows if not held_out(r.task, frac)]
    if cfg.heldout_frac:
        log.info("--heldout-frac %g: %d of %d rows held out for evaluation", cfg.heldout_frac, len(rows) - len(kept),
                 len(rows))
    if not kept:
        raise ConfigError(f"--dataset {cfg.dataset}: every row is held out at --heldout-frac {cfg.heldout_frac}")
    return kept


def take(source: Iterator[tuple[int, list[Prompt]]], n: int) -> list[tuple[int, list[Prompt]]]:
    """The next groups of `source` up to its `n`-th non-empty one (fewer: it ran dry)."""
    out, full = [], 0
    while full < n and (item := next(source, None)) is not None:
        out.append(item)
        full += bool(item[1])
    return out


def run(cfg: FeedConfig, stop: threading.Event | None = None) -> int:
    """Publish prompts; returns how many were published."""
    stop = stop_on_signals(stop)
    ensure_topics(cfg.kafka)
    errors: list[str] = []
    mark = FeedMark(cfg.kafka, cfg.feed_id) if cfg.dataset else None
    start, published = (0, set()) if mark is None or cfg.from_start else mark.load()
    if start or published:
        log.info("feed %s resumes at group %d (%d samples of it and later already published)",
                 cfg.feed_id, start, len(published))
    source, producer, backlog = groups(cfg, errors, start, published), make_producer(cfg.kafka), Backlog(cfg.kafka, cfg.group)
    lag = learner_lag(cfg.kafka) if cfg.max_lag else None
    topic, sent, exhausted, failed = cfg.kafka.topic(T.PROMPTS), 0, False, []
    position = start  # the next group to publish, once everything sent is acknowledged

    def save() -> None:
        if mark is not None:
            mark.save(position)

    def headers(g: int, prompt: Prompt) -> list[tuple[str, bytes]] | None:
        return mark and [(FEED_HEADER, cfg.feed_id.encode()), (SAMPLE_HEADER, f"{g}.{prompt.sample}".encode())]

    def delivered() -> None:  # the idempotent producer has retried already: the prompt is not on the topic
        if failed:
            raise FatalKafkaError(f"prompt delivery failed: {failed[0]}")

    try:
        save()  # a fresh feed's start too, so that a restart reads only what follows
        while not stop.is_set() and not exhausted:
            producer.flush(30)  # the watermarks must include what we sent
            delivered()
            save()
            waiting = backlog.count()
            room = (cfg.max_unfinished - waiting) // cfg.group_size  # whole groups only
            if lag is not None:  # the learner's backlog too: prompts not finished become trajectories
                room = min(room, (cfg.max_lag - waiting - lag.count()) // cfg.group_size)
            if cfg.count:
                room = min(room, (cfg.count - sent) // cfg.group_size)
            batch = take(source, max(room, 0))
            for g, prompt in ((g, p) for g, group in batch for p in group):
                produce(producer, topic, prompt.encode(), key=prompt.key, headers=headers(g, prompt),
                        on_delivery=lambda err, _: err is not None and failed.append(err))
            sent += sum(len(group) for _, group in batch)
            position = batch[-1][0] + 1 if batch else position
            # the source ran dry, or no further group fits in --count
            exhausted = sum(bool(group) for _, group in batch) < room or bool(
                cfg.count and sent + cfg.group_size > cfg.count)
            if room <= 0:
                stop.wait(cfg.poll_s)
        producer.flush(30)
        delivered()
        save()
        log.info("published %d prompts (%d bad rows skipped)", sent, len(errors))
        while cfg.wait_done and not stop.is_set() and (left := backlog.count()) > 0:
            log.info("waiting for %d unfinished prompts", left)
            stop.wait(cfg.poll_s)
    finally:
        producer.flush(30)
        backlog.close()
        if lag is not None:
            lag.close()
        if mark is not None:
            mark.close()
    return sent

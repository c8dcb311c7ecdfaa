"""`sao eval`: score the policy on held-out tasks, every `--every` versions, on an engine of its own.

Follows `sao.weights` as a producer does, with its own engine of the learner's architecture (vLLM
where this machine and the model allow it, else transformers), so evaluating never takes a
producer's slots. Which versions: the run's first (the policy before training), every multiple of
`--every`, and on a clean stop (SIGTERM, SIGINT) the newest version announced, so the run's last
policy has a score (producers/evaluate/versions.py); or exactly `--versions`, then it stops (a
finished run scored again: `sao broker --data-dir RUN_DIR/kafka` serves its log). Each is loaded
exactly and held while its episodes play: one greedy episode and `--samples` sampled ones per task,
all in flight together, and every action token is checked to carry that version.

The tasks are `--tasks` held-out tasks of `--env` (producers/heldout.py: the share
`--heldout-frac` of all tasks, by content, which `sao feed` with the same fraction never
publishes), or the held-out rows of `--dataset`; with no split (`--heldout-frac 0`), any tasks. The figures (producers/evaluate/scores.py) go
out as one `Evaluation` on `sao.evaluations` per version, tagged with the version and the learner
step that made it, to Prometheus on `--metrics-port` (`sao_eval_score{metric}`,
`sao_eval_version`), and, with `--out`, as a line of a JSONL file (what `sao up`'s dashboard and
report read). A restarted evaluator reads `sao.evaluations` first and scores no version twice.
An episode the environment or the engine fails counts as reward 0 and in `episode/errors`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from confluent_kafka import TopicPartition
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from producers.envs import env_factory, env_mixture
from producers.evaluate.scores import headline
from producers.evaluate.suite import Suite, figures, per_task
from producers.evaluate.versions import Versions, due, final, out_of_reach
from producers.feeder.datasets import load_rows
from producers.generate.base import SamplingParams
from schemas.weights.engine import ArchitectureMismatch
from producers.generate.vllm import VLLMConfig
from producers.heldout import evaluation_tasks, held_out, split_frac
from producers.sandbox import SandboxConfig
from producers.service import EpisodeLimits, choose_backend, env_bounds, learner_generator, make_parts
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer, make_producer, produce_and_wait, read_ranges
from schemas.messages import Evaluation, SchemaError
from schemas.process import stop_on_signals
from schemas.retry import retrying
from schemas.signing import load_trusted
from schemas.weights.announcements import learner_store
from schemas.weights.chain import WeightsError

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class EvalConfig(EpisodeLimits):
    env: str = "toy-target"
    """Environments evaluated, comma-separated (weights as in `sao feed --env` are ignored), each a
    built-in name, a `sao.envs` entry point or module:attr, as `sao producer --env`; each version
    is scored on each, one result per environment."""
    name: str = "heldout"
    """Name of this evaluation (its tasks and settings); a restart skips the versions scored under it."""
    every: int = 5
    """Score every version that is a multiple of this (besides the run's first, and the newest at a clean stop)."""
    versions: str = ""
    """Score exactly these versions instead, comma-separated (e.g. `0,12,24` of a finished run, under
    another --name), oldest first, waiting for any not yet announced, then stop; --every and
    --final-on-stop do not apply. Reachable: from the second-newest anchor on sao.weights whose file
    the learner's weight store still keeps (older ones are logged and skipped). Empty: the run's
    first, every --every-th, the newest at a stop."""
    tasks: int = 16
    """Tasks evaluated: the first this many distinct held-out tasks of the env's generator (seeded
    by --seed), or of --dataset's held-out rows."""
    samples: int = 4
    """Sampled episodes per task, at --temperature (k of mean@k and pass@k; 0: greedy only)."""
    greedy: bool = True
    """Also one greedy episode per task (greedy/mean, greedy/pass@1)."""
    success: float = 1.0
    """Reward at or above which an episode counts as solved (pass@k)."""
    heldout_frac: float = 0.0
    """Share of all tasks held out of training, by content: the tasks are drawn from it alone.
    Must equal the feeder's --heldout-frac (`sao up` passes one to both). 0: no split, any task
    (which training may see too; a --dataset of test tasks alone). An env with too few tasks to
    set any aside (`heldout = False`) takes any."""
    dataset: str = ""
    """JSONL or Parquet of tasks (as `sao feed --dataset`); its held-out rows are the tasks. Empty:
    the env's own generator."""
    seed: int = 0
    """Which generated tasks, and the seeds of the sampled episodes (the same for every version)."""
    backend: Literal["auto", "hf", "vllm"] = "auto"
    """The evaluator's own engine: vllm where this machine and the learner's model allow it, else hf."""
    device: str = "cpu"
    """torch device of the hf backend."""
    temperature: float = 1.0
    """Temperature of the sampled episodes (the producers': what training samples at)."""
    reward: str = ""
    """module:function(task, text, trajectory) -> float scoring each episode in place of the env's
    (needed for an env without a reward, such as writing); empty: the env's own reward."""
    env_step_timeout: float = 120.0
    """Seconds one call into the env or --reward may take; past it the episode counts as failed."""
    final_on_stop: bool = True
    """On SIGTERM or SIGINT, score the newest version announced (if not yet) before exiting."""
    max_evaluations: int = 0
    """Stop after this many evaluations (0: until SIGTERM)."""
    out: str = ""
    """Append each result to this JSONL file as well (`sao up` writes RUN_DIR/eval.jsonl); empty: none."""
    evaluator_id: str = ""
    """Who measured, in every result; default host-pid."""
    metrics_port: int = 0
    """Serve Prometheus metrics on this port (0: off)."""
    trusted_keys: str = ""
    """Comma-separated Ed25519 public keys (PEM) of the learner: only announcements it signed are
    evaluated (as a producer's --weights.trusted-keys); empty: not verified."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        for env in env_mixture(self.env):
            env_factory(env)  # an unknown name or a plug-in that does not import fails here
        for name, low in (("every", 1), ("tasks", 1), ("samples", 0), ("max_evaluations", 0), ("max_turns", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        try:
            self.wanted = tuple(sorted({int(v) for v in self.versions.split(",") if v.strip()}))
        except ValueError:
            raise ConfigError(f"--versions must be comma-separated version numbers, got {self.versions!r}") from None
        if any(v < 0 for v in self.wanted):
            raise ConfigError(f"--versions must be >= 0, got {self.versions!r}")
        if not self.greedy and not self.samples:
            raise ConfigError("--no-greedy with --samples 0 evaluates nothing: give --samples k")
        if not 0 <= self.heldout_frac <= 1:
            raise ConfigError(f"--heldout-frac must be in [0, 1], got {self.heldout_frac}")
        if self.dataset and not Path(self.dataset).is_file():
            raise ConfigError(f"--dataset {self.dataset}: no such file")
        try:
            self.sampling(greedy=False)
        except ValueError as e:
            raise ConfigError(f"--{e}".replace("_", "-", 1)) from None
        if not self.evaluator_id:
            self.evaluator_id = f"{socket.gethostname()}-{os.getpid()}"
        self.trusted = load_trusted(self.trusted_keys, "--trusted-keys") if self.trusted_keys else None

    @property
    def model(self) -> str:
        """Always the learner's published architecture and tokenizer (what `make_parts` names)."""
        return "learner"

    def sampling(self, greedy: bool, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, greedy=greedy,
                              stop_token_ids=stop_token_ids)


def suite_tasks(cfg: EvalConfig, env) -> tuple[list[dict], str]:
    """The tasks evaluated, and their split's name: heldout, or all where nothing is held out."""
    frac = split_frac(env, cfg.heldout_frac)
    if cfg.dataset:
        errors: list[str] = []
        rows = [p.task for p in load_rows(Path(cfg.dataset), env.name, errors) if p.env == env.name]
        tasks = [t for t in rows if frac <= 0 or held_out(t, frac)][:cfg.tasks]
        if not tasks:
            raise ConfigError(f"--dataset {cfg.dataset}: no held-out row of env {env.name} at --heldout-frac "
                              f"{cfg.heldout_frac} ({len(rows)} rows of it)")
    else:
        tasks = evaluation_tasks(env, cfg.tasks, frac, cfg.seed)
    if len(tasks) < cfg.tasks:
        log.warning("%d distinct evaluation tasks of %s, not the %d asked for", len(tasks), env.name, cfg.tasks)
    return tasks, "heldout" if frac > 0 else "all"


def scored_versions(kafka: KafkaConfig, suite: str, env: str) -> set[int]:
    """The versions already scored under `suite` for `env`, read from `sao.evaluations`."""
    consumer = make_consumer(kafka, f"sao-eval-read-{uuid.uuid4().hex}")
    try:
        topic = kafka.topic(T.EVALUATIONS)
        low, high = retrying(lambda: consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=5, cached=False))
        done = set()
        for msg in read_ranges(consumer, topic, {0: (low, high)}, timeout=60):
            try:
                e = Evaluation.decode(msg.value() or b"")
            except SchemaError as err:
                log.warning("%s offset %d is not an evaluation: %s", topic, msg.offset(), err)
                continue
            if e.suite == suite and e.env == env:
                done.add(e.version)
        return done
    finally:
        consumer.close()


class EvalMetrics:
    """`sao_eval_score{metric}`, `sao_eval_version`, `sao_eval_seconds`, `sao_eval_evaluations_total`,
    `sao_eval_skipped_total` (versions that could not be loaded)."""

    def __init__(self, port: int):
        self.registry = r = CollectorRegistry()
        self.score = Gauge("sao_eval_score", "Last evaluation's figures", ["env", "metric"], registry=r)
        self.version = Gauge("sao_eval_version", "Version of the last evaluation", registry=r)
        self.seconds = Gauge("sao_eval_seconds", "Wall time of the last evaluation", registry=r)
        self.evaluations = Counter("sao_eval_evaluations", "Versions scored", registry=r)
        self.skipped = Counter("sao_eval_skipped", "Versions that could not be loaded", registry=r)
        self._server = start_http_server(port, registry=r)[0] if port else None

    def record(self, e: Evaluation) -> None:
        for name, value in e.metrics.items():
            self.score.labels(e.env, name).set(value)
        self.version.set(e.version)
        self.seconds.set(e.seconds)
        self.evaluations.inc()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()


class Evaluator:
    """Loads a version, plays each environment's suite, publishes one result per environment."""

    def __init__(self, cfg: EvalConfig, suites: dict[str, Suite], versions: Versions, producer,
                 metrics: EvalMetrics):
        self.cfg, self.suites, self.versions, self.producer, self.metrics = cfg, suites, versions, producer, metrics

    def evaluate(self, version: int, envs: list[str]) -> bool:
        """Score `version` on the suites of `envs`; False if it cannot be loaded (logged and
        counted, never retried)."""
        t0 = time.perf_counter()
        try:
            announced = self.versions.load(version)
        except ArchitectureMismatch as e:
            raise ConfigError(f"the learner's weights (version {version}) do not fit the evaluator's engine: {e}") from e
        except (WeightsError, ValueError, OSError) as e:
            log.error("version %d not evaluated: %s", version, e)
            self.metrics.skipped.inc()
            return False
        for env in envs:
            suite = self.suites[env]
            played = asyncio.run(suite.play(version))
            self.publish(Evaluation(version=version, step=announced.step, env=env, suite=self.cfg.name,
                                    split=suite.split, num_tasks=len(suite.tasks), samples=self.cfg.samples,
                                    metrics=figures(self.cfg, played, version), evaluator=self.cfg.evaluator_id,
                                    seconds=time.perf_counter() - t0), per_task(self.cfg, played))
            t0 = time.perf_counter()
        return True

    def publish(self, e: Evaluation, tasks: dict[str, list]) -> None:
        """To the evaluations topic, and with each task's figures (suite.per_task) to --out."""
        topic = self.cfg.kafka.topic(T.EVALUATIONS)
        while True:  # a broker outage delays the result; a copy sent twice is the same result under one key
            try:
                err = produce_and_wait(self.producer, topic, e.encode(), e.key, timeout=120)
            except TimeoutError as timeout:
                err = timeout
            if err is None:
                break
            log.warning("evaluation of v%d not delivered (%s); sending it again", e.version, err)
        self.metrics.record(e)
        if self.cfg.out:
            line = {"version": e.version, "step": e.step, "env": e.env, "suite": e.suite, "split": e.split,
                    "time": e.created_at, "seconds": e.seconds, **e.metrics, **tasks}
            with open(self.cfg.out, "a") as f:
                f.write(json.dumps(line) + "\n")
        name, value = headline(e.metrics)
        log.info("eval %s %s v%d (step %d): %s %.3f over %d tasks in %.1f s; %s", e.suite, e.env, e.version, e.step,
                 name, value, e.num_tasks, e.seconds, " ".join(f"{k}={v:.3f}" for k, v in sorted(e.metrics.items())))


def run(cfg: EvalConfig, stop: threading.Event | None = None) -> int:
    """Returns the number of versions scored."""
    from schemas.tokenizers import load_tokenizer  # transformers only once we run

    stop = stop_on_signals(stop)
    metrics = EvalMetrics(cfg.metrics_port)  # up (and healthy) while it waits for the learner
    ensure_topics(cfg.kafka)
    if (store := learner_store(cfg.kafka, stop, trusted=cfg.trusted)) is None:
        metrics.close()
        return 0
    backend = choose_backend(cfg.backend, store)
    generator, model = learner_generator(backend, store, seed=cfg.seed, device=cfg.device, vllm=cfg.vllm)
    versions = producer = None
    try:
        envs, params, score = make_parts(cfg, load_tokenizer(model))
        bounds, suites = env_bounds(cfg, generator), {}
        for name, env in envs.items():
            tasks, split = suite_tasks(cfg, env)
            suites[name] = Suite(cfg=cfg, env=env, generator=generator, tasks=tasks, split=split,
                                 stops=params.stop_token_ids, score=score, bounds=replace(bounds, plugin=f"env {name}"))
            log.info("eval %s: %d tasks of %s (split %s)", cfg.name, len(tasks), name, split)
        # a version is settled once every environment has its score (a restart scores only the missing)
        scored = {name: scored_versions(cfg.kafka, cfg.name, name) for name in suites}
        versions, producer = Versions(cfg.kafka, generator, trusted=cfg.trusted), make_producer(cfg.kafka)
        evaluator = Evaluator(cfg, suites, versions, producer, metrics)

        def settled() -> set[int]:
            return set.intersection(*scored.values())

        def settle(v: int) -> None:
            for versions_scored in scored.values():
                versions_scored.add(v)

        def evaluate(v: int) -> bool:
            done = evaluator.evaluate(v, [name for name in suites if v not in scored[name]])
            settle(v)
            return done
        which = f"versions {','.join(map(str, cfg.wanted))}" if cfg.wanted else f"every {cfg.every} versions"
        log.info("eval %s: %s backend, %s%d samples each, %s; %d scored before", cfg.name, backend,
                 "greedy + " if cfg.greedy else "", cfg.samples, which, len(settled()))
        n = 0
        while not stop.is_set() and not (cfg.max_evaluations and n >= cfg.max_evaluations):
            if cfg.wanted and set(cfg.wanted) <= settled():
                break
            versions.poll(0.5)
            for v in out_of_reach(cfg.wanted, versions.announced, settled()):
                log.error("version %d not evaluated: older than v%d, the oldest sao.weights still reaches (from its "
                          "second-newest anchor on)", v, min(versions.announced))
                metrics.skipped.inc()
                settle(v)
            if (v := due(versions.announced, settled(), cfg.every, versions.first, cfg.wanted)) is not None:
                n += evaluate(v)
        if stop.is_set() and cfg.final_on_stop and not cfg.wanted:
            versions.poll(1.0)
            if (v := final(versions.announced, settled())) is not None:
                log.info("stopping: scoring the newest version, v%d, first", v)
                n += evaluate(v)
        return n
    finally:
        if producer is not None:
            producer.flush(10)
        if versions is not None:
            versions.close()
        metrics.close()
        if hasattr(generator, "close"):  # an engine's threads and processes (vLLM's) end with it
            generator.close()

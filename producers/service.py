"""`sao producer`: take a prompt from `sao.prompts`, play an episode, publish the trajectory.

A member of consumer group `sao-producers` (cooperative-sticky rebalancing, so members come and
go without stopping the others). Per prompt: decode (bad bytes → `sao.dlq`), play the episode on
the generator, produce the trajectory to `sao.trajectories` (or `sao.trajectories.pending` when
the environment gives no reward), wait for the broker's acknowledgement, and only then store and
commit the prompt's offset. A producer killed mid-episode has committed nothing for that prompt, so
the group hands it to another member: prompts are delivered at least once. A redelivered prompt
yields the same trajectory id (`<prompt id>#<attempt>.<sample>`), which is how the learner drops duplicates.

SIGTERM or SIGINT ends the loop after the current episode; the partitions' offsets are
committed and the consumer leaves the group, handing its partitions to the others at once.
Weights follow `sao.weights` in a background thread (producers/weights.py). Metrics: Prometheus
on `--metrics-port`, and a log line every `--log-every-s`.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from typing import Literal

from confluent_kafka import KafkaError, KafkaException

from producers.envs import ENVS, make_env
from producers.envs.chat import Chat
from producers.episode import TrajectoryIds, run_episode
from producers.generate.base import Generator, SamplingParams
from producers.generate.http import InvalidGeneration
from producers.metrics import ProducerMetrics
from producers.sandbox import Sandbox, SandboxConfig
from producers.weights import WeightSubscriber
from schemas import topics as T
from schemas.kafka import (KafkaConfig, consumer_error, dead_letter, decode_or_dead_letter, ensure_topics,
                           make_consumer, make_producer, produce)
from schemas.process import stop_on_signals
from schemas.config import ConfigError
from schemas.messages import Prompt, SchemaError, Trajectory

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ProducerConfig:
    backend: Literal["hf", "vllm", "http"] = "hf"
    """Generator: transformers in-process, vLLM in-process, or a completions server (`sao serve`)."""
    env: str = "toy-target"
    """Environment this producer plays; prompts for another env go to the DLQ."""
    model: str = "tiny-llama"
    """Policy (and tokenizer): smollm2 | tiny-llama | tiny-llama-bytes | a local HF directory."""
    seed: int = 0
    """Seed of tiny random models and of sampling."""
    device: str = "cpu"
    """torch device of the hf backend."""
    temperature: float = 1.0
    """Sampling temperature; the learner must recompute log-probs at the same value."""
    max_tokens: int = 256
    """Most tokens per model turn."""
    max_turns: int = 4
    """Most model turns per episode, for multi-turn environments that take it."""
    url: str = "http://127.0.0.1:8000"
    """Completions server of the http backend."""
    producer_id: str = ""
    """Id written into every trajectory; default host-pid."""
    group: str = "sao-producers"
    """Consumer group on sao.prompts."""
    follow_weights: bool = True
    """Follow sao.weights (with the http backend: only to tag versions the server does not report)."""
    max_prompts: int = 0
    """Stop after this many prompts (0: run until SIGTERM)."""
    metrics_port: int = 0
    """Serve Prometheus metrics on this port (0: off)."""
    log_every_s: float = 30.0
    """Seconds between metric log lines."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        if self.env not in ENVS:
            raise ConfigError(f"--env {self.env!r}: unknown; known: {sorted(ENVS)}")
        if not self.producer_id:
            self.producer_id = f"{socket.gethostname()}-{os.getpid()}"


def make_generator(cfg: ProducerConfig) -> Generator:
    match cfg.backend:
        case "hf":
            from producers.generate.hf import HFGenerator
            from producers.models import load_model
            return HFGenerator(load_model(cfg.model, seed=cfg.seed, device=cfg.device), seed=cfg.seed)
        case "http":
            from producers.generate.http import HttpGenerator
            return HttpGenerator(cfg.url, model=cfg.model)
        case "vllm":
            from producers.generate.vllm import VLLMGenerator
            return VLLMGenerator(cfg.model, seed=cfg.seed)
    raise ValueError(f"--backend {cfg.backend!r}")


def make_parts(cfg: ProducerConfig, tokenizer) -> tuple:
    """The environment and sampling params; the env gets the settings its constructor takes."""
    offered = {"tokenizer": lambda: tokenizer, "sandbox": lambda: Sandbox(cfg.sandbox),
               "max_turns": lambda: cfg.max_turns}
    takes = inspect.signature(ENVS[cfg.env]).parameters
    env = make_env(cfg.env, **{k: make() for k, make in offered.items() if k in takes})
    stops = Chat(tokenizer).stop_token_ids() if tokenizer is not None else ()
    return env, SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, stop_token_ids=stops)


def play(prompt: Prompt, env, generator: Generator, params: SamplingParams, producer_id: str) -> Trajectory:
    """One episode of `prompt`; SchemaError when its env or task is not one this producer can play."""
    if prompt.env != env.name:
        raise SchemaError("env", f"this producer plays {env.name!r}, not {prompt.env!r}")
    try:
        episode = env.episode(prompt.task)
    except SchemaError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as e:  # the env could not read this task
        raise SchemaError("task", f"{type(e).__name__}: {e}") from e
    ids = TrajectoryIds(id=prompt.trajectory_id, prompt_id=prompt.id, env=prompt.env,
                        producer_id=producer_id, group=prompt.group, group_size=prompt.group_size)
    return run_episode(episode, generator, params, ids)


def deliver(producer, topic: str, traj: Trajectory) -> None:
    """Produce the trajectory and block until the broker acknowledges it; raise if it cannot."""
    result = {}
    produce(producer, topic, traj.encode(), key=traj.key, on_delivery=lambda err, _: result.update(err=err))
    while "err" not in result:
        producer.poll(0.1)
    if result["err"] is not None:
        raise KafkaException(result["err"])


def commit(consumer, msg=None) -> None:
    """Store `msg`'s offset (if given) and commit what is stored; a partition revoked meanwhile
    just means its new owner replays the prompt (at least once)."""
    try:
        if msg is not None:
            consumer.store_offsets(msg)
        consumer.commit(asynchronous=False)
    except KafkaException as e:
        if e.args[0].code() != KafkaError._NO_OFFSET:
            log.warning("offset commit failed (%s); the prompt may be replayed", e.args[0])


def run(cfg: ProducerConfig, stop: threading.Event | None = None) -> None:
    from producers.models import load_tokenizer  # torch/transformers only once we run

    stop = stop_on_signals(stop)
    ensure_topics(cfg.kafka)
    generator = make_generator(cfg)
    env, params = make_parts(cfg, load_tokenizer(cfg.model))
    metrics = ProducerMetrics(cfg.producer_id, cfg.metrics_port, cfg.log_every_s)
    sub = WeightSubscriber(cfg.kafka, generator, verify_files=cfg.backend != "http") if cfg.follow_weights else None
    producer = make_producer(cfg.kafka)
    consumer = make_consumer(cfg.kafka, cfg.group, **{"partition.assignment.strategy": "cooperative-sticky"})
    topics = {True: cfg.kafka.topic(T.TRAJECTORIES), False: cfg.kafka.topic(T.PENDING)}
    done = 0
    try:
        if sub is not None and not sub.start().caught_up.wait(120):
            log.warning("weights backlog not read within 120 s; starting on version %d", generator.version)
        consumer.subscribe([cfg.kafka.topic(T.PROMPTS)], on_revoke=lambda c, _: commit(c),
                           on_lost=lambda _, ps: log.warning("lost partitions %s", [p.partition for p in ps]))
        log.info("producer %s: %s backend, env %s, weights v%d", cfg.producer_id, cfg.backend, env.name,
                 generator.version)
        while not stop.is_set() and not (cfg.max_prompts and done >= cfg.max_prompts):
            metrics.tick(generator.version, sub)
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if consumer_error(msg):
                continue
            prompt = decode_or_dead_letter(producer, cfg.kafka, msg, Prompt)
            if prompt is None:
                producer.flush(30)  # the dead letter is durable before the offset moves
                metrics.error("undecodable")
            else:
                log.info("episode start: prompt %s (partition %d offset %d)", prompt.id, msg.partition(),
                         msg.offset())
                try:
                    traj = play(prompt, env, generator, params, cfg.producer_id)
                    deliver(producer, topics[traj.reward is not None], traj)
                    metrics.episode(traj)
                except (SchemaError, InvalidGeneration) as e:  # this prompt cannot be played: DLQ it
                    dead_letter(producer, cfg.kafka, msg, e)
                    producer.flush(30)  # the dead letter is durable before the offset moves
                    metrics.error(type(e).__name__)
            commit(consumer, msg)
            done += 1
            if sub is not None and sub.error is not None:
                raise RuntimeError("weights subscription died") from sub.error
    finally:
        producer.flush(30)
        consumer.close()  # commits nothing new: offsets were committed per prompt; leaves the group
        if sub is not None:
            sub.close()
        metrics.close()
        log.info("producer %s stopped after %d prompts", cfg.producer_id, done)

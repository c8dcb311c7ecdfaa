"""`sao producer`: take prompts from `sao.prompts`, play `--concurrency` episodes at once, publish
the trajectories.

A member of consumer group `sao-producers` (cooperative-sticky rebalancing, so members come and
go without stopping the others). Per prompt: decode (bad bytes → `sao.dlq`), play the episode on
the generator, produce the trajectory to `sao.trajectories` (or `sao.trajectories.pending` when
the environment gives no reward), wait for the broker's acknowledgement, and only then count the
prompt delivered. Episodes finish out of order, so a partition's offset is committed only up to
the contiguous prefix of delivered prompts (producers/offsets.py): a producer killed with N
episodes in flight has committed none of them, and the group hands them to another member
(at least once). A redelivered prompt yields the same trajectory id (`<prompt id>#<attempt>.<sample>`),
which is how the learner drops duplicates. A revoked partition's episodes are cancelled and its
delivered prefix committed before it goes; its new owner replays the rest.

Why asyncio and not threads: episodes spend their time waiting (on the generator's batch, a
sandboxed tool call, the broker's ack), and the things they wait on already have asynchronous
forms: vLLM's AsyncLLM is asyncio-native, httpx has an async client, the hf backend resolves a
future per request, the sim backend sleeps on the loop's clock. So 64 episodes in flight are 64
coroutines on one thread, and all Kafka client calls and offset bookkeeping stay on that thread
(no locks; rebalance callbacks run inside `poll` there). Only blocking environment steps go to a
pool of `--concurrency` worker threads. Threads would have needed a lock around the offsets and
a thread per episode even while it only waits.

SIGTERM or SIGINT stops taking prompts; the episodes in flight get `--drain-s` seconds to finish
and be delivered, the rest are abandoned unpublished (a hanging env step included: it runs in a
daemon thread, schemas/boundary.py), the delivered prefix is committed, and the consumer leaves
the group, handing its partitions, and the abandoned prompts, to the others at once: the process
is gone within `--drain-s` plus a few seconds. Weights follow `sao.weights` in a background thread (schemas/weights/follow.py); the generator
swaps them between decode steps of its running batch. Metrics: Prometheus on `--metrics-port`,
and a log line every `--log-every-s`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from producers.envs import build_env, check_env, env_factory, env_mixture, takes
from producers.envs.chat import Chat
from producers.envs.text import TextEnv
from producers.episode import Player
from producers.generate.base import Generator, SamplingParams
from producers.generate.sim import SimConfig
from producers.generate.vllm import VLLMConfig
from producers.metrics import ProducerMetrics
from producers.offsets import OffsetCommitter, StalledFetches
from producers.sandbox import Sandbox, SandboxConfig
from producers.scoring import scorer
from schemas import topics as T
from schemas.boundary import Bounds, call
from schemas.weights.announcements import learner_store
from schemas.weights.follow import FollowConfig, WeightSubscriber
from schemas.kafka import (ServiceConfig, acknowledged, consumer_error, dead_letter, decode_or_dead_letter,
                           ensure_topics, make_consumer, make_producer)
from schemas.config import ConfigError
from schemas.messages import DEFAULT_LIMITS, Prompt, SchemaError, Trajectory
from schemas.models import FROM_LEARNER, check_model
from schemas.process import stop_on_signals
from schemas.progress import Backpressure, GroupLag
from schemas.retry import transient

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class EpisodeLimits:
    """How far an episode may run: one spelling for the services that play them (`sao producer`,
    `sao eval`), so that held-out episodes are bounded as training's are."""

    max_tokens: int = 256
    """Most tokens per model turn."""
    max_turns: int = 8
    """Most model turns per episode, for multi-turn environments that take it."""
    max_invalid_calls: int = 3
    """Tool-using envs that take it: replies in a row whose every tool call failed before the
    episode ends (finish_reason invalid_calls)."""
    episode_deadline_s: float = 300.0
    """Tool-using envs that take it: wall-clock seconds after which an episode's next turn ends it
    (finish_reason deadline)."""


@dataclass(kw_only=True)
class ProducerConfig(ServiceConfig, EpisodeLimits):
    backend: Literal["hf", "vllm", "http", "sim", "auto"] = "hf"
    """Generator: transformers in-process, vLLM in-process, a completions server (`sao serve`),
    simulated rollouts without a model (load and systems tests; see --sim.*), or auto: vllm where
    this machine and the model allow it (vLLM's CPU build needs x86-64 with AVX2 or AVX-512 and
    attention heads of a size its kernels serve), else hf; the start-up log says which."""
    concurrency: int = 8
    """Episodes in flight at once; the generator batches their requests."""
    env: str = "toy-target"
    """Environments this producer plays, comma-separated (weights as in `sao feed --env` are
    ignored): each a built-in name, an installed package's `sao.envs` entry point, or module:attr
    (an Env, or a gym-style text env); prompts for another env go to the DLQ."""
    reward: str = ""
    """module:function(task, text, trajectory) -> float | None giving each episode's outcome reward
    in place of the env's (None: to sao.trajectories.pending); empty: the env's own reward."""
    model: str = "tiny-llama"
    """Policy (and tokenizer): smollm2 | tiny-llama | tiny-llama-bytes | a local HF directory | a hub id
    in the local cache | learner (the learner's published architecture and tokenizer; hf backend)."""
    seed: int = 0
    """Seed of tiny random models and of sampling."""
    device: str = "cpu"
    """torch device of the hf backend."""
    temperature: float = 1.0
    """Sampling temperature; the learner must recompute log-probs at the same value."""
    url: str = "http://127.0.0.1:8000"
    """Completions server of the http backend."""
    serve_token: str = ""
    """Bearer token of that server (its `--serve-token`; both read `SAO_SERVE_TOKEN`)."""
    server_swaps: bool = False
    """http backend: load each new weights version into the server (a `vllm serve` started with
    VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls producers.generate.vllm.WorkerExtension,
    reading the same weights volume); off: the server follows sao.weights itself (`sao serve`)."""
    producer_id: str = ""
    """Id written into every trajectory; default host-pid."""
    group: str = "sao-producers"
    """Consumer group on sao.prompts."""
    follow_weights: bool = True
    """Follow sao.weights (with the http backend: only to tag versions the server does not report)."""
    max_prompts: int = 0
    """Stop after this many prompts (0: run until SIGTERM)."""
    env_step_timeout: float = 120.0
    """Seconds one call into the env or --reward plug-in may take (start, step, score); a call that
    takes longer is abandoned and its prompt dead-lettered."""
    max_lag: int = 256
    """Take no new prompt while the learner has this many trajectories or more left to consume
    (its progress commits, schemas/progress.py), so rollouts do not age into stale ones; resume by
    itself when it catches up (0: no bound). The feeder holds its prompts by the same bound."""
    drain_s: float = 10.0
    """On SIGTERM, seconds the episodes in flight get to finish and be delivered; the rest are
    abandoned unpublished and their prompts redelivered to another producer."""
    fetch_stall_s: float = 30.0
    """Seconds with a free episode slot that an assigned prompts partition may go unread while
    prompts wait on it before its fetch is restarted (the Kafka client can leave a partition
    unfetched after a rebalance: producers/offsets.py StalledFetches); 0: never check."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    weights: FollowConfig = field(default_factory=FollowConfig)

    def __post_init__(self):
        for name in env_mixture(self.env):
            env_factory(name)  # an unknown name or a plug-in that does not import fails here
        if self.concurrency < 1:
            raise ConfigError(f"--concurrency {self.concurrency}: must be >= 1")
        if not self.env_step_timeout > 0 or min(self.drain_s, self.max_lag, self.fetch_stall_s) < 0:
            raise ConfigError("--env-step-timeout must be > 0, --drain-s, --max-lag and --fetch-stall-s >= 0")
        if self.backend in ("hf", "vllm", "auto"):  # the other backends name a model their server knows
            check_model(self.model, from_learner=True)
        if self.model == FROM_LEARNER and not (self.backend in ("hf", "vllm", "auto") and self.follow_weights):
            raise ConfigError("--model learner: needs --backend hf or vllm and --follow-weights (it loads the "
                              "learner's weights)")
        if not self.producer_id:
            self.producer_id = f"{socket.gethostname()}-{os.getpid()}"


def make_generator(cfg: ProducerConfig, backend: str | None = None) -> Generator:
    """The generator of `backend` (default: `--backend`, which must not be auto then)."""
    match backend or cfg.backend:
        case "hf":
            from producers.generate.hf import HFGenerator
            from producers.models import load_model
            return HFGenerator(load_model(cfg.model, seed=cfg.seed, device=cfg.device), seed=cfg.seed)
        case "http":
            from producers.generate.http import HttpGenerator
            return HttpGenerator(cfg.url, model=cfg.model, token=cfg.serve_token, swaps=cfg.server_swaps)
        case "vllm":
            from producers.generate.vllm import VLLMGenerator
            from producers.models import engine_folder
            return VLLMGenerator(engine_folder(cfg.model, seed=cfg.seed), seed=cfg.seed, cfg=cfg.vllm)
        case "sim":
            from producers.generate.sim import SimGenerator
            return SimGenerator(cfg.sim, seed=cfg.seed)
    raise ValueError(f"--backend {backend or cfg.backend!r}")


def learner_generator(backend: str, store, *, seed: int, device: str, vllm: VLLMConfig) -> tuple[Generator, str]:
    """A generator of the learner's published architecture (random weights, version -1, until the
    learner's weights are loaded into it), and the learner's model name (for the tokenizer)."""
    from producers.models import learner_model_name

    if backend == "vllm":
        from producers.generate.vllm import VLLMGenerator
        return VLLMGenerator(store, load=False, version=-1, seed=seed, cfg=vllm), learner_model_name(store)
    from producers.generate.hf import HFGenerator
    from producers.models import load_learner_model
    policy, model = load_learner_model(store, device=device)
    return HFGenerator(policy, version=-1, seed=seed), model


def choose_backend(backend: str, folder) -> str:
    """`backend`, with auto resolved for the model in transformers folder `folder`: vllm where
    this machine and the model allow it, else hf, saying why."""
    if backend != "auto":
        return backend
    from producers.generate.vllm import refusal

    why = refusal(json.loads((Path(folder) / "config.json").read_text()))
    log.info("--backend auto: %s", f"hf ({why})" if why else "vllm")
    return "hf" if why else "vllm"


class PlaySettings(Protocol):
    """What playing an env's episodes takes from a service's config (`sao producer`, `sao eval`)."""

    env: str
    reward: str
    model: str
    temperature: float
    max_tokens: int
    max_turns: int
    max_invalid_calls: int
    episode_deadline_s: float
    env_step_timeout: float
    sandbox: SandboxConfig


def make_parts(cfg: PlaySettings, tokenizer) -> tuple:
    """The environments of `--env` by name (each checked on one smoke task), the sampling params,
    and the --reward scorer (None without one); each env gets the settings its constructor takes."""
    offered = {"tokenizer": lambda: tokenizer, "sandbox": lambda: Sandbox(cfg.sandbox),
               "max_turns": lambda: cfg.max_turns, "max_invalid_calls": lambda: cfg.max_invalid_calls,
               "deadline_s": lambda: cfg.episode_deadline_s}
    envs = {name: build_env(name, offered) for name in env_mixture(cfg.env)}
    needs = [(takes(env_factory(name), "tokenizer") or isinstance(env, TextEnv), f"--env {name}")
             for name, env in envs.items()]
    for needed, flag in (*needs, (bool(cfg.reward), f"--reward {cfg.reward}")):
        if needed and tokenizer is None:  # else every prompt would be dead-lettered
            raise ConfigError(f"{flag} needs a tokenizer and --model {cfg.model} has none "
                              "(try tiny-llama-bytes or smollm2)")
    for env in envs.values():
        check_env(env)  # an env that needs the tokenizer and has none was refused above
    score = scorer(cfg.reward, tokenizer) if cfg.reward else None
    stops = Chat(tokenizer).stop_token_ids() if tokenizer is not None else ()
    try:
        params = SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, stop_token_ids=stops)
    except ValueError as e:  # "temperature: must be ..." names the flag
        raise ConfigError(f"--{e}".replace("_", "-", 1)) from None
    return envs, params, score


def env_bounds(cfg: PlaySettings, generator: Generator) -> Bounds:
    """What the env's results must fit: the vocabulary and context window of the model, where the
    generator knows them (an http backend's server checks its own)."""
    context = getattr(generator, "context", None) or DEFAULT_LIMITS.max_tokens
    return Bounds(plugin=f"env {cfg.env}", vocab_size=getattr(generator, "vocab_size", None),
                  max_tokens=min(context, DEFAULT_LIMITS.max_tokens), timeout_s=cfg.env_step_timeout)


# the broker refuses this message whatever the retries: the episode's prompt goes to the DLQ
_REFUSED = {KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_RECORD, KafkaError.RECORD_LIST_TOO_LARGE}


async def deliver(producer, topic: str, traj: Trajectory) -> None:
    """Produce the trajectory and wait until the broker acknowledges it. A message the broker
    refuses (too large, invalid) raises SchemaError (its prompt is dead-lettered); one that could
    not be delivered yet (the cluster down longer than librdkafka's own retries) is produced again;
    anything else raises. The acknowledgement arrives in `producer.poll`, which the service loop
    calls on this thread."""
    payload = traj.encode()
    if len(payload) > T.MAX_MESSAGE_BYTES:
        raise SchemaError("trajectory", f"{len(payload)} bytes exceeds the {T.MAX_MESSAGE_BYTES}-byte message limit")
    backoff = 0.5
    while True:
        err = await acknowledged(producer, topic, payload, traj.key)
        if err is None:
            return
        if err.code() in _REFUSED:
            raise SchemaError("trajectory", f"the broker refused it: {err.str()}")
        if not transient(err):
            raise KafkaException(err)
        log.warning("trajectory %s not delivered (%s); producing it again", traj.id, err.str())
        await asyncio.sleep(backoff)
        backoff = min(2 * backoff, 10.0)


def run(cfg: ProducerConfig, stop: threading.Event | None = None) -> None:
    from schemas.tokenizers import load_tokenizer  # transformers only once we run

    stop = stop_on_signals(stop)
    generator, model, backend = None, cfg.model, cfg.backend
    if cfg.model == FROM_LEARNER:  # the architecture and tokenizer are the learner's: wait for them
        ensure_topics(cfg.kafka)
        if (store := learner_store(cfg.kafka, stop, trusted=cfg.weights.trusted)) is None:
            return
        backend = choose_backend(cfg.backend, store)
        # no version until the learner's loads
        generator, model = learner_generator(backend, store, seed=cfg.seed, device=cfg.device, vllm=cfg.vllm)
        log.info("--model learner: %s's architecture from %s", model, store)
    envs, params, score = make_parts(cfg, load_tokenizer(model))  # a misconfiguration fails before Kafka is asked
    ensure_topics(cfg.kafka)
    if generator is None:
        if cfg.backend == "auto":
            from producers.models import engine_folder
            backend = choose_backend(cfg.backend, engine_folder(cfg.model, seed=cfg.seed))
        else:
            backend = cfg.backend
        generator = make_generator(cfg, backend)
    player = Player(envs=envs, generator=generator, params=params, producer_id=cfg.producer_id,
                    tool_s=cfg.sim.tool_s if backend == "sim" else 0.0, bounds=env_bounds(cfg, generator))
    metrics = ProducerMetrics(cfg.producer_id, cfg.metrics_port, cfg.log_every_s)
    holds_weights = backend in ("hf", "vllm") or cfg.server_swaps  # reads the files: verify them first
    sub = WeightSubscriber(cfg.kafka, generator, verify_files=holds_weights, follow=cfg.weights,
                           requester=cfg.producer_id) if cfg.follow_weights else None
    producer = make_producer(cfg.kafka)
    offsets = OffsetCommitter(cfg.kafka.topic(T.PROMPTS))
    consumer = offsets.consumer = make_consumer(cfg.kafka, cfg.group, on_commit=offsets.on_commit,
                                                **{"partition.assignment.strategy": "cooperative-sticky"})
    done = 0
    try:
        if sub is not None and not _wait(sub.start().caught_up, stop, 120):
            log.warning("weights backlog not read within 120 s; starting on version %d", generator.version)
        if sub is not None and isinstance(sub.error, ConfigError):  # e.g. not the learner's architecture
            raise sub.error
        if generator.version < 0:
            raise ConfigError("--model learner: none of the learner's announced weights loaded (see the log)")
        log.info("producer %s: %s backend, env %s, %d episodes in flight, weights v%d", cfg.producer_id,
                 backend, ",".join(envs), cfg.concurrency, generator.version)
        done = asyncio.run(Service(cfg, offsets, producer, player, metrics, sub, stop, score).run())
    finally:
        producer.flush(5)  # dead letters; undelivered trajectories are abandoned (their prompts redelivered)
        consumer.close()  # commits nothing new: offsets were committed as prompts were delivered; leaves the group
        if sub is not None:
            sub.close()
        if hasattr(generator, "close"):  # an engine's threads and processes (vLLM's) end with the producer
            generator.close()
        metrics.close()
        log.info("producer %s stopped after %d prompts", cfg.producer_id, done)


def _wait(event: threading.Event, stop: threading.Event, timeout: float) -> bool:
    """`event.wait(timeout)` that a stop ends early (False then)."""
    deadline = time.monotonic() + timeout
    while not event.wait(0.2):
        if stop.is_set() or time.monotonic() > deadline:
            return False
    return True


class Service:
    """The consumer loop on one event loop: take prompts while fewer than `concurrency` episodes are
    in flight, serve delivery callbacks, and commit the delivered prefix of each partition."""

    def __init__(self, cfg: ProducerConfig, offsets: OffsetCommitter, producer, player: Player,
                 metrics: ProducerMetrics, sub: WeightSubscriber | None, stop: threading.Event, score=None):
        self.cfg, self.offsets, self.consumer, self.producer = cfg, offsets, offsets.consumer, producer
        self.player, self.metrics, self.sub, self.stop, self.score = player, metrics, sub, stop, score
        self.in_flight: dict[asyncio.Task, int] = {}  # episode -> its prompt's partition
        self.held: list = []  # messages polled while every slot was busy, taken first
        self.paused = False
        self.topics = {True: cfg.kafka.topic(T.TRAJECTORIES), False: cfg.kafka.topic(T.PENDING)}
        self.reward_bounds = Bounds(plugin=f"--reward {cfg.reward}", timeout_s=cfg.env_step_timeout)
        self.backpressure = Backpressure(cfg.kafka, cfg.max_lag) if cfg.max_lag else None
        self.stalls = (StalledFetches(self.consumer, GroupLag(cfg.kafka, T.PROMPTS, cfg.group), cfg.fetch_stall_s)
                       if cfg.fetch_stall_s else None)

    async def run(self) -> int:
        """Returns the number of prompts taken."""
        self.consumer.subscribe([self.cfg.kafka.topic(T.PROMPTS)], on_revoke=self._on_revoke,
                                on_lost=self._on_lost)
        taken = 0
        while not self.stop.is_set() and not (self.cfg.max_prompts and taken >= self.cfg.max_prompts):
            self.metrics.tick(self.player.generator.version, self.sub, len(self.in_flight))
            self.producer.poll(0)  # delivery callbacks resolve the episodes' acks, on this thread
            self._reap()
            self.offsets.resend_refused(time.monotonic())
            if (msg := self._next()) is not None:
                self._take(msg)
                taken += 1
                continue  # take the next one at once
            await self._idle()
        # finish what is in flight and commit it; on a stop, for at most --drain-s: the rest is
        # abandoned unpublished (its offsets uncommitted), and the group redelivers those prompts
        drain_until = time.monotonic() + self.cfg.drain_s if self.stop.is_set() else math.inf
        while self.in_flight and time.monotonic() < drain_until:
            self.producer.poll(0)
            await self._idle()
            self._reap()
        if self.in_flight:
            log.info("stopping: %d episodes abandoned, their prompts go to another producer", len(self.in_flight))
            self._drop(set(self.in_flight.values()))
            await asyncio.wait(self.in_flight, timeout=1.0)
        self.offsets.commit(list(self.offsets.positions))
        if self.backpressure is not None:
            self.backpressure.close()
        if self.stalls is not None:
            self.stalls.close()
        return taken

    def _next(self):
        """The next prompt message to take, or None. With every slot busy the partitions are paused
        but still polled, so a rebalance is answered at once, not when an episode ends; a message
        that comes anyway (from a partition assigned meanwhile) is held until a slot frees."""
        full = len(self.in_flight) >= self.cfg.concurrency or bool(self.backpressure and self.backpressure.held)
        if full != self.paused and (assigned := self.consumer.assignment()):
            (self.consumer.pause if full else self.consumer.resume)(assigned)
            self.paused = full
        if self.stalls is not None:
            self.stalls.tick(free=not full, now=time.monotonic())
        if self.held and not full:
            return self.held.pop(0)
        msg = self.consumer.poll(0)
        if msg is None or consumer_error(msg):
            return None
        if full:
            self.held.append(msg)
            self.consumer.pause([TopicPartition(msg.topic(), msg.partition())])
            self.paused = True  # so that a free slot resumes it with the rest
            return None
        return msg

    async def _idle(self) -> None:
        """Wait up to 10 ms for an episode to finish (the cadence of polls and acks)."""
        if self.in_flight:
            await asyncio.wait(self.in_flight, timeout=0.01, return_when=asyncio.FIRST_COMPLETED)
        else:
            await asyncio.sleep(0.01)

    def _reap(self) -> None:
        """Forget finished episodes; one that raised past its own handling ends the service."""
        for task in [t for t in self.in_flight if t.done()]:
            del self.in_flight[task]
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        if self.sub is not None and self.sub.error is not None:
            raise RuntimeError("weights subscription died") from self.sub.error

    def _take(self, msg) -> None:
        self.offsets.take(msg.partition(), msg.offset())
        prompt = decode_or_dead_letter(self.producer, self.cfg.kafka, msg, Prompt)
        if prompt is None:
            self.producer.flush(30)  # the dead letter is durable before the offset moves
            self.metrics.error("undecodable")
            self.offsets.deliver(msg.partition(), msg.offset())
            return
        log.info("episode start: prompt %s (partition %d offset %d)", prompt.id, msg.partition(), msg.offset())
        self.in_flight[asyncio.create_task(self._episode(msg, prompt))] = msg.partition()

    async def _episode(self, msg, prompt: Prompt) -> None:
        try:
            traj = await self.player.play(prompt)
            if self.score is not None:  # --reward: the outcome is the function's, not the env's
                traj = await call(self.reward_bounds, "reward", self.score, prompt.task, traj)
            await deliver(self.producer, self.topics[traj.reward is not None], traj)
            self.metrics.episode(traj)
        except ValueError as e:  # this prompt cannot be played, scored or published (SchemaError,
            # PluginError, RewardError, InvalidGeneration, a request the engine refused): DLQ it
            dead_letter(self.producer, self.cfg.kafka, msg, e)
            self.producer.flush(30)  # the dead letter is durable before the offset moves
            self.metrics.error(type(e).__name__)
        self.offsets.deliver(msg.partition(), msg.offset())

    def _on_revoke(self, consumer, partitions) -> None:
        """Cancel the revoked partitions' episodes and commit their delivered prefix; the new owner
        replays the rest (runs inside `consumer.poll`, on the loop's thread)."""
        revoked = self._drop({p.partition for p in partitions})
        self.offsets.commit(revoked)
        self.offsets.forget(revoked)

    def _on_lost(self, consumer, partitions) -> None:
        log.warning("lost partitions %s; their episodes in flight are dropped", [p.partition for p in partitions])
        self.offsets.forget(self._drop({p.partition for p in partitions}))

    def _drop(self, partitions: set[int]) -> set[int]:
        """Cancel the episodes and drop the held messages of `partitions`; returns them."""
        cancelled = [t for t, p in self.in_flight.items() if p in partitions and not t.done()]
        for task in cancelled:
            task.cancel()
        self.held = [m for m in self.held if m.partition() not in partitions]
        if partitions:
            log.info("partitions %s given up: %d episodes in flight cancelled", sorted(partitions), len(cancelled))
        return partitions

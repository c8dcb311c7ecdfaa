"""`sao learner`: consume trajectories as they arrive, train with SAO under FSDP2, publish weights.

One loop, the same for 1 and N ranks (`torchrun --nproc-per-node N -m learner.service`): rank 0
forms each step from Kafka and broadcasts its bytes; every rank trains its token-balanced share of
that step in token-budget micro-batches, and FSDP2 (parameters, gradients and optimizer state
sharded) sums the gradients (learner/update.py). After each step: checkpoint if due, then commit
the checkpoint's offsets to Kafka, then snapshot the policy if it changed; rank 0's publisher
thread writes and announces it while the next step trains (schemas/weights/publish.py).

Exactly once across crashes: the checkpoint (every rank's shards, learner/checkpoint.py) holds models,
optimizers, RNG, the weight version, the consumed position of every partition and the ledger of
trained trajectory ids; a restart, with any number of ranks, resumes from it and re-forms the
same steps, because steps close on counts, never on time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from learner.checkpoint import Checkpointer
from learner.checks import Trainable
from learner.failures import StepFailures
from learner.long_episodes import fresh_fraction, policy_tokens, staleness
from learner.lora import published_name
from learner.models import ModelConfig, build_models, build_policy
from learner.parallel import ParallelConfig, broadcast_bytes, init_distributed, snapshot
from learner.source import TrajectorySource
from learner.telemetry import Telemetry, episode_metrics, staleness_metrics
from learner.update import SAOUpdate, UpdateConfig
from learner.value import format_report, param_report
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, ensure_topics, make_producer
from schemas.messages import Trajectory
from schemas.process import stop_on_signals
from schemas.weights.announcements import announcer, newest_announced
from schemas.weights.collective import Links, link_backend
from schemas.weights.publish import DTYPES, AnchorRequests, Publisher, WeightsConfig
from schemas.weights.store import WeightStore

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LearnerConfig:
    run_dir: Path = Path("runs/learner")
    """Checkpoints and metrics.jsonl go here."""
    weights_dir: Path = Path("runs/weights")
    """Weight store shared with the producers (`SAO_WEIGHTS_DIR`)."""
    batch_trajectories: int = 128
    """A step closes at this many trajectories ..."""
    batch_tokens: int = 1 << 20
    """... or at this many tokens, whichever comes first."""
    max_staleness: int = 8
    """Action tokens sampled more than this many versions ago give no policy gradient (-1: no
    bound, 0: current only); the episode is dropped when too few of its tokens are fresher."""
    min_fresh_frac: float = 0.25
    """Drop a trajectory when less than this share of its action tokens is within --max-staleness
    (1.0: every token must be, as when whole episodes were judged by their oldest token). 0.25 from
    bench/results/fresh_fraction.md: it loses 0-1.3 % of the fresh tokens at bounds 8-4 and spends at
    most 4 token passes per token that gives policy gradient."""
    publish_every: int = 1
    """Publish the policy every this many versions."""
    keep_weights: int = 3
    """Anchors kept in the weight store, each with the delta files after it."""
    checkpoint_every: int = 10
    """Checkpoint every this many steps (offsets are committed to Kafka only then, so a crash
    replays at most this many steps; the weight versions published meanwhile are never reused)."""
    checkpoint_background: bool = True
    """Write checkpoints from a host copy on a thread while training goes on; the copy holds the
    models' and optimizers' size in memory meanwhile. Off: the step waits for the write and no copy
    is made (a memory-bound CPU learner)."""
    max_steps: int = 0
    """Stop after this many steps in total (0: run until SIGTERM)."""
    prefetch: int = 512
    """Decoded trajectories held ahead of training."""
    max_seq_len: int = 0
    """Longest trajectory trained, in tokens; longer ones go to sao.dlq (0: the model's context window)."""
    max_step_failures: int = 3
    """A step that raised on this many consecutive starts is dead-lettered whole (never a crash loop)."""
    dedup_window: int = 1 << 16
    """Most recent trained trajectory ids remembered to drop duplicates (bounds memory and checkpoints)."""
    group_wait_steps: int = 8
    """Group baselines: a group still incomplete after this many steps trains partial (G >= 2) or is dropped."""
    metrics_port: int = 0
    """Prometheus /metrics port on rank 0 (0: off)."""
    seed: int = 0
    """Seed of the learner's RNG."""
    model: ModelConfig = field(default_factory=ModelConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        at_least = {"batch_trajectories": 1, "batch_tokens": 1, "publish_every": 1, "keep_weights": 1,
                    "checkpoint_every": 1, "prefetch": 1, "max_step_failures": 1, "dedup_window": 1,
                    "group_wait_steps": 1, "max_staleness": -1, "max_steps": 0, "max_seq_len": 0,
                    "metrics_port": 0}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if not 0 <= self.min_fresh_frac <= 1:
            raise ConfigError(f"--min-fresh-frac must be in [0, 1], got {self.min_fresh_frac}")

    def trainable(self, model_config) -> Trainable:
        """What this learner can train, from its settings and its model's config (learner/checks.py)."""
        context = getattr(model_config, "max_position_embeddings", None) or self.max_seq_len
        if self.max_seq_len > context:
            raise ConfigError(f"--max-seq-len {self.max_seq_len} exceeds the model's context window {context}")
        return Trainable(vocab_size=model_config.vocab_size, max_seq_len=self.max_seq_len or context,
                         temperature=self.update.temperature,
                         needs_groups=self.update.settings.advantage == "group",
                         max_group_size=self.batch_trajectories)


@dataclass(kw_only=True)
class FormedStep:
    """A step as every rank sees it: its trajectories in consumption order, and their staleness
    against the version the step was formed at (docs/algorithm.md §6)."""

    trajectories: list[Trajectory]
    staleness: list[int]
    dropped: dict[str, list[str]] = field(default_factory=dict)
    """Rank 0: ids consumed while forming it and not trained, by reason (`StepBatch.dropped`)."""


class Learner:
    """The learner's parts and state; `run` drives it."""

    def __init__(self, cfg: LearnerConfig):
        self.cfg = cfg
        self.rank, self.world, self.device = init_distributed(cfg.parallel.device)
        torch.manual_seed(cfg.seed)
        self.policy, self.critic = build_models(build_policy(cfg.model) if self.rank == 0 else None,
                                                cfg.update.settings.uses_critic, cfg.parallel, self.device,
                                                cfg.model.lora)
        self.model_config = self.policy.config
        self.update = SAOUpdate(self.policy, self.critic, cfg.update)
        self.ckpt = Checkpointer(cfg.run_dir / "checkpoints", cfg.checkpoint_every, background=cfg.checkpoint_background)
        self.store = WeightStore(cfg.weights_dir, cfg.keep_weights)
        self.version = 0
        self.restarts: list[tuple[int, int]] = []  # (restored version, its new number): see continue_versions
        self.failures = StepFailures(cfg.run_dir / "step_failures.json", cfg.max_step_failures)
        self.source = TrajectorySource(
            cfg.kafka, cfg.trainable(self.model_config), prefetch=cfg.prefetch,
            dedup_window=cfg.dedup_window, group_wait_steps=cfg.group_wait_steps) if self.rank == 0 else None
        self.producer = make_producer(cfg.kafka) if self.rank == 0 else None
        self.publisher = Publisher(
            cfg.weights, self.store, announcer(self.producer, cfg.kafka.topic(T.WEIGHTS)),
            links=Links(cfg.weights.collective_port, cfg.weights.collective_timeout_s,
                        link_backend(cfg.weights.collective_backend, self.device), self.device,
                        cfg.weights.bucket_mb << 20) if cfg.weights.transport == "collective" else None,
            extra={"lora_scale": cfg.model.lora.scale} if cfg.model.lora else None) if self.rank == 0 else None
        self.anchor_requests: AnchorRequests | None = None  # rank 0, once the topics exist (`run`)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, optimizers: set[str] | None = None) -> dict:
        """Everything a restart needs: `SAOUpdate`'s state (sharded), the weight version and RNG,
        and on rank 0 the source's offsets and ledger. A collective: every rank calls it."""
        state = self.update.state_dict(optimizers=optimizers) | {
            "version": self.version, "restarts": [list(x) for x in self.restarts],
            "rng": torch.get_rng_state().numpy().tobytes()}
        if self.source is not None:
            state["source"] = self.source.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        self.restarts = [tuple(x) for x in state.get("restarts", [])]  # absent from older checkpoints
        torch.set_rng_state(torch.frombuffer(bytearray(state["rng"]), dtype=torch.uint8))
        self.update.load_state_dict(state)
        if self.source is not None:
            self.source.load_state_dict(state["source"])

    def restore(self) -> bool:
        """Load the latest checkpoint, whatever world size wrote it; False if there is none."""
        path = self.ckpt.latest()
        if path is None:
            return False
        template = self.state_dict(optimizers=Checkpointer.saved_keys(path))
        self.load_state_dict(Checkpointer.load(path, template))
        return True

    def continue_versions(self) -> None:
        """Never give two policies one version number. Versions published after the restored
        checkpoint (it is written every `checkpoint_every` steps, and asynchronously) belong to
        steps that are now replayed; producers already hold them and ignore repeats, so the
        restored policy takes the next number past the store's newest, and staleness skips the
        numbers in between (`source.staleness`). A collective."""
        newest = max(self.store.newest(), newest_announced(self.cfg.kafka)) if self.rank == 0 else -1
        version = torch.tensor([newest + 1 if newest > self.version else self.version],
                               dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(version, 0)
        if version.item() != self.version:
            log.info("the weight store holds versions past %d (published after this state); "
                     "this policy is version %d", self.version, version.item())
            self.restarts = [*self.restarts[-15:], (self.version, int(version.item()))]  # older: long stale
            self.version = int(version.item())

    def checkpoint(self) -> None:
        """Every rank writes its shards; offsets go to Kafka only once the checkpoint is durable."""
        state = self.state_dict()
        saved = state["source"]["positions"] if self.source else {}
        self.ckpt.save(self.update.step_count, state,
                       then=(lambda: self.source.commit(saved)) if self.source else lambda: None)

    # ------------------------------------------------------------------ weights
    def publish(self) -> float:
        """Snapshot the policy and hand it to the publisher, which writes and announces it in the
        background; returns the seconds the training thread spent (the snapshot). The critic is
        never gathered."""
        t0 = time.perf_counter()
        state = snapshot(self.policy, DTYPES[self.cfg.weights.dtype], self.cfg.weights.bucket_mb << 20,
                         published_name)
        if self.publisher is not None:
            self.publisher.submit(state, self.version, self.update.step_count)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ one step
    def next_trajectories(self, stop: threading.Event) -> FormedStep | None:
        """The next step, formed by rank 0 from Kafka and broadcast; None once `stop` is set."""
        step = None
        if self.rank == 0:
            step = self.source.next_step(
                step_index=self.update.step_count, staleness=self.staleness, fresh=self.fresh,
                min_fresh_frac=self.cfg.min_fresh_frac, batch_trajectories=self.cfg.batch_trajectories,
                batch_tokens=self.cfg.batch_tokens, stop=stop, poisoned=self.failures.poisoned)
        payloads = broadcast_bytes(step.payloads if step else None, self.device)
        if payloads is None:
            return None
        if step:  # rank 0 measured staleness while forming the step; the others measure it alike
            return FormedStep(trajectories=step.trajectories, staleness=step.staleness, dropped=step.dropped)
        trajs = [Trajectory.decode(p) for p in payloads]
        return FormedStep(trajectories=trajs, staleness=[self.staleness(t) for t in trajs])

    def staleness(self, traj: Trajectory) -> int:
        """Policy updates since `traj`'s stalest token was sampled, along this learner's line (docs/algorithm.md §6)."""
        return staleness(self.version, traj, self.restarts)

    def fresh(self, traj: Trajectory) -> float:
        """The share of `traj`'s action tokens within `--max-staleness` (learner/long_episodes.py)."""
        return fresh_fraction(self.version, traj, self.cfg.max_staleness, self.restarts)

    def train_step(self, trajs: list[Trajectory]) -> dict:
        t0 = time.perf_counter()
        up = self.cfg.update
        trained, masks = policy_tokens(self.version, trajs, self.cfg.max_staleness, up.overlong,
                                       up.overlong_penalty, self.restarts)
        with self.failures.guard([t.id for t in trajs]):  # the update alone: publishing is not the input's fault
            metrics = self.update.step(trained, masks)
        train_s = time.perf_counter() - t0
        if metrics["step/policy_updated"]:
            self.version += 1
        if self.ckpt.due(self.update.step_count):
            self.checkpoint()
        publish_s = 0.0
        if metrics["step/policy_updated"] and self.version % self.cfg.publish_every == 0:
            publish_s = self.publish()
        tokens = sum(t.num_tokens for t in trajs)
        step_s = time.perf_counter() - t0
        return metrics | (self.publisher.last if self.publisher else {}) | {
            "time": time.time(), "weights/version": self.version, "perf/step_s": step_s, "perf/train_s": train_s,
            "perf/publish_s": publish_s, "perf/tokens_per_s": tokens / step_s,
            "perf/trajectories_per_s": len(trajs) / step_s, "batch/trajectories": len(trajs),
            "batch/tokens": tokens, "trajectory_ids": [t.id for t in trajs]} | episode_metrics(trajs, masks)


def run(cfg: LearnerConfig) -> None:
    stop = stop_on_signals()
    learner = Learner(cfg)
    telemetry = Telemetry(cfg.run_dir, cfg.metrics_port) if learner.rank == 0 else None
    try:
        if learner.rank == 0:
            ensure_topics(cfg.kafka)  # idempotent; a fresh cluster works without a setup step
            learner.source.claim()  # before anything shared is touched: one learner per run
            learner.anchor_requests = AnchorRequests(cfg.kafka, learner.publisher)
        if learner.restore():
            log.info("resumed at step %d, version %d", learner.update.step_count, learner.version)
        learner.continue_versions()
        if learner.rank == 0 and learner.critic is not None:  # docs/algorithm.md §5: what the critic trains
            log.info("critic parameters:\n%s", format_report(param_report(learner.critic)))
        if learner.source:  # the checkpoint's positions are loaded: join, alone, before writing anything shared
            learner.source.start().joined()
            # producers on `--model learner` build the architecture from it
            learner.store.describe(learner.model_config, cfg.model.name, cfg.model.lora)
        learner.publish()  # version 0, or the restored version again (the same weights): producers ignore repeats
        while not cfg.max_steps or learner.update.step_count < cfg.max_steps:
            step = learner.next_trajectories(stop)
            if step is None:
                break
            metrics = learner.train_step(step.trajectories)
            if telemetry:
                src = learner.source
                telemetry.record(metrics | staleness_metrics(step.staleness) | {
                    "kafka/lag": src.lag(), "kafka/queued": src.queued(), "dropped_ids": step.dropped,
                    **{f"count/{k}": src.counts[k] for k in ("dlq", "stale", "duplicate")}})
        if learner.update.step_count % max(cfg.checkpoint_every, 1):
            learner.checkpoint()  # a clean stop keeps every trained step
        learner.ckpt.wait()
        if learner.publisher:
            learner.publisher.wait()  # the last version reaches the producers
    finally:
        if learner.anchor_requests:
            learner.anchor_requests.close()
        if learner.publisher:
            learner.publisher.close()
        if learner.source:
            learner.source.close()
        if learner.producer:
            learner.producer.flush(30)
        if telemetry:
            telemetry.close()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":  # torchrun --nproc-per-node N -m learner.service [flags]
    from schemas.config import one_line_errors, parse
    logging.basicConfig(level=os.environ.get("SAO_LOG_LEVEL", "INFO"))
    with one_line_errors("learner.service"):  # a misconfiguration: one line and exit 2 on every rank, as `sao learner`
        run(parse(LearnerConfig, description=__doc__))

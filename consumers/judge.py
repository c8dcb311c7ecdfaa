"""`sao judge`: score pending trajectories and publish their rewards.

Reads `sao.trajectories.pending` in consumer group `sao-judges` (judges scale by adding members),
decodes each completion with the policy's tokenizer, asks the judge, and publishes a `Reward`
keyed by the trajectory id, which the reward joiner then joins. The criterion is the last one set
on the control topic (`sao judge set-criterion`), else the one the schedule gives: `--criteria`
in turn, moving on every `--switch-every` rewards (0: never). A message it cannot decode is
skipped and counted: the joiner, reading the same topic, is the one that dead-letters it. The
judge itself is a plug-in called through the boundary (schemas/boundary.py): a call that raises,
hangs past `--judge-timeout` or returns no finite number, three times, skips that trajectory
(counted; the joiner times it out). A broker outage only delays a reward: it is sent until the
broker has it. Prometheus on `--metrics-port`: `sao_judge_rewards_total{criterion}`,
`sao_judge_skipped_total{reason}`, `sao_judge_seconds` (judging and publishing one reward).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from consumers.control import CriterionFollower
from consumers.judges import Judge, load_judge
from consumers.metrics import JudgeMetrics
from consumers.rewards import RewardPublisher
from consumers.tokenizer import load_tokenizer
from schemas import topics as T
from schemas.boundary import Bounds, PluginError, call_sync, reward
from schemas.config import ConfigError
from schemas.kafka import ServiceConfig, consumer_error, ensure_topics, make_consumer
from schemas.messages import Reward, SchemaError, Trajectory
from schemas.process import stop_on_signals

log = logging.getLogger(__name__)
GROUP = "sao-judges"


@dataclass(kw_only=True)
class JudgeConfig(ServiceConfig):
    judge: str = "style"
    """style (rule-based), llm (asks `--llm-url`), or module:callable(prompt, completion, criterion) -> float."""
    model: str = "tiny-llama-bytes"
    """The policy, whose tokenizer turns token ids back into text (same names as `sao producer --model`)."""
    criteria: tuple[str, ...] = ("uppercase",)
    """Criteria in schedule order; the first is used from the start."""
    switch_every: int = 0
    """Move to the next criterion every this many rewards (0: never)."""
    llm_url: str = ""
    """Completions server of the llm judge, e.g. http://127.0.0.1:8000 (`sao serve`)."""
    serve_token: str = ""
    """Bearer token of that server (its `--serve-token`; both read `SAO_SERVE_TOKEN`)."""
    max_rewards: int = 0
    """Stop after this many rewards (0: run until SIGTERM)."""
    judge_timeout: float = 60.0
    """Seconds one judge call may take; a call that takes longer is abandoned (the trajectory is
    skipped, counted, and times out in the joiner)."""

    def __post_init__(self):
        if not self.criteria:
            raise ConfigError("--criteria needs at least one criterion")


class Schedule:
    """The criterion for the next reward: the control topic's, else the schedule's."""

    def __init__(self, criteria: tuple[str, ...], switch_every: int):
        self.criteria, self.switch_every = criteria, switch_every
        self.given = 0
        self.override: str | None = None

    def current(self) -> str:
        if self.override is not None:
            return self.override
        phase = self.given // self.switch_every if self.switch_every else 0
        return self.criteria[phase % len(self.criteria)]


def completion_text(traj: Trajectory, tokenizer) -> tuple[str, str]:
    """(prompt, completion): the completion is the action tokens after the prompt."""
    ids = traj.tokens.tolist()
    actions = [t for t, a in zip(ids[traj.prompt_len:], traj.action_mask[traj.prompt_len:].tolist()) if a]
    return (tokenizer.decode(ids[:traj.prompt_len], skip_special_tokens=True),
            tokenizer.decode(actions, skip_special_tokens=True))


def judged(bounds: Bounds, judge: Judge, prompt: str, completion: str, criterion: str,
           attempts: int = 3) -> float:
    """The judge's reward, called through the plug-in boundary (schemas/boundary.py: bounded in
    time, anything it raises or returns but a finite number a PluginError), tried `attempts` times
    with a backoff, since an llm judge's server may be restarting."""
    for attempt in range(attempts):
        try:
            value = call_sync(bounds, "judge", judge, prompt, completion, criterion)
            if (r := reward(bounds, "judge", value)) is None:
                raise bounds.fail("judge", "returned None, not a reward")
            return r
        except PluginError:
            if attempt == attempts - 1:
                raise
            time.sleep(0.5 * 2 ** attempt)


def run(cfg: JudgeConfig, stop: threading.Event | None = None, judge: Judge | None = None) -> None:
    stop = stop_on_signals(stop)
    tokenizer = load_tokenizer(cfg.model)
    judge = judge or load_judge(cfg.judge, llm_url=cfg.llm_url, tokenizer=tokenizer, token=cfg.serve_token)
    ensure_topics(cfg.kafka, (T.PENDING, T.REWARDS))
    schedule = Schedule(cfg.criteria, cfg.switch_every)
    control = CriterionFollower(cfg.kafka)
    # auto-commit of stored offsets only: an offset is stored once its reward is on the broker
    consumer = make_consumer(cfg.kafka, GROUP, **{"enable.auto.commit": True})
    consumer.subscribe([cfg.kafka.topic(T.PENDING)])
    publisher = RewardPublisher(cfg.kafka)
    metrics = JudgeMetrics(cfg.metrics_port)
    bounds = Bounds(plugin=f"--judge {cfg.judge}", timeout_s=cfg.judge_timeout)
    skipped, last_log = 0, time.monotonic()
    try:
        while not stop.is_set() and not (cfg.max_rewards and schedule.given >= cfg.max_rewards):
            if (switched := control.latest()) != schedule.override:
                log.info("judge: criterion set to %r on the control topic", switched)
                schedule.override = switched
            msg = consumer.poll(0.5)
            if msg is None or consumer_error(msg):
                continue
            try:
                traj = Trajectory.decode(msg.value() or b"")
            except SchemaError:
                skipped += 1
                metrics.skipped("undecodable")
                consumer.store_offsets(msg)
                continue
            criterion = schedule.current()
            t0 = time.monotonic()
            try:
                reward = judged(bounds, judge, *completion_text(traj, tokenizer), criterion)
            except PluginError as e:  # this trajectory only: it stays unrewarded and times out in the joiner
                log.warning("judge: trajectory %s not scored: %s", traj.id, e)
                metrics.skipped("judge_error")
                consumer.store_offsets(msg)
                continue
            # the reward is on the broker before the trajectory counts as judged, however long that takes
            if not publisher.deliver(Reward(trajectory_id=traj.id, reward=reward, source=f"judge:{cfg.judge}",
                                            criterion=criterion), stop):
                break  # stopped before the broker took it: judged again after a restart
            consumer.store_offsets(msg)
            metrics.scored(criterion, time.monotonic() - t0)
            schedule.given += 1
            if time.monotonic() - last_log > cfg.log_every_s:
                log.info("judge: %d rewards, criterion %r, %d skipped", schedule.given, criterion, skipped)
                last_log = time.monotonic()
    finally:
        consumer.close()  # commits the offsets stored last
        control.close()
        publisher.producer.flush(5)
        metrics.close()

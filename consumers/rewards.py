"""Publish live rewards: `publish(...)` for Python callers, `sao reward publish` for humans and scripts.

A reward is keyed by its trajectory id, so it lands on the partition of `sao.rewards` that matches
the trajectory's partition of `sao.trajectories.pending` (both topics have the same partition
count and every client here uses the same partitioner), which is what the joiner's co-partitioned
tables need.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, Producer

from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import FatalKafkaError, KafkaConfig, make_producer, produce, produce_and_wait, refused
from schemas.messages import Reward

log = logging.getLogger(__name__)


class RewardPublisher:
    """A producer of rewards; `send` returns at once, `flush` waits for the broker's acks."""

    def __init__(self, kafka: KafkaConfig, producer: Producer | None = None):
        self.topic = kafka.topic(T.REWARDS)
        self.producer = producer or make_producer(kafka)
        self.failed: list[tuple[bytes | None, KafkaError]] = []  # (key, delivery error) of each reward lost

    def send(self, reward: Reward, on_delivery=None) -> None:
        produce(self.producer, self.topic, reward.encode(), key=reward.key, on_delivery=on_delivery or self._check)

    def flush(self, timeout: float = 30.0) -> None:
        if self.producer.flush(timeout):
            raise TimeoutError(f"rewards not acknowledged by the broker within {timeout}s")
        if refusal := next((err for _, err in self.failed if refused(err)), None):
            raise FatalKafkaError(f"Kafka refused the write to {self.topic}: {refusal.str()}")
        if self.failed:
            raise RuntimeError(f"rewards not delivered: {[f'{key!r}: {err}' for key, err in self.failed]}")

    def deliver(self, reward: Reward, stop: threading.Event) -> bool:
        """Send `reward` and wait until the broker has it, sending it again if librdkafka's own
        retries ran out (the cluster down for minutes): a broker outage delays a reward, never
        loses it or stops the caller. False if `stop` came first."""
        while not stop.is_set():
            try:
                err = produce_and_wait(self.producer, self.topic, reward.encode(), reward.key, timeout=math.inf,
                                       stop=stop)
            except TimeoutError:  # stopped
                return False
            if err is None:
                return True
            log.warning("reward for %s not delivered (%s); sending it again", reward.trajectory_id, err)
            stop.wait(1.0)
        return False

    def _check(self, err, msg) -> None:
        if err is not None:
            self.failed.append((msg.key(), err))


def publish(trajectory_id: str, reward: float, *, source: str = "python", criterion: str = "",
            token_index: int | None = None, kafka: KafkaConfig | None = None) -> Reward:
    """Publish one reward and wait until the broker has it; returns the message sent."""
    msg = Reward(trajectory_id=trajectory_id, reward=reward, token_index=token_index, source=source,
                 criterion=criterion)
    Reward.decode(msg.encode())  # the codec's checks (finite reward, bounded strings) before sending
    publisher = RewardPublisher(kafka or KafkaConfig())
    publisher.send(msg)
    publisher.flush()
    return msg


@dataclass(kw_only=True)
class PublishConfig:
    trajectory: str = ""
    """Id of the trajectory the reward is for (the receipt a producer or `sao serve` handed out); required."""
    reward: float | None = None
    """The reward; required."""
    token_index: int | None = None
    """Token index of a per-turn reward (an action token); unset for the outcome reward."""
    source: str = "cli"
    """Who gives the reward."""
    criterion: str = ""
    """What the reward measures, free text."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)


def run(cfg: PublishConfig) -> None:
    if not cfg.trajectory or cfg.reward is None:
        raise ConfigError("--trajectory and --reward are required")
    msg = publish(cfg.trajectory, cfg.reward, source=cfg.source, criterion=cfg.criterion,
                  token_index=cfg.token_index, kafka=cfg.kafka)
    print(f"published reward {msg.reward} for {msg.trajectory_id} to {cfg.kafka.topic(T.REWARDS)}")

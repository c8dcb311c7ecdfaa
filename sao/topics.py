"""`sao topics`: create every sao topic with its partition count and configs, then exit (idempotent:
existing topics are left as they are). The one-shot `topics` service of docker-compose.yml."""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas.kafka import KafkaConfig, ensure_topics, wait_for_broker


@dataclass(kw_only=True)
class TopicsConfig:
    wait_s: float = 120.0
    """Seconds to wait for the broker to answer before giving up."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)


def run(cfg: TopicsConfig) -> None:
    wait_for_broker(cfg.kafka.bootstrap, cfg.wait_s, cfg.kafka.settings)
    for name in ensure_topics(cfg.kafka):
        print(f"topic {name} ready", flush=True)

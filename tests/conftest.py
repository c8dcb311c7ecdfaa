"""Shared fixtures: one real Kafka broker per test session, and a fresh topic namespace per test.

`SAO_KAFKA_BOOTSTRAP` set -> the tests use that cluster instead of starting one.
"""

from __future__ import annotations

import os
import uuid

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from confluent_kafka.admin import AdminClient  # noqa: E402

from schemas.kafka import KafkaConfig, ensure_topics  # noqa: E402


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory) -> str:
    if os.environ.get("SAO_KAFKA_BOOTSTRAP"):
        yield os.environ["SAO_KAFKA_BOOTSTRAP"]
        return
    broker = EmbeddedBroker(BrokerConfig(data_dir=tmp_path_factory.mktemp("kafka"), port=0))
    broker.start()
    try:
        yield broker.bootstrap
    finally:
        broker.close()


@pytest.fixture
def kafka_cfg(kafka_bootstrap) -> KafkaConfig:
    """A KafkaConfig whose topics (all of them, created) belong to this test alone; deleted after
    it, so one broker does not pile up thousands of partitions over the session."""
    cfg = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}")
    ensure_topics(cfg)
    yield cfg
    admin = AdminClient(cfg.client())
    names = [t for t in admin.list_topics(timeout=10).topics if t.startswith(cfg.topic_prefix)]
    if names:
        admin.delete_topics(names, operation_timeout=30)

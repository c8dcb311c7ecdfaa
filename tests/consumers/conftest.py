"""A topic namespace shared by the tests of one module, for services that take seconds to start.

Unlike the per-test namespaces, these are not deleted: a few modules add a few hundred partitions
to the session's broker, and a faust app's internal topics would outlive a delete anyway.
"""

from __future__ import annotations

import uuid

import pytest

from schemas.kafka import KafkaConfig, ensure_topics


@pytest.fixture(scope="module")
def module_kafka(kafka_bootstrap) -> KafkaConfig:
    cfg = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=f"m{uuid.uuid4().hex[:10]}")
    ensure_topics(cfg)
    return cfg

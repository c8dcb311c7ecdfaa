"""Shared fixtures: one real Kafka broker per test session, and a fresh topic namespace per test.

`SAO_KAFKA_BOOTSTRAP` set -> the tests use that cluster instead of starting one. `SAO_TEST_FAST=1`
(`make test-fast`) leaves out the slow modules below, for iterating; `make test` runs them all.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from confluent_kafka.admin import AdminClient  # noqa: E402

from schemas.kafka import KafkaConfig, ensure_topics  # noqa: E402

SLOW = [
    "bench/test_critic_ablation.py",
    "bench/test_pipeline_stability.py",
    "consumers/test_endpoint.py",
    "consumers/test_joiner.py",
    "consumers/test_joiner_recovery.py",
    "consumers/test_judge.py",
    "learner/test_exactly_once.py",
    "learner/test_learning.py",
    "learner/test_multinode.py",
    "learner/test_one_learner.py",
    "learner/test_parallel.py",
    "schemas/weights/test_publish.py",
    "learner/test_service.py",
    "learner/test_untrainable.py",
    "producers/test_backpressure.py",
    "producers/test_boundary.py",
    "producers/test_collective.py",
    "producers/test_concurrency.py",
    "producers/test_eval.py",
    "producers/test_feeder.py",
    "producers/test_learner_model.py",
    "producers/test_models.py",
    "producers/test_plugins.py",
    "producers/test_proxy.py",
    "producers/test_service.py",
    "schemas/weights/test_signed.py",
    "producers/test_vllm.py",
    "producers/test_vllm_pipeline.py",
    "schemas/weights/test_follow.py",
    "test_adapters.py",
    "test_audit.py",
    "test_broker.py",
    "test_broker_faults.py",
    "test_cli.py",
    "test_compose.py",
    "test_export.py",
    "test_long_episode.py",
    "test_resume.py",
    "test_misconfiguration.py",
    "test_up.py",
    "test_warmup.py",
    "test_security.py",
]
"""The modules of 25 s or more in the suite's run of 2026-12-02 (`pytest --durations=0`, 57 min in
all): the compose, kill, multi-node, vLLM and pipeline tests and the longer Kafka ones. Without
them the suite's tests took 225 s."""
collect_ignore = SLOW if os.environ.get("SAO_TEST_FAST") == "1" else []

LONGEST_FIRST = [
    "test_broker_faults.py",
    "test_compose.py",
    "learner/test_service.py",
    "test_resume.py",
    "test_export.py",
    "bench/test_pipeline_stability.py",
    "producers/test_vllm_pipeline.py",
    "test_cli.py",
    "test_security.py",
    "producers/test_feeder.py",
    "learner/test_multinode.py",
    "test_broker.py",
]
"""The longest modules, longest first, by their tests' times in a fresh-clone `make test` of
2026-12-03 (`--durations=30`). `make test`'s two workers take whole modules in collection order;
handed out first, none of these starts last and runs alone while the other worker sits idle."""


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    tests = Path(__file__).parent
    items.sort(key=lambda item: first.get(item.path.relative_to(tests).as_posix(), len(first)))  # stable


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

"""Kafka plumbing against the real embedded broker: topics, bulk round trip, dead letters."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
from confluent_kafka import TopicPartition

from sao.demo import random_trajectory
from schemas import topics as T
from schemas.kafka import (KafkaConfig, decode_or_dead_letter, ensure_topics, make_consumer,
                           make_producer, passthrough_settings, produce, produce_and_wait, read_ranges)
from schemas.messages import DeadLetter, Trajectory, decode


def _drain(cfg: KafkaConfig, topic: str, want: int, timeout: float = 120.0) -> list:
    consumer = make_consumer(cfg, f"test-{uuid.uuid4().hex[:8]}")
    consumer.subscribe([topic])
    got = []
    try:
        deadline = time.monotonic() + timeout
        while len(got) < want and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            got.append(msg)
    finally:
        consumer.close()
    return got


def test_ensure_topics_twice_is_a_no_op_the_second_time(kafka_bootstrap):
    cfg = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:8]}")
    created = ensure_topics(cfg)
    assert sorted(created) == sorted(cfg.topic(t) for t in T.ALL)
    assert ensure_topics(cfg) == []
    from confluent_kafka.admin import AdminClient
    md = AdminClient(cfg.client()).list_topics(timeout=10).topics
    for t in T.ALL:
        assert len(md[cfg.topic(t)].partitions) == t.partitions


def test_a_thousand_trajectories_of_1_to_32k_tokens_come_back_byte_identical(kafka_cfg):
    rng = np.random.default_rng(7)
    # log-uniform lengths cover both ends of 1..32k without shipping 200 MB through 2 cores
    lengths = np.exp(rng.uniform(0, np.log(32768), 1000)).astype(int).clip(1, 32768)
    lengths[:2] = [1, 32768]
    sent = {}
    producer = make_producer(kafka_cfg)
    topic = kafka_cfg.topic(T.TRAJECTORIES)
    for i, n in enumerate(lengths):
        data = random_trajectory(rng, int(n), i).encode()
        sent[f"traj-{i}"] = data
        produce(producer, topic, data, key=f"traj-{i}".encode())
    assert producer.flush(60) == 0
    got = _drain(kafka_cfg, topic, len(sent))
    assert len(got) == len(sent)
    for msg in got:
        traj = Trajectory.decode(msg.value())
        assert sent[traj.id] == msg.value()
        assert traj.num_tokens == lengths[int(traj.id.split("-")[1])]


def test_invalid_bytes_go_to_the_dlq_with_their_offset_and_consumption_continues(kafka_cfg):
    rng = np.random.default_rng(3)
    topic = kafka_cfg.topic(T.TRAJECTORIES)
    producer = make_producer(kafka_cfg)
    payloads = [random_trajectory(rng, 50, 0).encode(), b"\x93not a trajectory",
                random_trajectory(rng, 60, 1).encode(), T.DLQ.suffix.encode(),
                random_trajectory(rng, 70, 2).encode()]
    for p in payloads:  # one key: one partition, so offsets are 0..4 in order
        produce(producer, topic, p, key=b"same-partition")
    assert producer.flush(30) == 0

    good, dlq_producer = [], make_producer(kafka_cfg)
    for msg in _drain(kafka_cfg, topic, len(payloads)):
        traj = decode_or_dead_letter(dlq_producer, kafka_cfg, msg, expect=Trajectory)
        if traj is not None:
            good.append((msg.offset(), traj.num_tokens))
    assert dlq_producer.flush(30) == 0
    assert [n for _, n in good] == [50, 60, 70]

    letters = [DeadLetter.decode(m.value()) for m in _drain(kafka_cfg, kafka_cfg.topic(T.DLQ), 2)]
    bad = {p for p in payloads if p in (b"\x93not a trajectory", b"dlq")}
    assert {dl.payload for dl in letters} == bad
    offsets = {dl.payload: dl.offset for dl in letters}
    assert offsets[b"\x93not a trajectory"] == 1 and offsets[b"dlq"] == 3
    assert all(dl.source_topic == topic and dl.error for dl in letters)


def test_a_message_of_the_wrong_kind_is_a_dead_letter(kafka_cfg):
    topic = kafka_cfg.topic(T.TRAJECTORIES)
    producer = make_producer(kafka_cfg)
    from schemas.messages import Prompt
    produce(producer, topic, Prompt(id="p", env="math").encode())
    assert producer.flush(30) == 0
    (msg,) = _drain(kafka_cfg, topic, 1)
    assert decode_or_dead_letter(producer, kafka_cfg, msg, expect=Trajectory) is None
    assert producer.flush(30) == 0
    (dl,) = _drain(kafka_cfg, kafka_cfg.topic(T.DLQ), 1)
    assert "kind" in decode(dl.value()).error


def test_sao_kafka_variables_pass_through_to_librdkafka():
    env = {"SAO_KAFKA_BOOTSTRAP": "b:9092", "SAO_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
           "SAO_KAFKA_SASL_MECHANISM": "PLAIN", "SAO_KAFKA_SASL_USERNAME": "u", "SAO_OTHER": "x"}
    assert passthrough_settings(env) == {"security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN",
                                         "sasl.username": "u"}
    from schemas.config import from_env
    cfg = from_env(KafkaConfig, env, prefix="SAO_KAFKA_")
    assert cfg.bootstrap == "b:9092"
    client = KafkaConfig(bootstrap="b:9092", settings=passthrough_settings(env)).client()
    assert client["sasl.mechanism"] == "PLAIN" and client["bootstrap.servers"] == "b:9092"


def test_one_rule_says_which_kafka_errors_are_worth_a_retry():
    from confluent_kafka import KafkaError

    from schemas.retry import transient
    for code in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._DESTROY_BROKER,
                 KafkaError.NOT_COORDINATOR, KafkaError._WAIT_COORD, KafkaError._MSG_TIMED_OUT,
                 KafkaError.REBALANCE_IN_PROGRESS, KafkaError.NOT_ENOUGH_REPLICAS,
                 KafkaError.OFFSET_NOT_AVAILABLE):  # a new leader's high watermark not caught up (a broker fault test saw it)
        assert transient(KafkaError(code)), code
    for code in (KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.SASL_AUTHENTICATION_FAILED,
                 KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.INVALID_CONFIG):
        assert not transient(KafkaError(code)), code
    assert not transient(KafkaError(KafkaError._TRANSPORT, fatal=True))


def test_topics_get_three_replicas_of_which_two_must_take_a_write_once_there_are_three_brokers():
    from schemas.topics import replication

    assert [replication(n) for n in (1, 2, 3, 5)] == [(1, 1), (2, 1), (3, 2), (3, 2)]


def test_a_range_read_ends_at_offsets_without_messages_and_reads_only_its_range(kafka_cfg):
    # a transaction's commit marker takes the last offset: no message is ever delivered there
    topic = kafka_cfg.topic(T.DLQ)
    producer = make_producer(kafka_cfg, **{"transactional.id": f"t-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(3):
        produce(producer, topic, f"m{i}".encode())
    producer.commit_transaction(30)
    consumer = make_consumer(kafka_cfg, f"test-{uuid.uuid4().hex[:8]}")
    try:
        deadline = time.monotonic() + 30
        while (marks := consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10, cached=False))[1] < 4:
            assert time.monotonic() < deadline, marks  # the committed transaction not visible yet
            time.sleep(0.2)
        low, high = marks
        assert high - low == 4  # three messages and the marker
        t0 = time.monotonic()
        assert [m.value() for m in read_ranges(consumer, topic, {0: (low, high)}, timeout=20)] == [b"m0", b"m1", b"m2"]
        assert time.monotonic() - t0 < 15  # done by its position, not by the timeout
        assert [m.offset() for m in read_ranges(consumer, topic, {0: (low + 1, low + 2)}, timeout=20)] == [low + 1]
        assert consumer.assignment() == []  # left unassigned for the next read
        stop = threading.Event()
        stop.set()
        assert list(read_ranges(consumer, topic, {0: (high, high + 5)}, stop=stop)) == []
    finally:
        consumer.close()



def test_produce_and_wait_returns_once_the_broker_has_the_message_and_times_out_on_a_dead_cluster(kafka_cfg):
    topic = kafka_cfg.topic(T.DLQ)
    assert produce_and_wait(make_producer(kafka_cfg), topic, b"acked", b"k") is None
    assert [m.value() for m in _drain(kafka_cfg, topic, 1)] == [b"acked"]
    nowhere = make_producer(KafkaConfig(bootstrap="127.0.0.1:1", topic_prefix=kafka_cfg.topic_prefix, settings={}))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="within 1 s"):
        produce_and_wait(nowhere, topic, b"never", timeout=1.0)
    assert time.monotonic() - t0 < 10
    stop = threading.Event()
    stop.set()
    with pytest.raises(TimeoutError, match="stopped"):
        produce_and_wait(nowhere, topic, b"never", timeout=60.0, stop=stop)
    nowhere.purge()

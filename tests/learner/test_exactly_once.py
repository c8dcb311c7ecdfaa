"""Exactly once across SIGKILLs with several partitions and several producers: consumption order
across partitions differs between runs, so a step may re-form with other members after a crash;
what must hold is that every trajectory trains in exactly one step."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import sys
import threading
import time

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from learner.source import group_id
from schemas import topics as T
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer, make_producer, produce
from tests.learner.service_util import (ROOT, announcements, assert_one_policy_per_version, learner_cmd, metrics,
                                        rollouts, run_learner, sigkill_mid_run, trained_ledger)


def test_sigkill_three_times_with_three_partitions_and_two_producers_trains_each_once(kafka_bootstrap, tmp_path):
    cfg = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=f"eo{time.time_ns()}")
    topic = cfg.topic(T.TRAJECTORIES)
    admin = AdminClient(cfg.client())  # held: a collected client cancels its futures
    admin.create_topics([NewTopic(topic, 3, 1)])[topic].result(30)
    ensure_topics(cfg)
    trajs = rollouts(296, seed=17, id_prefix="eo")

    def producer(share):  # each its own client; no key: the trajectories spread over the partitions
        p = make_producer(cfg)
        for t in share:
            produce(p, topic, t.encode())
        assert p.flush(60) == 0

    threads = [threading.Thread(target=producer, args=(trajs[i::2],)) for i in range(2)]
    for th in threads:
        th.start()
    flags = ("--batch-trajectories", "8", "--max-steps", "37", "--max-staleness", "-1", "--checkpoint-every", "3")
    sigkill_mid_run(learner_cmd(cfg, tmp_path, *flags), tmp_path, random.Random(5))
    for th in threads:
        th.join(60)
    run_learner(learner_cmd(cfg, tmp_path, *flags))

    trained = trained_ledger(tmp_path)
    assert set(trained) == {t.id for t in trajs}
    assert sorted(collections.Counter(trained.values()).items()) == [(s, 8) for s in range(37)]
    # a replayed step may re-form with other members: its policy takes a new version number
    assert_one_policy_per_version(announcements(cfg))
    admin.delete_topics([cfg.topic(t) for t in T.ALL], operation_timeout=30)


# The learner with a slow disk: a checkpoint becomes durable (and its offsets are committed) a few
# seconds after its save, so the next step is being formed from the stream before that commit.
SLOW_DISK = """
import sys, time
import learner.checkpoint as store
write = store.Checkpointer._write
def slow(self, tensors, step, tmp, data, then):
    write(self, tensors, step, tmp, data, lambda: (time.sleep(4), then()))
store.Checkpointer._write = slow
from sao.cli import main
main(sys.argv[1:])
"""


def _produce_to(cfg: KafkaConfig, partition: int, trajs) -> None:
    p = make_producer(cfg)
    for t in trajs:
        p.produce(cfg.topic(T.TRAJECTORIES), t.encode(), t.key, partition=partition)
    assert p.flush(30) == 0


def _committed(cfg: KafkaConfig) -> dict[int, int]:
    consumer = make_consumer(cfg, group_id(cfg))  # reads the group's offsets; never subscribes
    try:
        tps = [TopicPartition(cfg.topic(T.TRAJECTORIES), p) for p in (0, 1)]
        return {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=10) if tp.offset >= 0}
    finally:
        consumer.close()


def test_a_partition_first_read_between_a_checkpoints_save_and_its_commit_is_not_skipped(kafka_bootstrap, tmp_path):
    cfg = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=f"late{time.time_ns()}")
    topic = cfg.topic(T.TRAJECTORIES)
    admin = AdminClient(cfg.client())
    admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
    ensure_topics(cfg)
    trajs = rollouts(16, seed=23, id_prefix="late")
    _produce_to(cfg, 0, trajs[:8])
    flags = ("--batch-trajectories", "8", "--max-steps", "2", "--max-staleness", "-1", "--checkpoint-every", "1")
    cmd = [sys.executable, "-c", SLOW_DISK, *learner_cmd(cfg, tmp_path, *flags)[3:]]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 180
        while not metrics(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metrics(tmp_path), "step 0 never trained"
        # step 0 (partition 0 alone) is saved; its commit is seconds away. Partition 1's first
        # trajectories arrive now: step 1 takes them while it waits for four more
        _produce_to(cfg, 1, trajs[8:12])
        while _committed(cfg).get(0) != 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        committed = _committed(cfg)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        proc.kill()
    assert committed == {0: 8}, f"Kafka holds offsets the checkpoint does not: {committed}"
    _produce_to(cfg, 0, trajs[12:16])  # with partition 1's four, step 1 has exactly its eight
    run_learner(learner_cmd(cfg, tmp_path, *flags))
    trained = trained_ledger(tmp_path)
    assert set(trained) == {t.id for t in trajs}
    assert sorted(collections.Counter(trained.values()).items()) == [(0, 8), (1, 8)]
    admin.delete_topics([cfg.topic(t) for t in T.ALL], operation_timeout=30)

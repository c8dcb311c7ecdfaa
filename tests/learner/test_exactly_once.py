"""Exactly once across SIGKILLs with several partitions and several producers: consumption order
across partitions differs between runs, so a step may re-form with other members after a crash;
what must hold is that every trajectory trains in exactly one step."""

from __future__ import annotations

import collections
import random
import threading
import time

from confluent_kafka.admin import AdminClient, NewTopic

from schemas import topics as T
from schemas.kafka import KafkaConfig, ensure_topics, make_producer, produce
from tests.learner.service_util import (announcements, assert_one_policy_per_version, learner_cmd, rollouts,
                                        run_learner, sigkill_mid_run, trained_ledger)


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

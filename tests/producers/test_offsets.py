"""Commit positions under out-of-order completion: only the contiguous delivered prefix counts."""

import random
import time
import uuid

from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from producers.offsets import OffsetCommitter, PromptOffsets, StalledFetches
from schemas import topics as T
from schemas.kafka import make_consumer, make_producer
from schemas.progress import GroupLag


def test_position_moves_only_over_the_delivered_prefix():
    offsets = PromptOffsets()
    for o in (5, 6, 7):
        offsets.take(0, o)
    offsets.take(1, 0)
    assert offsets.deliver(0, 7) is None  # 5 and 6 still in flight
    assert offsets.deliver(0, 5) == 6
    assert offsets.deliver(1, 0) == 1  # partitions are independent
    assert offsets.deliver(0, 6) == 8  # 6 closes the gap up to 7
    offsets.take(0, 8)
    offsets.forget(0)  # revoked: a late delivery moves nothing
    assert offsets.deliver(0, 8) is None


def test_random_completion_orders_never_commit_past_an_undelivered_prompt():
    rng = random.Random(0)
    for _ in range(200):
        offsets, n = PromptOffsets(), rng.randint(1, 40)
        for o in range(n):
            offsets.take(3, o)
        delivered, committed = set(), 0
        for o in rng.sample(range(n), n):
            delivered.add(o)
            position = offsets.deliver(3, o)
            if position is not None:
                assert position > committed
                committed = position
            assert all(x in delivered for x in range(committed))  # nothing undelivered below it
            assert committed == n or committed not in delivered  # and it stops at the first gap
        assert committed == n


def test_a_commit_the_broker_refuses_is_sent_again_until_it_is_taken(kafka_cfg):
    """On a real broker: a commit refused (here: its topic does not exist yet) is resent, and
    taken once it can be; without the resend the position would stay uncommitted until the next
    prompt, which a feeder waiting on that commit never sends."""
    topic = f"{kafka_cfg.topic_prefix}.later"
    committer = OffsetCommitter(topic)
    consumer = committer.consumer = make_consumer(kafka_cfg, f"g-{uuid.uuid4().hex}", on_commit=committer.on_commit)
    try:
        committer.take(0, 0)
        committer.deliver(0, 0)  # position 1, sent asynchronously

        def poll_until(cond, timeout=30.0):
            deadline = time.monotonic() + timeout
            while not cond() and time.monotonic() < deadline:
                consumer.poll(0.1)
                committer.resend_refused(time.monotonic())
            return cond()
        assert poll_until(lambda: committer.refused == {0}), "the commit to a missing topic was not refused"
        admin = AdminClient(kafka_cfg.client())
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)

        def committed() -> int:
            return consumer.committed([TopicPartition(topic, 0)], timeout=10)[0].offset
        assert poll_until(lambda: committed() == 1), "the refused commit was never sent again"
        assert committer.refused == set()
    finally:
        consumer.close()


def test_a_partition_the_client_stopped_fetching_is_restarted_and_its_prompts_read(kafka_cfg):
    """On a real broker: a partition librdkafka holds unfetched without the service knowing (here
    paused behind its back, as a pause racing an assignment's fetch start leaves it) stays unread
    while the others are read; the watch restarts it at the prompt it owes after `stall_s` seconds
    of free slots, and leaves alone partitions with nothing waiting."""
    topic = kafka_cfg.topic(T.PROMPTS)
    group = f"g-{uuid.uuid4().hex}"
    consumer = make_consumer(kafka_cfg, group, **{"partition.assignment.strategy": "cooperative-sticky"})
    stalls = StalledFetches(consumer, GroupLag(kafka_cfg, T.PROMPTS, group), stall_s=2.0)
    producer = make_producer(kafka_cfg)
    try:
        consumer.subscribe([topic])
        deadline = time.monotonic() + 30
        while len(consumer.assignment()) < T.PROMPTS.partitions and time.monotonic() < deadline:
            consumer.poll(0.1)
        assert len(consumer.assignment()) == T.PROMPTS.partitions
        stuck, idle = 2, 5
        consumer.pause([TopicPartition(topic, stuck)])
        waiting = [p for p in range(T.PROMPTS.partitions) if p != idle]
        for p in waiting:
            for i in range(3):
                producer.produce(topic, f"{p}-{i}".encode(), partition=p)
        producer.flush(30)

        read: dict[int, int] = {}

        def poll_for(seconds: float, watch: bool) -> None:
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                msg = consumer.poll(0.05)
                if msg is not None and not msg.error():
                    read[msg.partition()] = read.get(msg.partition(), 0) + 1
                if watch:
                    stalls.tick(free=True, now=time.monotonic())
        poll_for(4.0, watch=False)
        assert stuck not in read and all(read.get(p) == 3 for p in waiting if p != stuck), read  # the fault is real
        poll_for(8.0, watch=True)
        assert read.get(stuck) == 3, read
        assert stalls.restarted == 1  # the stuck one only: not the idle one, not those read
        poll_for(3.0, watch=True)
        assert stalls.restarted == 1 and sum(read.values()) == 3 * len(waiting)  # read once, no replay
    finally:
        stalls.close()
        consumer.close()

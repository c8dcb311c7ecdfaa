"""The helpers every group of tests shares: publish messages and wait for the broker's acks, read a
topic back, wait on a condition, and run a `sao` service as a child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from schemas import topics as T
from schemas.kafka import KafkaConfig, make_consumer, make_producer, produce
from schemas.messages import decode

REPO = Path(__file__).resolve().parents[1]


def publish(kafka: KafkaConfig, topic: T.Topic, messages: list, key: bytes | None = None,
            timeout: float = 60.0) -> list[tuple[int, int]]:
    """Publish in order and wait for every ack; returns each message's (partition, offset).
    A message is a schemas.messages message (its own key), raw bytes (under `key`) or a
    (key, bytes) pair. One key keeps messages on one partition, so their order is fixed."""
    producer, where = make_producer(kafka), {}
    for i, m in enumerate(messages):
        def acked(err, msg, i=i):
            assert err is None, err
            where[i] = (msg.partition(), msg.offset())
        k, value = m if isinstance(m, tuple) else (key, m) if isinstance(m, bytes) else (m.key, m.encode())
        produce(producer, kafka.topic(topic), value, key=k, on_delivery=acked)
    assert producer.flush(timeout) == 0
    return [where[i] for i in range(len(messages))]


def wait_until(predicate, timeout: float = 30.0, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(every)


def read_topic(kafka: KafkaConfig, topic: T.Topic, n: int, timeout: float = 60.0, until=None) -> list:
    """The first n decoded messages of a topic (all partitions), read by a throwaway group;
    with `until`, read until `until(messages)` holds instead."""
    consumer = make_consumer(kafka, f"test-read-{uuid.uuid4().hex}")
    consumer.subscribe([kafka.topic(topic)])
    out, deadline = [], time.monotonic() + timeout
    try:
        while not (until(out) if until else len(out) >= n) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                out.append(decode(msg.value()))
    finally:
        consumer.close()
    return out


def read_ids(kafka: KafkaConfig, topic: T.Topic, ids: set[str], timeout: float = 60.0) -> list:
    """Messages of `topic` until every id in `ids` has been seen at least once (or the timeout)."""
    return read_topic(kafka, topic, 0, timeout=timeout,
                      until=lambda ms: ids <= {getattr(m, "id", None) for m in ms})


class Service:
    """A `sao <command>` child process on `kafka`'s cluster and prefix, one thread, whose output
    lines (stdout and stderr) are collected as they come."""

    def __init__(self, kafka: KafkaConfig, *args: str, env: dict | None = None):
        env = {**os.environ, "SAO_KAFKA_BOOTSTRAP": kafka.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka.topic_prefix,
               "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
        self.p = subprocess.Popen([sys.executable, "-m", "sao", *args], cwd=REPO, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True).start()

    def ready(self) -> bool:
        """A faust worker has joined its group and recovered its tables."""
        return any("Worker ready" in line for line in self.lines)

    def started(self) -> list[str]:
        """The prompt ids a producer has started episodes of; raises if it exited with an error."""
        if self.p.poll() not in (None, 0, -signal.SIGKILL):
            raise RuntimeError(f"sao exited {self.p.returncode}:\n{self.log(30)}")
        return [line.split("prompt ")[1].split()[0] for line in self.lines if "episode start" in line]

    def log(self, last: int = 40) -> str:
        return "".join(self.lines[-last:])

    def stop(self, sig=signal.SIGTERM, timeout: float = 60) -> int:
        """The exit status; a process still running after `timeout` is killed (status -9)."""
        self.p.send_signal(sig)
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait()


def producer_process(kafka: KafkaConfig, name: str, *args: str) -> Service:
    """A `sao producer --producer-id name` child process."""
    return Service(kafka, "producer", "--producer-id", name, *args)

"""Thin factories over confluent-kafka, topic creation, and dead letters.

Part of the contract rather than of any service: every process builds its clients here so that
delivery guarantees (idempotent acks=all producers, manually stored offsets) are the same everywhere.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from . import topics as T
from .config import ConfigError
from .messages import DEFAULT_LIMITS, DeadLetter, Limits, SchemaError, decode
from .process import threadsafe

log = logging.getLogger(__name__)

_OWN_KEYS = {"SAO_KAFKA_BOOTSTRAP", "SAO_KAFKA_TOPIC_PREFIX", "SAO_KAFKA_PASSWORD_FILE"}


def is_secret(setting: str) -> bool:
    """A librdkafka setting whose value is a secret (`sasl.password`, `ssl.key.password`, ...)."""
    return "password" in setting or "secret" in setting or setting == "ssl.key.pem"


def _from_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {k[len("SAO_KAFKA_"):].lower().replace("_", "."): v
            for k, v in environ.items() if k.startswith("SAO_KAFKA_") and k not in _OWN_KEYS}


def passthrough_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """librdkafka settings from `SAO_KAFKA_*`: `SAO_KAFKA_SASL_MECHANISM=PLAIN` → `sasl.mechanism`;
    secrets aside (`secret_settings`)."""
    return {k: v for k, v in _from_env(environ).items() if not is_secret(k)}


def secret_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """The secrets among the `SAO_KAFKA_*` settings (`SAO_KAFKA_SASL_PASSWORD`, ...). They are
    read when a client is made and are never part of a config object, so no flag's default in
    `--help`, no log line or saved setting shows them."""
    return {k: v for k, v in _from_env(environ).items() if is_secret(k)}


@dataclass(kw_only=True)
class KafkaConfig:
    bootstrap: str = "127.0.0.1:9092"
    """Bootstrap servers of the cluster (`SAO_KAFKA_BOOTSTRAP`); `sao up` and `sao demo` start
    an embedded broker unless this is set."""
    topic_prefix: str = "sao"
    """Prefix of every topic name (`sao.prompts`, ...)."""
    settings: dict[str, str] = field(default_factory=lambda: passthrough_settings(os.environ))
    """Extra librdkafka settings (`security.protocol`, `sasl.mechanism`, `sasl.username`,
    `ssl.ca.location`, ...); defaults to every other `SAO_KAFKA_*` variable. Secrets are not flags:
    set `SAO_KAFKA_SASL_PASSWORD` or `--kafka.password-file`."""
    password_file: str = ""
    """File holding the SASL password (`SAO_KAFKA_PASSWORD_FILE`), read when a client is made."""

    def topic(self, t: T.Topic) -> str:
        return t.name(self.topic_prefix)

    def client(self, **overrides) -> dict:
        """librdkafka settings of a client of this cluster, secrets included (never log them)."""
        return {"bootstrap.servers": self.bootstrap, "error_cb": raise_refusals, **self.settings,
                **secret_settings(os.environ), **self._password(), **overrides}

    def _password(self) -> dict[str, str]:
        if not self.password_file:
            return {}
        try:
            return {"sasl.password": Path(self.password_file).read_text().strip()}
        except OSError as e:
            raise ConfigError(f"--kafka.password-file {self.password_file}: {e.strerror}") from None

    def faust_credentials(self):
        """The same security settings for faust's aiokafka clients (the reward joiner), or None on
        a plaintext cluster."""
        from faust import SASLCredentials, SSLCredentials

        s = self.client()
        protocol = s.get("security.protocol", "PLAINTEXT").upper()
        context = None
        if protocol in ("SSL", "SASL_SSL"):
            import ssl
            context = ssl.create_default_context(cafile=s.get("ssl.ca.location"))
            if "ssl.certificate.location" in s:
                context.load_cert_chain(s["ssl.certificate.location"], s.get("ssl.key.location"),
                                        s.get("ssl.key.password"))
        if protocol.startswith("SASL"):
            return SASLCredentials(username=s.get("sasl.username"), password=s.get("sasl.password"),
                                   mechanism=s.get("sasl.mechanism", s.get("sasl.mechanisms", "PLAIN")).upper(),
                                   ssl_context=context)
        return SSLCredentials(context) if context else None


@dataclass(kw_only=True)
class ServiceConfig:
    """What a long-running service that logs its rates is configured with besides its own
    settings (the producer, the joiner, the judge): one spelling of the flags they share."""

    metrics_port: int = 0
    """Serve Prometheus metrics on this port (0: off)."""
    log_every_s: float = 30.0
    """Seconds between log lines with the rates."""
    kafka: KafkaConfig = field(default_factory=KafkaConfig)


def make_producer(cfg: KafkaConfig, **overrides) -> Producer:
    """An idempotent producer: acks=all, ordered retries, lz4."""
    return Producer(cfg.client(**{
        "enable.idempotence": True,  # implies acks=all and no reordering on retry
        "acks": "all",
        "compression.type": "lz4",
        "linger.ms": 5,  # small batching window; trajectories arrive one at a time
        "message.max.bytes": T.MAX_RECORD_BYTES,
        **overrides,
    }))


SESSION_TIMEOUT_S = 6.0
"""A group member that stops heartbeating is dropped from its group this long after."""


def make_consumer(cfg: KafkaConfig, group_id: str, **overrides) -> Consumer:
    """A consumer with manual commits and group timeouts tuned so a member joins in seconds."""
    return Consumer(cfg.client(**{
        "group.id": group_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,  # offsets are stored only once a result is durable
        "auto.offset.reset": "earliest",
        "session.timeout.ms": int(SESSION_TIMEOUT_S * 1000),  # librdkafka's 45 s default makes a dead member linger
        "heartbeat.interval.ms": 500,
        "max.poll.interval.ms": 600_000,  # a training step or an episode may take minutes
        "topic.metadata.refresh.interval.ms": 10_000,  # a deleted topic surfaces in seconds, not 5 min
        "fetch.max.bytes": T.MAX_RECORD_BYTES,
        "max.partition.fetch.bytes": T.MAX_RECORD_BYTES,
        **overrides,
    }))


def replication_now(cfg: KafkaConfig, timeout: float = 30.0) -> tuple[int, int]:
    """(replication factor, min.insync.replicas) of a topic created now: `topics.replication` for
    the brokers the cluster has."""
    return T.replication(len(metadata(AdminClient(cfg.client()), timeout).brokers))


def metadata(admin: AdminClient, timeout: float):
    """The cluster's metadata; a failed login (wrong password, untrusted certificate) raises
    FatalKafkaError, saying so, rather than a bare timeout."""
    try:
        return admin.list_topics(timeout=timeout)
    except KafkaException:
        admin.poll(0)  # a refused login is queued as a client error: raise_refusals raises it here
        raise


def ensure_topics(cfg: KafkaConfig, wanted: Iterable[T.Topic] = T.ALL, timeout: float = 30.0) -> list[str]:
    """Create the topics that do not exist yet, replicated as `replication_now` says; returns the
    names created (empty when all exist)."""
    admin = AdminClient(cfg.client())
    md = metadata(admin, timeout)
    existing = set(md.topics)
    factor, min_isr = T.replication(len(md.brokers))  # as replication_now, from the same look
    new = [NewTopic(cfg.topic(t), num_partitions=t.partitions, replication_factor=factor,
                    config={**t.config, "min.insync.replicas": str(min_isr)})
           for t in wanted if cfg.topic(t) not in existing]
    created = []
    for name, fut in (admin.create_topics(new, operation_timeout=timeout).items() if new else ()):
        try:
            fut.result(timeout)
            created.append(name)
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:  # another process won the race
                raise
    _await_topics(admin, created, timeout)
    return created


def _await_topics(admin: AdminClient, names: list[str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while names:
        md = admin.list_topics(timeout=timeout).topics
        if all(n in md and md[n].error is None and md[n].partitions for n in names):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"topics {names} not visible after {timeout}s")
        time.sleep(0.1)


def wait_for_broker(bootstrap: str, timeout: float = 60.0, settings: Mapping[str, str] | None = None,
                    brokers: int = 1) -> None:
    """Block until the cluster answers a metadata request naming at least `brokers` brokers."""
    # log_level 0: "connection refused" while the broker boots is expected, not worth a line
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0, **(settings or {})})
    deadline = time.monotonic() + timeout
    while True:
        try:
            if len(admin.list_topics(timeout=2).brokers) >= brokers:
                return
        except KafkaException:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no Kafka broker answered at {bootstrap} within {timeout}s")
        time.sleep(0.2)


class FatalKafkaError(RuntimeError):
    """The client cannot go on (fatal error, failed authentication or authorisation, a topic that
    vanished): the service stops with this message instead of logging and spinning."""


# Refusals no retry will fix: a right the client lacks (ACLs), credentials or a certificate that fail.
_REFUSED = {KafkaError.TOPIC_AUTHORIZATION_FAILED, KafkaError.GROUP_AUTHORIZATION_FAILED,
            KafkaError.CLUSTER_AUTHORIZATION_FAILED, KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
            KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError._AUTHENTICATION, KafkaError._SSL}
_LOGIN_FAILED = {KafkaError.SASL_AUTHENTICATION_FAILED, KafkaError._AUTHENTICATION, KafkaError._SSL}
# Errors a consumer loop cannot outwait: refusals, and a topic deleted under it.
_FATAL_CODES = _REFUSED | {KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC}


def raise_refusals(err: KafkaError) -> None:
    """Every client's `error_cb`. librdkafka reports a failed login or TLS handshake for the client
    as a whole, never on a message, and would retry it forever: raised from the `poll` that serves
    it, the service stops saying why instead of waiting in silence. Other client-wide errors (a
    broker down) are transient and librdkafka logs them itself."""
    if err.fatal() or err.code() in _LOGIN_FAILED:
        raise FatalKafkaError(f"Kafka: {err.str()}")
    log.debug("kafka: %s", err)


def refused(err: KafkaError) -> bool:
    """A delivery error that sending again cannot fix: the principal may not write the topic, its
    credentials failed, or the client hit a fatal error."""
    return err.fatal() or err.code() in _REFUSED


def consumer_error(msg: Message) -> bool:
    """The one check every consumer loop makes after `poll`: True if `msg` carries a transient
    error (logged; the loop polls again), False if it carries data; raises FatalKafkaError if the
    error is one no retry will fix. Topics are created before any consumer starts, so an unknown
    topic here means it was deleted or never reachable, not that it is still being created."""
    err = msg.error()
    if err is None:
        return False
    if err.fatal() or err.code() in _FATAL_CODES:
        raise FatalKafkaError(f"Kafka: {err.str()}" + (f" (topic {msg.topic()})" if msg.topic() else ""))
    log.warning("consumer: %s", err)
    return True


def read_ranges(consumer: Consumer, topic: str, ranges: Mapping[int, tuple[int, int]], *,
                timeout: float | None = None, stop: threading.Event | None = None,
                poll_s: float = 0.5) -> Iterator[Message]:
    """The messages of `topic` at offsets start <= offset < end of each partition's (start, end)
    in `ranges`, in order within a partition, read by `consumer` assigned to those partitions alone
    (unassigned afterwards, so a reader outside any group can be reused). A partition is done once
    its position reaches its end, so offsets without a message (compacted away, transaction
    markers) do not hold the read. Raises TimeoutError after `timeout` seconds (None: no limit);
    ends early once `stop` is set."""
    todo = {p: end for p, (start, end) in ranges.items() if end > start}
    if not todo:
        return
    consumer.assign([TopicPartition(topic, p, ranges[p][0]) for p in todo])
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while todo and not (stop is not None and stop.is_set()):
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{topic}: partitions {sorted(todo)} not read to their end in {timeout} s")
            msg = consumer.poll(poll_s)
            if msg is None or consumer_error(msg):
                for tp in consumer.position([TopicPartition(topic, p) for p in todo]):
                    if tp.offset >= todo[tp.partition]:
                        del todo[tp.partition]
                continue
            p = msg.partition()
            if p not in todo:
                continue
            if msg.offset() < todo[p]:
                yield msg
            if msg.offset() + 1 >= todo[p]:
                del todo[p]
    finally:
        consumer.unassign()


def produce(producer: Producer, topic: str, value: bytes, key: bytes | None = None,
            on_delivery: Callable | None = None, headers: list[tuple[str, bytes]] | None = None) -> None:
    """Produce without ever dropping: a full local queue is drained by serving callbacks, then retried."""
    while True:
        try:
            producer.produce(topic, value, key, on_delivery=on_delivery, headers=headers)
            break
        except BufferError:
            producer.poll(0.1)
    producer.poll(0)


def acknowledged(producer: Producer, topic: str, value: bytes, key: bytes | None = None) -> asyncio.Future:
    """Produce one message; a future on the running event loop that settles with None once the
    broker has it, or with the delivery error. For asyncio services: whichever thread polls
    `producer` (the loop's own, or an acknowledgements thread) settles it, and a settlement after
    the loop closed, or after the caller stopped waiting, is dropped."""
    loop = asyncio.get_running_loop()
    acked = loop.create_future()

    def settle(err) -> None:
        if not acked.done():
            acked.set_result(err)

    on_loop = threadsafe(loop, settle)
    produce(producer, topic, value, key, on_delivery=lambda err, _msg: on_loop(err))
    return acked


def produce_and_wait(producer: Producer, topic: str, value: bytes, key: bytes | None = None, *,
                     timeout: float = 30.0, stop: threading.Event | None = None) -> KafkaError | None:
    """Produce one message and serve the producer's callbacks until the broker acknowledges it: None
    once the broker has it, the delivery error if librdkafka gave up on it (the caller decides
    whether to send it again); FatalKafkaError if the broker refused it (`refused`). TimeoutError when neither came within `timeout` seconds or `stop`
    was set first. For callers that wait on a thread of their own; an asyncio service awaits
    `acknowledged` instead."""
    outcome: list[KafkaError | None] = []
    produce(producer, topic, value, key, on_delivery=lambda err, _: outcome.append(err))
    deadline = time.monotonic() + timeout
    while not outcome:
        if time.monotonic() > deadline or (stop is not None and stop.is_set()):
            raise TimeoutError(f"no acknowledgement from the broker for {topic} within {timeout:g} s"
                               if time.monotonic() > deadline else f"stopped before {topic} acknowledged")
        producer.poll(0.1)
    if outcome[0] is not None and refused(outcome[0]):
        raise FatalKafkaError(f"Kafka refused the write to {topic}: {outcome[0].str()}")
    return outcome[0]


def dead_letter(producer: Producer, cfg: KafkaConfig, msg: Message, error: Exception | str) -> None:
    """Publish an undecodable or invalid message to `sao.dlq` with its bytes, reason and origin.

    Returns at once; the caller stores the message's offset and continues.
    """
    dead_letter_record(producer, cfg, DeadLetter(source_topic=msg.topic(), partition=msg.partition(),
                                                 offset=msg.offset(), error=str(error),
                                                 payload=msg.value() or b""), key=msg.key())


def dead_letter_record(producer: Producer, cfg: KafkaConfig, dl: DeadLetter, key: bytes | None = None) -> None:
    """Publish a dead letter for a record consumed earlier (its message object may be long gone)."""
    log.warning("dead letter from %s[%d]@%d: %s", dl.source_topic, dl.partition, dl.offset, dl.error)
    produce(producer, cfg.topic(T.DLQ), dl.encode(), key=key, on_delivery=_log_failure)


def decode_or_dead_letter(producer: Producer, cfg: KafkaConfig, msg: Message, expect: type | None = None,
                          limits: Limits = DEFAULT_LIMITS):
    """The decoded message, or None after sending it to `sao.dlq` (undecodable or the wrong kind)."""
    try:
        decoded = decode(msg.value() or b"", limits)
        if expect is not None and not isinstance(decoded, expect):
            raise SchemaError("kind", f"expected {expect.kind!r} on {msg.topic()}, got {decoded.kind!r}")
        return decoded
    except SchemaError as e:
        dead_letter(producer, cfg, msg, e)
        return None


def _log_failure(err: KafkaError | None, msg: Message) -> None:
    if err is not None:
        log.error("delivery to %s failed: %s", msg.topic(), err)

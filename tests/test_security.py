"""A secured cluster (`sao broker --secure`: TLS, SASL/SCRAM-SHA-512, ACLs) refuses what
docs/security.md says it refuses: a plaintext client, a wrong password, an untrusted certificate,
and every read and write `sao.access.ACCESS` does not grant, each with an authorization error a
service reports in one line; what the table grants works; secrets show in no `--help`, log or
error; and the whole pipeline trains under these ACLs, each service as its own principal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from consumers.control import CONTROL
from sao import access
from sao.broker import BrokerConfig, EmbeddedBroker
from schemas import topics as T
from schemas.kafka import FatalKafkaError, KafkaConfig, consumer_error, make_consumer

ROOT = Path(__file__).resolve().parents[1]
TOPICS = [t.name() for t in (*T.ALL, CONTROL)]


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A secured three-node cluster (quorum over mutual TLS, brokers over SASL_SSL), as `sao broker
    --brokers 3 --secure` starts it; the pipeline test below secures a single node."""
    broker = EmbeddedBroker(BrokerConfig(port=0, brokers=3, secure=True, data_dir=tmp_path_factory.mktemp("secured"),
                                         start_timeout=300))
    broker.start()  # three JVMs and a quorum on two loaded cores (tests/test_broker.py)
    try:
        yield broker
    finally:
        broker.close()


def settings(broker: EmbeddedBroker, principal: str, **extra) -> dict:
    """librdkafka settings of `principal` (its password from the file `sao access` wrote)."""
    return {"bootstrap.servers": broker.bootstrap, **access.client_settings(principal, broker.security.ca),
            "sasl.password": access.password(broker.access_dir, principal), **extra}


def outcomes_of_writes(broker: EmbeddedBroker, principal: str, topics: list[str] = TOPICS) -> dict[str, bool]:
    """topic -> whether `principal`'s write to it was acknowledged (False: refused)."""
    producer = Producer(settings(broker, principal, **{"message.timeout.ms": 20_000, "acks": "all"}))
    results: dict[str, KafkaError | None] = {}
    for topic in topics:
        producer.produce(topic, b"x", partition=0, on_delivery=lambda err, msg: results.__setitem__(msg.topic(), err))
    producer.flush(30)
    assert set(results) == set(topics), results
    refused = {t: e for t, e in results.items() if e is not None}
    assert all(e.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED for e in refused.values()), refused
    return {t: e is None for t, e in results.items()}


def outcomes_of_reads(broker: EmbeddedBroker, principal: str) -> dict[str, bool]:
    """topic -> whether `principal` could fetch the message at offset 0 of partition 0 (False:
    an authorization error for that topic). Assigned, not subscribed: no group is involved."""
    consumer = Consumer(settings(broker, principal, **{"group.id": f"sao-up-{principal}",
                                                       "enable.auto.commit": False}))
    consumer.assign([TopicPartition(t, 0, OFFSET_BEGINNING) for t in TOPICS])
    seen: dict[str, bool] = {}
    deadline = time.monotonic() + 30
    try:
        while len(seen) < len(TOPICS) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.topic() is None:
                continue
            if msg.error() is None:
                seen[msg.topic()] = True
            else:
                assert msg.error().code() == KafkaError.TOPIC_AUTHORIZATION_FAILED, msg.error()
                seen[msg.topic()] = False
    finally:
        consumer.close()
    assert set(seen) == set(TOPICS), f"{principal}: no answer for {set(TOPICS) - set(seen)}"
    return seen


def test_every_principal_may_write_and_read_exactly_what_the_access_table_grants(secured):
    admin = Producer(settings(secured, access.ADMIN))
    for topic in TOPICS:  # something to read on every topic
        admin.produce(topic, b"seed", partition=0)
    assert admin.flush(30) == 0
    for principal in access.ACCESS:
        wrote, read = outcomes_of_writes(secured, principal), outcomes_of_reads(secured, principal)
        for topic in TOPICS:
            assert wrote[topic] == access.allows(principal, "topic", topic, "WRITE"), (principal, topic, "WRITE")
            assert read[topic] == access.allows(principal, "topic", topic, "READ"), (principal, topic, "READ")
    # the rules the issue names, read off the table
    writers = {p for p in access.ACCESS if access.allows(p, "topic", "sao.weights", "WRITE")}
    assert writers == {"learner"}
    assert not access.allows("producer", "topic", "sao.rewards", "READ")
    assert {t for t in TOPICS if access.allows("judge", "topic", t, "WRITE")} == {"sao.rewards", "sao.dlq"}


def test_a_plaintext_client_a_wrong_password_and_an_untrusted_certificate_are_refused(secured, tmp_path):
    plaintext = AdminClient({"bootstrap.servers": secured.bootstrap, "log_level": 0})
    with pytest.raises(KafkaException):
        plaintext.list_topics(timeout=5)
    # a wrong password: every client made by schemas.kafka raises it from the poll that hears it
    wrong = make_consumer(KafkaConfig(bootstrap=secured.bootstrap, settings={
        **access.client_settings("learner", secured.security.ca), "sasl.password": "not-it", "log_level": "0"}),
        "sao-learner")
    try:
        wrong.subscribe(["sao.trajectories"])
        with pytest.raises(FatalKafkaError, match="Authentication failed") as refused:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if (msg := wrong.poll(0.5)) is not None:
                    consumer_error(msg)
        assert "not-it" not in str(refused.value)
    finally:
        wrong.close()
    from sao.tls import make_tls
    other_ca = make_tls(tmp_path / "other")  # a broker certificate this CA never signed
    untrusted = AdminClient(settings(secured, "learner", **{"ssl.ca.location": str(other_ca / "ca.pem"),
                                                             "log_level": 0}))
    with pytest.raises(KafkaException):
        untrusted.list_topics(timeout=5)


def _sao(secured: EmbeddedBroker, principal: str, *args: str, env: dict | None = None, timeout: float = 120):
    env = {**os.environ, **secured.service_env(principal), "SAO_KAFKA_BOOTSTRAP": secured.bootstrap,
           "SAO_KAFKA_TOPIC_PREFIX": "sao", "SAO_LOG_LEVEL": "INFO", **(env or {})}
    return subprocess.run([sys.executable, "-m", "sao", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def said_by(stderr: str, prog: str) -> str:
    """The one line the command itself wrote (librdkafka's own log lines may come after it)."""
    [line] = [line for line in stderr.splitlines() if line.startswith(prog + ":")]
    return line


def test_a_second_pipelines_topics_get_the_same_table_from_one_sao_access(secured):
    """Compose's agent profile runs on topics `agent.*` beside `sao.*`: its secure override's
    one-shot gives them the same grants (`--also-prefixes agent`), idempotently."""
    out = _sao(secured, access.ADMIN, "access", "--dir", str(secured.access_dir), "--ca", str(secured.security.ca),
               "--also-prefixes", "agent")
    assert out.returncode == 0 and "access applied" in out.stdout, out.stderr[-2000:]
    topics = (*T.ALL, CONTROL)
    for principal in ("learner", "producer", "feeder"):
        expected = {t.name("agent"): access.allows(principal, "topic", t.name(), "WRITE") for t in topics}  # as on sao.*
        # the new grants reach each broker of the cluster with its metadata log: a loaded one may lag a little
        deadline = time.monotonic() + 60
        while (wrote := outcomes_of_writes(secured, principal, list(expected))) != expected and time.monotonic() < deadline:
            time.sleep(1)
        assert wrote == expected, principal
    assert access.allows("learner", "topic", "sao.weights", "WRITE")  # so agent.weights was written


def test_a_service_refused_says_so_in_one_line_and_no_secret_shows(secured):
    producer_password = access.password(secured.access_dir, "producer")
    # a producer's credentials cannot publish a reward: refused at once, in one line, not retried forever
    out = _sao(secured, "producer", "reward", "publish", "--trajectory", "t-1", "--reward", "1.0")
    assert out.returncode == 1, out.stdout + out.stderr
    said = said_by(out.stderr, "sao reward publish")
    assert said.startswith("sao reward publish: FatalKafkaError: Kafka refused the write to sao.rewards") \
        and "authoriz" in said.lower(), out.stderr[-2000:]
    # the judge's credentials can
    out = _sao(secured, "judge", "reward", "publish", "--trajectory", "t-1", "--reward", "1.0")
    assert out.returncode == 0 and "published reward 1.0 for t-1" in out.stdout, out.stderr[-2000:]
    # a wrong password: the service stops with the broker's answer, the password nowhere
    bad = secured.access_dir / "wrong.password"
    bad.write_text("hunter2-wrong")
    out = _sao(secured, "feeder", "feed", "--env", "toy-target", "--count", "1",
               env={"SAO_KAFKA_PASSWORD_FILE": str(bad)})
    said = said_by(out.stderr, "sao feed")
    assert out.returncode == 1 and said.startswith("sao feed: FatalKafkaError: Kafka: ") \
        and "Authentication failed" in said, out.stderr[-2000:]
    assert "hunter2-wrong" not in out.stdout + out.stderr
    # secrets in the environment are no flag defaults: --help does not print them
    helped = _sao(secured, "producer", "learner", "--help", env={"SAO_KAFKA_SASL_PASSWORD": producer_password,
                                                                 "SAO_KAFKA_SSL_KEY_PASSWORD": "key-secret"})
    assert helped.returncode == 0 and "--kafka.password-file" in helped.stdout
    assert producer_password not in helped.stdout and "key-secret" not in helped.stdout
    assert "--kafka.settings.sasl.password" not in helped.stdout
    assert "sasl.password" not in repr(KafkaConfig(settings={"sasl.username": "u"}, password_file="/x"))


def test_the_pipeline_trains_under_least_privilege_each_service_as_its_own_principal(tmp_path):
    """`sao up --broker.secure`: its own broker secured, every child connecting as its principal
    (learner, producer, feeder, evaluator, judge, joiner) with only the ACLs of the table; the run
    trains, scores and exports as on an open broker, and no log holds a password."""
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAO_KAFKA_")}
    cmd = [sys.executable, "-m", "sao", "up", "--broker.secure", "--steps", "4", "--producers", "1",
           "--env", "writing", "--model", "tiny-llama-bytes", "--batch-trajectories", "4", "--max-tokens", "8",
           "--eval-every", "3", "--eval-tasks", "2", "--eval-samples", "0", "--judge", "lowercase",
           "--run-dir", str(run), "--learner-flags=--update.warmup-steps 1 --update.lr-policy 3e-3"]
    out = subprocess.run(cmd, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "INFO"},
                         capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "broker up at" in text and "(TLS, SASL/SCRAM, ACLs)" in text, text[:2000]
    steps = [json.loads(x) for x in (run / "learner" / "metrics.jsonl").read_text().splitlines()]
    # `writing` has no reward of its own: every trajectory trained was scored by the judge and
    # joined with its reward by the joiner (faust's aiokafka clients over SASL_SSL)
    assert steps[-1]["weights/version"] == 3 and sum(len(s["trajectory_ids"]) for s in steps) == 16, steps[-1]
    scored = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert {s["version"] for s in scored} == {0, 3}, scored
    assert "model: version 3 exported" in out.stdout
    passwords = [p.read_text().strip() for p in (run / "kafka" / "access").glob("*.password")]
    assert len(passwords) == len(access.ACCESS) + 1
    logs = text + "".join(p.read_text(errors="replace") for p in run.rglob("*.log"))
    logs += "".join(p.read_text(errors="replace") for p in run.rglob("*.jsonl")) + (run / "up.json").read_text()
    assert not [p for p in passwords if p in logs], "a password was written to a log, metrics or settings"
    assert "AUTHORIZATION_FAILED" not in logs and "Authorization failed" not in logs, \
        [line for line in logs.splitlines() if "uthoriz" in line][:5]


def test_the_auditor_and_the_inference_server_work_as_their_own_principals(secured):
    """`sao audit` as `observer` reads every topic and group it accounts with; `sao serve` as
    `serve` follows the weights and answers: neither meets a refusal."""
    audit = _sao(secured, "observer", "audit", "--timeout-s", "30")
    said = audit.stdout + audit.stderr
    assert audit.returncode in (0, 1) and "prompts" in audit.stdout, said[-3000:]  # 1: the seeded bytes above
    assert "FatalKafkaError" not in said and "uthoriz" not in said, said[-3000:]
    from sao.broker import free_port
    port = free_port()
    env = {**os.environ, **secured.service_env("serve"), "SAO_KAFKA_BOOTSTRAP": secured.bootstrap,
           "SAO_KAFKA_TOPIC_PREFIX": "sao", "OMP_NUM_THREADS": "1"}
    serve = subprocess.Popen([sys.executable, "-m", "sao", "serve", "--port", str(port)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        import httpx
        deadline, healthy = time.monotonic() + 120, False
        while not healthy and serve.poll() is None and time.monotonic() < deadline:
            try:
                healthy = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                time.sleep(0.5)
        assert healthy, "sao serve as `serve` never answered"
    finally:
        serve.terminate()
        out, _ = serve.communicate(timeout=60)
    assert "FatalKafkaError" not in out and "uthoriz" not in out, out[-3000:]


def test_the_docs_show_the_access_table_the_code_applies():
    assert access.markdown() in (ROOT / "docs" / "security.md").read_text()

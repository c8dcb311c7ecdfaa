"""The embedded broker: durable across a restart on the same data folder, `sao broker` runs one
node or, one process per node as compose runs them, a replicated three-node cluster whose topics,
internal ones included, get three replicas with min.insync.replicas 2."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from sao.broker import BrokerConfig, EmbeddedBroker, free_port, free_ports
from sao.demo import random_trajectory
from schemas import topics as T
from schemas.kafka import KafkaConfig, ensure_topics, make_consumer, make_producer, produce, wait_for_broker
from tests.cluster_util import replication


def _produce(cfg: KafkaConfig, sent: list[bytes]) -> None:
    ensure_topics(cfg, [T.TRAJECTORIES])
    producer = make_producer(cfg)
    for data in sent:
        produce(producer, cfg.topic(T.TRAJECTORIES), data)
    assert producer.flush(30) == 0


def _consume(cfg: KafkaConfig, group: str, want: int, timeout: float = 60) -> list[bytes]:
    consumer = make_consumer(cfg, group)
    consumer.subscribe([cfg.topic(T.TRAJECTORIES)])
    got, deadline = [], time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            got.append(msg.value())
    consumer.close()
    return got


def test_messages_produced_before_a_restart_are_consumable_after(tmp_path):
    broker = EmbeddedBroker(BrokerConfig(data_dir=tmp_path / "kafka", port=0))
    assert broker.kind == "kafka"
    rng = np.random.default_rng(0)
    sent = [random_trajectory(rng, 100 + i, i).encode() for i in range(20)]
    try:
        broker.start()
        cfg = KafkaConfig(bootstrap=broker.bootstrap, settings={})
        _produce(cfg, sent)
        broker.stop()
        assert not broker.alive()

        broker.start()  # same folder, same port
        assert sorted(_consume(cfg, "after-restart", len(sent))) == sorted(sent)
    finally:
        broker.close()


def test_a_broker_whose_port_is_taken_fails_at_once_with_kafkas_reason(tmp_path):
    """Kafka exits within seconds when it cannot bind; the start says so then, with the log line
    that names the port, instead of waiting out --start-timeout on a process that is gone."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError) as e:
            EmbeddedBroker(BrokerConfig(port=port, data_dir=tmp_path / "b", start_timeout=600)).start()
    assert "exited while starting (node, status): 1, 1" in str(e.value), str(e.value)[-2000:]
    assert f"failed to bind to 127.0.0.1:{port}: Address already in use" in str(e.value), str(e.value)[-2000:]


def test_free_ports_are_below_the_ephemeral_range_so_no_outgoing_connection_takes_them():
    first_ephemeral = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    for _ in range(20):
        first = free_ports(6)
        assert 10000 <= first and first + 6 <= first_ephemeral
        for port in range(first, first + 6):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))


def test_sao_broker_command_serves_and_stops_on_sigterm(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sao", "broker", "--port", str(port),
                             "--data-dir", str(tmp_path / "b")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "SAO_LOG_LEVEL": "WARNING"})
    try:
        line = proc.stdout.readline()
        assert f"SAO_KAFKA_BOOTSTRAP=127.0.0.1:{port}" in line, line
        wait_for_broker(f"127.0.0.1:{port}", timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert "broker stopped" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_tansu_fallback_round_trips_trajectories(tmp_path):
    """The broker used where no Java is installed: memory-only, but the same clients work."""
    rng = np.random.default_rng(1)
    sent = [random_trajectory(rng, 50 + i, i).encode() for i in range(10)]
    with EmbeddedBroker(BrokerConfig(kind="tansu", data_dir=tmp_path, port=0)) as broker:
        assert broker.kind == "tansu"
        cfg = KafkaConfig(bootstrap=broker.bootstrap, settings={})
        _produce(cfg, sent)
        got = _consume(cfg, "tansu-group", len(sent))
    assert sorted(got) == sorted(sent)


def _serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sao", "broker", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "SAO_LOG_LEVEL": "WARNING"})


def _stopped(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0, proc.stdout.read()[-2000:]


def _node_log(data: Path, proc: subprocess.Popen, limit: int = 1500) -> str:
    """What a node that did not come up was doing: its state and the tail of Kafka's own log."""
    log = data / "broker.log"
    tail = log.read_text(errors="replace")[-limit:] if log.exists() else "(no broker.log yet)"
    return f"--- {data.name}: {'running' if proc.poll() is None else f'exited {proc.returncode}'}\n{tail}"


def test_three_sao_broker_nodes_in_their_own_processes_form_one_cluster(tmp_path):
    """As docker-compose.cluster.yml runs them: `--node N` each, ports and quorum from --port."""
    port = free_ports(6)  # clients on port .. port + 2, controllers on port + 3 .. port + 5
    procs = [_serve("--brokers", "3", "--node", str(n), "--port", str(port), "--cluster-id", "c2FvLXRlc3QtY2x1c3Rlcg",
                    "--data-dir", str(tmp_path / f"n{n}"), "--start-timeout", "300") for n in (1, 2, 3)]
    try:
        try:  # three JVMs, each formatting its log and then electing a quorum: minutes on a loaded 2-core machine
            wait_for_broker(f"127.0.0.1:{port}", timeout=300, brokers=3)
        except TimeoutError as e:
            pytest.fail(f"{e}\n" + "\n".join(_node_log(tmp_path / f"n{n}", p) for n, p in zip((1, 2, 3), procs)))
        assert [f"127.0.0.1:{port + n}" in p.stdout.readline() for n, p in enumerate(procs)] == [True] * 3
        assert set(replication(f"127.0.0.1:{port + 2}").values()) == {(3, "2")}
        for p in procs:
            _stopped(p)
    finally:
        for p in procs:
            p.kill()


def test_a_node_that_never_gets_a_quorum_fails_with_its_logs(tmp_path):
    """One node of three alone cannot elect a controller: it gives up after --start-timeout and says
    what its logs end with, since in a container its data folder is a volume nobody reads."""
    port = free_ports(6)
    proc = _serve("--brokers", "3", "--node", "2", "--port", str(port), "--cluster-id", "c2FvLXRlc3QtY2x1c3Rlcg",
                  "--data-dir", str(tmp_path / "n2"), "--start-timeout", "20")
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "did not answer in 20 s (--start-timeout 20 s)" in out, out[-2000:]
    assert f"--- node 2: {tmp_path / 'n2' / 'broker.log'}" in out, out[-2000:]

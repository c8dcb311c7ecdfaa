"""The learner on several nodes: two torchrun agents (c10d rendezvous on loopback, gloo) train
exactly as one process does; SIGKILL of every process of one node mid-run (its agent and its
rank) and the survivor's agent restarts the job on its own node, which resumes from the sharded
checkpoint and trains every trajectory exactly once."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from sao.broker import free_port
from schemas.kafka import KafkaConfig, ensure_topics
from schemas import topics as T
from tests.learner.service_util import (ROOT, announcements, assert_close_state, latest_checkpoint, learner_cmd,
                                        metrics, ONE_PARTITION, publish, published, rollouts, run_learner, trained_ledger)
from tests.kafka_util import wait_until

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "WARNING"}


def node(port: int, job: str, nnodes: str, flags: list[str], log: Path) -> subprocess.Popen:
    """One node's torchrun agent with one rank, in a process group of its own (its 'machine'), its
    stderr (agent and rank) in `log`. With fewer than the most nodes, a rendezvous waits
    `last_call_timeout` for more: long enough that a second agent started at the same time joins
    the first round instead of arriving as a scale-up (a second path, not the one tested here)."""
    with log.open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job,
             "--rdzv-conf", "last_call_timeout=15,join_timeout=120", "--max-restarts", "3", "-m", "learner.service",
             *flags], cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def tails(*logs: Path) -> str:
    """The end of each agent's log, for a failure message."""
    return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)


def accepts(port: int) -> bool:
    """Something listens on loopback `port`."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout.split()
    return [d for child in map(int, out) for d in (child, *descendants(child))]


def _run(kafka_bootstrap: str, name: str, trajs) -> KafkaConfig:
    cfg = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=f"mn{uuid.uuid4().hex[:8]}{name}")
    ensure_topics(cfg)
    publish(cfg, T.TRAJECTORIES, [t.encode() for t in trajs], key=ONE_PARTITION)
    return cfg


def test_two_nodes_train_exactly_as_one_process(kafka_bootstrap, tmp_path):
    trajs = rollouts(12, seed=5)
    flags = ("--batch-trajectories", "4", "--max-steps", "3", "--weights.dtype", "float32")  # 1e-5 needs float32
    one = _run(kafka_bootstrap, "one", trajs)
    run_learner(learner_cmd(one, tmp_path / "one", *flags))
    two = _run(kafka_bootstrap, "two", trajs)
    port, cmd = free_port(), learner_cmd(two, tmp_path / "two", *flags)[4:]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    agents = [node(port, "same", "2", cmd, log) for log in logs]
    try:
        for agent in agents:
            assert agent.wait(300) == 0, tails(*logs)
    finally:
        for agent in agents:
            agent.kill()
    shards = sorted(p.name for p in latest_checkpoint(tmp_path / "two").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # two ranks, one per node
    assert_close_state(published(announcements(two)), published(announcements(one)), rtol=1e-5)


def test_a_node_sigkilled_mid_run_and_the_survivor_resumes_alone_exactly_once(kafka_bootstrap, tmp_path):
    trajs = rollouts(80, seed=21)
    cfg = _run(kafka_bootstrap, "kill", trajs)
    flags = learner_cmd(cfg, tmp_path, "--batch-trajectories", "4", "--max-steps", "20", "--max-staleness", "-1",
                        "--checkpoint-every", "2")[4:]
    port = free_port()
    logs = tmp_path / "first.log", tmp_path / "second.log"
    first = node(port, "elastic", "1:2", flags, logs[0])  # hosts the rendezvous store
    wait_until(lambda: accepts(port) or first.poll() is not None, timeout=60)
    second = node(port, "elastic", "1:2", flags, logs[1])
    try:
        deadline = time.monotonic() + 300
        while len(metrics(tmp_path)) < 5 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert len(metrics(tmp_path)) >= 5, tails(*logs)
        assert len(list(latest_checkpoint(tmp_path).glob("*.distcp"))) == 2  # both nodes were in it
        for pid in [second.pid, *descendants(second.pid)]:  # the whole node: its agent and its rank (which
            os.kill(pid, signal.SIGKILL)                     # torchrun starts in a session of its own)
        second.wait()
        assert first.wait(400) == 0, tails(*logs)  # restarted alone, to the end
    finally:
        for agent in (first, second):
            for pid in [agent.pid, *descendants(agent.pid)]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    trained = trained_ledger(tmp_path)
    assert set(trained) == {t.id for t in trajs}
    assert sorted(collections.Counter(trained.values()).items()) == [(s, 4) for s in range(20)]
    assert sorted(p.name for p in latest_checkpoint(tmp_path).glob("*.distcp")) == ["__0_0.distcp"]

"""Broker faults with the whole pipeline running, every service its own `sao` process: the feeder,
two `writing` producers, the judge, the reward joiner and the learner, on tiny models. A broker is
SIGKILLed mid-run (on a 3-node cluster: a follower, the leader of sao.trajectories partition 0,
the learner group's coordinator; alone: the only broker, then restarted on its data) and brought
back. Every service carries on by itself: nothing restarts any of them, and each is alive or done
at its --count / --max-steps with status 0 to the end; every fed prompt trains exactly once,
which `sao audit` proves from the topics and the learner's checkpoint. The learner stops after
exactly as many steps as the feeder's prompts fill, so a prompt lost anywhere leaves it short.

Each case prints one row of the README's fault table (`pytest -s`): seconds the broker was down,
the longest pause between learner steps after the SIGKILL, seconds from the SIGKILL to the first
step training a prompt fed after it (against a prompt's median feed-to-training time before),
ids unexplained (lost: the audit passes only with none), and duplicate copies (dropped by id)."""

from __future__ import annotations

import json
import random
import statistics
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from learner.source import group_id
from sao.audit import AuditConfig, audit, read_topic
from sao.broker import BrokerConfig, EmbeddedBroker, free_port
from schemas import topics as T
from schemas.kafka import KafkaConfig, ensure_topics
from schemas.messages import Prompt, decode
from tests.cluster_util import replication
from tests.consumers.util import Service, wait_until

STEP, STEPS = 4, 12
FED = STEP * STEPS  # the learner's --max-steps consume every fed prompt, once


class Pipeline:
    """The services of one run, started in the order a deployment brings them up."""

    def __init__(self, kafka: KafkaConfig, run: Path):
        self.kafka, self.run = kafka, run
        tiny, quiet = ("--model", "tiny-llama-bytes"), {"SAO_LOG_LEVEL": "WARNING"}
        group = ("--group", f"{kafka.topic_prefix}-producers")
        # producers at INFO: a stalled one's last lines name the prompts it took ("episode start")
        self.procs = {
            "reward-join": Service(kafka, "reward-join", "--data-dir", str(run / "joiner")),
            "judge": Service(kafka, "judge", *tiny, "--criteria", "lowercase", env=quiet),
            **{f"producer-{i}": Service(kafka, "producer", "--env", "writing", *tiny, "--max-tokens", "24",
                                        "--concurrency", "2", "--no-follow-weights", "--producer-id", f"p{i}",
                                        *group, env={"SAO_LOG_LEVEL": "INFO"})
               for i in range(2)},
            "learner": Service(kafka, "learner", "--model.name", "tiny-llama", "--model.vocab-size", "260",
                               "--batch-trajectories", str(STEP), "--max-steps", str(STEPS), "--max-staleness", "-1",
                               "--checkpoint-every", "2", "--update.warmup-steps", "0",
                               "--run-dir", str(run / "learner"), "--weights-dir", str(run / "weights"), env=quiet),
        }
        # prompts flow once the learner has joined its group (it then describes its model in the
        # weight store), so that the run is a steady stream from the feeder to the learner
        wait_until(lambda: (run / "weights" / "config.json").exists() or self.failed(), timeout=300, every=0.5)
        self.procs["feed"] = Service(kafka, "feed", "--env", "writing", "--count", str(FED), "--max-unfinished", "4",
                                     *group)

    def steps(self) -> list[dict]:
        path = self.run / "learner" / "metrics.jsonl"
        text = path.read_text() if path.exists() else ""
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]

    def failed(self) -> dict[str, str]:
        """Services that exited with a non-zero status, and their last lines."""
        return {n: s.log(20) for n, s in self.procs.items() if s.p.poll() not in (None, 0)}

    def wait_steps(self, n: int, timeout: float) -> None:
        try:
            wait_until(lambda: len(self.steps()) >= n or self.failed(), timeout=timeout, every=0.5)
        except TimeoutError:
            pytest.fail(f"{len(self.steps())} of {n} steps in {timeout} s; where every id is:\n{self.accounts()}\n"
                        f"the services' last lines: { {name: s.log(8) for name, s in self.procs.items()} }")
        assert not self.failed(), self.failed()

    def accounts(self) -> str:
        """`sao audit`'s table of the run so far: which stage holds the ids a stalled run lacks."""
        try:
            return audit(AuditConfig(run_dir=self.run / "learner", kafka=self.kafka)).table()
        except Exception as e:  # the diagnosis must not hide the failure it explains
            return f"(no audit: {e!r})"

    def finish(self) -> None:
        """The learner done at --max-steps, the feeder at --count, the others alive until their
        SIGTERM; all with status 0. Nothing here restarts a process: each is the one started."""
        self.wait_steps(STEPS, timeout=420)
        wait_until(lambda: self.procs["learner"].p.poll() is not None, timeout=120, every=0.5)
        assert {n: s.p.returncode for n, s in self.procs.items() if n in ("learner", "feed")} == {
            "learner": 0, "feed": 0}, self.failed()
        running = {n: s for n, s in self.procs.items() if n not in ("learner", "feed")}
        assert all(s.p.poll() is None for s in running.values()), self.failed()
        assert {n: s.stop() for n, s in running.items()} == dict.fromkeys(running, 0), self.failed()

    def close(self) -> None:
        for s in self.procs.values():
            if s.p.poll() is None:
                s.p.kill()


def timings(kafka: KafkaConfig, steps: list[dict], fault: float) -> tuple[float, float, float]:
    """(median seconds from a prompt's feed to its training before the fault; the longest pause
    between learner steps after it; seconds from the fault to the first step training a prompt fed
    after it: the whole chain, feeder to learner, moving again)."""
    fed = {m.id: m.created_at for r in read_topic(kafka, kafka.topic(T.PROMPTS), 60)
           if isinstance(m := decode(r.value), Prompt)}
    prompts = [(s["time"], [fed[t.rpartition("#")[0]] for t in s["trajectory_ids"]]) for s in steps]
    before = [at - f for at, f_s in prompts if at < fault for f in f_s]
    times = [at for at, _ in prompts]
    pauses = [b - a for a, b in zip(times, times[1:]) if b > fault]
    after = [at for at, f_s in prompts if max(f_s) > fault]
    assert before and after, "the fault did not fall mid-run"
    return statistics.median(before), max(pauses), min(after) - fault


def accounted(kafka: KafkaConfig, run: Path) -> tuple[int, int]:
    """`sao audit` of the run: every prompt trained exactly once; returns (ids unexplained,
    duplicate copies)."""
    result = audit(AuditConfig(run_dir=run / "learner", producer_group=f"{kafka.topic_prefix}-producers",
                               kafka=kafka))
    assert result.ok, result.table()
    prompts, pending, trajectories = result.sections
    assert prompts.rows["produced a trajectory"] == pending.rows["joined"] == trajectories.rows["trained"] == FED, \
        result.table()
    return sum(len(s.unexplained) for s in result.sections), result.duplicates


def report(fault: str, down_s: float, kafka: KafkaConfig, pipeline: Pipeline, at: float) -> None:
    """One row of the README's fault table, once the audit has passed."""
    lost, duplicates = accounted(kafka, pipeline.run)
    latency, pause, moving = timings(kafka, pipeline.steps(), at)
    print(f"\nfault table: | {fault} | {down_s:.0f} | {pause:.0f} | {moving:.0f} ({latency:.0f} before) | {lost} | "
          f"{duplicates} |", flush=True)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Three brokers on loopback, shared by the cases (each restores the one it killed)."""
    broker = EmbeddedBroker(BrokerConfig(brokers=3, port=0, data_dir=tmp_path_factory.mktemp("cluster"), start_timeout=240))
    broker.start()
    try:
        assert set(replication(broker.bootstrap).values()) == {(3, "2")}
        yield broker
    finally:
        broker.close()


def victim(kafka: KafkaConfig, broker: EmbeddedBroker, role: str) -> int:
    """Index in `broker.nodes` of the node playing `role` now."""
    admin = AdminClient(kafka.client())
    leader = admin.list_topics(timeout=30).topics[kafka.topic(T.TRAJECTORIES)].partitions[0].leader
    group = group_id(kafka)
    coordinator = admin.describe_consumer_groups([group])[group].result().coordinator.id
    ids = {"trajectories-leader": leader, "learner-coordinator": coordinator,
           "follower": random.Random(0).choice(sorted({n.id for n in broker.nodes} - {leader, coordinator}))}
    return [n.id for n in broker.nodes].index(ids[role])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("role", ["follower", "trajectories-leader", "learner-coordinator"])
def test_one_of_three_brokers_sigkilled_mid_run_loses_nothing(cluster, role, tmp_path):
    kafka = KafkaConfig(bootstrap=cluster.bootstrap, topic_prefix=f"f{uuid.uuid4().hex[:8]}", settings={})
    ensure_topics(kafka)
    pipeline, node = Pipeline(kafka, tmp_path), None
    try:
        pipeline.wait_steps(3, timeout=300)
        node = victim(kafka, cluster, role)
        killed = time.time()
        cluster.kill(node)
        pipeline.wait_steps(len(pipeline.steps()) + 2, timeout=300)  # two steps on the two left
        down = time.time() - killed
        cluster.restart(node)
        node = None
        pipeline.finish()
    finally:
        pipeline.close()
        if node is not None:  # a case that failed with its node down leaves the next ones three
            cluster.restart(node)
    report(f"1 of 3 brokers SIGKILLed ({role.replace('-', ' ')})", down, kafka, pipeline, killed)


@pytest.mark.timeout(900)
def test_the_only_broker_sigkilled_and_restarted_on_its_data_loses_nothing(tmp_path):
    broker = EmbeddedBroker(BrokerConfig(port=free_port(), data_dir=tmp_path / "kafka")).start()
    kafka = KafkaConfig(bootstrap=broker.bootstrap, topic_prefix="single", settings={})
    try:
        ensure_topics(kafka)
        pipeline = Pipeline(kafka, tmp_path)
        try:
            pipeline.wait_steps(3, timeout=300)
            killed = time.time()
            broker.kill(0)
            time.sleep(10)  # down: every client retries into a refused connection
            broker.restart(0)
            down = time.time() - killed
            pipeline.finish()
        finally:
            pipeline.close()
        report("the only broker SIGKILLed, restarted on its data", down, kafka, pipeline, killed)
    finally:
        broker.close()

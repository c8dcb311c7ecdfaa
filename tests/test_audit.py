"""`sao audit` on a real run (feeder, producer, learner as processes on the broker): every id
accounted for; then faults constructed on the topics and a learner too forgetful to drop a
repeat: a prompt committed without a trajectory, trajectories trained twice, and trajectories
dropped as stale (explained by the learner's record of them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from confluent_kafka import TopicPartition

from sao.audit import AuditConfig, audit
from schemas import topics as T
from schemas.kafka import KafkaConfig, make_consumer
from schemas.messages import Prompt
from schemas.progress import learner_lag
from tests.consumers.util import REPO, Service, publish, wait_until
from tests.learner.service_util import rollouts

FEED, STEP = 20, 4


def _learner(kafka: KafkaConfig, run: Path, *flags: str) -> Service:
    return Service(kafka, "learner", "--run-dir", str(run / "learner"), "--weights-dir", str(run / "weights"),
                   "--batch-trajectories", str(STEP), "--update.warmup-steps", "0", *flags,
                   env={"SAO_LOG_LEVEL": "WARNING"})


def _finished(proc: Service, timeout: float = 240) -> None:
    wait_until(lambda: proc.p.poll() is not None, timeout=timeout, every=0.5)
    assert proc.p.returncode == 0, proc.log()


def _sao_audit(kafka: KafkaConfig, run: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sao", "audit", "--run-dir", str(run / "learner"),
                           "--kafka.bootstrap", kafka.bootstrap, "--kafka.topic-prefix", kafka.topic_prefix],
                          cwd=REPO, capture_output=True, text=True, timeout=180)


def _commit_past(kafka: KafkaConfig, group: str, topic: str, partition: int) -> None:
    """Commit `group`'s offset on a partition to its end, as a producer that lost a prompt would."""
    consumer = make_consumer(kafka, group)
    try:
        _, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        consumer.commit(offsets=[TopicPartition(topic, partition, high)], asynchronous=False)
    finally:
        consumer.close()


def test_audit_accounts_for_a_real_run_and_flags_a_lost_prompt_and_a_repeat_trained_twice(kafka_cfg, tmp_path):
    producer = Service(kafka_cfg, "producer", "--env", "toy-target", "--model", "tiny-llama", "--max-tokens", "4",
                       "--no-follow-weights", env={"SAO_LOG_LEVEL": "WARNING"})
    try:
        _finished(Service(kafka_cfg, "feed", "--env", "toy-target", "--count", str(FEED)))
        _finished(_learner(kafka_cfg, tmp_path, "--max-steps", "3", "--checkpoint-every", "2"))
        wait_until(lambda: audit(AuditConfig(run_dir=tmp_path / "learner", kafka=kafka_cfg)).sections[0]
                   .rows["produced a trajectory"] == FEED, timeout=120, every=1)
    finally:
        assert producer.stop() == 0, producer.log()

    clean = _sao_audit(kafka_cfg, tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    result = audit(AuditConfig(run_dir=tmp_path / "learner", kafka=kafka_cfg))
    prompts, pending, trajectories = result.sections
    assert prompts.total == prompts.rows["produced a trajectory"] == FEED
    assert pending.total == 0
    assert trajectories.rows["trained"] == 3 * STEP
    assert trajectories.rows["not yet trained (past the checkpoint)"] == FEED - 3 * STEP
    assert result.duplicates == 0 and not result.trained_twice

    # a prompt no producer played, yet committed past: lost
    lost = Prompt(id="lost-prompt", env="toy-target", task={"target": 1})
    publish(kafka_cfg, T.PROMPTS, [(b"lost", lost.encode())])
    p = next(p for p, m in _prompts_by_partition(kafka_cfg).items() if lost.trajectory_id in m)
    _commit_past(kafka_cfg, "sao-producers", kafka_cfg.topic(T.PROMPTS), p)
    # a learner that remembers 4 ids, at max-staleness 2: the 8 left over (version 0) go stale, 4
    # fresh rollouts train, and then 4 more carrying ids trained at step 0 train a second time.
    # Fresh ones are published once the learner has read all 8 (its progress group's lag is 0), so
    # that none can be polled ahead of a leftover from another partition and close a step first.
    lines = lambda: [json.loads(x) for x in (tmp_path / "learner" / "metrics.jsonl").read_text().splitlines()]  # noqa: E731
    steps = lines()
    version = steps[-1]["weights/version"]
    fresh, repeats = (rollouts(STEP, seed=seed, id_prefix=name, version=version) for seed, name in ((3, "fresh"), (4, "again")))
    for traj, tid in zip(repeats, steps[0]["trajectory_ids"]):
        traj.id = tid
    assert learner_lag(kafka_cfg).count() == FEED - 3 * STEP
    second = _learner(kafka_cfg, tmp_path, "--max-steps", "5", "--dedup-window", "4", "--max-staleness", "2")
    wait_until(lambda: learner_lag(kafka_cfg).count() == 0, timeout=240, every=0.5)
    publish(kafka_cfg, T.TRAJECTORIES, fresh)
    wait_until(lambda: len(lines()) > 3 or second.p.poll() is not None, timeout=240, every=0.5)
    publish(kafka_cfg, T.TRAJECTORIES, repeats)  # the ledger holds step 3's ids alone by now
    _finished(second)

    flagged = _sao_audit(kafka_cfg, tmp_path)
    assert flagged.returncode == 1, flagged.stdout + flagged.stderr
    assert f"unexplained prompts fed (1): {lost.trajectory_id}" in flagged.stdout, flagged.stdout
    first_repeat = sorted(steps[0]["trajectory_ids"])[0]
    assert f"trained twice: {first_repeat} (steps [0, 4])" in flagged.stdout, flagged.stdout
    result = audit(AuditConfig(run_dir=tmp_path / "learner", kafka=kafka_cfg))
    trajectories = result.sections[2]
    assert sorted(result.trained_twice) == sorted(steps[0]["trajectory_ids"])
    assert trajectories.rows["trained"] == 4 * STEP and not trajectories.unexplained, flagged.stdout
    assert trajectories.rows["dropped as stale"] == FEED - 3 * STEP, flagged.stdout
    assert result.duplicates == STEP


def _prompts_by_partition(kafka: KafkaConfig) -> dict[int, set[str]]:
    from sao.audit import read_topic
    from schemas.messages import decode

    out: dict[int, set[str]] = {}
    for r in read_topic(kafka, kafka.topic(T.PROMPTS), timeout=60):
        out.setdefault(r.partition, set()).add(decode(r.value).trajectory_id)
    return out

"""`sao learner` end to end on the real broker: weights out, ranks, crashes, poison."""

from __future__ import annotations

import collections
import os
import random
import signal
import subprocess
import time

import msgpack
import numpy as np
import torch

from learner.models import tiny_llama
from schemas import topics as T
from schemas.kafka import make_consumer
from schemas.messages import DeadLetter, Weights
from tests.learner.service_util import (ROOT, announcements, as_published, assert_close_state,
                                        assert_one_policy_per_version, final_policy, latest_checkpoint, learner_cmd,
                                        metrics, ONE_PARTITION, publish, published, rollouts, run_learner, sigkill_mid_run,
                                        trained_ledger)


def test_learner_trains_on_fresh_rollouts_and_publishes_loadable_versions(kafka_cfg, tmp_path):
    """A test producer samples with the newest announced weights while the learner trains."""
    cmd = learner_cmd(kafka_cfg, tmp_path, "--batch-trajectories", "4", "--max-steps", "4")
    learner = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    model, version, sent, seen = tiny_llama(seed=0), -1, 0, []
    consumer = make_consumer(kafka_cfg, "test-producer")
    consumer.subscribe([kafka_cfg.topic(T.WEIGHTS)])
    try:
        while learner.poll() is None and sent < 64:
            msg = consumer.poll(0.2)
            if msg is not None and msg.error() is None:
                seen.append(Weights.decode(msg.value()))
                model.load_state_dict(published(seen))
                version = seen[-1].version
            if version < 0:
                continue  # wait for version 0: producers start from the learner's weights
            publish(kafka_cfg, T.TRAJECTORIES, [t.encode() for t in rollouts(2, seed=sent, id_prefix=f"p{sent}-",
                                                             model=model, version=version)], key=None)
            sent += 2
        _, err = learner.communicate(timeout=120)
    finally:
        consumer.close()
        if learner.poll() is None:
            learner.kill()
    assert learner.returncode == 0, err[-3000:]
    ws = announcements(kafka_cfg)
    assert [w.version for w in ws] == [0, 1, 2, 3, 4]
    assert [w.step for w in ws] == [0, 1, 2, 3, 4]
    assert [w.base for w in ws] == [-1, 0, 1, 2, 3] and all(w.inline for w in ws)  # an anchor, then deltas
    last = published(ws)  # every tensor's checksum and the digest verified
    assert_close_state(last, as_published(final_policy(tmp_path)), rtol=0)  # bf16 by default
    steps = metrics(tmp_path)
    assert len(steps) == 4 and all(s["step/policy_updated"] == 1 for s in steps)
    assert all(0 <= s["stale/max"] <= 8 for s in steps)


def test_two_gloo_ranks_match_one_rank_after_three_steps(kafka_cfg, tmp_path, kafka_bootstrap):
    from schemas.kafka import KafkaConfig, ensure_topics
    payloads = [t.encode() for t in rollouts(12, seed=5)]
    finals = {}
    for nproc in (1, 2):
        cfg = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=f"{kafka_cfg.topic_prefix}n{nproc}")
        ensure_topics(cfg)
        publish(cfg, T.TRAJECTORIES, payloads, key=ONE_PARTITION)
        run_learner(learner_cmd(cfg, tmp_path / str(nproc), "--batch-trajectories", "4",
                                "--max-steps", "3", "--weights.dtype", "float32", nproc=nproc))
        finals[nproc] = published(announcements(cfg))
    assert_close_state(finals[2], finals[1], rtol=1e-5)
    assert not all(torch.equal(finals[1][k], tiny_llama(seed=0).state_dict()[k]) for k in finals[1])


def test_sigkill_three_times_trains_every_trajectory_exactly_once(kafka_bootstrap, kafka_cfg, tmp_path):
    """300 trajectories, batch 8: 37 steps. The learner is SIGKILLed at three random moments
    and restarted; the result must equal an uninterrupted run's, step for step."""
    from schemas.kafka import KafkaConfig, ensure_topics
    trajs = rollouts(300, seed=11)
    payloads = [t.encode() for t in trajs]
    flags = ("--batch-trajectories", "8", "--max-steps", "37", "--max-staleness", "-1", "--checkpoint-every", "2")
    runs = {}
    for name in ("clean", "killed"):
        cfg = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=f"{kafka_cfg.topic_prefix}{name}")
        ensure_topics(cfg)
        publish(cfg, T.TRAJECTORIES, payloads, key=ONE_PARTITION)
        runs[name] = (cfg, tmp_path / name)
    run_learner(learner_cmd(*runs["clean"], *flags))

    cfg, run_dir = runs["killed"]
    kills = 3
    sigkill_mid_run(learner_cmd(cfg, run_dir, *flags), run_dir, random.Random(3), kills)
    run_learner(learner_cmd(cfg, run_dir, *flags))  # to the end

    # the ledger in the final checkpoint says which step trained each trajectory: every one of
    # the 296 in exactly one step, eight to a step, as in the uninterrupted run
    trained = trained_ledger(run_dir)
    assert set(trained) == {t.id for t in trajs[:296]}
    assert sorted(collections.Counter(trained.values()).items()) == [(s, 8) for s in range(37)]
    assert trained == trained_ledger(runs["clean"][1])
    # every step the metrics log recorded, replays after a crash included, had the ledger's
    # composition (a crash after a checkpoint may leave a step without its line, never wrong)
    records = metrics(run_dir)
    assert all(trained[i] == m["step/index"] for m in records for i in m["trajectory_ids"])
    assert len({m["step/index"] for m in records}) >= 37 - kills

    # published weights: each step's policy with the same bytes as in the uninterrupted run, and
    # no version number naming two policies (steps replayed after a crash are numbered anew)
    announced = {name: announcements(c) for name, (c, _) in runs.items()}
    assert [w.version for w in announced["clean"]] == list(range(38))
    assert {(w.step, w.digest) for w in announced["killed"]} == {(w.step, w.digest) for w in announced["clean"]}
    assert_one_policy_per_version(announced["killed"])
    assert_close_state(final_policy(run_dir), final_policy(runs["clean"][1]), rtol=0)


def test_killed_on_two_ranks_resumes_on_one_and_trains_every_trajectory_once(kafka_cfg, tmp_path):
    """SIGKILL to a 2-rank learner (the whole torchrun group), then a 1-rank learner resumes from
    its sharded checkpoint: each trajectory in exactly one step, four to a step."""
    trajs = rollouts(48, seed=13)
    publish(kafka_cfg, T.TRAJECTORIES, [t.encode() for t in trajs], key=ONE_PARTITION)
    flags = ("--batch-trajectories", "4", "--max-steps", "12", "--max-staleness", "-1", "--checkpoint-every", "2")
    proc = subprocess.Popen(learner_cmd(kafka_cfg, tmp_path, *flags, nproc=2), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while len(metrics(tmp_path)) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    shards = sorted(p.name for p in latest_checkpoint(tmp_path).glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # written by both ranks
    run_learner(learner_cmd(kafka_cfg, tmp_path, *flags))  # one rank, to the end
    trained = trained_ledger(tmp_path)
    assert set(trained) == {t.id for t in trajs}
    assert sorted(collections.Counter(trained.values()).items()) == [(s, 4) for s in range(12)]
    assert all(trained[i] == m["step/index"] for m in metrics(tmp_path) for i in m["trajectory_ids"])


def test_versions_published_after_the_last_checkpoint_are_never_reused(kafka_cfg, tmp_path):
    """Checkpoints every 5 steps; SIGKILL a few steps in, before the first: the restart replays
    those steps from the start, and its policies take numbers past every version announced."""
    trajs = rollouts(48, seed=5)
    publish(kafka_cfg, T.TRAJECTORIES, [t.encode() for t in trajs], key=ONE_PARTITION)
    flags = ("--batch-trajectories", "4", "--max-steps", "12", "--max-staleness", "-1", "--checkpoint-every", "5")
    proc = subprocess.Popen(learner_cmd(kafka_cfg, tmp_path, *flags), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    announcements(kafka_cfg, timeout=120, until=3)  # versions 0-2: the publisher announces off the training
    proc.send_signal(signal.SIGKILL)                 # thread, so a step's metrics can come before its version
    assert proc.wait() == -signal.SIGKILL
    assert not (tmp_path / "learner" / "checkpoints").exists() or not list(
        (tmp_path / "learner" / "checkpoints").glob("step*"))  # killed before the first checkpoint
    before = announcements(kafka_cfg)
    assert [w.version for w in before] == list(range(len(before))) and len(before) >= 3
    run_learner(learner_cmd(kafka_cfg, tmp_path, *flags))  # to the end

    after = announcements(kafka_cfg)[len(before):]
    assert after[0].version == before[-1].version + 1 and after[0].step == 0  # the restored (initial) policy
    assert [w.version for w in after] == list(range(after[0].version, after[0].version + 13))
    assert [w.step for w in after] == list(range(13))
    assert after[0].digest == before[0].digest  # the same policy as version 0, under a new number
    assert_one_policy_per_version(before + after)
    # all rollouts are version 0's: step k is k updates stale, as in a run never killed (the
    # skipped numbers are not updates)
    replayed = metrics(tmp_path)[-12:]
    assert [(m["step/index"], m["stale/max"]) for m in replayed] == [(k, k) for k in range(12)]
    trained = trained_ledger(tmp_path)
    assert sorted(collections.Counter(trained.values()).items()) == [(s, 4) for s in range(12)]


def _raw(traj) -> dict:
    return msgpack.unpackb(traj.encode(), raw=False)


def test_poison_is_dead_lettered_and_counted_and_a_skipped_step_publishes_nothing(kafka_cfg, tmp_path):
    good = rollouts(19, seed=21)
    for i, t in enumerate(good):  # as if sampled by the version current when they arrive
        t.versions = np.where(t.action_mask == 1, i // 4, -1).astype(np.int32)
    mismatched = _raw(good[0]) | {"id": "mismatched"}
    mismatched["versions"] = mismatched["versions"][:-4]
    nan_reward = _raw(good[1]) | {"id": "nan-reward", "reward": float("nan")}
    stale = rollouts(1, seed=99, id_prefix="stale")[0]  # version 0 when the learner is at 3
    huge = rollouts(1, seed=98, id_prefix="huge")[0]
    huge.reward = 3e38  # finite, so it decodes, but its value loss overflows: the step is skipped
    huge.versions = np.where(huge.action_mask == 1, 3, -1).astype(np.int32)
    stream = ([t.encode() for t in good[:8]] + [b"\x00garbage", msgpack.packb(mismatched)]
              + [t.encode() for t in good[8:12]] + [msgpack.packb(nan_reward), stale.encode()]
              + [huge.encode()] + [t.encode() for t in good[12:19]])
    publish(kafka_cfg, T.TRAJECTORIES, stream, key=ONE_PARTITION)
    run_learner(learner_cmd(kafka_cfg, tmp_path, "--batch-trajectories", "4", "--max-steps", "5",
                            "--max-staleness", "1"))
    steps = metrics(tmp_path)
    assert [s["step/skipped"] for s in steps] == [0, 0, 0, 1, 0]
    assert steps[-1]["count/dlq"] == 3 and steps[-1]["count/stale"] == 1
    assert [s["weights/version"] for s in steps] == [1, 2, 3, 3, 4]
    assert [w.version for w in announcements(kafka_cfg)] == [0, 1, 2, 3, 4]  # none from the skipped step

    consumer = make_consumer(kafka_cfg, "dlq-reader")
    consumer.subscribe([kafka_cfg.topic(T.DLQ)])
    letters, deadline = [], time.monotonic() + 30
    while len(letters) < 3 and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and msg.error() is None:
            letters.append(DeadLetter.decode(msg.value()))
    consumer.close()
    assert [dl.offset for dl in letters] == [8, 9, 14]
    assert "versions" in letters[1].error and "reward" in letters[2].error


def test_activation_checkpointing_trains_the_same_step(kafka_cfg, tmp_path, kafka_bootstrap):
    """Recomputing activations in backward changes memory, not the result."""
    from schemas.kafka import KafkaConfig, ensure_topics
    payloads = [t.encode() for t in rollouts(4, seed=31)]
    finals = []
    for i, flags in enumerate([(), ("--parallel.activation-checkpointing",)]):
        cfg = KafkaConfig(bootstrap=kafka_bootstrap, topic_prefix=f"{kafka_cfg.topic_prefix}ac{i}")
        ensure_topics(cfg)
        publish(cfg, T.TRAJECTORIES, payloads, key=ONE_PARTITION)
        run_learner(learner_cmd(cfg, tmp_path / str(i), "--batch-trajectories", "4", "--max-steps", "1",
                                "--weights.dtype", "float32", *flags))
        finals.append(published(announcements(cfg)))
    assert_close_state(finals[1], finals[0], rtol=1e-6)

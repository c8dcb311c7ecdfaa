"""No input stops the learner: every kind of untrainable trajectory, fed to a running `sao learner`
between valid ones, lands in `sao.dlq` with its reason and source offset; the learner trains every
valid one, survives SIGKILL and a restart on the same topic, and trains nothing twice."""

from __future__ import annotations

import collections
import dataclasses
import os
import signal
import subprocess
import time

import msgpack
import numpy as np

from schemas import topics as T
from schemas.messages import Prompt
from tests.learner.service_util import (ROOT, learner_cmd, metrics, ONE_PARTITION, publish, rollouts, run_learner,
                                        trained_ledger)
from tests.learner.test_checks import read_dead_letters


def _raw(traj, **fields) -> bytes:
    return msgpack.packb(msgpack.unpackb(traj.encode(), raw=False) | fields, use_bin_type=True)


def _with_prefix(t, n: int):
    """`t` with n more prompt tokens in front: a longer, otherwise valid trajectory."""
    return dataclasses.replace(
        t, tokens=np.r_[np.ones(n, np.int32), t.tokens], action_mask=np.r_[np.zeros(n, np.uint8), t.action_mask],
        rollout_logprobs=np.r_[np.zeros(n, np.float32), t.rollout_logprobs],
        versions=np.r_[np.full(n, -1, np.int32), t.versions], prompt_len=t.prompt_len + n)


def untrainable_kinds(t) -> dict[str, tuple[bytes, str]]:
    """name -> (payload, a word the dead letter's reason must contain), each built from valid `t`."""
    last = len(t.tokens) - 1
    acted = np.flatnonzero(t.action_mask)
    out_of_vocab, negative, positive_lp = t.tokens.copy(), t.tokens.copy(), t.rollout_logprobs.copy()
    out_of_vocab[last], negative[0], positive_lp[acted[0]] = 64, -3, 0.5
    first_acts = np.r_[1, t.action_mask[1:]].astype(np.uint8)
    bad = {
        "garbage": (b"\x00\xffnot msgpack", "<message>"),
        "empty": (b"", "<message>"),
        "out-of-vocab": (dataclasses.replace(t, tokens=out_of_vocab), "tokens"),
        "negative-id": (dataclasses.replace(t, tokens=negative), "tokens"),
        "too-long": (_with_prefix(t, 40), "max-seq-len"),
        "no-action": (dataclasses.replace(t, action_mask=np.zeros_like(t.action_mask),
                                          versions=np.full_like(t.versions, -1)), "action_mask"),
        "acts-first": (dataclasses.replace(t, action_mask=first_acts, prompt_len=0,
                                           versions=np.where(first_acts == 1, 0, -1).astype(np.int32)), "action_mask"),
        "positive-logprob": (dataclasses.replace(t, rollout_logprobs=positive_lp), "rollout_logprobs"),
        "temperature": (dataclasses.replace(t, temperature=0.7), "temperature"),
        "top-p": (dataclasses.replace(t, top_p=0.9), "top_p"),
        "top-k": (dataclasses.replace(t, top_k=5), "top_k"),
        "no-reward": (dataclasses.replace(t, reward=None), "reward"),
        "turn-reward-off-sequence": (_raw(t, turn_rewards=[[999, 1.0]]), "turn_rewards"),
        "turn-reward-string": (_raw(t, turn_rewards=[[int(acted[0]), "1.0"]]), "turn_rewards"),
        "turn-rewards-map": (_raw(t, turn_rewards={"3": 1.0}), "turn_rewards"),
        "unknown-version": (_raw(t, v=99), "v"),
        "a-prompt": (Prompt(id="p", env="toy-target").encode(), "kind"),
    }
    return {name: (p if isinstance(p, bytes) else p.encode(), word) for name, (p, word) in bad.items()}


def _interleave(valid: list, bad: dict) -> tuple[list[bytes], dict[int, tuple[str, str]]]:
    """valid and bad payloads alternating; returns the stream and offset -> (bad name, word)."""
    stream, where, bad_items = [], {}, list(bad.items())
    for i, t in enumerate(valid):
        stream.append(t.encode())
        if i < len(bad_items):
            name, (payload, word) = bad_items[i]
            where[len(stream)] = (name, word)
            stream.append(payload)
    return stream, where


def test_every_untrainable_kind_is_dead_lettered_the_learner_survives_sigkill_and_trains_each_valid_once(
        kafka_cfg, tmp_path):
    valid = rollouts(32, seed=41, id_prefix="ok")
    bad = untrainable_kinds(rollouts(1, seed=42, id_prefix="bad")[0])
    first, where = _interleave(valid[:16], bad)
    publish(kafka_cfg, T.TRAJECTORIES, first, key=ONE_PARTITION)
    flags = ("--batch-trajectories", "4", "--max-steps", "8", "--max-seq-len", "40", "--max-staleness", "-1")
    proc = subprocess.Popen(learner_cmd(kafka_cfg, tmp_path, *flags), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 180
    while len(metrics(tmp_path)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read()[-3000:]  # still running after all the bad input
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stderr.close()

    publish(kafka_cfg, T.TRAJECTORIES, [t.encode() for t in valid[16:]], key=ONE_PARTITION)
    run_learner(learner_cmd(kafka_cfg, tmp_path, *flags))  # to the end, no crash loop

    trained = trained_ledger(tmp_path)
    assert set(trained) == {t.id for t in valid}  # every valid one, and nothing else
    assert sorted(collections.Counter(trained.values()).items()) == [(s, 4) for s in range(8)]
    letters = read_dead_letters(kafka_cfg, 2 * len(bad))  # a replay after SIGKILL may letter twice
    by_offset = {dl.offset: dl for dl in letters}
    assert sorted(by_offset) == sorted(where)
    for offset, (name, word) in where.items():
        dl = by_offset[offset]
        assert word in dl.error and dl.source_topic == kafka_cfg.topic(T.TRAJECTORIES), (name, dl.error)
        assert dl.payload == first[offset], name


def test_a_topic_deleted_under_a_running_learner_stops_it_with_a_clear_error(kafka_cfg, tmp_path):
    from confluent_kafka.admin import AdminClient
    publish(kafka_cfg, T.TRAJECTORIES, [t.encode() for t in rollouts(4, seed=43)], key=ONE_PARTITION)
    proc = subprocess.Popen(learner_cmd(kafka_cfg, tmp_path, "--batch-trajectories", "4"), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 120
        while not metrics(tmp_path) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        topic = kafka_cfg.topic(T.TRAJECTORIES)
        admin = AdminClient(kafka_cfg.client())  # held: a collected client cancels its futures
        admin.delete_topics([topic])[topic].result(30)
        _, err = proc.communicate(timeout=60)  # never a log-and-spin
    finally:
        proc.kill()
    assert proc.returncode not in (0, None), err[-3000:]
    assert "FatalKafkaError" in err and topic in err and "Unknown topic" in err, err[-3000:]

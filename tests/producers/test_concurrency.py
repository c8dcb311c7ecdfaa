"""Many episodes in flight per producer, on the real broker: at-least-once with out-of-order
completion under SIGKILL, and exact per-token versions across a swap with 16 episodes in flight."""

from __future__ import annotations

import math
import signal
import time
import uuid
from collections import defaultdict

import numpy as np
import torch
from confluent_kafka import TopicPartition

from schemas import topics as T
from schemas.catalogue import tiny_llama
from schemas.kafka import make_consumer
from tests.producers.util import (announce, announcement, full_forward_logprobs, make_prompts, producer_process,
                                  publish_prompts, read_topic, wait_until, write_weights)

# no learner consumes here: no backpressure bound either (--max-lag 0), or 400 prompts would hold at 256
SIM = ("--backend", "sim", "--env", "toy-target", "--model", "tiny-llama", "--no-follow-weights", "--max-lag", "0",
       "--sim.median-tokens", "20", "--sim.sigma", "1.0", "--sim.token-s", "0.02", "--max-tokens", "200")


def committed_positions(kafka_cfg) -> dict[int, int]:
    """The producers group's committed position of each prompts partition (-1001: none yet)."""
    consumer = make_consumer(kafka_cfg, "sao-producers")  # never subscribes: only reads commits
    try:
        parts = [TopicPartition(kafka_cfg.topic(T.PROMPTS), p) for p in range(T.PROMPTS.partitions)]
        return {tp.partition: tp.offset for tp in consumer.committed(parts, timeout=10)}
    finally:
        consumer.close()


def test_sigkill_with_64_in_flight_loses_no_prompt_and_commits_only_delivered_prefixes(kafka_cfg):
    prompts = make_prompts("toy-target", [{"target": i % 4} for i in range(400)])
    where = dict(zip((p.id for p in prompts), publish_prompts(kafka_cfg, prompts)))
    a = producer_process(kafka_cfg, "a", *SIM, "--concurrency", "64")
    try:
        wait_until(lambda: len(a.started()) >= 150, timeout=180)  # many delivered, 64 in flight
        a.stop(signal.SIGKILL)
        delivered = {t.prompt_id for t in read_topic(kafka_cfg, T.TRAJECTORIES, 0, timeout=5, until=lambda _: False)}
        positions = committed_positions(kafka_cfg)
        by_partition = defaultdict(dict)
        for pid, (partition, offset) in where.items():
            by_partition[partition][offset] = pid in delivered
        ahead = 0
        for partition, done in by_partition.items():
            position = positions.get(partition, -1001)
            assert all(done[o] for o in range(max(position, 0))), f"partition {partition} committed past a gap"
            ahead += sum(d for o, d in done.items() if o >= max(position, 0))
        assert ahead > 0  # episodes did finish out of order beyond the committed prefix
        assert len(a.started()) - len(delivered) > 1  # and several were cut off in flight

        b = producer_process(kafka_cfg, "b", *SIM, "--concurrency", "64")
        try:
            ids = {p.id for p in prompts}
            trajs = read_topic(kafka_cfg, T.TRAJECTORIES, 0, timeout=180,
                               until=lambda ts: ids <= {t.prompt_id for t in ts})
            assert ids <= {t.prompt_id for t in trajs}, f"lost {len(ids - {t.prompt_id for t in trajs})}"
            assert b.stop() == 0
        finally:
            b.p.kill()
    finally:
        a.p.kill()


def test_a_swap_with_16_episodes_in_flight_tags_each_token_with_the_version_that_sampled_it(kafka_cfg, tmp_path):
    """Version 1's lm_head is zero, so a token it sampled has log-prob exactly −log 64 whatever the
    cached context; a token of version 0 has version 0's full-forward log-prob. The tiny Llama gets
    4,096 positions (the catalogue's has 256, whose episodes ended in 0.8 s here: a swap applied
    any later found one already finished, and CI failed on it)."""
    v0 = tiny_llama(max_positions=4096, seed=0)
    v0.save_pretrained(tmp_path / "v0")  # no tokenizer files: raw ids, no stop token, every episode runs 4,094 tokens
    flat = tiny_llama(max_positions=4096, seed=0)
    with torch.no_grad():
        flat.lm_head.weight.zero_()
    path = write_weights(flat, tmp_path / f"v1-{uuid.uuid4().hex[:6]}.safetensors")
    prompts = make_prompts("toy-target", [{"target": i % 4} for i in range(16)])
    publish_prompts(kafka_cfg, prompts)
    proc = producer_process(kafka_cfg, "swap", "--backend", "hf", "--env", "toy-target", "--model", str(tmp_path / "v0"),
                "--seed", "0", "--concurrency", "16", "--max-tokens", "8192")
    try:
        wait_until(lambda: len(proc.started()) == 16, timeout=120)
        announce(kafka_cfg, announcement(path, 1))
        trajs = read_topic(kafka_cfg, T.TRAJECTORIES, 16, timeout=300)
        assert proc.stop() == 0
    finally:
        proc.p.kill()
    assert len(trajs) == 16
    for t in trajs:
        acted = t.action_mask == 1
        versions, logp = t.versions[acted], t.rollout_logprobs[acted]
        assert (np.diff(versions) >= 0).all() and versions[0] == 0 and versions[-1] == 1  # swapped mid-flight
        np.testing.assert_allclose(logp[versions == 1], -math.log(64), atol=1e-5)
        before = int((versions == 0).sum())
        ref = full_forward_logprobs(v0, t.tokens[:t.prompt_len + before].tolist(), before, t.temperature)
        np.testing.assert_allclose(logp[:before], ref.numpy(), atol=1e-4)


def test_a_member_joining_while_every_slot_is_busy_gets_partitions_at_once(kafka_cfg):
    """Producer a has every slot on a 100 s episode when b joins. a answers the rebalance while
    they run (its partitions are paused, not left unpolled): b starts episodes long before any of
    a's could end, and a gives up the revoked partitions."""
    slow = ("--backend", "sim", "--env", "toy-target", "--model", "tiny-llama", "--no-follow-weights",
            "--sim.median-tokens", "1e9", "--sim.sigma", "0", "--sim.token-s", "0.5", "--max-tokens", "200",
            "--concurrency", "4")
    publish_prompts(kafka_cfg, make_prompts("toy-target", [{"target": i % 4} for i in range(24)]))
    a = producer_process(kafka_cfg, "a", *slow)
    b = None
    try:
        wait_until(lambda: len(a.started()) == 4, timeout=120)
        started = time.monotonic()
        b = producer_process(kafka_cfg, "b", *slow)
        wait_until(lambda: len(b.started()) >= 4, timeout=90)
        assert time.monotonic() - started < 100  # a's episodes were all still running
        assert any("given up" in line for line in a.lines)
        assert read_topic(kafka_cfg, T.TRAJECTORIES, 1, timeout=1) == []
    finally:
        for proc in (a, b):
            if proc is not None:
                proc.p.kill()

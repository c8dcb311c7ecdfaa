"""Publication off the training thread: snapshots, anchors and deltas, supersession, failures, and a
learner restarted after dying between a delta's write and its announcement."""

from __future__ import annotations

import subprocess
import threading

import pytest
import torch
import torch.distributed as dist

from learner.models import ModelConfig, build_models, build_policy
from learner.parallel import ParallelConfig, init_distributed
from learner.parallel import snapshot
from producers.generate.hf import HFGenerator
from producers.models import load_model
from schemas import topics as T
from schemas.kafka import make_producer
from schemas.weights import payload as W
from schemas.weights.announcements import announcer, newest_announced
from schemas.weights.chain import local_path
from schemas.weights.follow import WeightSubscriber
from schemas.weights.publish import AnchorRequests, Publisher, WeightsConfig
from schemas.weights.store import WeightStore
from tests.learner.service_util import (ROOT, announcements, as_published, assert_close_state, final_policy,
                                        learner_cmd, metrics, ONE_PARTITION, publish, published, rollouts, run_learner)
from tests.producers.util import wait_until


@pytest.fixture
def group_of_one():
    init_distributed("cpu")
    yield
    dist.destroy_process_group()


def _state(value: float, n: int = 4096) -> W.State:
    x = torch.linspace(0, 1, n) + value
    return {"w": W.from_torch(x.bfloat16()), "norm": W.from_torch(torch.ones(8).bfloat16())}


def test_a_snapshot_is_a_copy_in_the_published_dtype(group_of_one):
    policy, _ = build_models(build_policy(ModelConfig()), False, ParallelConfig(), torch.device("cpu"))
    before = {k: v.full_tensor().detach().clone() for k, v in policy.state_dict().items()}  # DTensors
    snap = snapshot(policy, torch.bfloat16, bucket_bytes=4096)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)  # training goes on
    assert list(snap) == list(before)
    assert all(t.dtype == "BF16" and torch.equal(W.to_torch(t), before[k].bfloat16()) for k, t in snap.items())


def _publisher(kafka_cfg, tmp_path, announce=None, **cfg) -> Publisher:
    real = announcer(make_producer(kafka_cfg), kafka_cfg.topic(T.WEIGHTS))
    return Publisher(WeightsConfig(**cfg), WeightStore(tmp_path / "weights"), announce or real)


def test_anchors_at_start_every_k_versions_and_on_request_deltas_between(kafka_cfg, tmp_path):
    pub = _publisher(kafka_cfg, tmp_path, anchor_every=3, inline_bytes=4096)
    states = [_state(v * 1e-4) for v in range(8)]
    try:
        for v, state in enumerate(states):
            if v == 5:
                pub.request_anchor()
            pub.submit(state, v, step=v)
            pub.wait()
    finally:
        pub.close()
    ws = announcements(kafka_cfg)
    assert [w.base for w in ws] == [-1, 0, 1, -1, 3, -1, 5, 6]  # start, 3 versions on, requested
    assert [w.inline for w in ws] == [w.base >= 0 for w in ws]  # 8 KB anchors as files, deltas inline
    for v, state in enumerate(states):
        rebuilt = published(ws, v)
        assert torch.equal(rebuilt["w"], W.to_torch(state["w"]))
    assert all(ws[v].digest == W.digest(states[v]) for v in range(8))


def _nudged(v: int) -> W.State:
    """tiny-llama's seed-0 policy in bf16, moved by v x 1e-2: version v of a run."""
    return {k: W.from_torch((t + v * 1e-2).bfloat16()) for k, t in load_model("tiny-llama", seed=0).state_dict().items()}


def test_a_producer_that_cannot_reach_the_newest_version_gets_an_anchor_on_request(kafka_cfg, tmp_path):
    """A late producer finds the chain broken (a delta's file gone): it asks on sao.weights.requests,
    the learner's next publication is an anchor although --weights.anchor-every is far off, and the
    producer then serves exactly that version."""
    pub = _publisher(kafka_cfg, tmp_path, anchor_every=1000, inline_bytes=0)  # files: one can go missing
    asks = AnchorRequests(kafka_cfg, pub)
    gen = HFGenerator(load_model("tiny-llama", seed=0), seed=0)
    sub = WeightSubscriber(kafka_cfg, gen, requester="late-producer")
    try:
        for v in range(3):
            pub.submit(_nudged(v), v, step=v)
            pub.wait()
        local_path(announcements(kafka_cfg, timeout=5)[1].uri).unlink()  # v1's delta lost
        sub.start()
        wait_until(lambda: pub.anchor_requests == 1)
        assert gen.version == 0 and sub.counts["anchor_asks"] == 1  # v1 and v2 out of reach
        pub.submit(_nudged(3), 3, step=3)
        pub.wait()
        wait_until(lambda: gen.version == 3)
    finally:
        sub.close()
        asks.close()
        pub.close()
    ws = announcements(kafka_cfg, timeout=5)
    assert [w.base for w in ws] == [-1, 0, 1, -1]  # the requested anchor, 997 versions early
    assert pub.last["weights/anchor_requests"] == 1
    assert_close_state(gen.model.state_dict(), {k: W.to_torch(t).float() for k, t in _nudged(3).items()}, rtol=0)


def test_a_newer_snapshot_supersedes_the_queued_one_and_submit_never_waits(kafka_cfg, tmp_path):
    gate, real = threading.Event(), announcer(make_producer(kafka_cfg), kafka_cfg.topic(T.WEIGHTS))
    announcing = threading.Event()
    pub = _publisher(kafka_cfg, tmp_path, announce=lambda w: (announcing.set(), gate.wait(60), real(w)))
    try:
        pub.submit(_state(0), 0, step=0)
        assert announcing.wait(60)  # v0 in flight, its announcement held back
        for v in range(1, 4):  # v1 and v2 superseded, v3 queued
            pub.submit(_state(v * 1e-2), v, step=v)
        assert not gate.is_set() and pub.superseded == 2  # every submit returned with v0 still in flight
        gate.set()
        pub.wait()
    finally:
        pub.close()
    ws = announcements(kafka_cfg)
    assert [(w.version, w.base) for w in ws] == [(0, -1), (3, 0)]  # a delta onto what was published
    assert torch.equal(published(ws)["w"], W.to_torch(_state(3e-2)["w"]))


def test_a_failed_publication_is_raised_by_the_next_submit(kafka_cfg, tmp_path):
    pub = _publisher(kafka_cfg, tmp_path, inline_bytes=0)
    (tmp_path / "weights").rmdir()
    (tmp_path / "weights").write_text("a file where the store should be")
    try:
        pub.submit(_state(0), 0, step=0)
        with pytest.raises(RuntimeError, match="weight publication failed"):
            pub.wait()
        with pytest.raises(RuntimeError, match="weight publication failed"):
            pub.submit(_state(1), 1, step=1)
    finally:
        pub.close()


def test_newest_announced_reads_the_tail_of_the_topic(kafka_cfg, tmp_path):
    assert newest_announced(kafka_cfg) == -1
    pub = _publisher(kafka_cfg, tmp_path)
    try:
        for v in (0, 1, 5):
            pub.submit(_state(v), v, step=v)
            pub.wait()
    finally:
        pub.close()
    from tests.producers.util import announce as announce_raw
    announce_raw(kafka_cfg, b"not an announcement")
    assert newest_announced(kafka_cfg) == 5


def test_a_delta_written_but_never_announced_is_never_a_base(kafka_cfg, tmp_path):
    """The learner is SIGKILLed mid-run; the store is then as a SIGKILL between a delta's write and
    its announcement leaves it (the next delta file, written by the store's own code, unannounced).
    The restart numbers its policies past that file, starts a new chain with an anchor, and a
    producer that followed the first run ends on the restarted learner's last version, exactly."""
    trajs = rollouts(24, seed=7)
    publish(kafka_cfg, T.TRAJECTORIES, [t.encode() for t in trajs], key=ONE_PARTITION)
    flags = ("--batch-trajectories", "4", "--max-steps", "6", "--max-staleness", "-1", "--checkpoint-every", "2",
             "--weights.inline-bytes", "0")  # every update a file, as for a large model
    gen = HFGenerator(load_model("tiny-llama", seed=0), seed=0)
    sub = WeightSubscriber(kafka_cfg, gen).start()
    try:
        proc = subprocess.Popen(learner_cmd(kafka_cfg, tmp_path, *flags), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        wait_until(lambda: len(metrics(tmp_path)) >= 3 or proc.poll() is not None, timeout=120)
        proc.kill()
        proc.wait()
        before = announcements(kafka_cfg, timeout=5)
        last = before[-1]
        wait_until(lambda: gen.version == last.version)
        store = WeightStore(tmp_path / "weights")
        held = {k: W.from_torch(v) for k, v in published(before).items()}
        moved = {k: W.from_torch(W.to_torch(t) + 1) for k, t in held.items()}
        orphan = store.save(last.version + 1, W.delta(moved, held, last.version)[0])
        run_learner(learner_cmd(kafka_cfg, tmp_path, *flags))
        after = announcements(kafka_cfg)[len(before):]
        wait_until(lambda: gen.version == after[-1].version)
    finally:
        sub.close()
    assert orphan.name == f"v{last.version + 1:08d}.delta.safetensors"
    assert after[0].base == -1 and after[0].version > last.version + 1  # past the orphan, a new chain
    assert all(w.base != last.version + 1 for w in after)
    assert_close_state({k: v for k, v in gen.model.state_dict().items()},
                       {k: v.float() for k, v in as_published(final_policy(tmp_path)).items()}, rtol=0)
    assert sub.counts["rejected"] == 0 and sub.error is None

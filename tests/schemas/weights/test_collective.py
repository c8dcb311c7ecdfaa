"""The collective links themselves, over real TCP stores and gloo groups in one process: a state
sent a bucket at a time arrives bit for bit; an engine holding another layout is dropped within
the timeout while the learner goes on, and links again; an engine without a GPU does not join an
NCCL learner (its files carry on). The whole path with `sao learner` and two `sao serve` engines
is tests/producers/test_collective.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from sao.broker import free_port
from schemas.config import ConfigError
from schemas.weights import collective as C
from schemas.weights import payload as W
from tests.producers.util import wait_until


def state(seed: int, rows: int = 40) -> W.State:
    g = torch.Generator().manual_seed(seed)
    return {"embed": W.from_torch(torch.randn(rows, 16, generator=g).to(torch.bfloat16)),
            "norm": W.from_torch(torch.randn(16, generator=g)),
            "head": W.from_torch(torch.randn(8, 16, generator=g).to(torch.bfloat16))}


def zeros_like(s: W.State) -> W.State:
    return {k: W.Tensor(t.dtype, t.shape, np.zeros_like(t.bits)) for k, t in s.items()}


@pytest.fixture
def links():
    links = C.Links(free_port(), timeout_s=3.0, bucket_bytes=300)  # embed (1280 B) alone; norm + head in one
    yield links
    links.close()


def linked(links: C.Links) -> C.Link:
    link = C.Link(f"127.0.0.1:{links.store.port}", timeout_s=3.0)
    link.start()
    wait_until(lambda: link.linked and link.slot in links.members, timeout=30)
    return link


def send(links: C.Links, version: int, s: W.State) -> dict:
    """Broadcast on a thread of its own, as the learner's publisher does; its result when done."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("took", links.broadcast(version, s)))
    thread.start()
    out["thread"] = thread
    return out


def test_a_state_sent_in_buckets_arrives_bit_for_bit(links):
    link = linked(links)
    sent = state(1)
    out = send(links, 7, sent)
    got = link.receive(7, zeros_like(sent))
    out["thread"].join(10)
    assert out["took"] == [link.slot]
    assert {k: (t.dtype, t.shape) for k, t in got.items()} == {k: (t.dtype, t.shape) for k, t in sent.items()}
    assert all(np.array_equal(got[k].bits, sent[k].bits) for k in sent)
    assert W.digest(got) == W.digest(sent)
    link.close()


def test_an_engine_holding_another_layout_is_dropped_and_the_learner_goes_on_then_it_links_again(links):
    link = linked(links)
    first = link.slot
    out = send(links, 1, state(1))
    with pytest.raises(RuntimeError, match="another layout"):
        link.receive(1, zeros_like(state(1, rows=41)))  # one row more than the learner's
    out["thread"].join(10)
    assert not out["thread"].is_alive() and out["took"] == []  # dropped, within the 3 s timeout
    assert first not in links.members
    wait_until(lambda: link.linked and link.slot in links.members, timeout=30)  # linked again, new slot
    assert link.slot != first
    sent = state(2)
    out = send(links, 2, sent)
    got = link.receive(2, zeros_like(sent))
    out["thread"].join(10)
    assert out["took"] == [link.slot] and W.digest(got) == W.digest(sent)
    link.close()


def test_a_stalled_engine_is_dropped_while_a_healthy_one_waits_and_takes_the_update(links):
    """The learner waits its 3 s timeout on the stalled engine's first bucket before sending the
    next; the healthy engine must outwait that (its buckets' receives fail at twice its timeout,
    not at its group's own 3 s: a race lost in CI once)."""
    healthy, stalled = linked(links), linked(links)
    sent = state(4)
    out = send(links, 4, sent)
    got = healthy.receive(4, zeros_like(sent))  # `stalled` never receives
    out["thread"].join(10)
    assert out["took"] == [healthy.slot] and W.digest(got) == W.digest(sent)
    assert links.members == [healthy.slot]
    healthy.close()
    stalled.close()


def test_an_engine_not_in_a_broadcast_takes_the_files():
    links = C.Links(free_port(), timeout_s=3.0)
    try:
        links.broadcast(3, state(3))  # before the engine linked: it is not listed
        link = linked(links)
        assert link.receive(3, zeros_like(state(3))) is None
        link.close()
    finally:
        links.close()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine has a GPU here: it would link over NCCL")
def test_an_engine_without_a_gpu_does_not_link_to_a_learner_broadcasting_over_nccl():
    import datetime
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    store.set(C._BACKEND, "nccl")  # what a learner on CUDA writes
    link = C.Link(f"127.0.0.1:{store.port}", timeout_s=3.0)
    link.start()
    wait_until(lambda: link.refused, timeout=30)
    assert "NCCL" in link.refused and not link.linked
    assert store.add(C._ENGINES, 0) == 0  # took no slot: the learner never waits for it
    link.start()  # a later state held does not make it try again
    assert link._thread is None or not link._thread.is_alive()
    link.close()


def test_the_links_backend_follows_the_learners_device():
    assert C.link_backend("auto", torch.device("cpu")) == "gloo"
    assert C.link_backend("auto", torch.device("cuda", 0)) == "nccl"
    assert C.link_backend("gloo", torch.device("cuda", 0)) == "gloo"
    with pytest.raises(ConfigError, match="--weights.collective-backend nccl"):
        C.link_backend("nccl", torch.device("cpu"))


def test_buckets_keep_order_and_put_a_larger_tensor_alone():
    ts = [torch.empty(n, dtype=torch.uint8) for n in (100, 150, 400, 50, 60)]
    assert [[t.numel() for t in b] for b in C._buckets(ts, 300)] == [[100, 150], [400], [50, 60]]

"""Weight store and checkpointer: atomic files, last K kept, weights streamed bucket by bucket,
sharded checkpoints that are snapshots, durable before their `then`, with plain data beside."""

from __future__ import annotations

import hashlib
import io
import shutil
from urllib.parse import urlparse

import msgpack
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load, load_file

from learner.parallel import init_distributed
from learner.store import Checkpointer, WeightStore, write_safetensors


def specs_of(state):
    return {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}


def test_streamed_safetensors_equal_the_library_and_take_any_bucketing():
    state = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64),
             "c": torch.randn(2, 2).to(torch.bfloat16), "d": torch.ones(1, dtype=torch.bool)}
    items = list(state.items())
    for buckets in ([items], [[x] for x in items], [items[:3], items[3:]]):
        f = io.BytesIO()
        write_safetensors(f, specs_of(state), buckets)
        loaded = load(f.getvalue())
        assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    with pytest.raises(ValueError, match="order"):
        write_safetensors(io.BytesIO(), specs_of(state), [items[::-1]])


def test_weight_store_announces_what_it_wrote_and_keeps_the_last_k(tmp_path):
    store = WeightStore(tmp_path, keep=2)
    tied = torch.randn(4, 3)
    for v in range(4):
        state = {"embed.weight": tied, "lm_head.weight": tied, "b": torch.full((2,), float(v))}
        w = store.save(specs_of(state), [list(state.items())], v, step=v)
    path = urlparse(w.uri).path
    data = open(path, "rb").read()
    assert (w.version, w.step, w.num_bytes, w.sha256) == (3, 3, len(data), hashlib.sha256(data).hexdigest())
    assert torch.equal(load_file(path)["lm_head.weight"], tied)  # tied tensors are stored twice
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002.safetensors", "v00000003.safetensors"]


@pytest.fixture
def group_of_one():
    init_distributed("cpu")
    yield
    dist.destroy_process_group()


def test_checkpoint_is_a_snapshot_and_then_runs_once_it_is_durable(tmp_path, group_of_one):
    ckpt = Checkpointer(tmp_path, every=2, keep=2)
    assert ckpt.due(4) and not ckpt.due(3)
    weights, durable = torch.zeros(3), []
    ckpt.save(1, {"model": {"w": weights}, "ids": {"a": 0}, "raw": b"\x00\x01"},
              then=lambda: durable.append(sorted(p.name for p in tmp_path.iterdir())))
    weights += 1  # training goes on while the write is in flight
    ckpt.wait()
    assert durable == [["step00000001"]]
    assert msgpack.unpackb((ckpt.latest() / "learner.msgpack").read_bytes()) == {"ids": {"a": 0}, "raw": b"\x00\x01"}
    loaded = Checkpointer.load(ckpt.latest(), {"model": {"w": torch.full((3,), 7.0)}})
    assert torch.equal(loaded["model"]["w"], torch.zeros(3)) and loaded["ids"] == {"a": 0}
    assert Checkpointer.saved_keys(ckpt.latest()) == {"model"}
    for step in (2, 3):
        ckpt.save(step, {"model": {"w": weights}})
    ckpt.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000002", "step00000003"]


def test_a_failed_checkpoint_write_is_raised_and_commits_nothing(tmp_path, group_of_one):
    ckpt, committed = Checkpointer(tmp_path / "c"), []
    shutil.rmtree(tmp_path / "c")
    (tmp_path / "c").write_text("a file where the folder should be")
    ckpt.save(1, {"model": {"w": torch.zeros(1)}}, then=lambda: committed.append(1))
    with pytest.raises(RuntimeError, match="checkpoint write failed"):
        ckpt.wait()
    assert committed == []

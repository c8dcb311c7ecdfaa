"""The checkpointer: sharded checkpoints that are snapshots, durable before their `then`, with plain
data beside."""

from __future__ import annotations

import shutil

import msgpack
import pytest
import torch
import torch.distributed as dist

from learner.checkpoint import Checkpointer
from learner.parallel import init_distributed


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


def test_a_checkpoint_in_the_foreground_is_durable_when_save_returns_and_a_failure_raises_there(tmp_path,
                                                                                                 group_of_one):
    ckpt, durable = Checkpointer(tmp_path / "c", background=False), []
    weights = torch.zeros(3)
    ckpt.save(1, {"model": {"w": weights}}, then=lambda: durable.append(1))
    assert durable == [1] and ckpt.latest().name == "step00000001"  # no write left in flight
    weights += 1
    assert torch.equal(Checkpointer.load(ckpt.latest(), {"model": {"w": torch.ones(3)}})["model"]["w"], torch.zeros(3))
    shutil.rmtree(tmp_path / "c")
    (tmp_path / "c").write_text("a file where the folder should be")
    with pytest.raises(RuntimeError, match="checkpoint write failed"):
        ckpt.save(2, {"model": {"w": weights}}, then=lambda: durable.append(2))
    assert durable == [1]

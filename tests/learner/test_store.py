"""Weight store and checkpointer: atomic files, last K kept, snapshots taken before training goes on."""

from __future__ import annotations

import hashlib
import shutil
from urllib.parse import urlparse

import pytest
import torch
from safetensors.torch import load_file

from learner.store import Checkpointer, WeightStore


def test_weight_store_announces_what_it_wrote_and_keeps_the_last_k(tmp_path):
    store = WeightStore(tmp_path, keep=2)
    tied = torch.randn(4, 3)
    for v in range(4):
        w = store.save({"embed.weight": tied, "lm_head.weight": tied, "b": torch.full((2,), float(v))}, v, step=v)
    path = urlparse(w.uri).path
    data = open(path, "rb").read()
    assert (w.version, w.step, w.num_bytes, w.sha256) == (3, 3, len(data), hashlib.sha256(data).hexdigest())
    assert torch.equal(load_file(path)["lm_head.weight"], tied)  # tied tensors are stored twice
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000002.safetensors", "v00000003.safetensors"]


def test_checkpoint_is_a_snapshot_and_then_runs_once_it_is_durable(tmp_path):
    ckpt = Checkpointer(tmp_path, every=2, keep=2)
    assert ckpt.due(4) and not ckpt.due(3)
    weights, durable = torch.zeros(3), []
    ckpt.save(1, {"w": weights, "ids": {"a": 0}}, then=lambda: durable.append(sorted(tmp_path.iterdir())))
    weights += 1  # training goes on while the write is in flight
    ckpt.wait()
    assert [p.name for p in durable[0]] == ["step00000001.pt"]
    assert torch.equal(ckpt.latest()["w"], torch.zeros(3)) and ckpt.latest()["ids"] == {"a": 0}
    for step in (2, 3):
        ckpt.save(step, {"w": weights})
    ckpt.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step00000002.pt", "step00000003.pt"]


def test_a_failed_checkpoint_write_is_raised_and_commits_nothing(tmp_path):
    ckpt, committed = Checkpointer(tmp_path / "c"), []
    shutil.rmtree(tmp_path / "c")
    ckpt.save(1, {"w": torch.zeros(1)}, then=lambda: committed.append(1))
    with pytest.raises(RuntimeError, match="checkpoint write failed"):
        ckpt.wait()
    assert committed == []

"""The weight store: atomic payload files, the last K anchors kept with the deltas after them."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from schemas.weights import payload as W
from schemas.weights.store import WeightStore


def _payload(version: int, anchor: bool) -> W.Payload:
    state = {"w": W.from_torch(torch.full((4,), float(version)))}
    return W.anchor(state) if anchor else W.delta(state, {"w": W.from_torch(torch.zeros(4))}, version - 1)[0]


def test_weight_store_writes_payloads_atomically_and_keeps_the_last_anchors_with_their_chains(tmp_path):
    store = WeightStore(tmp_path, keep=2)
    paths = {v: store.save(v, _payload(v, anchor=v % 3 == 0)) for v in range(8)}  # anchors 0, 3, 6
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "v00000003.safetensors", "v00000004.delta.safetensors", "v00000005.delta.safetensors",
        "v00000006.safetensors", "v00000007.delta.safetensors"]
    assert store.newest() == 7  # a delta counts: its number is taken
    decoded, views = W.decode(paths[7].read_bytes())
    assert decoded.base == 6 and W.to_torch(W.apply(decoded, views, {"w": W.from_torch(torch.zeros(4))})["w"]).tolist() == [7.0] * 4
    assert load_file(paths[6])["w"].tolist() == [6.0] * 4  # an anchor is a plain safetensors file too

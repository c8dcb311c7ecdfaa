"""Which updates a producer applies (`plan`), and the LoRA merge engines are handed."""

from __future__ import annotations

import torch
from hypothesis import given, strategies as st

from schemas.messages import Weights
from schemas.weights import payload as W
from schemas.weights.chain import merged, plan


def _w(version: int, base: int = -1) -> Weights:
    return Weights(version=version, step=version, base=base, uri=f"file:///w/{version}", digest="0" * 64, num_bytes=1)


def versions(chain: list[Weights]) -> list[int]:
    return [w.version for w in chain]


def test_plan_by_hand():
    line = [_w(0), _w(1, 0), _w(2, 1), _w(3, 2), _w(4), _w(5, 4)]
    assert versions(plan(line, held=-1)) == [4, 5]  # a late start: the newest anchor and its chain
    assert versions(plan(line, held=3)) == [4, 5]  # past the held version only through the newest anchor
    assert versions(plan(line[:4], held=1)) == [2, 3]  # deltas onto the held version
    assert versions(plan(line, held=5)) == []  # nothing newer
    assert versions(plan(line[:4], held=1, bad={2})) == []  # a refused link: no way past it
    assert versions(plan([_w(0), _w(1, 0), _w(3, 2)], held=1)) == []  # a delta whose base never came
    assert versions(plan([_w(0), _w(2, 1), _w(1, 0)], held=0)) == [1, 2]  # out of order: in base order
    assert versions(plan([_w(0), _w(1, 0), _w(2), _w(3, 2)], held=1)) == [2, 3]
    assert versions(plan([_w(0), _w(1, 0), _w(2, 1), _w(3)], held=1)) == [3]  # the shortest way to the newest


@given(st.lists(st.tuples(st.integers(0, 30), st.integers(-1, 29)), max_size=25), st.integers(-1, 30),
       st.sets(st.integers(0, 30), max_size=5))
def test_plan_is_a_chain_from_what_is_held_or_an_anchor_to_the_newest_reachable(raw, held, bad):
    history = [_w(v, b if b < v else -1) for v, b in raw]
    chain = plan(history, held, bad)
    last = {w.version: w for w in history}
    usable = {v: w for v, w in last.items() if v not in bad}
    # every way there is: from held along deltas, or from an anchor
    after = {w.base: w for w in sorted(usable.values(), key=lambda w: w.version) if w.base >= 0}
    ends = set()
    for start in [held] + [v for v, w in usable.items() if w.base < 0]:
        v = start
        ends.add(v)
        while v in after:
            v = after[v].version
            ends.add(v)
    best = max(ends | {held})
    if best <= held:
        assert chain == []
        return
    assert chain[-1].version == best and not any(w.version in bad for w in chain)
    assert chain[0].base == (held if chain[0].base >= 0 else -1)
    assert all(b.base == a.version for a, b in zip(chain, chain[1:]))
    assert all(last[w.version] is w for w in chain)  # a version announced twice: the later counts


def test_merged_lora_weights_are_base_plus_scaled_b_times_a():
    base, a, b = torch.randn(6, 4), torch.randn(2, 4), torch.randn(6, 2)
    state = {"m.q.weight": W.from_torch(base), "m.q.lora_A.weight": W.from_torch(a),
             "m.q.lora_B.weight": W.from_torch(b), "m.norm.weight": W.from_torch(torch.ones(4))}
    out = merged(state, scale=0.5)
    assert list(out) == ["m.q.weight", "m.norm.weight"]
    torch.testing.assert_close(W.to_torch(out["m.q.weight"]), base + 0.5 * b @ a, rtol=0, atol=1e-6)
    assert out["m.norm.weight"] is state["m.norm.weight"]

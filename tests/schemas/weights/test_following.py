"""The weight follower's decisions with no Kafka, files or engine (schemas/weights/follow.py `Following`):
what it ignores, which chain it loads, what a failure rules out, when it asks for an anchor."""

from __future__ import annotations

from schemas.messages import Weights
from schemas.weights.follow import Following


def w(version: int, base: int = -1) -> Weights:
    return Weights(version=version, step=version, digest=f"d{version}", num_bytes=1, base=base,
                   payload=b"x", created_at=0.0)


def test_a_chain_runs_from_the_held_version_or_the_newest_anchor_and_skips_what_failed():
    f = Following(keep_anchors=2)
    f.backlog([w(0), w(1, 0), w(2, 1), w(3), w(4, 3)])
    assert [x.version for x in f.chain(-1)] == [3, 4]  # the newest anchor and its delta: shortest
    assert [x.version for x in f.chain(2)] == [3, 4]  # from v2, no delta onto 2: the anchor again
    f.announced(w(5, 4), engine_version=4)
    assert [x.version for x in f.chain(4)] == [5]
    f.failed(5, "digest mismatch")
    assert f.chain(4) == [] and f.counts["rejected"] == 1 and f.bad == {5}
    f.announced(w(5, 4), engine_version=4)  # announced again: worth another try
    assert [x.version for x in f.chain(4)] == [5] and f.bad == set()


def test_an_old_announcement_is_ignored_and_the_history_keeps_the_newest_anchors_only():
    f = Following(keep_anchors=2)
    for x in [w(0), w(1, 0), w(2), w(3, 2), w(4), w(5, 4)]:
        f.announced(x, engine_version=3)
    assert f.counts["ignored"] == 4  # v0..v3 are not newer than the engine's v3
    assert [x.version for x in f.history] == [2, 3, 4, 5] and f.newest().version == 5
    f.announced(w(2), engine_version=3, received=True)  # came over the link: not "ignored"
    assert f.counts["ignored"] == 4


def test_an_anchor_is_asked_for_only_when_out_of_reach_and_not_more_often_than_the_bound():
    f = Following(ask_every_s=10.0)
    f.backlog([w(0), w(1, 0)])
    assert f.anchor_request("p", held=1, now=0.0) is None  # nothing newer than held
    f.announced(w(3, 2), engine_version=1)  # a delta onto v2, which this follower never saw
    assert f.chain(1) == []
    ask = f.anchor_request("p", held=1, now=100.0)
    assert (ask.requester, ask.held_version, ask.wanted_version, ask.reason) == ("p", 1, 3, "no anchor reaches it")
    assert f.anchor_request("p", held=1, now=105.0) is None  # asked 5 s ago
    f.failed(3, "base v2 not held")
    again = f.anchor_request("p", held=1, now=111.0)
    assert again.reason == "v3: base v2 not held"

"""Commit positions under out-of-order completion: only the contiguous delivered prefix counts."""

import random

from producers.offsets import PromptOffsets


def test_position_moves_only_over_the_delivered_prefix():
    offsets = PromptOffsets()
    for o in (5, 6, 7):
        offsets.take(0, o)
    offsets.take(1, 0)
    assert offsets.deliver(0, 7) is None  # 5 and 6 still in flight
    assert offsets.deliver(0, 5) == 6
    assert offsets.deliver(1, 0) == 1  # partitions are independent
    assert offsets.deliver(0, 6) == 8  # 6 closes the gap up to 7
    offsets.take(0, 8)
    offsets.forget(0)  # revoked: a late delivery moves nothing
    assert offsets.deliver(0, 8) is None


def test_random_completion_orders_never_commit_past_an_undelivered_prompt():
    rng = random.Random(0)
    for _ in range(200):
        offsets, n = PromptOffsets(), rng.randint(1, 40)
        for o in range(n):
            offsets.take(3, o)
        delivered, committed = set(), 0
        for o in rng.sample(range(n), n):
            delivered.add(o)
            position = offsets.deliver(3, o)
            if position is not None:
                assert position > committed
                committed = position
            assert all(x in delivered for x in range(committed))  # nothing undelivered below it
            assert committed == n or committed not in delivered  # and it stops at the first gap
        assert committed == n

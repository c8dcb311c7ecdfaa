"""The evaluation's figures and its choice of versions: pure functions, hand-computed cases and properties."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producers.evaluate.scores import (episode_scores, greedy_scores, headline, paired_change, pass_at_k, sampled_scores,
                                      sign_test, task_scores)
from producers.evaluate.service import EvalConfig
from producers.evaluate.suite import per_task
from producers.evaluate.versions import due, final, out_of_reach
from schemas.messages import Trajectory


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # two failures cannot fill three draws
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 9).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_success(nck):
    n, c, k = nck
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(samples[i] for i in s) for s in subsets) / len(subsets))


def test_pass_at_k_refuses_impossible_counts():
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_greedy_and_sampled_figures_by_hand():
    assert greedy_scores([1.0, 0.0, 0.5, 1.0], success=1.0) == {"greedy/mean": 0.625, "greedy/pass@1": 0.5}
    got = sampled_scores([[1.0, 0.0], [0.0, 0.0], [0.5, 1.0]], success=1.0)
    assert got["sampled/mean@2"] == pytest.approx(2.5 / 6)
    assert got["sampled/pass@1"] == pytest.approx((0.5 + 0 + 0.5) / 3)
    assert got["sampled/pass@2"] == pytest.approx(2 / 3)
    assert got["sampled/best@2"] == pytest.approx((1 + 0 + 1) / 3)
    assert headline(got) == ("sampled/mean@2", got["sampled/mean@2"])
    assert headline({"greedy/mean": 0.25, **got}) == ("greedy/mean", 0.25)


def test_task_scores_are_the_greedy_reward_or_the_samples_mean_in_task_order():
    assert task_scores([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]], greedy=True) == [1.0, 0.0]
    assert task_scores([[1.0, 0.0], [0.5, 1.0]], greedy=False) == [0.5, 0.75]


def test_paired_change_counts_the_tasks_each_way_and_the_sign_test_by_hand():
    # 32 tasks: 12 solved by both, 2 by before alone, 7 by after alone
    before = [1.0] * 12 + [1.0] * 2 + [0.0] * 7 + [0.0] * 11
    after = [1.0] * 12 + [0.0] * 2 + [1.0] * 7 + [0.0] * 11
    got = paired_change(before, after)
    assert (got["gained"], got["lost"]) == (7, 2)
    assert got["p"] == pytest.approx(2 * (1 + 9 + 36) / 2 ** 9)  # P(<= 2 of 9 fair coins one way), both tails
    assert paired_change(after, before)["p"] == got["p"] and sign_test(0, 0) == 1.0 and sign_test(3, 3) == 1.0
    assert sign_test(0, 6) == pytest.approx(2 / 64)
    assert paired_change([0.5, 1.0], [1.0, 0.5]) == {"gained": 1, "lost": 1, "p": 1.0}  # graded rewards: the sign
    with pytest.raises(ValueError, match="same tasks"):
        paired_change([1.0], [1.0, 0.0])


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 7), st.integers(0, 7))
def test_the_sign_test_is_the_two_sided_binomial_tail(gained, lost):
    n = gained + lost
    if n == 0:
        return
    splits = list(itertools.product((0, 1), repeat=n))  # every way n fair coins can fall
    extreme = sum(min(sum(s), n - sum(s)) <= min(gained, lost) for s in splits) / len(splits)
    assert sign_test(gained, lost) == pytest.approx(extreme)


def _episode(n_prompt: int, n_response: int, finish: str, turns: int, reward: float = 1.0,
             tool_calls: int = 0) -> Trajectory:
    n = n_prompt + n_response
    mask = np.r_[np.zeros(n_prompt), np.ones(n_response)].astype(np.uint8)
    return Trajectory(id="t", prompt_id="p", env="e", producer_id="x", tokens=np.arange(n), action_mask=mask,
                      rollout_logprobs=np.zeros(n), versions=np.where(mask == 1, 3, -1), prompt_len=n_prompt,
                      reward=reward, finish_reason=finish, num_turns=turns, tool_calls=tool_calls)


def test_episode_figures_by_hand():
    got = episode_scores([_episode(3, 4, "stop", 1), _episode(2, 8, "length", 3)])
    assert got == {"episode/response_tokens": 6.0, "episode/turns": 2.0, "episode/truncated": 0.5}
    assert episode_scores([]) == {}


def test_each_task_has_its_score_turns_and_tool_calls_in_task_order_a_failed_episode_none():
    played = {0: [_episode(2, 4, "stop", 3, 1.0, 2), _episode(2, 3, "stop", 2, 0.0, 1), None],
              1: [None, _episode(2, 5, "stop", 4, 1.0, 3), _episode(2, 5, "stop", 2, 0.0, 1)],
              2: [None, None, None]}
    assert per_task(EvalConfig(samples=2), played) == {
        "tasks": [1.0, 0.0, 0.0], "task_turns": [3.0, None, None], "task_tool_calls": [2.0, None, None]}
    assert per_task(EvalConfig(samples=3, greedy=False), played) == {
        "tasks": [1 / 3, 1 / 3, 0.0], "task_turns": [2.5, 3.0, None], "task_tool_calls": [1.5, 2.0, None]}


def test_the_first_version_comes_first_then_the_newest_due_one():
    assert due({0, 1, 2}, set(), every=5, first=0) == 0
    assert due({0, 1, 2}, {0}, every=5, first=0) is None
    assert due(set(range(13)), {0}, every=5, first=0) == 10  # behind: 5 is skipped, not queued
    assert due(set(range(13)), {0, 10}, every=5, first=0) is None
    assert due({37, 38, 40}, set(), every=5, first=37) == 37  # a run resumed at 37: its first seen
    assert due({37, 38, 40}, {37}, every=5, first=37) == 40
    assert due(set(), set(), every=5, first=None) is None


def test_versions_asked_for_by_name_come_oldest_first_behind_or_not():
    assert due(set(range(25)), set(), every=6, first=0, wanted=(0, 12, 24)) == 0
    assert due(set(range(25)), {0}, every=6, first=0, wanted=(0, 12, 24)) == 12  # not skipped for 24
    assert due(set(range(25)), {0, 12}, every=6, first=0, wanted=(0, 5, 24)) == 5  # --every does not apply
    assert due(set(range(10)), {0}, every=6, first=0, wanted=(0, 12)) is None  # 12 not announced yet
    assert due(set(range(25)), {0, 12, 24}, every=6, first=0, wanted=(0, 12, 24)) is None


def test_a_version_named_older_than_every_version_held_is_out_of_reach_not_awaited():
    assert out_of_reach((0, 3, 30), {2, 3, 4}, set()) == [0]  # 30 may still come
    assert out_of_reach((0, 3), {2, 3, 4}, {0}) == []
    assert out_of_reach((0,), set(), set()) == []  # nothing announced yet: nothing to judge by


def test_at_a_stop_the_newest_version_is_scored_unless_it_is():
    assert final({0, 5, 7}, {0, 5}) == 7
    assert final({0, 5}, {0, 5}) is None
    assert final(set(), set()) is None


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 60), max_size=30), st.sets(st.integers(0, 60), max_size=10), st.integers(1, 10))
def test_a_due_version_is_announced_unsettled_and_past_every_settled_one_unless_it_is_the_first(announced, settled, every):
    first = min(announced, default=None)
    v = due(announced, settled, every, first)
    if v is None:
        return
    assert v in announced and v not in settled
    assert v == first or (v % every == 0 and v > max(settled, default=-1))

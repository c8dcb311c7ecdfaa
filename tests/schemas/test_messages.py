"""The wire contract: round trips of every kind, and one test per documented invalid case."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from schemas.messages import (
    SCHEMA_VERSION, TOKEN_ARRAYS, AnchorRequest, DeadLetter, Evaluation, Limits, Prompt, Reward, SchemaError, Trajectory, Weights, decode)

text = st.text(max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), finite, text)
small_map = st.dictionaries(text, scalars, max_size=5)


@st.composite
def trajectories(draw) -> Trajectory:
    n = draw(st.integers(0, 300))
    prompt_len = draw(st.integers(0, n))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    mask = np.zeros(n, np.uint8)
    mask[prompt_len:] = rng.integers(0, 2, n - prompt_len)
    return Trajectory(
        id=draw(text), prompt_id=draw(text), env=draw(text), producer_id=draw(text),
        tokens=rng.integers(-(2**31), 2**31 - 1, n, dtype=np.int32), action_mask=mask,
        # off-action log-probs are free: observations may carry anything, NaN included
        rollout_logprobs=np.where(mask == 1, -rng.exponential(2.0, n), rng.normal(size=n)).astype(np.float32),
        versions=np.where(mask == 1, rng.integers(0, 1000, n), -1).astype(np.int32),
        prompt_len=prompt_len, reward=draw(st.one_of(st.none(), finite)),
        turn_rewards=[(int(i), draw(finite)) for i in np.flatnonzero(mask)[:draw(st.integers(0, 3))]],
        group=draw(text), group_size=draw(st.integers(1, 64)),
        temperature=draw(st.floats(0.01, 10)), top_p=draw(st.floats(0.01, 1)), top_k=draw(st.integers(0, 100)),
        finish_reason=draw(st.sampled_from(["stop", "length", "abort"])),
        num_turns=draw(st.integers(0, 50)),
        timing=draw(st.dictionaries(text, finite, max_size=4)), meta=draw(small_map))


messages = st.one_of(
    trajectories(),
    st.builds(Prompt, id=text, env=text, task=small_map, created_at=finite, attempt=st.integers(0, 10**6),
              sample=st.just(3), group_size=st.integers(4, 64)),
    st.builds(Reward, trajectory_id=text, reward=finite, token_index=st.one_of(st.none(), st.integers(0, 10**6)),
              source=text, criterion=text, created_at=finite),
    st.builds(Weights, version=st.integers(1, 2**40), step=st.integers(0, 2**40), base=st.integers(-1, 0),
              uri=text.filter(bool), digest=st.text("0123456789abcdef", min_size=64, max_size=64),
              num_bytes=st.integers(0, 2**50), dtype=st.sampled_from(["float32", "bfloat16"]),
              store=text, created_at=finite),
    st.binary(min_size=1, max_size=300).map(lambda p: Weights(
        version=3, step=3, base=2, payload=p, digest="e" * 64, num_bytes=len(p))),
    st.builds(DeadLetter, source_topic=text, partition=st.integers(-1, 1000),
              offset=st.integers(-1, 2**62), error=text, payload=st.binary(max_size=200), created_at=finite),
    st.builds(AnchorRequest, requester=text, held_version=st.integers(-1, 2**40), wanted_version=st.integers(0, 2**40),
              reason=text, created_at=finite),
    st.builds(Evaluation, version=st.integers(0, 2**40), step=st.integers(0, 2**40), env=text, suite=text, split=text,
              num_tasks=st.integers(1, 10**6), samples=st.integers(0, 64),
              metrics=st.dictionaries(text, finite, max_size=8), evaluator=text, seconds=finite, created_at=finite),
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_kind_round_trips_byte_identical(msg):
    data = msg.encode()
    back = decode(data)
    assert type(back) is type(msg)
    assert back.encode() == data


def test_token_arrays_decode_as_views_over_the_payload():
    traj = _traj()
    back = Trajectory.decode(traj.encode())
    for name in ("tokens", "action_mask", "rollout_logprobs", "versions"):
        arr = getattr(back, name)
        assert not arr.flags.owndata and not arr.flags.writeable, name  # frombuffer views, no copy
        np.testing.assert_array_equal(arr, getattr(traj, name))
    assert back.tokens.dtype == np.dtype("<i4") and back.rollout_logprobs.dtype == np.dtype("<f4")


def test_min_version_is_the_oldest_on_action_tokens():
    traj = _traj()
    traj.versions = np.array([-1, -1, 5, 3, -1, 7], np.int32)
    assert traj.min_version == 3


def test_decode_as_the_wrong_class_names_kind():
    with pytest.raises(SchemaError) as e:
        Weights.decode(_traj().encode())
    assert e.value.field == "kind"


# ------------------------------------------------------------------ one test per invalid case


def _traj(**overrides) -> Trajectory:
    base = dict(id="t1", prompt_id="p1", env="toy", producer_id="prod-0",
                tokens=np.array([1, 2, 3, 4, 5, 6], np.int32),
                action_mask=np.array([0, 0, 1, 1, 0, 1], np.uint8),
                rollout_logprobs=np.array([0, 0, -0.5, -1.0, 0, -0.1], np.float32),
                versions=np.array([-1, -1, 2, 2, -1, 3], np.int32), prompt_len=2, reward=1.0)
    return Trajectory(**{**base, **overrides})


def _raw(msg) -> dict:
    return msgpack.unpackb(msg.encode(), raw=False)


def _field_error(m: dict, limits: Limits = Limits()) -> str:
    with pytest.raises(SchemaError) as e:
        decode(msgpack.packb(m, use_bin_type=True), limits)
    assert e.value.field in str(e.value)
    return e.value.field


def test_unknown_version_names_v():
    m = _raw(_traj())
    m["v"] = SCHEMA_VERSION + 1
    assert _field_error(m) == "v"


def test_unknown_kind_names_kind():
    m = _raw(_traj())
    m["kind"] = "pickle"
    assert _field_error(m) == "kind"


@pytest.mark.parametrize("name,value", [
    ("id", 7), ("prompt_len", "2"), ("reward", "high"), ("tokens", [1, 2, 3, 4, 5, 6]),
    ("timing", [1.0]), ("num_turns", True)])
def test_wrong_type_names_the_field(name, value):
    m = _raw(_traj())
    m[name] = value
    assert _field_error(m) == name


@pytest.mark.parametrize("name", ["id", "tokens", "action_mask", "rollout_logprobs", "versions",
                                  "prompt_len", "reward", "meta"])
def test_missing_field_names_it(name):
    m = _raw(_traj())
    del m[name]
    assert _field_error(m) == name


def test_unknown_field_names_it():
    m = _raw(_traj())
    m["__reduce__"] = b"cos\nsystem\n"
    assert _field_error(m) == "__reduce__"


@pytest.mark.parametrize("name", ["action_mask", "rollout_logprobs", "versions"])
def test_per_token_arrays_of_different_lengths_name_the_field(name):
    m = _raw(_traj())
    m[name] = m[name][: -TOKEN_ARRAYS[name].itemsize]  # one item short
    assert _field_error(m) == name


def test_ragged_byte_count_names_the_field():
    m = _raw(_traj())
    m["tokens"] = m["tokens"] + b"\x00"
    assert _field_error(m) == "tokens"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rollout_logprob_on_an_action_token_names_it(bad):
    lp = np.array([0, 0, -0.5, bad, 0, -0.1], np.float32)
    assert _field_error(_raw(_traj(rollout_logprobs=lp))) == "rollout_logprobs"


def test_non_finite_logprob_off_actions_is_allowed():
    lp = np.array([np.nan, 0, -0.5, -1.0, np.inf, -0.1], np.float32)
    assert Trajectory.decode(_traj(rollout_logprobs=lp).encode()).id == "t1"


def test_action_token_inside_the_prompt_names_action_mask():
    mask = np.array([0, 1, 1, 1, 0, 1], np.uint8)
    versions = np.array([-1, 2, 2, 2, -1, 3], np.int32)
    assert _field_error(_raw(_traj(action_mask=mask, versions=versions))) == "action_mask"


def test_prompt_longer_than_the_sequence_names_prompt_len():
    m = _raw(_traj())
    m["prompt_len"] = 7
    assert _field_error(m) == "prompt_len"


def test_non_binary_action_mask_names_it():
    assert _field_error(_raw(_traj(action_mask=np.array([0, 0, 2, 1, 0, 1], np.uint8)))) == "action_mask"


def test_version_must_mark_actions_only():
    assert _field_error(_raw(_traj(versions=np.array([0, -1, 2, 2, -1, 3], np.int32)))) == "versions"
    assert _field_error(_raw(_traj(versions=np.array([-1, -1, -1, 2, -1, 3], np.int32)))) == "versions"


def test_nan_reward_names_reward():
    m = _raw(_traj())
    m["reward"] = float("nan")
    assert _field_error(m) == "reward"


def test_oversized_payload_is_refused_before_parsing():
    data = _traj().encode()
    with pytest.raises(SchemaError) as e:
        decode(data, Limits(max_message_bytes=len(data) - 1))
    assert e.value.field == "<message>"


def test_too_many_tokens_names_tokens():
    m = _raw(_traj())
    assert _field_error(m, Limits(max_tokens=5)) == "tokens"


def test_huge_declared_length_in_a_few_bytes_allocates_nothing():
    # bin32 header claiming 4 GiB, then nothing: must fail fast, not allocate
    with pytest.raises(SchemaError):
        decode(b"\xc6\xff\xff\xff\xff")
    # map32 header claiming 4 billion entries
    with pytest.raises(SchemaError):
        decode(b"\xdf\xff\xff\xff\xff")


def test_oversized_string_names_the_field():
    m = _raw(_traj())
    m["producer_id"] = "x" * 200
    with pytest.raises(SchemaError):
        decode(msgpack.packb(m, use_bin_type=True), Limits(max_str_bytes=100))


def test_trailing_bytes_are_refused():
    with pytest.raises(SchemaError) as e:
        decode(_traj().encode() + b"\x00")
    assert "trailing" in str(e.value)


def test_bad_digest_names_it():
    m = _raw(Weights(version=1, step=1, uri="file:///w", digest="ab" * 32, num_bytes=1))
    m["digest"] = "XYZ"
    assert _field_error(m) == "digest"


@pytest.mark.parametrize("change, field", [
    ({"base": 5}, "base"),  # a delta onto itself
    ({"base": 7}, "base"),  # onto a newer version
    ({"base": -2}, "base"),
    ({"uri": "", "payload": b""}, "payload"),  # the bytes are nowhere
    ({"payload": b"x"}, "payload"),  # and at a uri too
    ({"uri": "", "payload": b"xy"}, "payload"),  # not the announced size
    ({"payload": "text"}, "payload"),
    ({"sha256": "ab" * 32}, "sha256"),  # an announcement of the old format: refused, not misread
])
def test_weights_announcements_name_what_is_inconsistent(change, field):
    m = _raw(Weights(version=5, step=5, uri="file:///w", digest="ab" * 32, num_bytes=1))
    assert _field_error(m | change) == field


def test_an_inline_delta_round_trips():
    w = Weights(version=5, step=4, base=4, payload=b"\x00" * 9, digest="cd" * 32, num_bytes=9)
    got = decode(w.encode())
    assert (got.version, got.base, got.payload, got.uri, got.inline) == (5, 4, b"\x00" * 9, "", True)


def test_not_a_map_is_refused():
    with pytest.raises(SchemaError):
        decode(msgpack.packb([1, 2, 3]))


# ------------------------------------------------------------------ per-turn rewards and sampling settings


@pytest.mark.parametrize("pairs", [
    [[9, 1.0]],  # index beyond the sequence
    [[1, 1.0]],  # a prompt token
    [[4, 1.0]],  # an observation token
    [[2, "1.0"]],  # a string where a number belongs
    [["2", 1.0]],
    [[2, float("nan")]],
    [[2, 1.0, 3]],  # not a pair
    [[-1, 1.0]],
    "2:1.0",
])
def test_a_malformed_turn_reward_names_turn_rewards(pairs):
    m = _raw(_traj())
    m["turn_rewards"] = pairs
    assert _field_error(m).startswith("turn_rewards")


def test_turn_rewards_are_bounded_in_count():
    m = _raw(_traj())
    m["turn_rewards"] = [[2, 0.1]] * 5
    assert _field_error(m, Limits(max_turn_rewards=4)) == "turn_rewards"


def test_turn_rewards_on_action_tokens_round_trip():
    back = Trajectory.decode(_traj(turn_rewards=[(2, 0.5), (3, -1.0)]).encode())
    assert back.turn_rewards == [(2, 0.5), (3, -1.0)]


@pytest.mark.parametrize("name,value", [("temperature", 0.0), ("temperature", -1.0), ("temperature", float("inf")),
                                        ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("top_k", 2.5)])
def test_impossible_sampling_settings_name_the_field(name, value):
    m = _raw(_traj())
    m[name] = value
    assert _field_error(m) == name


@pytest.mark.parametrize("name", ["turn_rewards", "temperature", "top_p", "top_k", "group", "group_size"])
def test_every_trajectory_carries_its_sampling_settings_and_group(name):
    m = _raw(_traj())
    del m[name]
    assert _field_error(m) == name


def test_a_prompt_sample_outside_its_group_names_sample():
    m = _raw(Prompt(id="p", env="toy", sample=1, group_size=2))
    m["sample"] = 2
    assert _field_error(m) == "sample"


def test_prompt_ids_name_the_group_and_the_trajectory():
    p = Prompt(id="row-7", env="toy", attempt=2, sample=5, group_size=8)
    assert (p.group, p.trajectory_id) == ("row-7#2", "row-7#2.5")


@pytest.mark.parametrize("metrics", [{"greedy/mean": float("nan")}, {"greedy/mean": "high"}, {"x": True}])
def test_an_evaluation_figure_that_is_not_a_finite_number_names_it(metrics):
    body = {"v": SCHEMA_VERSION, "kind": "evaluation", "version": 3, "step": 3, "env": "math", "suite": "heldout",
            "split": "heldout", "num_tasks": 4, "samples": 0, "metrics": metrics, "evaluator": "e",
            "seconds": 1.0, "created_at": 0.0}
    with pytest.raises(SchemaError, match=f"metrics.{next(iter(metrics))}"):
        decode(msgpack.packb(body, use_bin_type=True))


def test_an_evaluation_is_keyed_by_suite_env_and_version():
    e = Evaluation(version=7, step=9, env="math", suite="heldout", split="heldout", num_tasks=2, samples=4,
                   metrics={"sampled/pass@4": 0.5})
    assert e.key == b"heldout/math/7"
    assert Evaluation.decode(e.encode()).metrics == {"sampled/pass@4": 0.5}


def test_a_version_2_trajectory_still_decodes_with_no_tool_counts():
    traj = Trajectory(id="t", prompt_id="p", env="e", producer_id="x", tokens=np.arange(4), action_mask=np.array([0, 1, 1, 1], np.uint8),
                      rollout_logprobs=np.zeros(4), versions=np.array([-1, 0, 0, 0]), prompt_len=1, reward=1.0,
                      tool_calls=3, tool_errors=1)
    assert Trajectory.decode(traj.encode()).tool_calls == 3
    m = msgpack.unpackb(traj.encode())
    m["v"] = 2
    del m["tool_calls"], m["tool_errors"]
    old = Trajectory.decode(msgpack.packb(m, use_bin_type=True))
    assert (old.tool_calls, old.tool_errors) == (0, 0)
    m["tool_calls"] = 3  # a field version 2 never had
    with pytest.raises(SchemaError, match="tool_calls"):
        Trajectory.decode(msgpack.packb(m, use_bin_type=True))

"""Weight subscription on the real broker with the real hf generator and tiny models."""

from __future__ import annotations

import asyncio

import time

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from transformers import DynamicCache

from producers.envs import make_env
from producers.episode import TrajectoryIds, run_episode
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator
from producers.models import load_model
from producers.weights import WeightsError, WeightSubscriber, local_path, newest_first, verify
from schemas.config import ConfigError
from schemas.messages import Weights
from tests.producers.util import announcement, publish, wait_until, write_weights

PARAMS = SamplingParams(temperature=1.0, max_tokens=12, seed=0)
PROMPT = [1, 5, 9]


def _w(version: int) -> Weights:
    return Weights(version=version, step=version, uri=f"file:///w/{version}", sha256="0" * 64, num_bytes=1)


def test_newest_first_keeps_only_newer_versions_newest_first():
    got = newest_first([_w(1), _w(3), _w(2), _w(5), _w(0)], current=1)
    assert [w.version for w in got] == [5, 3, 2]


@given(st.lists(st.integers(0, 20), max_size=30), st.integers(-1, 20))
def test_newest_first_property(versions, current):
    got = [w.version for w in newest_first([_w(v) for v in versions], current)]
    assert got == sorted({v for v in versions if v > current}, reverse=True)


def test_verify_checks_size_and_sha256(tmp_path):
    path = write_weights(load_model("tiny-llama", seed=1), tmp_path / "w.safetensors")
    good = announcement(path, 1)
    assert verify(good) == path
    with pytest.raises(WeightsError, match="sha256"):
        verify(announcement(path, 1, sha256="a" * 64))
    with path.open("r+b") as f:  # flip one byte after the announcement was made
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(WeightsError, match="sha256"):
        verify(good)
    with pytest.raises(WeightsError, match="bytes"):
        verify(Weights(version=1, step=1, uri=good.uri, sha256=good.sha256, num_bytes=1))
    with pytest.raises(WeightsError, match="cannot read"):
        verify(Weights(version=1, step=1, uri=(tmp_path / "nope").as_uri(), sha256="0" * 64, num_bytes=1))
    with pytest.raises(WeightsError, match="only file"):
        local_path("s3://bucket/w.safetensors")


def _same_weights(model: torch.nn.Module, other: torch.nn.Module) -> bool:
    a, b = model.state_dict(), other.state_dict()
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def gen():
    return HFGenerator(load_model("tiny-llama", seed=0), seed=0)


def test_newer_version_is_loaded_older_ignored_corrupt_rejected(kafka_cfg, gen, tmp_path):
    sub = WeightSubscriber(kafka_cfg, gen).start()
    try:
        assert sub.caught_up.wait(30)
        new = load_model("tiny-llama", seed=1)
        publish(kafka_cfg, announcement(write_weights(new, tmp_path / "v2.safetensors"), 2))
        wait_until(lambda: gen.version == 2)
        assert _same_weights(gen.model, new)
        publish(kafka_cfg, announcement(write_weights(load_model("tiny-llama", seed=5),
                                                      tmp_path / "v1.safetensors"), 1))
        wait_until(lambda: sub.counts["ignored"] == 1)
        publish(kafka_cfg, b"\x93not a weights message")
        wait_until(lambda: sub.counts["invalid"] == 1)
    finally:
        sub.close()
    assert sub.error is None


def test_weights_of_another_architecture_stop_the_subscription_with_a_clear_error(kafka_cfg, gen, tmp_path):
    """A learner on another model is a misconfiguration, not a bad file: the producer must stop
    (its service raises `sub.error`) rather than sample on forever with weights that never change."""
    wrong_shape = write_weights(load_model("tiny-llama-bytes", seed=0), tmp_path / "v3.safetensors")
    sub = WeightSubscriber(kafka_cfg, gen).start()
    try:
        assert sub.caught_up.wait(30)
        publish(kafka_cfg, announcement(wrong_shape, 3))  # sha256 fine, state dict does not fit
        wait_until(lambda: sub.error is not None)
        assert isinstance(sub.error, ConfigError) and "architecture" in str(sub.error)
        assert gen.version == 0
    finally:
        sub.close()


def test_corrupt_weights_are_rejected_and_generation_continues_on_the_old_version(kafka_cfg, gen, tmp_path):
    old = load_model("tiny-llama", seed=0)
    sub = WeightSubscriber(kafka_cfg, gen).start()
    try:
        assert sub.caught_up.wait(30)
        path = write_weights(load_model("tiny-llama", seed=1), tmp_path / "v1.safetensors")
        w = announcement(path, 1)
        path.write_bytes(path.read_bytes()[:-8] + b"\0" * 8)  # same size, different bytes
        publish(kafka_cfg, w)
        wait_until(lambda: sub.counts["rejected"] == 1)
        out = asyncio.run(gen.generate(PROMPT, PARAMS))
        assert gen.version == 0 and (out.versions == 0).all()
        # the tokens' log-probs are those of the old weights
        ids = torch.tensor([PROMPT + out.token_ids.tolist()])
        with torch.no_grad():
            logp = torch.log_softmax(old(ids).logits[0, len(PROMPT) - 1:-1].float(), -1)
        expected = logp.gather(-1, torch.from_numpy(out.token_ids).long()[:, None])[:, 0].numpy()
        np.testing.assert_allclose(out.logprobs, expected, atol=1e-4)
    finally:
        sub.close()


def test_a_new_subscriber_starts_from_the_newest_loadable_version(kafka_cfg, gen, tmp_path):
    v1 = load_model("tiny-llama", seed=1)
    publish(kafka_cfg, announcement(write_weights(v1, tmp_path / "v1.safetensors"), 1))
    path2 = write_weights(load_model("tiny-llama", seed=2), tmp_path / "v2.safetensors")
    publish(kafka_cfg, announcement(path2, 2, sha256="b" * 64))  # corrupt newest
    sub = WeightSubscriber(kafka_cfg, gen).start()
    try:
        assert sub.caught_up.wait(30)
        assert gen.version == 1 and _same_weights(gen.model, v1)
        assert sub.counts == {"loaded": 1, "rejected": 1, "ignored": 0, "invalid": 0}
    finally:
        sub.close()


def test_weights_published_mid_episode_are_picked_up_between_decode_steps(kafka_cfg, gen, tmp_path):
    old, new = load_model("tiny-llama", seed=0), load_model("tiny-llama", seed=1)
    path = write_weights(new, tmp_path / "v1.safetensors")
    sub = WeightSubscriber(kafka_cfg, gen).start()
    steps = []

    def pace(module, args, kwargs):
        """Publish at the 5th decode step, then slow decoding until the swap lands."""
        steps.append(1)
        if len(steps) == 5:
            publish(kafka_cfg, announcement(path, 1))
        if len(steps) > 5 and gen.version == 0:
            time.sleep(0.01)

    episode = make_env("toy-target").episode({"target": 1})
    ids = TrajectoryIds(id="t", prompt_id="p", env="toy-target", producer_id="test")
    try:
        assert sub.caught_up.wait(30)
        handle = gen.model.register_forward_pre_hook(pace, with_kwargs=True)
        traj = asyncio.run(run_episode(episode, gen, SamplingParams(temperature=1.0, max_tokens=400, seed=0), ids))
        handle.remove()
    finally:
        sub.close()
    n = traj.prompt_len
    assert (traj.versions[:n] == -1).all()
    versions = traj.versions[n:]
    switch = int(np.argmax(versions == 1))
    assert versions[0] == 0 and versions[-1] == 1 and 5 <= switch < len(versions) - 1
    assert (versions[:switch] == 0).all() and (versions[switch:] == 1).all()
    # Replay: old weights up to the swap (their KV cache is kept, as in the generator), new after.
    seq = torch.from_numpy(traj.tokens).long()[None]
    first = n + switch - 1  # input position whose logits sampled the first new-version token
    with torch.no_grad():
        cache = DynamicCache(config=old.config)
        before = old(seq[:, :first], past_key_values=cache, use_cache=True).logits
        after = new(seq[:, first:], past_key_values=cache, use_cache=True).logits
        logits = torch.cat([before, after], 1)[0, n - 1:-1].float()
        replay = torch.log_softmax(logits, -1).gather(-1, seq[0, n:, None])[:, 0].numpy()
        old_only = torch.log_softmax(old(seq).logits[0, n - 1:-1].float(), -1)
        old_only = old_only.gather(-1, seq[0, n:, None])[:, 0].numpy()
    rollout = traj.rollout_logprobs[n:]
    np.testing.assert_allclose(rollout, replay, atol=1e-4)
    assert np.abs(rollout[switch:] - old_only[switch:]).max() > 0.1  # the new weights mattered

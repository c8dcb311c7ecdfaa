"""Weight subscription on the real broker with the real hf generator and tiny models: anchors and
delta chains (inline and in files), refusals that keep the old weights, late starts."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from transformers import DynamicCache

from producers.envs import make_env
from producers.episode import TrajectoryIds, run_episode
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator
from producers.metrics import weight_update_gauges
from producers.models import load_model
from schemas import topics as T
from schemas.config import ConfigError
from schemas.messages import Weights
from schemas.weights import payload as W
from schemas.weights.follow import WeightSubscriber
from tests.producers.util import announce, announcement, read_topic, state_of, wait_until, write_weights

PARAMS = SamplingParams(temperature=1.0, max_tokens=12, seed=0)
PROMPT = [1, 5, 9]


def nudged(state: W.State, seed: int, frac: float = 0.05) -> W.State:
    """`state` with a `frac` of each tensor's elements moved a little (a training step's worth)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in state.items():
        x = W.to_torch(t).clone()
        flat = x.view(-1)
        idx = torch.from_numpy(rng.choice(flat.numel(), max(1, int(frac * flat.numel())), replace=False))
        flat[idx] += 1e-3
        out[name] = W.from_torch(x)
    return out


class Line:
    """A learner's line of versions, published as the learner does: anchors and deltas, each
    inline or as a file."""

    def __init__(self, kafka, tmp_path, state: W.State):
        self.kafka, self.tmp, self.states = kafka, tmp_path, {}
        self.states[-1] = state

    def publish(self, version: int, state: W.State, base: int = -1, *, inline: bool = True,
                payload: W.Payload | None = None, digest: str | None = None, file_gone: bool = False) -> Weights:
        if payload is None:
            payload = W.anchor(state) if base < 0 else W.delta(state, self.states[base], base)[0]
        self.states[version] = state
        uri, data = "", payload.to_bytes()
        if not inline:
            path = self.tmp / f"v{version}.safetensors"
            if not file_gone:  # else the file is lost before the producer reads it
                path.write_bytes(data)
            uri, data = path.resolve().as_uri(), b""
        w = Weights(version=version, step=version, base=base, uri=uri, payload=data, num_bytes=payload.num_bytes,
                    digest=digest or W.digest(state), dtype="float32")
        announce(self.kafka, w)
        return w


def same_weights(model: torch.nn.Module, state: W.State) -> bool:
    live = model.state_dict()
    return live.keys() == state.keys() and all(torch.equal(live[k], W.to_torch(t)) for k, t in state.items())


@pytest.fixture
def gen():
    return HFGenerator(load_model("tiny-llama", seed=0), seed=0)


@pytest.fixture
def v0(gen):
    return state_of(gen.model)  # the learner's version 0: the same seed's weights


def subscribe(kafka_cfg, gen) -> WeightSubscriber:
    sub = WeightSubscriber(kafka_cfg, gen).start()
    assert sub.caught_up.wait(30)
    return sub


def test_a_delta_chain_is_applied_onto_its_base_inline_or_from_files(kafka_cfg, gen, v0, tmp_path):
    line, states = Line(kafka_cfg, tmp_path, v0), [v0]
    line.publish(0, v0, inline=False)
    sub = subscribe(kafka_cfg, gen)
    try:
        for v in (1, 2, 3):
            states.append(nudged(states[-1], seed=v))
            line.publish(v, states[v], base=v - 1, inline=v != 2)
            wait_until(lambda: gen.version == v)
            assert same_weights(gen.model, states[v])  # bit-exact: the deltas lose nothing
        assert sub.by_source == {"inline": 2, "file": 1, "collective": 0}
        assert sub.counts["rejected"] == 0 and sub.last["chain"] == 1
    finally:
        sub.close()


def disk_bytes_written() -> int:
    """Bytes this process has caused to be written to storage (the kernel counts pages as they are dirtied)."""
    return int(dict(x.split(": ") for x in Path("/proc/self/io").read_text().splitlines())["write_bytes"])


def test_updates_reach_the_engine_in_memory_without_writing_a_file(kafka_cfg, gen, v0, tmp_path):
    """Inline deltas are applied to the held state and handed to the engine's parameters: the
    follower writes nothing to disk (it used to write each version whole, then load that file)."""
    line, states = Line(kafka_cfg, tmp_path, v0), [v0]
    line.publish(0, v0)
    sub = subscribe(kafka_cfg, gen)
    try:
        before = disk_bytes_written()
        for v in range(1, 7):
            states.append(nudged(states[-1], seed=v))
            line.publish(v, states[v], base=v - 1)
            wait_until(lambda: gen.version == v)
        written = disk_bytes_written() - before
        assert same_weights(gen.model, states[-1]) and sub.by_source["inline"] == 6
        full = sum(t.bits.nbytes for t in v0.values())
        assert written < full, f"{written} bytes written to disk for 6 updates of a {full}-byte state"
    finally:
        sub.close()


def on_version_1(kafka_cfg, gen, v0, tmp_path) -> tuple[Line, dict, WeightSubscriber]:
    """An anchor (v0) and a delta (v1) published, and a producer that loaded v1."""
    line, s = Line(kafka_cfg, tmp_path, v0), {0: v0}
    line.publish(0, v0)
    sub = subscribe(kafka_cfg, gen)
    s[1] = nudged(s[0], 1)
    line.publish(1, s[1], base=0)
    wait_until(lambda: gen.version == 1)
    return line, s, sub


def test_a_missing_delta_is_refused_then_the_next_anchor_and_its_chain_load(kafka_cfg, gen, v0, tmp_path):
    line, s, sub = on_version_1(kafka_cfg, gen, v0, tmp_path)
    try:
        s[2], seen = nudged(s[1], 2), sub.handled
        w2 = line.publish(2, s[2], base=1, inline=False, file_gone=True)
        wait_until(lambda: sub.handled == seen + 1)
        assert sub.counts["rejected"] == 1 and sub.counts["anchor_asks"] == 1  # asked for an anchor
        s[3] = nudged(s[2], 3)
        line.publish(3, s[3], base=2)  # onto the version it could not load: no way there
        wait_until(lambda: sub.handled == seen + 2)
        assert sub.counts["anchor_asks"] == 1  # asked once, not at every announcement
        assert gen.version == 1 and same_weights(gen.model, s[1])  # nothing half-applied
        s[4], s[5] = nudged(s[3], 4), nudged(s[3], 5)
        line.publish(4, s[4])
        line.publish(5, s[5], base=4)
        wait_until(lambda: gen.version == 5)
        assert same_weights(gen.model, s[5])
        assert w2.version in sub.following.bad
    finally:
        sub.close()


def test_deltas_announced_out_of_order_apply_once_their_base_is_there(kafka_cfg, gen, v0, tmp_path):
    line, s = Line(kafka_cfg, tmp_path, v0), {0: v0}
    line.publish(0, v0)
    s[1] = nudged(s[0], 1)
    s[2] = nudged(s[1], 2)
    line.states[1] = s[1]
    sub = subscribe(kafka_cfg, gen)
    try:
        seen = sub.handled
        line.publish(2, s[2], base=1)  # first, while the producer holds 0
        wait_until(lambda: sub.handled == seen + 1)
        assert gen.version == 0
        line.publish(1, s[1], base=0)
        wait_until(lambda: gen.version == 2)
        assert same_weights(gen.model, s[2]) and sub.last["chain"] == 2  # 1 then 2, loaded once
    finally:
        sub.close()


def test_an_update_that_does_not_verify_keeps_the_old_weights_serving(kafka_cfg, gen, v0, tmp_path):
    line, s, sub = on_version_1(kafka_cfg, gen, v0, tmp_path)
    try:
        # a delta made against another state than the one announced as its base: every tensor it
        # changes comes out with the wrong checksum
        wrong, _ = W.delta(nudged(s[1], 7), nudged(s[1], 8), 1)
        line.publish(2, nudged(s[1], 7), base=1, payload=wrong)
        wait_until(lambda: sub.counts["rejected"] == 1)
        # a right payload under a digest that is not its state's
        line.publish(3, nudged(s[1], 3), base=1, digest="f" * 64)
        wait_until(lambda: sub.counts["rejected"] == 2)
        assert gen.version == 1 and same_weights(gen.model, s[1])
        out = asyncio.run(gen.generate(PROMPT, PARAMS))
        assert (out.versions == 1).all()
    finally:
        sub.close()


def test_a_late_producer_loads_the_newest_anchor_and_the_chain_after_it(kafka_cfg, gen, v0, tmp_path):
    line, s = Line(kafka_cfg, tmp_path, v0), {0: v0}
    line.publish(0, v0, inline=False)
    for v in range(1, 9):
        s[v] = nudged(s[v - 1], v)
        line.publish(v, s[v], base=-1 if v == 5 else v - 1, inline=v != 6)
    (tmp_path / "v0.safetensors").unlink()  # pruned by the learner long ago: not needed
    sub = subscribe(kafka_cfg, gen)
    try:
        assert gen.version == 8 and same_weights(gen.model, s[8])
        assert sub.last["chain"] == 4 and sub.counts["rejected"] == 0  # anchor 5, then 6, 7, 8
        assert sub.held_version == 8
    finally:
        sub.close()


def test_update_figures_separate_the_engine_pause_from_the_fetch_and_are_exported(kafka_cfg, gen, v0, tmp_path):
    line = Line(kafka_cfg, tmp_path, v0)
    line.publish(0, v0)
    sub = subscribe(kafka_cfg, gen)
    registry = CollectorRegistry()
    weight_update_gauges(registry, "sao_test", sub)
    try:
        line.publish(1, nudged(v0, 1), base=0)
        wait_until(lambda: gen.version == 1)
        last = sub.last
        assert 0 < last["pause_s"] < last["load_s"] and last["fetch_s"] > 0 and last["lag_s"] > 0
        assert gen.last_pause_s == last["pause_s"]
        text = generate_latest(registry).decode()
        assert f'sao_test_weight_last_seconds{{phase="pause"}} {last["pause_s"]}' in text
        assert f"sao_test_weight_bytes_sum {float(last['bytes'])}" in text
    finally:
        sub.close()


def test_older_versions_are_ignored_and_undecodable_announcements_counted(kafka_cfg, gen, tmp_path):
    sub = subscribe(kafka_cfg, gen)
    try:
        new = load_model("tiny-llama", seed=1)
        announce(kafka_cfg, announcement(write_weights(new, tmp_path / "v2.safetensors"), 2))
        wait_until(lambda: gen.version == 2)
        assert same_weights(gen.model, state_of(new))
        announce(kafka_cfg, announcement(write_weights(load_model("tiny-llama", seed=5),
                                                      tmp_path / "v1.safetensors"), 1))
        wait_until(lambda: sub.counts["ignored"] == 1)
        announce(kafka_cfg, b"\x93not a weights message")
        wait_until(lambda: sub.counts["invalid"] == 1)
        assert gen.version == 2
    finally:
        sub.close()
    assert sub.error is None


def test_weights_of_another_architecture_stop_the_subscription_with_a_clear_error(kafka_cfg, gen, tmp_path):
    """A learner on another model is a misconfiguration, not a bad file: the producer must stop
    (its service raises `sub.error`) rather than sample on forever with weights that never change."""
    wrong_shape = write_weights(load_model("tiny-llama-bytes", seed=0), tmp_path / "v3.safetensors")
    sub = subscribe(kafka_cfg, gen)
    try:
        announce(kafka_cfg, announcement(wrong_shape, 3))  # verifies, but the state dict does not fit
        wait_until(lambda: sub.error is not None)
        assert isinstance(sub.error, ConfigError) and "architecture" in str(sub.error)
        assert gen.version == 0
    finally:
        sub.close()


def test_a_new_subscriber_starts_from_the_newest_loadable_version(kafka_cfg, gen, tmp_path):
    v1 = load_model("tiny-llama", seed=1)
    announce(kafka_cfg, announcement(write_weights(v1, tmp_path / "v1.safetensors"), 1))
    path2 = write_weights(load_model("tiny-llama", seed=2), tmp_path / "v2.safetensors")
    announce(kafka_cfg, announcement(path2, 2, digest="b" * 64))  # corrupt newest
    sub = subscribe(kafka_cfg, gen)
    try:
        assert gen.version == 1 and same_weights(gen.model, state_of(v1))
        assert sub.counts == {"loaded": 1, "rejected": 1, "ignored": 0, "invalid": 0, "anchor_asks": 1}
        [ask] = read_topic(kafka_cfg, T.WEIGHT_REQUESTS, 1)  # v2 is out of reach: the learner is asked
        assert (ask.held_version, ask.wanted_version) == (1, 2) and "v2" in ask.reason
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
            announce(kafka_cfg, announcement(path, 1))
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

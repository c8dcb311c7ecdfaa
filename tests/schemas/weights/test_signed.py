"""Signed weights, even on an open broker: a learner signing with its Ed25519 key (the publisher,
real Kafka) and a real hf engine trusting its public key. Whatever else anyone writes on
sao.weights (an anchor of another model with its correct digest, the learner's own announcement
re-sent under a new version, one signed by another key, an unsigned one, an old one replayed) is
refused or ignored, logged and counted, and the engine keeps serving the learner's weights. A key
rotation: both keys trusted while the learner switches, then the old one refused."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator
from producers.models import load_model
from schemas import topics as T
from schemas.config import ConfigError
from schemas.kafka import make_producer
from schemas.messages import Weights
from schemas.signing import create_keys, load_signer, load_trusted, refusal
from schemas.weights import payload as W
from schemas.weights.announcements import announcer
from schemas.weights.follow import FollowConfig, WeightSubscriber
from schemas.weights.publish import Publisher, WeightsConfig
from schemas.weights.store import WeightStore
from tests.learner.service_util import announcements
from tests.producers.util import wait_until


def _state(model: str, v: int) -> W.State:
    """Version v of a run on `model`: its seed-0 weights, moved by v x 1e-2."""
    return {k: W.from_torch(t + v * 1e-2) for k, t in load_model(model, seed=0).state_dict().items()}


def _publish(kafka_cfg, store, key, versions) -> None:
    pub = Publisher(WeightsConfig(signing_key=str(key), inline_bytes=0), store,
                    announcer(make_producer(kafka_cfg), kafka_cfg.topic(T.WEIGHTS)))
    try:
        for v in versions:
            pub.submit(_state("tiny-llama", v), v, step=v)
            pub.wait()
    finally:
        pub.close()


def _send(kafka_cfg, w: Weights) -> None:
    producer = make_producer(kafka_cfg)
    producer.produce(kafka_cfg.topic(T.WEIGHTS), w.encode(), key=w.key)
    assert producer.flush(30) == 0


def test_only_what_the_learner_signed_is_loaded_and_the_engine_serves_on(kafka_cfg, tmp_path):
    key, pub_key = create_keys(tmp_path / "keys")
    other_key, _ = create_keys(tmp_path / "attacker")
    store = WeightStore(tmp_path / "weights")
    _publish(kafka_cfg, store, key, [0, 1])
    gen = HFGenerator(load_model("tiny-llama", seed=0), seed=0)
    sub = WeightSubscriber(kafka_cfg, gen, follow=FollowConfig(trusted_keys=str(pub_key))).start()
    try:
        wait_until(lambda: gen.version == 1)
        first, latest = announcements(kafka_cfg, until=2)
        # 1. another model's anchor with its correct digest, unsigned (as found by the issue)
        forged_state = _state("tiny-llama", 7)
        payload = W.anchor(forged_state)
        _send(kafka_cfg, Weights(version=5, step=5, digest=W.digest(forged_state), num_bytes=payload.num_bytes,
                                 payload=payload.to_bytes(), store=first.store))
        # 2. the learner's own first announcement re-sent under a new version number
        _send(kafka_cfg, dataclasses.replace(first, version=6))
        # 3. a well-formed announcement signed by a key this engine does not trust
        _send(kafka_cfg, load_signer(other_key).sign(dataclasses.replace(first, version=7)))
        # 4. an old one replayed as it was: signed, but not newer than what runs
        _send(kafka_cfg, first)
        wait_until(lambda: sub.counts["unsigned"] == 1 and sub.counts["forged"] == 1
                   and sub.counts["untrusted"] == 1 and sub.counts["ignored"] >= 1)
        assert gen.version == 1 and sub.counts["loaded"] == 1 and sub.counts["rejected"] == 0
        out = asyncio.run(gen.generate([1, 2, 3], SamplingParams(max_tokens=4, seed=1)))  # still serving
        assert (out.versions == 1).all()
        _publish(kafka_cfg, store, key, [8])  # the learner's next version still goes through
        wait_until(lambda: gen.version == 8)
    finally:
        sub.close()
    assert latest.version == 1 and all(w.signature and w.key_id for w in announcements(kafka_cfg, timeout=5)[:2])


def test_a_key_rotation_keeps_both_keys_trusted_for_its_window_then_only_the_new(tmp_path):
    old, old_pub = create_keys(tmp_path / "old")
    new, new_pub = create_keys(tmp_path / "new")
    w = Weights(version=3, step=3, digest="a" * 64, num_bytes=2, payload=b"xy", base=2)
    by_old, by_new = load_signer(old).sign(w), load_signer(new).sign(w)
    window = load_trusted(f"{old_pub},{new_pub}")
    assert refusal(by_old, window) == refusal(by_new, window) == ""  # during the rotation window
    after = load_trusted(str(new_pub))
    assert refusal(by_old, after) == "untrusted" and refusal(by_new, after) == ""
    assert refusal(Weights.decode(by_new.encode()), after) == ""  # what travels verifies
    for field, value in (("version", 4), ("digest", "b" * 64), ("base", 1), ("payload", b"yz"), ("uri", "file:///x")):
        assert refusal(dataclasses.replace(by_new, **{field: value}), after) == "forged", field
    assert refusal(w, after) == "unsigned"
    assert (tmp_path / "new" / "learner.key").stat().st_mode & 0o077 == 0  # the private key: its owner's only


def test_unreadable_or_wrong_keys_are_refused_at_start(tmp_path):
    _, pub = create_keys(tmp_path / "k")
    with pytest.raises(ConfigError, match="--weights.signing-key"):
        WeightsConfig(signing_key=str(pub))  # a public key where the private one goes
    with pytest.raises(ConfigError, match="--weights.trusted-keys"):
        FollowConfig(trusted_keys=str(tmp_path / "missing.pub"))


def test_sao_keys_makes_a_pair_once_keeps_it_on_every_start_and_copies_the_public_half(tmp_path):
    from sao.keys import KeysConfig, run

    cfg = KeysConfig(out=tmp_path / "keys", keep=True, public_copy=tmp_path / "weights" / "learner.pub")
    run(cfg)
    first = load_signer(tmp_path / "keys" / "learner.key").key_id
    run(cfg)  # the stack started again: the same key
    assert load_signer(tmp_path / "keys" / "learner.key").key_id == first
    assert set(load_trusted(str(tmp_path / "weights" / "learner.pub"))) == {first}
    with pytest.raises(ConfigError, match="holds a key pair already"):
        run(KeysConfig(out=tmp_path / "keys"))
    run(KeysConfig(out=tmp_path / "keys", force=True))
    assert load_signer(tmp_path / "keys" / "learner.key").key_id != first

"""`sao serve` and the http backend against it, and log-prob parity with the learner's recomputation."""

from __future__ import annotations

import asyncio

import random
import threading

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from safetensors.torch import load_file

from learner.logprobs import collate, token_logprobs
from learner.models import tiny_llama as learner_tiny_llama
from producers.envs import make_env
from producers.episode import TrajectoryIds, run_episode
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator
from producers.generate.http import HttpGenerator
from producers.models import load_model
from producers.serve.api import RequestError, parse_request, version_spans
from producers.serve.service import chat_template, make_server
from schemas.catalogue import TINY_LLAMA, TINY_LLAMA_BYTES
from schemas.tokenizers import ByteTokenizer, load_tokenizer
from schemas.weights.follow import WeightSubscriber
from tests.producers.util import announce, announcement, wait_until, write_weights

T = 0.7  # not 1, so the temperature path is exercised on both sides


class Served:
    """An hf generator behind a real `sao serve` HTTP server on a free loopback port."""

    def __init__(self, model_name: str, seed: int = 0):
        self.gen = HFGenerator(load_model(model_name, seed=seed), seed=seed)
        self.server = make_server(self.gen, load_tokenizer(model_name), port=0, model_name=model_name)
        self.url = "http://%s:%d" % self.server.server_address[:2]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def served_bytes():
    s = Served("tiny-llama-bytes")
    yield s
    s.close()


@pytest.fixture(scope="module")
def served_toy():
    s = Served("tiny-llama")
    yield s
    s.close()


def _learner_model(gen: HFGenerator, tmp_path, config: dict):
    """The learner's tiny llama, loaded from the producer's weights saved to a file."""
    path = write_weights(gen.model, tmp_path / "policy.safetensors")
    model = learner_tiny_llama(vocab_size=config["vocab_size"], max_positions=config["max_positions"], seed=99)
    model.load_state_dict(load_file(str(path)))
    return model.eval()


def _max_gap(trajs, model) -> float:
    batch = collate(trajs)
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch, temperature=T)
    acted = batch.action_mask
    assert acted.sum() > 0
    return float((logp[acted] - batch.logp_rollout[acted]).abs().max())


@pytest.mark.parametrize("backend", ["hf", "http"])
def test_single_turn_logprobs_match_the_learners_recomputation(backend, served_bytes, tmp_path):
    gen = served_bytes.gen if backend == "hf" else HttpGenerator(served_bytes.url)
    env = make_env("math", tokenizer=load_tokenizer("tiny-llama-bytes"))
    rng = random.Random(0)
    params = SamplingParams(temperature=T, max_tokens=24)
    trajs = [asyncio.run(run_episode(env.episode(env.sample_task(rng)), gen, params,
                         TrajectoryIds(id=f"t{i}", prompt_id=f"p{i}", env="math", producer_id="test")))
             for i in range(3)]
    assert _max_gap(trajs, _learner_model(served_bytes.gen, tmp_path, TINY_LLAMA_BYTES)) < 1e-4


@pytest.mark.parametrize("backend", ["hf", "http"])
def test_multi_turn_logprobs_with_observations_match_the_learners_recomputation(backend, served_toy, tmp_path):
    gen = served_toy.gen if backend == "hf" else HttpGenerator(served_toy.url)
    env = make_env("toy-multiturn")
    rng = random.Random(1)
    params = SamplingParams(temperature=T, max_tokens=8)
    trajs = [asyncio.run(run_episode(env.episode(env.sample_task(rng)), gen, params,
                         TrajectoryIds(id=f"t{i}", prompt_id=f"p{i}", env=env.name, producer_id="test")))
             for i in range(3)]
    assert all(t.num_turns > 1 and (t.action_mask[t.prompt_len:] == 0).any() for t in trajs)
    assert _max_gap(trajs, _learner_model(served_toy.gen, tmp_path, TINY_LLAMA)) < 1e-4


def test_http_results_carry_the_servers_tokens_logprobs_and_versions(served_toy):
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=5)
    direct = asyncio.run(served_toy.gen.generate([1, 4], params))
    over_http = asyncio.run(HttpGenerator(served_toy.url).generate([1, 4], params))
    np.testing.assert_array_equal(over_http.token_ids, direct.token_ids)
    np.testing.assert_allclose(over_http.logprobs, direct.logprobs, atol=1e-6)
    np.testing.assert_array_equal(over_http.versions, direct.versions)
    assert httpx.get(f"{served_toy.url}/weight_info").json() == {"weight_version": served_toy.gen.version}


def test_the_server_follows_weights_and_reports_versions_per_token(kafka_cfg, tmp_path):
    served = Served("tiny-llama", seed=0)
    sub = WeightSubscriber(kafka_cfg, served.gen).start()
    try:
        assert sub.caught_up.wait(30)
        client = HttpGenerator(served.url)
        assert (asyncio.run(client.generate([1, 3], SamplingParams(max_tokens=4))).versions == 0).all()
        announce(kafka_cfg, announcement(write_weights(load_model("tiny-llama", seed=1),
                                                      tmp_path / "v1.safetensors"), 1))
        wait_until(lambda: served.gen.version == 1)
        out = asyncio.run(client.generate([1, 3], SamplingParams(max_tokens=4)))
        assert (out.versions == 1).all() and client.version == 1
    finally:
        sub.close()
        served.close()


@pytest.mark.parametrize("change, field", [
    ({"prompt": "text"}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [1, -2]}, "prompt"),
    ({"n": 2}, "n"), ({"stream": True}, "stream"), ({"logprobs": 5}, "logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"min_p": 0.1}, "min_p"), ({"logit_bias": {"3": 1}}, "logit_bias"), ({"temperature": 0}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"), ({"top_p": 0}, "top_p"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
])
def test_requests_that_change_the_distribution_are_refused(change, field):
    body = {"prompt": [1, 2], "max_tokens": 4, "logprobs": 0, **change}
    with pytest.raises(RequestError, match=f"^{field}"):
        parse_request(body)


def test_a_valid_request_maps_onto_sampling_params():
    prompt, params = parse_request({"prompt": [[1, 2]], "max_tokens": 5, "temperature": 0.5, "top_k": -1,
                                    "top_p": 1.0, "stop_token_ids": [7], "seed": 3, "logprobs": 0})
    assert prompt == [1, 2]
    assert params == SamplingParams(temperature=0.5, max_tokens=5, stop_token_ids=(7,), seed=3)


def test_bad_requests_get_400_and_the_server_keeps_serving(served_toy):
    r = httpx.post(f"{served_toy.url}/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(f"{served_toy.url}/v1/completions", json={"prompt": [1, 10_000], "max_tokens": 2})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert httpx.get(f"{served_toy.url}/health").status_code == 200


def test_version_spans_hand_case():
    assert version_spans(np.array([3, 3, 4, 4, 4])) == [{"version": 3, "start": 0, "end": 2},
                                                        {"version": 4, "start": 2, "end": 5}]
    assert version_spans(np.array([], dtype=np.int32)) == []


@given(st.lists(st.integers(0, 3), max_size=40).map(sorted))
def test_version_spans_cover_every_token_once(versions):
    spans = version_spans(np.array(versions, dtype=np.int32))
    flat = [s["version"] for s in spans for _ in range(s["start"], s["end"])]
    assert flat == versions


def test_concurrent_requests_share_decode_steps_and_keep_exact_log_probs(tmp_path):
    """Eight http clients at once (as a producer's episodes in flight): the server's hf engine
    decodes them as one batch, and each answer's log-probs still match the learner's recomputation."""
    served = Served("tiny-llama")
    rows = []
    handle = served.gen.model.register_forward_hook(lambda m, a, out: rows.append(out.logits.shape[0]))
    try:
        client = HttpGenerator(served.url)
        env = make_env("toy-target")
        rng = random.Random(3)
        params = SamplingParams(temperature=T, max_tokens=40)

        async def eight():
            return await asyncio.gather(*(run_episode(
                env.episode(env.sample_task(rng)), client, params,
                TrajectoryIds(id=f"t{i}", prompt_id=f"p{i}", env=env.name, producer_id="test")) for i in range(8)))

        trajs = asyncio.run(eight())
    finally:
        handle.remove()
        served.close()
    assert max(rows) >= 4  # batched, not one request per forward
    assert _max_gap(trajs, _learner_model(served.gen, tmp_path, TINY_LLAMA)) < 1e-4


class _LastTurnMarked(ByteTokenizer):
    """ChatML that marks the conversation's end, as templates that render the last turn their own
    way do: a conversation is then not a prefix of its continuation."""

    def apply_chat_template(self, messages, **kw):
        return super().apply_chat_template(messages, **kw) + "<|endoftext|>"


def test_without_a_usable_chat_template_the_server_answers_completions_only(served_toy):
    assert chat_template(None) is None and chat_template(_LastTurnMarked()) is None
    assert chat_template(ByteTokenizer()) is not None
    r = httpx.post(f"{served_toy.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    r = httpx.post(f"{served_toy.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200

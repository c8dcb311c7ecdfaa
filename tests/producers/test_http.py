"""The http backend's parsing of completions responses (vLLM's JSON shape, docs/vllm.md §3.2)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from producers.generate.base import SamplingParams
from producers.generate.http import HttpGenerator, InvalidGeneration, as_version, parse_choice, request_body, versions_from


def vllm_choice(tokens, logprobs, **extra) -> dict:
    """One choice as `vllm serve` returns it with return_token_ids and return_tokens_as_token_ids."""
    names = [f"token_id:{t}" for t in tokens]
    return {"index": 0, "text": "", "finish_reason": "stop", "stop_reason": None,
            "token_ids": tokens, "prompt_token_ids": [1, 2, 3],
            "logprobs": {"tokens": names, "token_logprobs": logprobs,
                         "top_logprobs": [{n: x} for n, x in zip(names, logprobs)], "text_offset": [0, 1]},
            **extra}


def test_request_asks_for_the_untruncated_tempered_distribution():
    body = request_body([5, 6], SamplingParams(temperature=0.7, max_tokens=9, stop_token_ids=(2,), seed=4), "m")
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 9 and body["temperature"] == 0.7
    assert (body["top_p"], body["top_k"], body["min_p"]) == (1.0, -1, 0.0)
    assert (body["presence_penalty"], body["frequency_penalty"], body["repetition_penalty"]) == (0.0, 0.0, 1.0)
    assert body["logprobs"] == 0 and body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert body["stop_token_ids"] == [2] and body["seed"] == 4


def test_parse_vllm_choice_without_versions():
    tokens, logprobs, versions, finish = parse_choice(vllm_choice([791, 6460], [-0.21, -1.37]))
    assert tokens.tolist() == [791, 6460] and np.allclose(logprobs, [-0.21, -1.37])
    assert versions is None and finish == "stop"


def test_token_ids_fall_back_to_the_token_id_strings():
    choice = vllm_choice([7, 8], [-0.5, -0.25])
    del choice["token_ids"]
    assert parse_choice(choice)[0].tolist() == [7, 8]


@pytest.mark.parametrize("bad", [-9999.0, -10000.0, float("nan"), float("-inf"), 0.5, None])
def test_clamped_or_impossible_logprobs_are_invalid(bad):
    with pytest.raises(InvalidGeneration, match="token 1"):
        parse_choice(vllm_choice([7, 8], [-0.5, bad]))


def test_mismatched_lengths_names_and_finish_reasons_are_invalid():
    with pytest.raises(InvalidGeneration):
        parse_choice(vllm_choice([7, 8], [-0.5]))
    choice = vllm_choice([7, 8], [-0.5, -0.1])
    choice["logprobs"]["tokens"] = ["token_id:7", "token_id:9"]
    with pytest.raises(InvalidGeneration, match="do not name"):
        parse_choice(choice)
    with pytest.raises(InvalidGeneration, match="abort"):
        parse_choice({**vllm_choice([7], [-0.5]), "finish_reason": "abort"})


def test_weight_versions_as_spans_or_per_token():
    spans = [{"version": "v3", "start": 0, "end": 2}, {"version": 4, "start": 2, "end": 3}]
    assert versions_from(spans, 3).tolist() == [3, 3, 4]
    assert versions_from([3, 3, 4], 3).tolist() == [3, 3, 4]
    assert versions_from(None, 3) is None
    with pytest.raises(InvalidGeneration, match="cover"):
        versions_from([{"version": 1, "start": 0, "end": 1}], 3)
    assert [as_version(v) for v in (5, "5", "v5")] == [5, 5, 5]


def test_an_unreachable_server_fails_after_bounded_retries():
    gen = HttpGenerator("http://127.0.0.1:9", retries=1, timeout_s=2)  # port 9: nothing listens
    with pytest.raises(Exception, match="(?i)connect"):
        asyncio.run(gen.generate([1], SamplingParams(max_tokens=1)))


def test_announced_version_is_the_fallback_tag():
    gen = HttpGenerator("http://127.0.0.1:9")
    assert gen.version == 0
    gen.load_weights("/not/read", 7)
    gen.load_weights("/not/read", 5)
    assert gen.version == 7


def test_a_refused_request_is_an_invalid_generation_not_a_crash():
    import threading

    from producers.generate.hf import HFGenerator
    from producers.models import load_model
    from producers.serve.service import make_server

    server = make_server(HFGenerator(load_model("tiny-llama")), None, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        gen = HttpGenerator("http://%s:%d" % server.server_address[:2])
        with pytest.raises(InvalidGeneration, match="400.*vocabulary"):
            asyncio.run(gen.generate([1, 10_000], SamplingParams(max_tokens=2)))
    finally:
        server.shutdown()
        server.server_close()

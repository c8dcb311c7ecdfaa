"""The vllm backend's pure parts. vLLM cannot run here; its own output objects and its engine are
stood in by SimpleNamespace objects and a call-recording engine with vLLM's method names."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace as NS

import numpy as np
import pytest

from producers.generate.base import SamplingParams
from producers.generate.http import InvalidGeneration
from producers.generate.vllm import extract, sampling_kwargs, swap, versions_from_marks


def request_output(tokens, logprobs, finish="stop", **extra):
    """vllm.outputs.RequestOutput with one CompletionOutput and logprobs=0 (sampled token only)."""
    lps = [{t: NS(logprob=x, rank=1, decoded_token=None)} for t, x in zip(tokens, logprobs)]
    return NS(request_id="r", prompt_token_ids=[1, 2], finished=True,
              outputs=[NS(token_ids=tokens, logprobs=lps, cumulative_logprob=sum(logprobs),
                          finish_reason=finish, stop_reason=None, **extra)])


def test_sampling_kwargs_ask_for_the_untruncated_tempered_distribution():
    kw = sampling_kwargs(SamplingParams(temperature=0.6, max_tokens=7, stop_token_ids=(2,), seed=1))
    assert kw["temperature"] == 0.6 and kw["max_tokens"] == 7 and kw["stop_token_ids"] == [2]
    assert (kw["top_p"], kw["top_k"], kw["min_p"]) == (1.0, -1, 0.0)
    assert (kw["presence_penalty"], kw["frequency_penalty"], kw["repetition_penalty"]) == (0.0, 0.0, 1.0)
    assert kw["logprobs"] == 0 and kw["seed"] == 1
    assert "seed" not in sampling_kwargs(SamplingParams())


def test_extract_reads_the_sampled_tokens_logprob():
    tokens, logprobs, native, finish = extract(request_output([5, 9], [-0.5, -2.0]))
    assert tokens.tolist() == [5, 9] and np.allclose(logprobs, [-0.5, -2.0])
    assert native is None and finish == "stop"
    spans = [{"version": "3", "start": 0, "end": 2}]
    assert extract(request_output([5, 9], [-0.5, -2.0], weight_versions=spans))[2] == spans


@pytest.mark.parametrize("out", [
    request_output([5, 9], [-0.5, float("-inf")]),
    request_output([5, 9], [-0.5, float("nan")]),
    request_output([5], [-0.5], finish="abort"),
    NS(outputs=[NS(token_ids=[5], logprobs=None, finish_reason="stop")]),
])
def test_extract_rejects_what_a_trajectory_cannot_carry(out):
    with pytest.raises(InvalidGeneration):
        extract(out)


def test_versions_from_marks():
    assert versions_from_marks(5, 2, []).tolist() == [2] * 5
    assert versions_from_marks(6, 2, [(2, 3), (4, 5)]).tolist() == [2, 2, 3, 3, 5, 5]
    assert versions_from_marks(3, 0, [(3, 1)]).tolist() == [0, 0, 0]  # swap after the last token


class Engine:
    """Records the AsyncLLM calls a swap makes; `old_reset` mimics a pre-keyword signature."""

    def __init__(self, old_reset=False, fail_load=False, keep=True):
        self.calls, self.old_reset, self.fail_load, self.keep = [], old_reset, fail_load, keep

    async def pause_generation(self, *, mode="abort", clear_cache=True, **kw):
        if not self.keep and mode == "keep":
            raise TypeError("mode")
        self.calls.append(("pause", mode, clear_cache))

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method, args))
        if self.fail_load:
            raise RuntimeError("load failed")

    async def reset_prefix_cache(self, **kw):
        if self.old_reset and kw:
            raise TypeError("unexpected keyword")
        self.calls.append(("reset", kw))
        return True

    async def update_weight_version(self, v):
        self.calls.append(("version", v))

    async def resume_generation(self):
        self.calls.append(("resume",))


def test_swap_pauses_keeping_requests_loads_resets_labels_then_resumes():
    engine, live = Engine(), []
    asyncio.run(swap(engine, "/w/v3.safetensors", 3, lambda: live.append(len(engine.calls))))
    assert engine.calls == [("pause", "keep", True), ("rpc", "load_safetensors", ("/w/v3.safetensors",)),
                            ("reset", {"reset_running_requests": True}), ("version", "3"), ("resume",)]
    assert live == [4]  # the version goes live after the load, before the engine resumes


def test_swap_falls_back_to_the_old_reset_signature():
    engine = Engine(old_reset=True)
    asyncio.run(swap(engine, "/w", 1))
    assert ("reset", {}) in engine.calls and engine.calls[-1] == ("resume",)


def test_a_failed_load_still_resumes_and_never_goes_live():
    engine, live = Engine(fail_load=True), []
    with pytest.raises(RuntimeError):
        asyncio.run(swap(engine, "/w", 1, lambda: live.append(1)))
    assert engine.calls[-1] == ("resume",) and live == []


def test_an_engine_without_keep_is_refused_not_aborted():
    engine = Engine(keep=False)
    with pytest.raises(TypeError):
        asyncio.run(swap(engine, "/w", 1))
    assert engine.calls == []  # no abort-mode pause, no load

"""The vllm backend on real vLLM (vLLM 0.32's CPU build here): log-probs equal a float32 forward of
the same weights, before and after an in-place weight swap (the tied-head re-pack included), a
swap in the middle of a request splits its tokens between the two versions exactly (on CPU the
next version is staged into a shadow of the model while that request decodes), 16 requests in
flight, a poisoned request fails alone, and a file of another architecture, or one that fails while
staged, is refused with the old weights kept. The end-to-end runs (a producer through Kafka into the learner, a SIGKILLed
producer, the http backend against `vllm serve`) are in test_vllm_pipeline.py."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from producers.generate.base import SamplingParams
from producers.generate.http import InvalidGeneration, versions_from
from producers.generate.vllm import VLLMGenerator, extract, mismatch, sampling_kwargs, threads_bind
from producers.generate.watchdog import engine_processes
from schemas.catalogue import TINY_LLAMA, tiny_llama
from schemas.weights.engine import ArchitectureMismatch

# head size 32: the smallest vLLM's CPU attention kernels serve; tied embeddings, like SmolLM2
TIED = {**TINY_LLAMA, "hidden_size": 128}
PROMPTS = [[1, 2, 3], [4, 5], [7, 8, 9, 10]]


def tied_model(seed: int = 0):
    model = tiny_llama(**TIED, seed=seed)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    return model


def perturbed(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {k: (v + 0.5 * v.std() * torch.randn(v.shape, generator=g)).contiguous() for k, v in state.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # still tied
    return out


def forward_logprobs(state: dict, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of each sampled token under `state`, from one float32 transformers forward."""
    model = tied_model()
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    steps = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, -1)
    return steps.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """One engine for the module (start-up ~25 s), on the tied tiny model's folder."""
    root = tmp_path_factory.mktemp("vllm")
    model = tied_model()
    model.save_pretrained(root / "model")
    states = {0: model.state_dict(), 1: perturbed(model.state_dict(), 1), 2: perturbed(model.state_dict(), 2)}
    files = {}
    for v in (1, 2):
        files[v] = root / f"v{v}.safetensors"
        save_file({k: t.clone() for k, t in states[v].items()}, str(files[v]))
    gen = VLLMGenerator(root / "model", seed=0)
    yield NS(gen=gen, states=states, files=files, root=root)
    gen.close()
    assert not engine_processes(os.getpid()), "an engine process outlived close()"


def generate(gen, prompt, **params):
    return asyncio.run(gen.generate(prompt, SamplingParams(**{"max_tokens": 16, "seed": 1, **params})))


def gap(out, state, prompt, temperature: float = 1.0) -> float:
    ref = forward_logprobs(state, prompt, out.token_ids.tolist(), temperature)
    return float((ref - torch.from_numpy(out.logprobs)).abs().max())


def test_log_probs_equal_a_float32_forward_and_swaps_keep_them_exact_with_a_tied_head(engine):
    gen = engine.gen
    assert gen.version == 0
    out = generate(gen, PROMPTS[0], temperature=0.7)  # the log-probs are of softmax(logits / T)
    assert out.versions.tolist() == [0] * 16 and gap(out, engine.states[0], PROMPTS[0], 0.7) < 1e-4
    gen.load_state(engine.states[1], 1)  # in memory, as the weight follower hands over every update
    after = generate(gen, PROMPTS[0])
    assert after.versions.tolist() == [1] * 16
    # the tied output head was re-packed: a stale head would be off by far more than this
    assert gap(after, engine.states[1], PROMPTS[0]) < 1e-4
    assert gap(after, engine.states[0], PROMPTS[0]) > 1e-2
    assert gen.last_pause_s < 5


def test_a_swap_in_the_middle_of_a_request_splits_its_tokens_between_the_versions(engine):
    gen = engine.gen
    start = gen.version
    params = SamplingParams(max_tokens=240, seed=3)

    async def run():
        request = asyncio.ensure_future(gen.generate(PROMPTS[1], params))
        await asyncio.sleep(0.5)  # some tokens sampled
        await asyncio.to_thread(gen.load_weights, str(engine.files[2]), start + 1)
        return await request

    out = asyncio.run(run())
    v = out.versions.tolist()
    cut = v.index(start + 1)
    assert 0 < cut < len(v) and v == [start] * cut + [start + 1] * (len(v) - cut)
    tokens = out.token_ids.tolist()
    before = forward_logprobs(engine.states[1], PROMPTS[1], tokens[:cut])
    torch.testing.assert_close(torch.from_numpy(out.logprobs[:cut]), before, atol=1e-4, rtol=0)
    # after the swap the frozen request was re-prefilled: its later tokens are the new weights'
    after = forward_logprobs(engine.states[2], PROMPTS[1], tokens)[cut:]
    torch.testing.assert_close(torch.from_numpy(out.logprobs[cut:]), after, atol=1e-4, rtol=0)


def test_sixteen_requests_in_flight_sample_apart_and_a_poisoned_one_fails_alone(engine):
    gen = engine.gen

    async def run():
        good = [gen.generate(PROMPTS[i % 3], SamplingParams(max_tokens=12, seed=i)) for i in range(16)]
        bad = [gen.generate([1, 999], SamplingParams(max_tokens=4)),  # beyond the vocabulary
               gen.generate([1] * 300, SamplingParams(max_tokens=20))]  # longer than the engine's context
        return await asyncio.gather(*good, *bad, return_exceptions=True)

    *good, beyond, too_long = asyncio.run(run())
    assert isinstance(beyond, ValueError) and "token id 999" in str(beyond)
    assert isinstance(too_long, InvalidGeneration), too_long
    assert all(len(g.token_ids) == 12 and np.isfinite(g.logprobs).all() for g in good)
    assert len({tuple(g.token_ids.tolist()) for g in good}) == 16  # per-request seeds
    assert len(generate(gen, PROMPTS[2]).token_ids) == 16  # the engine serves on


def test_seeded_requests_beyond_one_steps_prefill_budget_all_finish(engine):
    # prompts filling several scheduler steps: on CPU a chunked prefill of a seeded request made vLLM
    # rewind its torch.Generator's offset, which CPU generators lack, and the engine died
    gen = engine.gen

    async def run():
        return await asyncio.gather(*[gen.generate([1 + (i + j) % 60 for j in range(200)],
                                                   SamplingParams(max_tokens=4, seed=i)) for i in range(48)])

    out = asyncio.run(run())
    assert all(len(o.token_ids) == 4 and np.isfinite(o.logprobs).all() for o in out)
    assert len(generate(gen, PROMPTS[2]).token_ids) == 16  # the engine serves on


def test_the_engines_worker_computes_on_every_core_this_process_may_use(engine):
    # vLLM's own "auto" binding leaves one thread on a 2-vCPU machine (bench/results/vllm_generation_notes.md)
    from vllm.utils.cpu_resource_utils import parse_id_list

    allowed = sorted(os.sched_getaffinity(0))
    workers = [pid for pid in engine_processes(os.getpid())
               if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"VLLM::Worker")]
    assert workers, "no vLLM worker process below this one"
    for pid in workers:  # vLLM pins each OpenMP thread to one core of its list
        cores = set()
        for task in Path(f"/proc/{pid}/task").iterdir():
            status = (task / "status").read_text()
            cores |= set(parse_id_list(status.split("Cpus_allowed_list:")[1].split()[0]))
        assert sorted(cores) == allowed
    assert threads_bind("all") == ",".join(map(str, allowed)) and threads_bind("0-1|2-3") == "0-1|2-3"


def test_a_file_of_another_architecture_is_refused_and_the_old_weights_serve_on(engine):
    gen, version = engine.gen, engine.gen.version
    before = generate(gen, PROMPTS[0])
    other = tiny_llama(**{**TIED, "num_layers": 3}, seed=0)
    save_file({k: t.contiguous().clone() for k, t in other.state_dict().items()}, str(engine.root / "other.safetensors"))
    with pytest.raises(ArchitectureMismatch):
        gen.load_weights(str(engine.root / "other.safetensors"), version + 1)
    with pytest.raises(ValueError, match="older"):
        gen.load_weights(str(engine.files[1]), version - 1)
    again = generate(gen, PROMPTS[0])
    assert gen.version == version and again.token_ids.tolist() == before.token_ids.tolist()
    np.testing.assert_allclose(again.logprobs, before.logprobs, atol=1e-6)


def test_a_file_that_fails_while_staged_leaves_the_old_weights_serving(engine):
    """The header is this model's, the data is cut short: staging (on CPU, the shadow's reload)
    fails while the engine decodes on, the swap raises, and the live weights never changed (the
    last good weights, here a state handed over in memory, are staged again)."""
    gen = engine.gen
    gen.load_state(engine.states[2], gen.version + 1)
    version = gen.version
    before = generate(gen, PROMPTS[2])
    whole = engine.files[1].read_bytes()
    (engine.root / "cut.safetensors").write_bytes(whole[:len(whole) - 4096])
    with pytest.raises(Exception, match="staging the weights failed"):
        gen.load_weights(str(engine.root / "cut.safetensors"), version + 1)
    again = generate(gen, PROMPTS[2])
    assert gen.version == version and again.versions.tolist() == [version] * 16
    assert again.token_ids.tolist() == before.token_ids.tolist()
    np.testing.assert_allclose(again.logprobs, before.logprobs, atol=1e-6)
    gen.load_weights(str(engine.files[1]), version + 1)  # the next swap stages into a new shadow
    after = generate(gen, PROMPTS[2])
    assert after.versions.tolist() == [version + 1] * 16 and gap(after, engine.states[1], PROMPTS[2]) < 1e-4


def test_pure_parts_sampling_kwargs_spans_and_extraction():
    kw = sampling_kwargs(SamplingParams(temperature=0.6, max_tokens=7, stop_token_ids=(2,), seed=1))
    assert (kw["top_p"], kw["top_k"], kw["min_p"], kw["logprobs"], kw["seed"]) == (1.0, -1, 0.0, 0, 1)
    spans = [NS(version="3", start=0, end=2), NS(version="default", start=2, end=3)]  # vLLM's WeightVersionSpan
    assert versions_from(spans, 3).tolist() == [3, 3, 0]
    out = NS(outputs=[NS(token_ids=[5], logprobs=[{5: NS(logprob=float("nan"))}], finish_reason="stop",
                         weight_versions=spans)])
    with pytest.raises(InvalidGeneration):
        extract(out)
    tied = {"model.embed_tokens.weight": (64, 128), "lm_head.weight": (64, 128)}
    assert mismatch(tied, {"model.embed_tokens.weight": (64, 128)}, tied=True) == []
    assert mismatch(tied, {"model.embed_tokens.weight": (65, 128)}, tied=True)

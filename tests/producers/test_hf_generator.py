"""The `hf` generator: KV-cached decoding whose log-probs match a full forward, seeding,
truncation, and weight swaps between decode steps (also from another thread)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from learner.models import tiny_llama, tiny_qwen3_moe
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator, truncate
from tests.producers.util import full_forward_logprobs

PROMPT = [1, 5, 9]


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3_moe])
def test_cached_decoding_log_probs_match_a_full_forward(build):
    model = build(seed=1)
    gen = HFGenerator(model, seed=0)
    out = gen.submit(PROMPT, SamplingParams(temperature=0.8, max_tokens=12)).result()
    assert len(out.token_ids) == 12 and out.finish_reason == "length"
    assert out.token_ids.dtype.name == "int32" and out.logprobs.dtype.name == "float32"
    ref = full_forward_logprobs(model, PROMPT + out.token_ids.tolist(), 12, 0.8)
    torch.testing.assert_close(torch.from_numpy(out.logprobs), ref, atol=2e-5, rtol=1e-5)
    assert out.versions.tolist() == [0] * 12


def test_seed_makes_sampling_reproducible():
    gen = HFGenerator(tiny_llama(seed=1))
    a = gen.submit(PROMPT, SamplingParams(max_tokens=16, seed=3)).result()
    b = gen.submit(PROMPT, SamplingParams(max_tokens=16, seed=3)).result()
    c = gen.submit(PROMPT, SamplingParams(max_tokens=16, seed=4)).result()
    assert a.token_ids.tolist() == b.token_ids.tolist() != c.token_ids.tolist()
    # without a per-call seed, the generator's own seeded stream decides
    d = HFGenerator(tiny_llama(seed=1), seed=9).submit(PROMPT, SamplingParams(max_tokens=16)).result()
    e = HFGenerator(tiny_llama(seed=1), seed=9).submit(PROMPT, SamplingParams(max_tokens=16)).result()
    assert d.token_ids.tolist() == e.token_ids.tolist()


def test_stop_token_ends_generation_and_is_kept():
    gen = HFGenerator(tiny_llama(seed=1))
    first = gen.submit(PROMPT, SamplingParams(max_tokens=8, seed=0)).result()
    stop = int(first.token_ids[2])
    out = gen.submit(PROMPT, SamplingParams(max_tokens=8, seed=0, stop_token_ids=(stop,))).result()
    cut = first.token_ids.tolist().index(stop) + 1
    assert out.token_ids.tolist() == first.token_ids[:cut].tolist() and out.finish_reason == "stop"


def test_truncation_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    kept = lambda x: torch.isfinite(x).tolist()  # noqa: E731
    assert kept(truncate(logits, top_k=2, top_p=1.0)) == [True, True, False, False]
    assert kept(truncate(logits, top_k=0, top_p=0.8)) == [True, True, False, False]
    assert kept(truncate(logits, top_k=0, top_p=0.81)) == [True, True, True, False]
    assert kept(truncate(logits, top_k=0, top_p=1.0)) == [True] * 4


def test_truncated_log_prob_is_of_the_renormalised_distribution():
    model = tiny_llama(seed=1)
    out = HFGenerator(model).submit(PROMPT, SamplingParams(max_tokens=6, top_k=1, seed=0)).result()
    assert (out.logprobs == 0.0).all()  # a single surviving token has probability 1
    with torch.no_grad():  # and it is the greedy token
        tokens = PROMPT + out.token_ids.tolist()
        logits = model(input_ids=torch.tensor([tokens])).logits[0]
    assert logits[len(PROMPT) - 1:-1].argmax(-1).tolist() == out.token_ids.tolist()
    out = HFGenerator(model).submit(PROMPT, SamplingParams(max_tokens=6, top_k=5, seed=0)).result()
    full = full_forward_logprobs(model, PROMPT + out.token_ids.tolist(), 6, 1.0)
    assert (torch.from_numpy(out.logprobs) > full).all()  # renormalised over 5 tokens


def test_non_positive_temperature_is_refused():
    with pytest.raises(ValueError, match="temperature"):
        HFGenerator(tiny_llama()).submit(PROMPT, SamplingParams(temperature=0.0)).result()


def test_load_weights_swaps_and_records_the_version(tmp_path):
    gen = HFGenerator(tiny_llama(seed=1))
    other = tiny_llama(seed=2)
    save_file(other.state_dict(), tmp_path / "w.safetensors")
    gen.load_weights(str(tmp_path / "w.safetensors"), version=5)
    assert gen.version == 5
    for p, q in zip(gen.model.parameters(), other.parameters()):
        assert torch.equal(p, q)
    out = gen.submit(PROMPT, SamplingParams(max_tokens=3)).result()
    assert out.versions.tolist() == [5, 5, 5]
    with pytest.raises(ValueError, match="older"):
        gen.load_weights(str(tmp_path / "w.safetensors"), version=4)


def test_a_mismatching_file_is_refused_and_the_old_weights_kept(tmp_path):
    gen = HFGenerator(tiny_llama(seed=1))
    before = [p.detach().clone() for p in gen.model.parameters()]
    save_file(tiny_llama(seed=2, hidden_size=16).state_dict(), tmp_path / "bad.safetensors")
    with pytest.raises(ValueError, match="does not match"):
        gen.load_weights(str(tmp_path / "bad.safetensors"), version=1)
    assert gen.version == 0
    assert all(torch.equal(p, q) for p, q in zip(before, gen.model.parameters()))


def test_swap_from_another_thread_lands_between_decode_steps(tmp_path):
    """A load issued while step 3 is running applies at a later step boundary: versions go
    0…0 then 1…1 and never back; the first three tokens were sampled before the load."""
    model = tiny_llama(seed=1)
    gen = HFGenerator(model)
    path = tmp_path / "w.safetensors"
    save_file(tiny_llama(seed=2).state_dict(), path)
    calls, loader = [0], []

    def hook(module, args, output):  # runs inside a decode step, holding the step lock
        calls[0] += 1
        if calls[0] == 3:
            loader.append(threading.Thread(target=gen.load_weights, args=(str(path), 1)))
            loader[0].start()
            time.sleep(0.3)  # the loader reads the file and queues the swap meanwhile

    handle = model.register_forward_hook(hook)
    out = gen.submit(PROMPT, SamplingParams(max_tokens=10, seed=0)).result()
    handle.remove()
    loader[0].join(timeout=10)
    versions = out.versions.tolist()
    assert versions[:3] == [0, 0, 0] and versions[-1] == 1
    assert versions == sorted(versions)
    assert gen.version == 1


@pytest.mark.parametrize("build", [tiny_llama, tiny_qwen3_moe])
def test_batched_requests_that_join_and_leave_keep_full_forward_log_probs(build):
    """Requests of different prompt lengths and output lengths share the running batch (joining
    while others decode, leaving when done); every sampled token's log-prob equals a full
    forward of its own sequence within 1e-4, the property the importance ratio depends on."""
    model = build(seed=1)
    gen = HFGenerator(model, seed=0)
    batch_sizes, gate = [], threading.Event()

    def pace(module, args, output):  # hold the second step so the later requests join mid-flight
        batch_sizes.append(output.logits.shape[0])
        if len(batch_sizes) == 2:
            gate.wait(10)

    handle = model.register_forward_hook(pace)
    futures, requests = [], []
    for i in range(6):
        prompt = [(j + i) % 50 + 1 for j in range(1 + 3 * (i // 2))]  # pairs of lengths 1, 4, 7: prefilled
        # together, while rows of different lengths need different padding
        params = SamplingParams(temperature=0.7 + 0.1 * i, max_tokens=4 + 5 * i, seed=i)
        requests.append((prompt, params))
        futures.append(gen.submit(prompt, params))
        if i == 1:
            time.sleep(0.2)  # the first two are decoding before the others arrive
    gate.set()
    outs = [f.result(timeout=120) for f in futures]
    handle.remove()
    gen.close()
    for (prompt, params), out in zip(requests, outs):
        n = len(out.token_ids)
        assert n == params.max_tokens and out.finish_reason == "length"
        ref = full_forward_logprobs(model, prompt + out.token_ids.tolist(), n, params.temperature)
        torch.testing.assert_close(torch.from_numpy(out.logprobs), ref, atol=1e-4, rtol=0)
    assert max(batch_sizes) >= 3  # they were batched, not run one by one


def test_a_batched_weight_swap_lands_between_decode_steps_for_every_row(tmp_path):
    """A swap while 16 requests decode together: each row's versions go 0…0 then 1…1, every row
    sees the switch at the same engine step, and tokens after it match the new weights."""
    model = tiny_llama(seed=1)
    gen = HFGenerator(model, seed=0)
    path = tmp_path / "w.safetensors"
    save_file(tiny_llama(seed=2).state_dict(), path)
    calls = [0]

    def hook(module, args, output):
        calls[0] += 1
        if calls[0] == 20:  # mid-way: every request is in the batch by now
            threading.Thread(target=gen.load_weights, args=(str(path), 1)).start()
            time.sleep(0.3)

    model.register_forward_hook(hook)
    futures = [gen.submit(PROMPT + [i], SamplingParams(max_tokens=30, seed=i)) for i in range(16)]
    outs = [f.result(timeout=120) for f in futures]
    gen.close()
    switch = {out.versions.tolist().index(1) for out in outs}
    for out in outs:
        v = out.versions.tolist()
        assert v == sorted(v) and v[0] == 0 and v[-1] == 1
    assert len({len(PROMPT) + s for s in switch}) <= 2  # rows joined at most a step apart


def test_one_poisoned_request_fails_alone_and_the_rest_of_its_batch_completes():
    """A request whose stream consumer raises mid-decode, and one whose prompt id is beyond the
    vocabulary, fail by themselves; the requests batched with them sample on, their log-probs
    those of a full forward."""
    model = tiny_llama(seed=2)
    gen = HFGenerator(model, seed=0)
    params = SamplingParams(max_tokens=10, seed=5)
    release = threading.Event()

    def poisoned(token):  # the third token's callback raises, inside the engine's step
        release.wait()
        poisoned.n = getattr(poisoned, "n", 0) + 1
        if poisoned.n == 3:
            raise RuntimeError("the client's stream handler broke")

    futures = [gen.submit(PROMPT, params, poisoned), *(gen.submit([2, 4, 6, 8][:k], params) for k in (2, 3, 4))]
    with pytest.raises(ValueError, match=r"prompt: token id 64 is not in \[0, 64\)"):
        gen.submit([1, 64], params)
    release.set()
    with pytest.raises(ValueError, match="sampling failed for this request: RuntimeError: the client's stream"):
        futures[0].result(60)
    for k, f in zip((2, 3, 4), futures[1:]):
        out = f.result(60)
        assert len(out.token_ids) == 10
        ref = full_forward_logprobs(model, [2, 4, 6, 8][:k] + out.token_ids.tolist(), 10, 1.0)
        torch.testing.assert_close(torch.from_numpy(out.logprobs), ref, atol=2e-5, rtol=1e-5)
    assert len(gen.submit(PROMPT, params).result(60).token_ids) == 10  # the engine serves on


@pytest.mark.parametrize("field, value, message", [
    ("seed", 1 << 70, "seed: must be an integer in"), ("temperature", 1e-300, "temperature: must be a number in"),
    ("temperature", float("nan"), "temperature"), ("top_p", 0.0, "top_p"), ("top_k", -1, "top_k"),
    ("max_tokens", 0, "max_tokens")])
def test_sampling_params_out_of_range_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})

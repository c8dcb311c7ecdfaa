"""Real vLLM in the loop: a `--backend vllm` producer through Kafka into the learner, whose
recomputed log-probs equal the engine's within 1e-4; a SIGKILLed vLLM producer loses no prompt and
leaves no engine process behind; the http backend against vLLM's own server (`vllm serve`),
weight swaps included."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from producers.generate.base import SamplingParams
from producers.generate.http import HttpGenerator
from sao.broker import free_port
from schemas import topics as T
from tests.learner.service_util import ROOT, learner_cmd, metrics
from tests.producers.test_vllm import PROMPTS, forward_logprobs, perturbed, tied_model
from tests.producers.util import make_prompts, publish_prompts, read_topic, wait_until

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "INFO", "HF_HUB_OFFLINE": "1"}


def _sao(kafka_cfg, *args: str, **kw) -> subprocess.Popen:
    env = {**ENV, "SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix}
    return subprocess.Popen([sys.executable, "-m", "sao", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


def _descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    children = {int(x) for x in out.split()}
    return children.union(*(_descendants(c) for c in children)) if children else set()


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        if stat.split(") ")[1][0] != "Z":
            alive.add(pid)
    return alive


def test_a_vllm_producer_feeds_the_learner_with_the_learners_own_log_probs(kafka_cfg, tmp_path):
    # a tiny learner 128 wide: attention heads of 32, which vLLM's CPU kernels serve
    learner = subprocess.Popen(learner_cmd(kafka_cfg, tmp_path, "--model.hidden-size", "128", "--batch-trajectories",
                                           "8", "--max-steps", "1", "--max-staleness", "-1",
                                           "--weights.dtype", "float32"),  # bf16 by default: 1e-4 needs float32
                               cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    publish_prompts(kafka_cfg, make_prompts("toy-target", [{"target": i % 4} for i in range(8)]))
    producer = _sao(kafka_cfg, "producer", "--backend", "vllm", "--model", "learner", "--env", "toy-target",
                    "--max-tokens", "12", "--max-prompts", "8", "--producer-id", "vllm")
    try:
        assert producer.wait(400) == 0, producer.stderr.read()[-4000:]
        assert learner.wait(300) == 0, learner.stderr.read()[-4000:]
    finally:
        producer.kill()
        learner.kill()
    [step] = metrics(tmp_path)
    assert step["batch/trajectories"] == 8
    # the learner's float32 recomputation against the engine's rollout log-probs, per token
    assert math.exp(-1e-4) < step["dis/ratio_min"] <= step["dis/ratio_max"] < math.exp(1e-4), step
    trajs = read_topic(kafka_cfg, T.TRAJECTORIES, 8)
    assert {t.producer_id for t in trajs} == {"vllm"} and all(t.versions.max() == 0 for t in trajs)


def test_a_sigkilled_vllm_producer_loses_no_prompt_and_leaves_no_engine_process(kafka_cfg, tmp_path):
    tied_model().save_pretrained(tmp_path / "model")
    prompts = make_prompts("toy-target", [{"target": i % 4} for i in range(24)])
    publish_prompts(kafka_cfg, prompts)
    args = ("--env", "toy-target", "--model", str(tmp_path / "model"), "--max-tokens", "48", "--concurrency", "4",
            "--no-follow-weights")
    victim = _sao(kafka_cfg, "producer", "--backend", "vllm", *args, "--producer-id", "victim")
    try:
        wait_until(lambda: len(read_topic(kafka_cfg, T.TRAJECTORIES, 3, timeout=2)) >= 3 or victim.poll() is not None,
                   timeout=300, every=1)
        assert victim.poll() is None, victim.stderr.read()[-3000:]
        engine = _descendants(victim.pid)
        assert engine, "no engine processes under the producer"
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        wait_until(lambda: not _alive(engine), timeout=60, every=0.5)
    finally:
        victim.kill()
    rest = _sao(kafka_cfg, "producer", "--backend", "hf", *args, "--producer-id", "rest")
    try:
        done = lambda: {t.prompt_id for t in read_topic(kafka_cfg, T.TRAJECTORIES, 24, timeout=3)}  # noqa: E731
        wait_until(lambda: done() >= {p.id for p in prompts}, timeout=300, every=2)
    finally:
        rest.send_signal(signal.SIGTERM)
        rest.wait(60)


@pytest.fixture
def vllm_server(tmp_path):
    """`vllm serve` (the OpenAI server) on the tied tiny model, dev mode, our worker extension."""
    model = tied_model()
    model.save_pretrained(tmp_path / "model")
    port = free_port()
    env = {**ENV, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path / "model"),
         "--served-model-name", "tied", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
         "--enforce-eager", "--max-model-len", "256", "--logprobs-mode", "processed_logprobs",
         "--generation-config", "vllm", "--skip-tokenizer-init",
         "--worker-extension-cls", "producers.generate.vllm.WorkerExtension"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import httpx
    url = f"http://127.0.0.1:{port}"

    def healthy():
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return server.poll() is not None
    try:
        wait_until(healthy, timeout=300, every=1)
        assert server.poll() is None, "vllm serve exited"
        yield url, model.state_dict(), tmp_path
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def test_the_http_backend_samples_from_vllm_serve_and_swaps_its_weights_in_place(vllm_server):
    url, state, root = vllm_server
    gen = HttpGenerator(url, model="tied", swaps=True)

    def sample(prompt):
        return asyncio.run(gen.generate(prompt, SamplingParams(max_tokens=12, seed=2)))

    out = sample(PROMPTS[0])
    assert out.versions.tolist() == [0] * 12  # vLLM's "default" label: the weights it started on
    ref = forward_logprobs(state, PROMPTS[0], out.token_ids.tolist())
    torch.testing.assert_close(torch.from_numpy(out.logprobs), ref, atol=1e-4, rtol=0)
    new = perturbed(state, 7)
    save_file({k: t.clone() for k, t in new.items()}, str(root / "v1.safetensors"))
    t0 = time.monotonic()
    gen.load_weights(str(root / "v1.safetensors"), 1)
    assert 0 < gen.last_pause_s <= time.monotonic() - t0
    after = sample(PROMPTS[0])
    assert after.versions.tolist() == [1] * 12
    ref = forward_logprobs(new, PROMPTS[0], after.token_ids.tolist())
    torch.testing.assert_close(torch.from_numpy(after.logprobs), ref, atol=1e-4, rtol=0)
    gen.load_weights(str(root / "v1.safetensors"), 1)  # already there: no second swap

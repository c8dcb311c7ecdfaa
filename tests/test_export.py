"""`sao export`: a version of a real learner's policy, from the weight store and `sao.weights` or
from its checkpoint, as a folder that transformers, PEFT and real vLLM load, whose log-probs equal
the learner's own forward at that version within 1e-4 (float32)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from learner.logprobs import collate, token_logprobs
from learner.lora import inject
from learner.models import ModelConfig, build_policy, tiny_llama
from producers.generate.base import SamplingParams
from sao.export import ExportConfig, run
from schemas import topics as T
from schemas.config import ConfigError
from schemas.messages import Trajectory
from schemas.tokenizers import ByteTokenizer
from tests.learner.service_util import ONE_PARTITION, ROOT, final_policy, learner_cmd, publish, rollouts, run_learner

SEQUENCES = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 2, 30, 41, 5], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
LORA = ["--model.lora-rank", "4", "--model.lora-alpha", "8"]


def logprobs(model: torch.nn.Module, seqs=SEQUENCES) -> np.ndarray:
    """Each sequence's tokens after the first under `model`, by the learner's own forward."""
    trajs = [Trajectory(id=f"s{i}", prompt_id="p", env="x", producer_id="x", tokens=np.array(s, np.int32),
                        action_mask=np.r_[0, np.ones(len(s) - 1)].astype(np.uint8),
                        rollout_logprobs=np.zeros(len(s), np.float32), versions=np.zeros(len(s), np.int32),
                        prompt_len=1, reward=0.0) for i, s in enumerate(seqs)]
    with torch.no_grad():
        logp, _ = token_logprobs(model.float().eval(), collate(trajs), temperature=1.0)
    return np.concatenate([logp[i, 1:len(s)].numpy() for i, s in enumerate(seqs)])


def learner_policy(run_dir: Path, cfg: ModelConfig) -> torch.nn.Module:
    """The learner's policy as its newest checkpoint holds it (DCP's own offline converter)."""
    model = build_policy(cfg)
    if cfg.lora:
        inject(model, cfg.lora, cfg.lora.targets)
    model.load_state_dict(final_policy(run_dir))
    return model


def train(kafka_cfg, tmp_path: Path, steps: int, *flags: str) -> None:
    """A real learner, `steps` steps of 4 trajectories, publishing float32, a checkpoint each step."""
    publish(kafka_cfg, T.TRAJECTORIES, [t.encode() for t in rollouts(4 * steps, seed=5)], key=ONE_PARTITION)
    run_learner(learner_cmd(kafka_cfg, tmp_path, "--batch-trajectories", "4", "--max-steps", str(steps),
                            "--checkpoint-every", "1", "--max-staleness", "-1", "--update.lr-policy", "1e-2",
                            "--weights.dtype", "float32", *flags))


def sao_export(kafka_cfg, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sao", "export", "--kafka.bootstrap", kafka_cfg.bootstrap,
                           "--kafka.topic-prefix", kafka_cfg.topic_prefix, *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "SAO_LOG_LEVEL": "WARNING"})


def test_a_lora_run_exports_the_merged_model_and_the_adapter_with_the_learners_logprobs(kafka_cfg, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    train(kafka_cfg, tmp_path, 2, *LORA)
    out = sao_export(kafka_cfg, "--out", str(tmp_path / "from-weights"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path / "from-weights")
    from_ckpt = run(ExportConfig(out=tmp_path / "from-checkpoint", checkpoint=tmp_path / "learner",
                                 weights_dir=tmp_path / "weights"))

    expected = logprobs(learner_policy(tmp_path, ModelConfig(lora_rank=4, lora_alpha=8.0)))
    base = logprobs(tiny_llama(seed=0))
    assert np.abs(expected - base).max() > 1e-3  # two steps moved the policy: the check below can fail
    for folder in (tmp_path / "from-weights", from_ckpt):
        meta = json.loads((folder / "export.json").read_text())
        assert (meta["version"], meta["lora_merged"], meta["dtype"]) == (2, True, "float32"), meta
        merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        assert not any("lora" in k for k in merged.state_dict())  # a plain model: W + scale * B @ A
        np.testing.assert_allclose(logprobs(merged), expected, atol=1e-4)
        adapted = PeftModel.from_pretrained(tiny_llama(seed=0), folder / "adapter")  # the run's base + adapter alone
        np.testing.assert_allclose(logprobs(adapted), expected, atol=1e-4)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # written whole: no temporary left

    v1 = sao_export(kafka_cfg, "--out", str(tmp_path / "v1"), "--version", "1")
    assert v1.returncode == 0 and json.loads((tmp_path / "v1" / "export.json").read_text())["version"] == 1
    assert np.abs(logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "v1")) - expected).max() > 1e-4
    missing = sao_export(kafka_cfg, "--out", str(tmp_path / "v9"), "--version", "9")
    assert missing.returncode == 2 and "--version 9" in missing.stderr and not (tmp_path / "v9").exists()
    with pytest.raises(ConfigError, match="holds version 2"):
        run(ExportConfig(out=tmp_path / "x", checkpoint=tmp_path / "learner", weights_dir=tmp_path / "weights",
                         version=1))


def test_real_vllm_serves_an_exported_folder_with_its_tokenizer_and_the_learners_logprobs(kafka_cfg, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from producers.generate.vllm import VLLMGenerator

    # tiny-llama-bytes 128 wide: a model with a tokenizer, and attention heads of 32 that vLLM's CPU kernels serve
    train(kafka_cfg, tmp_path, 1, "--model.name", "tiny-llama-bytes", "--model.hidden-size", "128")
    folder = run(ExportConfig(out=tmp_path / "export", kafka=kafka_cfg))
    tokenizer, byte = AutoTokenizer.from_pretrained(folder), ByteTokenizer()
    chat = [{"role": "user", "content": "2+3?"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        byte.apply_chat_template(chat, add_generation_prompt=True)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == byte.eos_token_id

    policy = learner_policy(tmp_path, ModelConfig(name="tiny-llama-bytes", hidden_size=128))
    np.testing.assert_allclose(logprobs(AutoModelForCausalLM.from_pretrained(folder)), logprobs(policy), atol=1e-4)
    prompt = byte.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    gen = VLLMGenerator(folder, seed=0)
    try:
        out = asyncio.run(gen.generate(prompt, SamplingParams(max_tokens=12, seed=3)))
    finally:
        gen.close()
    expected = logprobs(policy, [prompt + out.token_ids.tolist()])[len(prompt) - 1:]
    np.testing.assert_allclose(out.logprobs, expected, atol=1e-4)

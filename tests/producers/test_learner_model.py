"""One flag decides the model: the learner takes a hub id from the local Hugging Face cache, and a
producer on `--model learner` builds the learner's published architecture and loads its weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from learner.models import tiny_llama
from schemas.config import ConfigError
from schemas.models import check_model
from tests.learner.service_util import learner_cmd, metrics
from tests.producers.util import producer_process, make_prompts, publish_prompts, read_topic
from schemas import topics as T

REPO = Path(__file__).resolve().parents[2]
REVISION = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(root: Path, repo_id: str) -> Path:
    """A Hugging Face cache holding `repo_id` as a download would leave it: a snapshot folder
    named by its revision and `refs/main` pointing at it. The model is a tiny Llama of another
    width than the producer's built-in `tiny-llama`, so only its published config builds it."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    tiny_llama(hidden_size=48, seed=3).save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return root


def test_a_hub_id_is_accepted_only_when_the_local_cache_holds_it(tmp_path):
    with pytest.raises(ConfigError, match="hub id in the local Hugging Face cache"):
        check_model("nobody-here/absent-model")
    cache = hub_cache(tmp_path / "hub", "sao-test/tiny-48")
    code = ("from schemas.models import check_model; from schemas.tokenizers import load_tokenizer; "
            "from learner.models import ModelConfig, build_policy; from producers.models import load_model; "
            "import torch; n = check_model('sao-test/tiny-48'); a = build_policy(ModelConfig(name=n)); "
            "b = load_model(n); assert load_tokenizer(n) is None; "
            "assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values())); "
            "print(a.config.hidden_size)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env={**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["48"]


def test_a_producer_on_model_learner_plays_with_the_learners_published_model(kafka_cfg, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache(tmp_path / "hub", "sao-test/tiny-48")))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "WARNING"}
    # the producer starts first: it waits for the learner's first announcement
    producer = producer_process(kafka_cfg, "follower", "--model", "learner", "--env", "toy-target", "--max-tokens", "4",
                    "--concurrency", "2", "--max-prompts", "4")
    learner = subprocess.Popen(learner_cmd(kafka_cfg, tmp_path, "--model.name", "sao-test/tiny-48",
                                           "--batch-trajectories", "4", "--max-steps", "1"),
                               cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        publish_prompts(kafka_cfg, make_prompts("toy-target", [{"target": i % 4} for i in range(4)]))
        trajs = read_topic(kafka_cfg, T.TRAJECTORIES, 4, timeout=180)
        assert learner.wait(180) == 0, learner.stderr.read()[-3000:]
        assert producer.p.wait(60) == 0, "".join(producer.lines[-30:])
    finally:
        for p in (learner, producer.p):
            p.kill()
    # every sampled token was sampled by the learner's version 0, not by a random model (-1)
    assert {v for t in trajs for v in t.versions[t.action_mask == 1].tolist()} == {0}
    assert any("sao-test/tiny-48's architecture" in line for line in producer.lines)
    assert metrics(tmp_path)[-1]["batch/trajectories"] == 4

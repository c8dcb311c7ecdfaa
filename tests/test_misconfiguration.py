"""A misconfigured service fails at start, within 30 s, naming the setting to change; never per message."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from sao.cli import COMMANDS
from tests.learner.service_util import ROOT

KAFKA = ("--kafka.bootstrap", "127.0.0.1:1")  # nothing listens: each must fail before it needs Kafka
CHILD_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}

CASES = [
    (["learner", "--batch-trajectories", "0"], "--batch-trajectories"),
    (["learner", "--batch-tokens", "0"], "--batch-tokens"),
    (["learner", "--publish-every", "0"], "--publish-every"),
    (["learner", "--checkpoint-every", "0"], "--checkpoint-every"),
    (["learner", "--max-staleness", "-2"], "--max-staleness"),
    (["learner", "--model.name", "no-such-model"], "--model.name"),
    (["learner", "--max-seq-len", "100000"], "--max-seq-len"),  # beyond tiny-llama's 256 positions
    (["learner", "--update.lr-policy", "0"], "--update.lr-policy"),
    (["learner", "--update.algorithm", "grpo", "--update.critic-updates", "3"], "--update.critic-updates"),
    (["learner", "--update.algorithm", "sao_k1", "--update.critic-updates", "2"], "--update.critic-updates"),
    (["learner", "--weights.transport", "collective", "--weights.collective-backend", "nccl"],
     "--weights.collective-backend"),  # NCCL needs the learner on CUDA
    (["producer", "--model", "no-such-model"], "--model"),
    (["producer", "--env", "math", "--model", "tiny-llama"], "tokenizer"),
    (["producer", "--env", "no-such-env"], "--env"),
    (["serve", "--model", "no-such-model"], "--model"),
    (["feed", "--group-size", "0"], "--group-size"),
    (["feed", "--env", "no-such-env"], "--env"),
    (["feed", "--env", "math", "--heldout-frac", "1"], "--heldout-frac"),
    (["eval", "--every", "0"], "--every"),
    (["eval", "--env", "no-such-env"], "--env"),
    (["eval", "--temperature", "0"], "--temperature"),
]


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    """The 30 s are the service's to find the mistake, not the disk's. In CI, on a fresh machine
    right after the compose test (image layers through the page cache, the engine stopping), the
    first of these runs passed 30 s while the thirteen after it, importing the same torch and
    transformers, each finished inside it. One untimed import of every module they start first."""
    modules = sorted({COMMANDS[argv[0]][0] for argv, _ in CASES})
    subprocess.run([sys.executable, "-c", f"import {', '.join(modules)}"], check=True, timeout=600,
                   cwd=ROOT, env=CHILD_ENV)


@pytest.mark.parametrize("argv,named", CASES)
def test_a_misconfiguration_exits_non_zero_naming_the_setting(argv, named, tmp_path):
    out = subprocess.run([sys.executable, "-m", "sao", *argv, *KAFKA], capture_output=True, text=True,
                         timeout=30, cwd=tmp_path, env=CHILD_ENV)
    assert out.returncode != 0
    assert named in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]


def test_a_producer_whose_model_is_not_the_learners_architecture_stops_at_start(kafka_cfg, tmp_path):
    """The learner announced a 128-token-vocabulary model; this producer runs tiny-llama (64)."""
    from schemas.catalogue import tiny_llama
    from schemas import topics as T
    from schemas.kafka import make_producer, produce
    from tests.producers.util import announcement, write_weights
    w = announcement(write_weights(tiny_llama(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4,
                                              num_kv_heads=2, max_positions=256), tmp_path / "v0.safetensors"), 0)
    producer = make_producer(kafka_cfg)
    produce(producer, kafka_cfg.topic(T.WEIGHTS), w.encode(), key=w.key)
    assert producer.flush(30) == 0
    out = subprocess.run([sys.executable, "-m", "sao", "producer", "--model", "tiny-llama",
                          "--kafka.bootstrap", kafka_cfg.bootstrap, "--kafka.topic-prefix", kafka_cfg.topic_prefix],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2 and "--model" in out.stderr and "architecture" in out.stderr, out.stderr[-2000:]


def test_the_learner_under_torchrun_reports_a_misconfiguration_in_one_line_too(tmp_path):
    """`torchrun -m learner.service` runs the module itself, not `sao learner`: the same one line
    naming the flag, exit status 2, no traceback (on every rank, each parsing its own flags)."""
    out = subprocess.run([sys.executable, "-m", "learner.service", "--update.algorithm", "grpo",
                          "--update.warmup-steps", "5", *KAFKA], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path, env=CHILD_ENV)
    assert out.returncode == 2, out.stderr[-2000:]
    said = " ".join(re.sub(r"[│╭╮╰╯─]", " ", out.stderr).split())  # tyro boxes and wraps the message
    assert "--update.warmup-steps 5: --update.algorithm grpo has no critic" in said, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]

"""Helpers for the learner-service tests: real rollouts of the tiny model, and `sao learner` runs."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import torch

from learner.models import tiny_llama
from producers.envs import make_env
from producers.episode import play_tasks
from producers.generate.base import SamplingParams
from producers.generate.hf import HFGenerator
from sao.broker import free_port
from schemas import topics as T
from schemas.kafka import KafkaConfig, make_consumer
from schemas.messages import Weights
from schemas.weights import payload as W
from schemas.weights.chain import plan, rebuild
from tests.kafka_util import publish  # noqa: F401 (the learner tests publish through it)

ROOT = Path(__file__).resolve().parents[2]
ONE_PARTITION = b"one-partition"
"""The key that keeps a test's trajectories on one partition, so their consumption order is fixed."""
PARAMS = SamplingParams(max_tokens=6, temperature=1.0)


def rollouts(n: int, *, seed: int = 0, id_prefix: str = "r", model=None, version: int = 0) -> list:
    """`n` toy-target trajectories sampled by the tiny Llama (the learner's initial weights)."""
    gen = HFGenerator(model or tiny_llama(seed=0), version=version, seed=seed)
    env = make_env("toy-target", vocab_size=64)
    return play_tasks(env, gen, PARAMS, random.Random(seed), num_prompts=n, id_prefix=id_prefix)


def learner_cmd(cfg: KafkaConfig, run_dir: Path, *flags: str, nproc: int = 1) -> list[str]:
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                 "--master-port", str(free_port()), "-m", "learner.service"] if nproc > 1
                else [sys.executable, "-m", "sao", "learner"])
    return [*launcher, "--run-dir", str(run_dir / "learner"), "--weights-dir", str(run_dir / "weights"),
            "--kafka.bootstrap", cfg.bootstrap, "--kafka.topic-prefix", cfg.topic_prefix,
            "--update.warmup-steps", "0", *flags]


def run_learner(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "WARNING"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


def metrics(run_dir: Path) -> list[dict]:
    """The JSONL step records; a last line cut short by SIGKILL (no newline yet) is not a record."""
    path = run_dir / "learner" / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def announcements(cfg: KafkaConfig, timeout: float = 30, until: int | None = None) -> list[Weights]:
    """Every weights announcement on the topic, in order; with `until`, the first `until` of them
    as soon as they are there (from a learner still running), else what came within `timeout`."""
    consumer = make_consumer(cfg, f"reader-{time.time_ns()}")
    consumer.subscribe([cfg.topic(T.WEIGHTS)])
    got, idle_until = [], time.monotonic() + timeout
    try:
        while time.monotonic() < idle_until and (until is None or len(got) < until):
            msg = consumer.poll(0.1 if until else 0.5)
            if msg is None or msg.error():
                continue
            got.append(Weights.decode(msg.value()))
            if until is None:
                idle_until = time.monotonic() + 3  # settle: nothing more for 3 s
    finally:
        consumer.close()
    return got


def assert_one_policy_per_version(ws: list[Weights]) -> None:
    """Announced versions never go backwards, and a number repeated names the same weights."""
    assert [w.version for w in ws] == sorted(w.version for w in ws)
    by_version = {}
    for w in ws:
        by_version.setdefault(w.version, set()).add(w.digest)
    assert all(len(s) == 1 for s in by_version.values()), by_version


def published(ws: list[Weights], version: int | None = None) -> dict[str, torch.Tensor]:
    """The weights announced as `version` (default: the last one), rebuilt as a producer rebuilds
    them (an anchor and the deltas after it), every tensor and the digest verified."""
    target = ws[-1].version if version is None else version
    state, failed, error = rebuild(plan([w for w in ws if w.version <= target], -1), None)
    assert failed is None and state is not None and state.version == target, error
    return {k: W.to_torch(t) for k, t in state.state.items()}


def as_published(state: dict[str, torch.Tensor], dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """`state` as the learner publishes it by default."""
    return {k: v.to(dtype) for k, v in state.items()}


def assert_close_state(a: dict, b: dict, rtol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=rtol, msg=k)


def latest_checkpoint(run_dir: Path) -> Path:
    return sorted((run_dir / "learner" / "checkpoints").glob("step*"))[-1]


def final_policy(run_dir: Path) -> dict[str, torch.Tensor]:
    """The policy in the newest checkpoint, its shards joined (DCP's offline converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = run_dir / "final_policy.pt"
    dcp_to_torch_save(latest_checkpoint(run_dir), out)
    return torch.load(out, weights_only=False)["policy"]


def trained_ledger(run_dir: Path) -> dict[str, int]:
    """trajectory id -> step index, from the newest checkpoint's ledger."""
    data = (latest_checkpoint(run_dir) / "learner.msgpack").read_bytes()
    return dict(msgpack.unpackb(data, raw=False, strict_map_key=False)["source"]["trained"])


def sigkill_mid_run(cmd: list[str], run_dir: Path, rnd: random.Random, times: int = 3) -> None:
    """Start the learner `times` times, each time SIGKILLing it a few steps in, anywhere in a step:
    mid-train, mid-checkpoint, mid-publish."""
    for _ in range(times):
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        target = len(metrics(run_dir)) + rnd.randint(2, 8)
        deadline = time.monotonic() + 120
        while len(metrics(run_dir)) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rnd.uniform(0, 0.3))
        proc.send_signal(signal.SIGKILL)
        proc.wait()

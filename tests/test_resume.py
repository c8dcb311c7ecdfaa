"""`sao up --resume RUN_DIR` on its own broker: a run stopped by SIGTERM, then by a SIGKILL of its
whole process tree (the broker's JVM included), continues on the same Kafka data to its last step;
`sao audit` over that data finds nothing lost and nothing trained twice, every version is scored
once, and the report covers the whole run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sao.audit import lineage, metrics_lines
from sao.broker import free_port
from schemas.kafka import wait_for_broker

ROOT = Path(__file__).resolve().parents[1]
STEPS = 9


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "WARNING"}
    for name in ("SAO_KAFKA_BOOTSTRAP", "SAO_KAFKA_TOPIC_PREFIX"):  # its own broker, in the run dir
        env.pop(name, None)
    return env


def _up(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sao", "up", *args], cwd=ROOT, env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _steps(run_dir: Path) -> list[int]:
    return [m["step/index"] for m in lineage(metrics_lines(run_dir / "learner"))]


def _until_step(up: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while max(_steps(run_dir), default=0) < step:
        assert up.poll() is None, up.stdout.read()[-3000:]
        assert time.monotonic() < deadline, f"no step {step} in {timeout:.0f} s"
        time.sleep(1)


def _gone(pgid: int, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    return False


def test_a_run_stopped_by_sigterm_and_by_sigkill_of_its_tree_resumes_and_loses_nothing(tmp_path):
    run_dir = tmp_path / "run"
    up = _up("--steps", str(STEPS), "--producers", "1", "--env", "toy-target", "--model", "tiny-llama",
             "--batch-trajectories", "4", "--max-tokens", "8", "--run-dir", str(run_dir), "--eval-every", "4",
             "--eval-tasks", "2", "--eval-samples", "1", "--final-eval-s", "120",
             "--learner-flags=--update.warmup-steps 1 --update.lr-policy 3e-3 --update.lr-critic 3e-3 "
             "--checkpoint-every 2")
    try:
        _until_step(up, run_dir, 2)
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=180)
        assert up.returncode == 0, out[-3000:]
        first = max(_steps(run_dir))
        assert first < STEPS, "the run was to be stopped mid-way"

        up = _up("--resume", str(run_dir))  # SIGKILLed with its whole tree: no clean stop of anything
        _until_step(up, run_dir, first + 2)
        os.killpg(up.pid, signal.SIGKILL)
        up.wait(30)
        assert _gone(up.pid), "a process of the killed run lived on"
        killed_at = max(_steps(run_dir))
        assert killed_at < STEPS

        up = _up("--resume", str(run_dir))
        out, _ = up.communicate(timeout=900)
        assert up.returncode == 0, out[-3000:]
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
    assert f"resuming the run in {run_dir}" in out
    assert _steps(run_dir) == list(range(STEPS)), _steps(run_dir)  # every step once, in one lineage
    versions = [e["version"] for e in map(json.loads, (run_dir / "eval.jsonl").read_text().splitlines())]
    assert versions[0] == 0 and len(versions) == len(set(versions)) and max(versions) >= STEPS - 1, versions
    summary = (run_dir / "summary.txt").read_text()
    assert f"learner steps: {STEPS}" in summary
    lost = (run_dir / "learner" / "metrics.jsonl").read_text().count("\n") - STEPS  # records past the lineage
    assert (f"steps lost to learner restarts: {lost} " in summary) == (lost > 0), summary
    assert json.loads((run_dir / "model" / "export.json").read_text())["version"] >= STEPS - 1

    port = free_port()  # the run's own Kafka data, served again for the audit
    broker = subprocess.Popen([sys.executable, "-m", "sao", "broker", "--data-dir", str(run_dir / "kafka"),
                               "--port", str(port)], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        wait_for_broker(f"127.0.0.1:{port}", timeout=120)
        audit = subprocess.run([sys.executable, "-m", "sao", "audit", "--run-dir", str(run_dir / "learner"),
                                "--kafka.bootstrap", f"127.0.0.1:{port}"], cwd=ROOT, env=_env(),
                               capture_output=True, text=True, timeout=300)
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(60)
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-2000:]
    assert re.search(r"trained in more than one step\s+0\n", audit.stdout), audit.stdout


def test_resume_refuses_a_folder_that_is_not_a_run():
    from sao.up import UpConfig, run
    from schemas.config import ConfigError

    with pytest.raises(ConfigError, match="no up.json"):
        run(UpConfig(resume=ROOT / "docs"))

"""bench/pipeline_stability.py: the collapse criterion at its short windows, a resumed step counted
once, and a `--quick` sweep through real `sao up` runs (Kafka, producers, learner) that writes its
table, its PNG and every run's records."""

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.async_stability import collapse_step
from bench.pipeline_stability import curves

ROOT = Path(__file__).resolve().parents[2]


def test_the_short_collapse_window_sees_a_fall_a_twenty_step_mean_would_hide():
    reward = [0.4, 0.6, 0.8, 0.8, 0.8, 0.8, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]
    zeros = [0.0] * len(reward)
    at = collapse_step(reward, zeros, zeros, patience=5, smooth_steps=5)
    assert at is not None and 6 <= at <= 10  # the 5-step mean drops below 0.4 a few steps into the fall
    assert collapse_step(reward, zeros, zeros, patience=5) is None  # the 20-step mean never halves


def test_a_step_written_again_by_a_resumed_learner_counts_once():
    steps = [{"step/index": i, "reward/mean": r} for i, r in [(0, 0.1), (1, 0.2), (1, 0.3), (2, 0.4)]]
    assert curves(steps)["reward"] == [0.1, 0.3, 0.4]


def test_quick_sweep_runs_each_method_through_sao_up_and_writes_the_table(tmp_path):
    out, raw = tmp_path / "stability", tmp_path / "raw.json"
    result = subprocess.run(
        [sys.executable, "bench/pipeline_stability.py", "--quick", "--steps", "3",
         "--methods", "sao", "grpo_dis", "running_mean", "--run-root", str(tmp_path / "runs"), "--out", str(out), "--raw", str(raw), "--timeout", "600"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    rows = [line.split(" | ")[:2] for line in out.with_suffix(".md").read_text().splitlines()
            if line.startswith(("| sao", "| grpo_dis", "| running_mean"))]
    assert rows == [["| sao", "3"], ["| grpo_dis", "3"], ["| running_mean", "3"]]
    runs = json.loads(raw.read_text())["runs"]
    assert [len(runs[m]["curves"]["reward"]) for m in ("sao", "grpo_dis", "running_mean")] == [3, 3, 3]
    assert all(0.0 <= k <= 1.0 for m in runs for k in runs[m]["curves"]["kept"])
    assert out.with_suffix(".png").stat().st_size > 10_000
    # grpo_dis trains on groups of 4 rollouts of a prompt: its advantages are group-normalised
    learner_lines = (tmp_path / "runs" / "grpo_dis" / "learner" / "metrics.jsonl").read_text().splitlines()
    assert all(abs(json.loads(line)["adv/mean"]) < 1e-4 for line in learner_lines)  # group-normalised
    # running_mean's baseline is global: the feeder's prompt ids never repeat, yet it trains
    running = [json.loads(line) for line in
               (tmp_path / "runs" / "running_mean" / "learner" / "metrics.jsonl").read_text().splitlines()]
    assert running[-1]["baseline/unseen"] == 0.0 and max(r["adv/abs_mean"] for r in running) > 0

"""bench/async_stability.py: collapse detection on made-up curves, and a tiny `--quick` run that
writes its table and PNG."""

import math
import os
import subprocess
import sys
from pathlib import Path

from bench.async_stability import collapse_step

ROOT = Path(__file__).resolve().parents[2]


def test_collapse_is_the_first_of_patience_steps_below_half_the_running_max():
    rise, fall = [0.2 + 0.6 * i / 99 for i in range(100)], [0.3] * 80
    reward = rise + fall + [0.8] * 40
    finite = [0.0] * len(reward)
    at = collapse_step(reward, finite, finite, patience=50)
    # the 20-step mean falls below 0.4 a few steps into the fall, and stays there about 65 steps
    assert 100 < at < 100 + 20
    assert collapse_step(reward, finite, finite, patience=80) is None  # not low for 80 in a row
    assert collapse_step(rise + [0.5] * 100, finite, finite) is None  # 0.5 ≥ 0.8 / 2: no collapse


def test_a_non_finite_loss_or_a_skipped_step_is_a_collapse_at_that_step():
    reward, zeros = [0.5] * 200, [0.0] * 200
    assert collapse_step(reward, zeros[:70] + [math.nan] + zeros[71:], zeros) == 70
    assert collapse_step(reward, zeros, zeros[:30] + [1.0] + zeros[31:]) == 30
    assert collapse_step(reward, zeros, zeros) is None


def test_quick_run_writes_the_table_and_the_png(tmp_path):
    out = tmp_path / "stability"
    result = subprocess.run(
        [sys.executable, "bench/async_stability.py", "--quick", "--steps", "6", "--staleness", "0", "2",
         "--algorithms", "sao", "grpo", "--batch", "8", "--jobs", "1", "--out", str(out),
         "--raw", str(tmp_path / "raw.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ | {"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    table = out.with_suffix(".md").read_text()
    rows = [line for line in table.splitlines() if line.startswith(("| 0 |", "| 2 |"))]
    assert [r.split(" | ")[:2] for r in rows] == [["| 0", "sao"], ["| 0", "grpo"], ["| 2", "sao"],
                                                  ["| 2", "grpo"]]
    assert "| 2 | sao | " in result.stdout and out.with_suffix(".png").stat().st_size > 10_000

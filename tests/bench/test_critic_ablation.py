"""bench/critic_ablation.py end to end in its quick mode: quick starts trained for both models, a
few steps of sao, sao_k1 and sao_full_critic on each, a table with every row's critic diagnostics
defined, the PNG and every run's per-step metrics written, and `--replot` redoing the same table from
them (a smoke run; its numbers mean nothing)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_ablation_writes_a_full_table_a_png_and_the_runs(tmp_path):
    out, raw = tmp_path / "ablation", tmp_path / "raw.json"
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "bench/critic_ablation.py", "--quick", "--jobs", "2",
                           "--out", str(out), "--cache", str(tmp_path / "starts"), "--raw", str(raw)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    main, over_time = out.with_suffix(".md").read_text().split("Over time:")
    rows = [line.split(" | ") for line in main.splitlines() if line.startswith(("| dense", "| MoE"))]
    assert sum(line.startswith(("| dense", "| MoE")) for line in over_time.splitlines()) == 6
    assert sorted((r[0], r[1]) for r in rows) == sorted(
        (f"| {m}", a) for m in ("dense", "MoE") for a in ("sao", "sao_k1", "sao_full_critic"))
    for r in rows:  # rewards, EV overall and by third, correlation and gradient norms all measured
        assert all(math.isfinite(float(c.strip(" |").split(" ± ")[0])) for c in r[2:]), r
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = json.loads(raw.read_text())["runs"]
    assert len(runs) == 6 and all(len(h) == 12 for hs in runs.values() for h in hs)
    assert all("value/explained_var_last" in h[-1] and "grad_norm/critic" in h[-1]
               for hs in runs.values() for h in hs)
    table = out.with_suffix(".md").read_text()
    out.with_suffix(".md").unlink()
    again = subprocess.run([sys.executable, "bench/critic_ablation.py", "--quick", "--replot", "--out", str(out),
                            "--raw", str(raw)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert out.with_suffix(".md").read_text() == table  # the same table from the saved runs

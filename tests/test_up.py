"""`sao up` on the tiny model: every process starts, a producer SIGKILLed mid-run is reported and
restarted, weights reach version 5, the report is a real PNG, and SIGTERM leaves no child behind;
a run of two environments has its first and last versions scored on each and its last exported."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from producers.evaluate.scores import paired_change

ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie has exited; only its parent's wait is missing
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


def test_up_restarts_a_killed_producer_reports_and_stops_every_child(kafka_cfg, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "WARNING",
           "SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix}
    cmd = [sys.executable, "-m", "sao", "up", "--steps", "1000", "--producers", "2", "--env", "toy-target",
           "--model", "tiny-llama", "--batch-trajectories", "4", "--max-tokens", "8", "--run-dir", str(tmp_path),
           "--learner-flags=--update.warmup-steps 1 --update.lr-policy 3e-3 --update.lr-critic 3e-3"]
    up = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = up.stdout.readline()  # "learner=PID producer-0=PID producer-1=PID eval=PID feeder=PID"
        pids = dict(x.split("=") for x in first.split())
        assert set(pids) == {"learner", "producer-0", "producer-1", "eval", "feeder"}, first
        pids = {k: int(v) for k, v in pids.items()}
        assert all(_alive(p) for p in pids.values())
        metrics = tmp_path / "learner" / "metrics.jsonl"

        def version() -> int:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            return json.loads(lines[-2])["weights/version"] if len(lines) >= 2 else -1

        deadline = time.monotonic() + 240
        while version() < 2 and time.monotonic() < deadline:
            time.sleep(1)
        assert version() >= 2, "the learner published no weights in 4 minutes"
        os.kill(pids["producer-0"], signal.SIGKILL)
        while version() < 5 and time.monotonic() < deadline + 120:
            time.sleep(1)
        assert version() >= 5
        restarted = time.monotonic() + 60  # the supervisor notices on its next look, not at once
        # reaping the old child and forking the new one are two moments: a look between them sees 3
        while (pids["producer-0"] in (children := _children(up.pid)) or len(children) < 5) \
                and time.monotonic() < restarted:
            time.sleep(0.5)
        assert pids["producer-0"] not in children and len(children) == 5, children  # restarted: a new pid
    finally:
        up.send_signal(signal.SIGTERM)
        out, _ = up.communicate(timeout=120)
    assert up.returncode == 0, out[-3000:]
    assert "producer-0 crashed (signal SIGKILL); restart 1/3" in out, out[-3000:]
    assert not [p for p in children | set(pids.values()) if _alive(p)], "a child outlived `sao up`"
    summary = (tmp_path / "summary.txt").read_text()
    assert "process producer-0: stopped, 1 restart(s)" in summary, summary
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = subprocess.run([sys.executable, "-m", "sao", "report", str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 0 and "learner steps:" in report.stdout, report.stderr


def test_a_run_of_two_environments_scores_first_and_last_versions_on_each_and_reports_each(kafka_cfg, tmp_path):
    """A single-turn and a multi-turn environment trained together: the feeder mixes them, the one
    producer plays both, the learner reports each one's reward, lengths and DIS kept fraction, the
    evaluator scores each."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "WARNING",
           "SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix}
    cmd = [sys.executable, "-m", "sao", "up", "--steps", "8", "--producers", "1", "--env", "toy-target=1,toy-multiturn=1",
           "--model", "tiny-llama", "--batch-trajectories", "4", "--max-tokens", "4", "--run-dir", str(tmp_path),
           "--eval-every", "4", "--eval-tasks", "3", "--eval-samples", "2", "--heldout-frac", "0.2",
           "--learner-flags=--update.warmup-steps 1 --update.lr-policy 3e-3 --update.lr-critic 3e-3"]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    steps = [json.loads(x) for x in (tmp_path / "learner" / "metrics.jsonl").read_text().splitlines()]
    scored = [json.loads(x) for x in (tmp_path / "eval.jsonl").read_text().splitlines()]
    envs = ("toy-target", "toy-multiturn")
    for name in envs:  # toy-target holds nothing out (too few tasks): its split is all of it
        mine = [s for s in scored if s["env"] == name]
        assert mine[0]["version"] == 0 and mine[-1]["version"] == steps[-1]["weights/version"] == 7, scored
        assert {"greedy/mean", "sampled/pass@2"} <= set(mine[0])
        assert len({s["version"] for s in mine}) == len(mine)  # each version once per env
    assert {s["split"] for s in scored if s["env"] == "toy-multiturn"} == {"heldout"}
    trained = [i for s in steps for i in s["trajectory_ids"]]
    assert all(any(i.startswith(f"{name}-") for i in trained) for name in envs), trained
    per_env = {k for s in steps for k in s if k.startswith("env/")}
    assert {f"env/{n}/{m}" for n in envs for m in ("reward", "episodes", "response_tokens", "dis_kept_frac")} <= per_env
    assert all(0 <= s[f"env/{n}/dis_kept_frac"] <= 1 for s in steps for n in envs if f"env/{n}/reward" in s)
    summary = (tmp_path / "summary.txt").read_text()
    assert all(f"held-out greedy/mean on {n} (sao eval" in summary and f"env {n}: " in summary for n in envs), summary
    assert ("reward rise (mean of the last 5 steps - mean of the first 5): - (needs 10 steps)" in summary) == \
        (len(steps) < 10), summary
    for name in envs:  # first against last version, task by task, from eval.jsonl's per-task scores
        mine = [s for s in scored if s["env"] == name]
        c = paired_change(mine[0]["tasks"], mine[-1]["tasks"])
        assert f"of {len(mine[0]['tasks'])} tasks {c['gained']} gained, {c['lost']} lost, sign test p={c['p']:.2f})" \
            in summary, summary
    assert "process eval: stopped, 0 restart(s)" in summary, summary
    assert f"model: version 7 exported to {tmp_path / 'model'}" in out.stdout, out.stdout[-2000:]
    assert json.loads((tmp_path / "model" / "export.json").read_text())["version"] == 7
    from schemas.signing import load_trusted, refusal
    from tests.learner.service_util import announcements
    trusted = load_trusted(str(tmp_path / "keys" / "learner.pub"))  # the run's own key: every version signed
    assert {refusal(w, trusted) for w in announcements(kafka_cfg, timeout=5)} == {""}
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_a_new_run_on_its_own_broker_removes_the_earlier_runs_state_and_nothing_else(tmp_path):
    """A second `make run` must not resume the first: its checkpoints name offsets of a broker
    that is gone, and its metrics would be read as the new run's."""
    from sao.up import RUN_STATE, start_afresh

    (tmp_path / "learner" / "checkpoints").mkdir(parents=True)
    (tmp_path / "learner" / "metrics.jsonl").write_text('{"step/index": 15}\n')
    (tmp_path / "summary.txt").write_text("old")
    (tmp_path / "notes.md").write_text("mine")  # not a run's: kept
    start_afresh(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]
    assert {"learner", "weights", "joiner", "logs", "summary.txt", "report.png", "eval.jsonl"} <= set(RUN_STATE)
    start_afresh(tmp_path / "absent")  # a first run: nothing to remove

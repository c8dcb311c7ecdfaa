"""Live rewards end to end, every stage its own `sao` process on the real broker: the `writing`
producer publishes unrewarded trajectories to the pending topic, the judge scores them, the joiner
joins them, and the learner trains a step on them."""

from __future__ import annotations

import json

from schemas import topics as T
from tests.consumers.util import Service, read_topic, wait_until

STEP = 4  # trajectories in the learner's one step


def test_writing_producer_to_judge_to_joiner_to_a_learner_step(kafka_cfg, tmp_path):
    tiny = ("--model", "tiny-llama-bytes")
    procs = {
        "joiner": Service(kafka_cfg, "reward-join"),
        "judge": Service(kafka_cfg, "judge", *tiny, "--criteria", "lowercase"),
        "producer": Service(kafka_cfg, "producer", "--env", "writing", *tiny, "--max-tokens", "8",
                            "--no-follow-weights"),
        "learner": Service(kafka_cfg, "learner", "--model.name", "tiny-llama", "--model.vocab-size", "260",
                           "--batch-trajectories", str(STEP), "--max-steps", "1", "--run-dir", str(tmp_path / "run"),
                           "--weights-dir", str(tmp_path / "weights")),
        "feed": Service(kafka_cfg, "feed", "--env", "writing", "--count", str(STEP)),
    }
    try:
        wait_until(lambda: procs["learner"].p.poll() is not None or any(
            p.p.poll() not in (None, 0) for p in procs.values()), timeout=400, every=1)
        assert procs["learner"].p.returncode == 0, {n: p.log(15) for n, p in procs.items()}
        [step] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        pending = {t.id for t in read_topic(kafka_cfg, T.PENDING, STEP)}
        assert sorted(step["trajectory_ids"]) == sorted(pending)
        joined = read_topic(kafka_cfg, T.TRAJECTORIES, STEP)
        assert all(t.meta["reward_source"] == "judge:style" and t.meta["reward_criterion"] == "lowercase"
                   for t in joined)
        assert step["batch/trajectories"] == STEP
    finally:
        for p in procs.values():
            if p.p.poll() is None:
                p.stop()

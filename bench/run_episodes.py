"""What a finished calc-agent run trained on, by problem size and by version: every trajectory of
the run, read back from its own broker's log (`RUN_DIR/kafka`, started again on that log, read,
stopped) and joined with its prompt's task. Per window of learner versions (the oldest version among
an episode's action tokens) and per number of operations: the episodes, the share solved, the mean
tool calls, and the shares that answered before the last operation (fewer calls than operations;
the warm start makes one per operation) and that called more than needed.

    python bench/run_episodes.py runs/up-agent [RUN_DIR ...] [--window 6]

The evaluator's 32 greedy episodes per version show what a version does; this shows what the
learner was trained on, which is where a drift in behaviour starts (bench/results/agent_run.md,
"Why the runs dip").
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import tyro  # noqa: E402

from sao.audit import decoded, read_topic  # noqa: E402
from sao.broker import BrokerConfig, EmbeddedBroker  # noqa: E402
from schemas import topics as T  # noqa: E402
from schemas.kafka import KafkaConfig  # noqa: E402
from schemas.messages import Prompt, Trajectory  # noqa: E402


@dataclass
class Args:
    runs: tyro.conf.Positional[tuple[Path, ...]]
    """`sao up` run folders (`--run-dir`), each read in turn."""
    window: int = 6
    """Learner versions per row (`sao up --eval-every` lines the rows up with the evaluations)."""


def read_run(run_dir: Path) -> tuple[list[Trajectory], dict[str, dict]]:
    """The run's trajectories (each id once, in log order) and each prompt id's task."""
    if not (run_dir / "kafka").is_dir():
        raise SystemExit(f"{run_dir}: no kafka/ folder (a run of `sao up` with its own broker)")
    with EmbeddedBroker(BrokerConfig(data_dir=run_dir / "kafka", port=0)) as broker:
        kafka = KafkaConfig(bootstrap=broker.bootstrap)
        trajectories = decoded(read_topic(kafka, kafka.topic(T.TRAJECTORIES), timeout=60), Trajectory)
        prompts = decoded(read_topic(kafka, kafka.topic(T.PROMPTS), timeout=60), Prompt)
    seen, episodes = set(), []
    for t in trajectories.values():
        if t is not None and t.id not in seen:
            seen.add(t.id)
            episodes.append(t)
    return episodes, {p.id: p.task for p in prompts.values() if p is not None}


def table(episodes: list[Trajectory], tasks: dict[str, dict], window: int) -> list[str]:
    rows: dict[tuple[int, int], list[Trajectory]] = defaultdict(list)
    for t in episodes:
        task = tasks.get(t.prompt_id)
        if task is None or "steps" not in task or t.min_version < 0:
            continue  # not a calc-agent episode, its prompt is gone, or it has no action token
        rows[t.min_version // window, len(task["steps"])].append(t)
    lines = ["| versions | operations | episodes | solved | tool calls | answered early | called more |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (w, ops), ts in sorted(rows.items()):
        calls = np.array([t.tool_calls for t in ts])
        lines.append(f"| {w * window}-{w * window + window - 1} | {ops} | {len(ts)} | "
                     f"{np.mean([t.reward >= 1 for t in ts]):.2f} | {calls.mean():.2f} | {np.mean(calls < ops):.2f} | "
                     f"{np.mean(calls > ops):.2f} |")
    return lines


def main(args: Args) -> None:
    if not args.runs:
        raise SystemExit("give one or more `sao up` run folders")
    for run in args.runs:
        episodes, tasks = read_run(run)
        print(f"\n{run}: {len(episodes)} trajectories\n", flush=True)
        print("\n".join(table(episodes, tasks, args.window)), flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))

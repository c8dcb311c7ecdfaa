"""Datasets for `sao feed --dataset`: their rows and the order of each epoch.

A dataset is a JSONL file (one row per line) or a Parquet file (one row per row). A row is
`{"task": {...}, "id": "...", "env": "..."}` with `id` and `env` optional, or a bare task map (the
row minus `id` and `env`); in Parquet, `task` may be a struct or a JSON string. The task map is the
environment's own (`Env.sample_task`'s shape). A row keeps one prompt id across epochs (its `id`,
else `<file name>:<line or row number>`), so per-prompt baselines see its history. A bad row is
reported and skipped; a file with no good row is refused at start.

Epoch e visits the rows in file order, or with `shuffle` in a permutation seeded by (seed, e), so
every epoch has its own order and a restart recomputes the same one, which is how a restarted
feed resumes at its row (producers/feeder/service.py keeps the position in Kafka).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path

from schemas.config import ConfigError
from schemas.messages import Prompt, SchemaError

log = logging.getLogger(__name__)


def _row_prompt(row: object, default_id: str, env: str) -> Prompt:
    if not isinstance(row, dict):
        raise ValueError("expected an object (a task, or {\"task\": {...}})")
    task = row.get("task", {k: v for k, v in row.items() if k not in ("id", "env")})
    if isinstance(task, str):
        task = json.loads(task)
    if not isinstance(task, dict) or not all(isinstance(k, str) for k in task):
        raise ValueError("task: expected an object with string keys")
    return Prompt(id=str(row.get("id") or default_id), env=str(row.get("env") or env), task=task)


def load_rows(path: Path, env: str, errors: list[str]) -> list[Prompt]:
    """The dataset's rows as prompts (attempt 0, one sample); bad rows go to `errors`."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # only a Parquet feed pays for importing it
        numbered = enumerate(pq.read_table(path).to_pylist(), 1)
    else:
        numbered = ((n, line) for n, line in enumerate(path.open(), 1) if line.strip())
    rows = []
    for n, raw in numbered:
        try:
            row = json.loads(raw) if isinstance(raw, str) else raw
            rows.append(_row_prompt(row, f"{path.name}:{n}", env))
        except (ValueError, SchemaError) as e:
            errors.append(f"{path}:{n}: {e}")
            log.error("skipping %s:%d: %s", path, n, e)
    if not rows:
        raise ConfigError(f"--dataset {path}: no usable row ({len(errors)} bad)")
    return rows


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """Row indices in the order epoch `epoch` publishes them."""
    order = list(range(n))
    if shuffle:
        random.Random(f"{seed}/{epoch}").shuffle(order)
    return order


def dataset_prompts(rows: list[Prompt], epochs: int, seed: int, shuffle: bool) -> Iterator[Prompt]:
    """Every row's prompt, epoch after epoch, each epoch a new attempt."""
    for epoch in range(epochs):
        for i in epoch_order(len(rows), seed, epoch, shuffle):
            yield dataclasses.replace(rows[i], attempt=epoch)

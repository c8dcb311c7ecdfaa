"""What the learner shows: a JSONL line and a terminal progress line per step, Prometheus gauges."""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np


def staleness_metrics(staleness: list[int]) -> dict:
    """`stale/p50|p99|max` and the step's histogram {staleness: count}."""
    if not staleness:
        return {}
    s = np.asarray(staleness)
    return {"stale/p50": float(np.percentile(s, 50)), "stale/p99": float(np.percentile(s, 99)),
            "stale/max": int(s.max()), "stale/hist": {str(k): v for k, v in sorted(Counter(s.tolist()).items())}}


def env_metrics(trajs: list, totals: np.ndarray) -> dict:
    """Per environment of the step (several train in one run): `env/<name>/reward` (mean total
    reward), `/episodes`, `/response_tokens` (mean)."""
    out = {}
    for env in sorted({t.env for t in trajs}):
        rows = [i for i, t in enumerate(trajs) if t.env == env]
        out |= {f"env/{env}/reward": float(np.mean(totals[rows])), f"env/{env}/episodes": len(rows),
                f"env/{env}/response_tokens": float(np.mean([trajs[i].num_tokens - trajs[i].prompt_len
                                                             for i in rows]))}
    return out


def kept_by_env(kept, row_envs: list[str], envs: list[str]) -> dict:
    """Counts to sum over micro-batches and ranks, per environment (`envs`, every rank the same
    keys in the same order): its action tokens the DIS mask kept (`kept`, (b, T) bool, rows of
    environments `row_envs`), and its action tokens; `kept_fracs` divides them once summed."""
    out = {}
    for env in envs:
        rows = [i for i, e in enumerate(row_envs) if e == env]
        out[f"env/{env}/dis_kept_tokens"] = kept[rows].sum()
    return out


def kept_fracs(summed: dict, acted: dict[str, int]) -> dict:
    """`env/<name>/dis_kept_frac` from the summed counts of `kept_by_env` and each environment's
    action tokens in the step; the counts themselves dropped."""
    out = {k: v for k, v in summed.items() if not k.endswith("/dis_kept_tokens")}
    return out | {f"env/{env}/dis_kept_frac": summed[f"env/{env}/dis_kept_tokens"] / max(n, 1) for env, n in acted.items()}


def episode_metrics(trajs: list, masks: list[np.ndarray]) -> dict:
    """What the step's episodes looked like: `episode/turns`, `/tool_calls`, `/tool_errors`,
    `/observation_tokens` (context only, never trained), `/response_tokens` mean and p50/p90/max,
    `end/<finish reason>` shares, and `policy/trained_token_frac`: the share of action tokens whose
    gradient counted (the rest too stale, or of a masked truncated episode)."""
    response = np.array([t.num_tokens - t.prompt_len for t in trajs])
    observed = [int((t.action_mask[t.prompt_len:] == 0).sum()) for t in trajs]
    acted = sum(int(t.action_mask.sum()) for t in trajs)
    ends = Counter(t.finish_reason for t in trajs)
    return {"episode/turns": float(np.mean([t.num_turns for t in trajs])),
            "episode/tool_calls": float(np.mean([t.tool_calls for t in trajs])),
            "episode/tool_errors": float(np.mean([t.tool_errors for t in trajs])),
            "episode/observation_tokens": float(np.mean(observed)),
            "episode/response_tokens": float(response.mean()),
            "episode/response_tokens_p50": float(np.percentile(response, 50)),
            "episode/response_tokens_p90": float(np.percentile(response, 90)),
            "episode/response_tokens_max": int(response.max()),
            **{f"end/{reason}": n / len(trajs) for reason, n in sorted(ends.items())},
            "policy/trained_token_frac": sum(int(m.sum()) for m in masks) / max(acted, 1)}


class Telemetry:
    def __init__(self, run_dir: Path, metrics_port: int = 0):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", buffering=1)
        self.gauges: dict = {}
        self.start = time.monotonic()
        if metrics_port:
            from prometheus_client import start_http_server
            start_http_server(metrics_port)

    def _gauge(self, key: str):
        from prometheus_client import Gauge
        if key not in self.gauges:
            name = "sao_learner_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            self.gauges[key] = Gauge(name, f"learner metric {key}")
        return self.gauges[key]

    def record(self, metrics: dict) -> None:
        self.jsonl.write(json.dumps(metrics, allow_nan=True) + "\n")
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._gauge(key).set(value)
        m = metrics
        line = (f"step {m['step/index']:>6} v{m['weights/version']:<5} "
                f"reward {m.get('reward/mean', math.nan):+.3f} "
                f"loss π {m.get('loss/policy', math.nan):+.4f} V {m.get('loss/value', math.nan):.4f} "
                f"kept {m.get('dis/kept_frac', math.nan):.4f} "
                f"{m['perf/tokens_per_s']:>8.0f} tok/s lag {m['kafka/lag']:>5} "
                f"dlq {m['count/dlq']} stale {m['count/stale']} dup {m['count/duplicate']}"
                f"{' SKIPPED' if m.get('step/skipped') else ''}")
        print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.jsonl.close()

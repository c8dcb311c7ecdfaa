"""The live view of `sao up`: what the learner's metrics file, each producer's Prometheus endpoint,
the dead-letter topic and the supervisor say, redrawn every second with rich (or one plain line
every `every_s` seconds when the output is not a terminal).
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections import deque
from pathlib import Path

from rich.table import Table

from producers.evaluate.scores import by_env, headline
from sao.supervisor import Supervisor
from schemas import topics as T
from schemas.kafka import KafkaConfig


class Tail:
    """New lines of a JSONL file, read incrementally (the file only grows)."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        new = []
        with open(self.path) as f:
            f.seek(self.offset)
            for line in f:
                if not line.endswith("\n"):  # a line being written: read it next time
                    break
                self.offset += len(line)
                new.append(json.loads(line))
        return new


class LearnerTail(Tail):
    """The learner's metrics.jsonl: its last step and the recent rewards."""

    def __init__(self, path: Path, window: int = 20):
        super().__init__(path)
        self.last: dict = {}
        self.rewards: deque = deque(maxlen=2 * window)
        self.window = window

    def read(self) -> list[dict]:
        new = super().read()
        for step in new:
            self.last = step
            self.rewards.append(step.get("reward/mean", math.nan))
        return new

    def trend(self) -> tuple[float, float]:
        """(mean reward of the last `window` steps, change against the `window` before)."""
        r = list(self.rewards)
        recent, before = r[-self.window:], r[:-self.window]
        mean = sum(recent) / len(recent) if recent else math.nan
        return mean, (mean - sum(before) / len(before)) if before else math.nan


def episode_line(m: dict) -> str:
    """The last step's episodes: turns, tool calls, lengths and why they ended."""
    if "episode/turns" not in m:
        return "-"
    ends = ", ".join(f"{k[4:]} {v:.0%}" for k, v in sorted(m.items()) if k.startswith("end/"))
    return (f"{m['episode/turns']:.1f} turns, {m['episode/tool_calls']:.1f} tool calls "
            f"({m['episode/tool_errors']:.1f} failed), response tokens p50/p90/max "
            f"{m['episode/response_tokens_p50']:.0f}/{m['episode/response_tokens_p90']:.0f}/"
            f"{m['episode/response_tokens_max']}, {m['episode/observation_tokens']:.0f} observation; ended: {ends}")


def evaluation_line(results: list[dict]) -> str:
    """The held-out score of the newest evaluation against the first: `v20 0.62 (v0 0.41, +0.21)`,
    per environment (`env: …; env: …`) where several are evaluated."""
    if not results:
        return "-"
    envs = by_env(results)
    lines = []
    for env, scored in envs.items():
        name, value = headline(scored[-1])
        line = f"{env + ': ' if len(envs) > 1 else ''}v{scored[-1]['version']} {name} {value:.3f}"
        if len(scored) > 1:
            first = headline(scored[0])[1]
            line += f" (v{scored[0]['version']} {first:.3f}, {value - first:+.3f})"
        lines.append(line)
    return "; ".join(lines)


def scrape(port: int) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text endpoint (name -> value); {} when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.partition(" ")
            out[name] = float(value)
    return out


class Dashboard:
    def __init__(self, sup: Supervisor, run_dir: Path, producer_ports: dict[str, int], kafka: KafkaConfig,
                 steps: int):
        self.sup, self.ports, self.kafka, self.steps = sup, producer_ports, kafka, steps
        self.learner = LearnerTail(run_dir / "learner" / "metrics.jsonl")
        self.evaluations, self._eval_tail = [], Tail(run_dir / "eval.jsonl")
        self.rates: dict[str, tuple[float, float, float]] = {}  # producer -> (t, episodes, per second)
        self.versions: dict[str, float] = {}
        self.events: deque = deque(maxlen=6)
        self.dlq = 0
        self._consumer = None

    def update(self, events: list[str]) -> None:
        self.events.extend(f"{time.strftime('%H:%M:%S')} {e}" for e in events)
        self.learner.read()
        self.evaluations += self._eval_tail.read()
        now = time.monotonic()
        for name, port in self.ports.items():
            m = scrape(port)
            if "sao_producer_episodes_total" not in m:
                continue
            n = m["sao_producer_episodes_total"]
            t0, n0, rate = self.rates.get(name, (now, n, 0.0))
            if now - t0 >= 5:
                t0, n0, rate = now, n, (n - n0) / (now - t0)
            self.rates[name] = (t0, n0, rate)
            self.versions[name] = m.get("sao_producer_weight_version", math.nan)
        self.dlq = self._dlq_count()

    def _dlq_count(self) -> int:
        from confluent_kafka import Consumer, TopicPartition
        if self._consumer is None:
            self._consumer = Consumer(self.kafka.client(**{"group.id": "sao-up-dashboard", "log_level": 0}))
        try:
            return self._consumer.get_watermark_offsets(TopicPartition(self.kafka.topic(T.DLQ), 0), timeout=1)[1]
        except Exception:  # noqa: BLE001 - a view: a broker hiccup shows the last count
            return self.dlq

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()

    def render(self) -> Table:
        m = self.learner.last
        mean, trend = self.learner.trend()
        t = Table(title=f"sao up: step {m.get('step/index', -1) + 1}/{self.steps}, weights "
                        f"v{m.get('weights/version', 0)}", show_header=False, expand=False)
        t.add_column(style="bold")
        t.add_column()
        f = lambda key, spec=".3f": format(m[key], spec) if key in m else "-"  # noqa: E731
        t.add_row("reward", f"{mean:+.3f} (last {self.learner.window} steps), trend {trend:+.3f}")
        t.add_row("DIS kept fraction", f("dis/kept_frac", ".4f"))
        t.add_row("explained variance", f("value/explained_var"))
        t.add_row("staleness p50 / p99", f"{f('stale/p50', '.1f')} / {f('stale/p99', '.1f')} versions")
        t.add_row("learner", f"{f('perf/tokens_per_s', '.0f')} tok/s, consumer lag {f('kafka/lag', 'd')}")
        t.add_row("episodes", episode_line(m))
        t.add_row("held-out (sao eval)", evaluation_line(self.evaluations))
        t.add_row("dead letters", str(self.dlq))
        for name, (_, _, rate) in sorted(self.rates.items()):
            t.add_row(f"{name} (producer)", f"{rate:.2f} traj/s, weights v{self.versions.get(name, math.nan):.0f}")
        for c in self.sup.children.values():
            extra = f", {c.restarts} restart(s)" if c.restarts else ""
            t.add_row(f"process {c.name}", f"{c.state} (pid {c.pid}){extra}")
        for e in self.events:
            t.add_row("event", e, style="yellow")
        return t

    def line(self) -> str:
        m = self.learner.last
        mean, _ = self.learner.trend()
        states = " ".join(f"{c.name}={c.state}" + (f"+{c.restarts}" if c.restarts else "")
                          for c in self.sup.children.values())
        return (f"step {m.get('step/index', -1) + 1}/{self.steps} v{m.get('weights/version', 0)} "
                f"reward {mean:+.3f} eval {evaluation_line(self.evaluations)} dlq {self.dlq} {states}")

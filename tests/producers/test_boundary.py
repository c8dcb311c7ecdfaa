"""The plug-in boundary, enforced on a running producer: each rule broken by a hostile env or
reward plug-in costs that prompt alone (in the DLQ with the plug-in's name and the reason, its
offset committed), and the producer goes on serving the good prompts after it. SIGTERM during a
hanging step stops the producer within its drain bound, the prompt unpublished and uncommitted."""

from __future__ import annotations

import signal
import time

import pytest

from producers.envs.base import Step
from producers.feeder.service import Backlog
from producers.service import ProducerConfig
from producers.service import run as produce
from schemas import topics as T
from schemas.kafka import make_producer, produce as send
from schemas.messages import DeadLetter, Prompt
from tests.producers.util import producer_process, read_topic, wait_until

HOSTILE = "tests.producers.test_boundary:Hostile"
PASSTHROUGH = "tests.producers.test_boundary:passthrough"


class Hostile:
    """A token-level env whose episode misbehaves as its task's `mode` says; "ok" plays fair."""

    name = "hostile"

    def sample_task(self, rng):
        return {"mode": "ok"}

    def episode(self, task):
        mode = task["mode"]
        if mode == "reset_exit":
            raise SystemExit(3)

        class Ep:
            prompt_ids, max_turns = [1, 2, 3], 2

            def step(self, action_ids):
                match mode:
                    case "huge":
                        return Step(observation=[5] * 6_000_000)
                    case "str_reward":
                        return Step(observation=[5], reward="high")
                    case "list_reward":
                        return Step(observation=[5], reward=[1.0])
                    case "final_str":
                        return Step(reward="1.0", done=True)
                    case "id_2_40":
                        return Step(observation=[1 << 40])
                    case "beyond_vocab":
                        return Step(observation=[10_000])
                    case "step_exit":
                        raise SystemExit(4)
                    case "hang":
                        time.sleep(3600)
                return Step(reward=0.5, done=True)

        return Ep()


def passthrough(task, text, trajectory):
    """A --reward plug-in: the env's own reward, except where the task makes it misbehave."""
    if task["mode"] == "reward_exit":
        raise SystemExit(5)
    if task["mode"] == "reward_hang":
        time.sleep(3600)
    return trajectory.reward


def _publish(kafka_cfg, modes: list[str]) -> list[Prompt]:
    """Prompts in this order on one partition (one key), so a producer takes them in order."""
    prompts = [Prompt(id=f"{m}-{i}-{time.time_ns()}", env=HOSTILE, task={"mode": m}) for i, m in enumerate(modes)]
    producer = make_producer(kafka_cfg)
    for p in prompts:
        send(producer, kafka_cfg.topic(T.PROMPTS), p.encode(), key=b"in-order")
    assert producer.flush(30) == 0
    return prompts


RULES = [
    ("huge", "env.step.observation: 6000000 tokens: more than a trajectory may hold (4096, the context window)"),
    ("str_reward", "env.step.reward: expected a number or None, got a str ('high')"),
    ("list_reward", "env.step.reward: expected a number or None, got a list"),
    ("final_str", "env.step.reward: expected a number or None, got a str ('1.0')"),
    ("id_2_40", "env.step.observation: token id 1099511627776 outside the vocabulary"),
    ("beyond_vocab", "env.step.observation: token id 10000 outside the vocabulary [0, 260)"),
    ("step_exit", "env.step: SystemExit: 4"),
    ("reset_exit", "task: SystemExit: 3"),
    ("hang", "env.step: no answer within 2 s (--env-step-timeout); abandoned"),
    ("reward_exit", "reward: --reward tests.producers.test_boundary:passthrough raised SystemExit: 5"),
    ("reward_hang", "reward: no answer within 2 s"),
]


@pytest.mark.parametrize("mode, reason", RULES, ids=[m for m, _ in RULES])
def test_a_plug_in_breaking_a_rule_costs_its_prompt_and_the_producer_serves_the_next(kafka_cfg, mode, reason):
    bad, *good = _publish(kafka_cfg, [mode, "ok", "ok"])
    produce(ProducerConfig(env=HOSTILE, reward=PASSTHROUGH, model="tiny-llama-bytes", max_tokens=2,
                           concurrency=1, max_prompts=3, env_step_timeout=2, follow_weights=False, kafka=kafka_cfg))
    [letter] = read_topic(kafka_cfg, T.DLQ, 1)
    assert isinstance(letter, DeadLetter) and letter.payload == bad.encode()
    assert reason in letter.error, letter.error
    assert (HOSTILE in letter.error) or (PASSTHROUGH in letter.error)  # the plug-in is named
    trajs = read_topic(kafka_cfg, T.TRAJECTORIES, 2)
    assert sorted(t.prompt_id for t in trajs) == sorted(p.id for p in good)  # served after the bad one
    backlog = Backlog(kafka_cfg, "sao-producers")
    assert backlog.count() == 0  # the bad prompt's offset is committed too: no crash loop
    backlog.close()


def test_sigterm_during_a_hanging_step_stops_the_producer_within_its_drain_bound(kafka_cfg):
    [hung] = _publish(kafka_cfg, ["hang"])
    proc = producer_process(kafka_cfg, "p", "--env", HOSTILE, "--model", "tiny-llama-bytes", "--max-tokens", "2",
                "--env-step-timeout", "600", "--drain-s", "2", "--no-follow-weights")
    wait_until(lambda: hung.id in proc.started(), timeout=120)
    time.sleep(1)  # in the step now
    t0 = time.monotonic()
    rc = proc.stop(signal.SIGTERM, timeout=30)
    took = time.monotonic() - t0
    assert rc == 0, "".join(proc.lines[-20:])
    assert took < 2 + 8, f"stopped {took:.1f} s after SIGTERM (--drain-s 2)"
    assert read_topic(kafka_cfg, T.TRAJECTORIES, 1, timeout=3) == []  # abandoned, not half-published
    assert read_topic(kafka_cfg, T.DLQ, 1, timeout=3) == []
    backlog = Backlog(kafka_cfg, "sao-producers")
    assert backlog.count() == 1  # uncommitted: the group hands it to another producer
    backlog.close()

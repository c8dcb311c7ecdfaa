"""`sao producer` on the real broker: in-process for the message paths, as `sao producer`
processes for SIGTERM, SIGKILL and elastic scaling."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import numpy as np
from prometheus_client import generate_latest

from producers.feeder.service import Backlog
from producers.metrics import ProducerMetrics
from producers.envs.python_tool import SYSTEM
from producers.service import ProducerConfig, run
from schemas import topics as T
from schemas.messages import DeadLetter, Trajectory
from schemas.tokenizers import ByteTokenizer
from sao.broker import free_port
from tests.producers.util import producer_process, make_prompts, publish_prompts, read_topic, wait_until


def test_prompts_become_trajectories_and_bad_prompts_go_to_the_dlq(kafka_cfg):
    good = make_prompts("toy-target", [{"target": i % 4} for i in range(5)])
    bad = [b"\xc1 not msgpack", *make_prompts("math", [{"question": "q", "answer": 1}]),
           *make_prompts("toy-target", [{"no-target": 1}])]
    publish_prompts(kafka_cfg, good + bad)
    cfg = ProducerConfig(env="toy-target", model="tiny-llama", max_tokens=8, max_prompts=len(good) + len(bad),
                         producer_id="prod-a", kafka=kafka_cfg)
    run(cfg)
    trajs = read_topic(kafka_cfg, T.TRAJECTORIES, len(good))
    assert sorted(t.prompt_id for t in trajs) == sorted(p.id for p in good)
    for t in trajs:
        assert isinstance(t, Trajectory) and t.producer_id == "prod-a" and t.id == f"{t.prompt_id}#0.0"
        assert t.reward is not None and (t.versions[t.action_mask == 1] == 0).all()
    dead = read_topic(kafka_cfg, T.DLQ, 3)
    assert all(isinstance(d, DeadLetter) for d in dead)
    errors = " | ".join(d.error for d in dead)
    assert "MessagePack" in errors and "plays ['toy-target'], not 'math'" in errors and "task" in errors
    assert {d.payload for d in dead} == {bad[0], bad[1].encode(), bad[2].encode()}
    backlog = Backlog(kafka_cfg, "sao-producers")
    assert backlog.count() == 0  # every offset, bad ones included, committed
    backlog.close()


def test_unrewarded_trajectories_go_to_the_pending_topic(kafka_cfg):
    prompts = make_prompts("writing", [{"instruction": "Write a haiku about tea."}] * 2)
    publish_prompts(kafka_cfg, prompts)
    run(ProducerConfig(env="writing", model="tiny-llama-bytes", max_tokens=6, max_prompts=2, kafka=kafka_cfg))
    pending = read_topic(kafka_cfg, T.PENDING, 2)
    assert sorted(t.prompt_id for t in pending) == sorted(p.id for p in prompts)
    assert all(t.reward is None for t in pending)
    assert read_topic(kafka_cfg, T.TRAJECTORIES, 1, timeout=3) == []


def test_python_tool_producer_publishes_a_scored_trajectory_of_its_chat_prompt(kafka_cfg):
    """The service end of `python-tool`: its episode (sandbox started, system prompt, scoring) runs
    in a producer and the trajectory is published. A random tiny model never writes a code block,
    so the code -> sandbox -> observation turn is tested on the env (tests/producers/test_python_tool.py)."""
    publish_prompts(kafka_cfg, make_prompts("python-tool", [{"question": "What is 2 + 2?", "answer": 4}]))
    run(ProducerConfig(env="python-tool", model="tiny-llama-bytes", max_tokens=6, max_turns=2, max_prompts=1,
                       kafka=kafka_cfg))
    [traj] = read_topic(kafka_cfg, T.TRAJECTORIES, 1)
    prompt = ByteTokenizer().decode(traj.tokens[:traj.prompt_len].tolist())
    assert traj.env == "python-tool" and traj.reward == 0.0 and traj.num_turns == 1
    assert SYSTEM in prompt and "What is 2 + 2?" in prompt
    assert traj.action_mask[traj.prompt_len:].all() and 0 < traj.num_tokens - traj.prompt_len <= 6


def test_metrics_are_served_and_named():
    port = free_port()
    metrics = ProducerMetrics("m", port=port, log_every_s=0)
    try:
        traj = Trajectory(id="t", prompt_id="p", env="e", producer_id="m", tokens=np.array([1, 2, 3], np.int32),
                          action_mask=np.array([0, 1, 1], np.uint8),
                          rollout_logprobs=np.array([0, -1, -1], np.float32),
                          versions=np.array([-1, 4, 4], np.int32), prompt_len=1, reward=1.0)
        metrics.episode(traj)
        metrics.error("undecodable")
        metrics.tick(4)
        text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
        assert "sao_producer_episodes_total 1.0" in text and "sao_producer_action_tokens_total 2.0" in text
        assert 'sao_producer_errors_total{kind="undecodable"} 1.0' in text
        assert "sao_producer_weight_version 4.0" in text
        assert generate_latest(metrics.registry).decode().count("sao_producer") > 5
    finally:
        metrics.close()


def test_sigterm_finishes_the_episode_in_flight_within_the_drain_then_commits_and_exits(kafka_cfg):
    prompts = make_prompts("toy-target", [{"target": 1}, {"target": 2}])
    publish_prompts(kafka_cfg, prompts)
    # a 4 s episode (1000 tokens of 4 ms), signalled about a second in; --drain-s 20 lets it finish
    proc = producer_process(kafka_cfg, "term", "--env", "toy-target", "--backend", "sim", "--sim.median-tokens", "1000",
                "--sim.sigma", "0", "--sim.token-s", "0.004", "--max-tokens", "1000", "--concurrency", "1",
                "--drain-s", "20", "--no-follow-weights")
    try:
        wait_until(lambda: proc.started() or proc.p.poll() is not None, timeout=120)
        time.sleep(1)
        assert proc.stop(signal.SIGTERM) == 0, "".join(proc.lines[-20:])
    finally:
        proc.p.kill()
    [in_flight] = proc.started()  # it took no second prompt after the signal
    [traj] = read_topic(kafka_cfg, T.TRAJECTORIES, 1)
    assert traj.prompt_id == in_flight and len(traj.tokens) > 1000  # finished, not cut short
    backlog = Backlog(kafka_cfg, "sao-producers")
    assert backlog.count() == 1  # the finished prompt is committed, the other one is still waiting
    backlog.close()


def test_elastic_scaling_with_a_member_killed_mid_episode_loses_no_prompt(kafka_cfg):
    args = ("--env", "toy-target", "--model", "tiny-llama", "--max-tokens", "150", "--no-follow-weights")
    stop, published = threading.Event(), []

    def flow():  # a prompt every 0.6 s (about one producer's pace) until the scaling is over
        while not stop.wait(0.6):
            prompt = make_prompts("toy-target", [{"target": len(published) % 4}])[0]
            publish_prompts(kafka_cfg, [prompt])
            published.append(prompt.id)

    flowing = threading.Thread(target=flow)
    flowing.start()
    procs = {"a": producer_process(kafka_cfg, "a", *args)}
    try:
        wait_until(lambda: len(procs["a"].started()) >= 2, timeout=120)
        procs["b"], procs["c"] = producer_process(kafka_cfg, "b", *args), producer_process(kafka_cfg, "c", *args)  # scale out
        wait_until(lambda: procs["b"].started() and procs["c"].started(), timeout=120)
        from_c = lambda ts: any(t.producer_id == "c" for t in ts)  # noqa: E731
        assert from_c(read_topic(kafka_cfg, T.TRAJECTORIES, 0, timeout=120, until=from_c))  # c took part
        seen = len(procs["c"].started())
        wait_until(lambda: len(procs["c"].started()) > seen, timeout=60)  # an episode just began
        killed = procs["c"].started()[-1]
        procs["c"].stop(signal.SIGKILL)  # mid-episode: its prompt was never committed
        stop.wait(3.0)
        stop.set()
        flowing.join()
        prompts = set(published)
        trajs = read_topic(kafka_cfg, T.TRAJECTORIES, 0, timeout=90,
                           until=lambda ts: prompts <= {t.prompt_id for t in ts})
        done = {t.prompt_id for t in trajs}
        assert prompts <= done, f"lost {sorted(prompts - done)} of {len(prompts)}"
        assert {t.producer_id for t in trajs if t.prompt_id == killed} <= {"a", "b"}  # redone elsewhere
        assert {t.producer_id for t in trajs} >= {"a", "b", "c"}
        assert procs["a"].stop() == 0 and procs["b"].stop() == 0
    finally:
        stop.set()
        for proc in procs.values():
            proc.p.kill()

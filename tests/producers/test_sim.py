"""The `sim` backend: exact log-probs of its fixed distribution, lognormal lengths, and per-token
versions exact across a swap."""

import asyncio
import math

import numpy as np

from producers.generate.base import SamplingParams
from producers.generate.sim import SimConfig, SimGenerator, sim_logprobs


def test_log_probs_are_those_of_the_fixed_distribution_at_the_temperature():
    logp = sim_logprobs(8, 0.5, stop_token_ids=(3,))
    assert logp[3] == -np.inf and math.isclose(np.exp(logp).sum(), 1.0, rel_tol=1e-12)
    # p_i ∝ (i + 2)^(-1/T): the ratio of tokens 0 and 1 is (3/2)^2 at T = 0.5
    assert math.isclose(logp[0] - logp[1], 2 * math.log(1.5), rel_tol=1e-12)
    gen = SimGenerator(SimConfig(median_tokens=50, token_s=0.0, vocab_size=8), seed=0)
    params = SamplingParams(temperature=0.5, max_tokens=400, stop_token_ids=(3,))
    out = asyncio.run(gen.generate([1], params))
    assert 3 not in out.token_ids.tolist()
    np.testing.assert_allclose(out.logprobs, logp[out.token_ids].astype(np.float32))


def test_output_lengths_are_lognormal_with_the_configured_median_and_spread():
    gen = SimGenerator(SimConfig(median_tokens=40, sigma=1.0, token_s=0.0), seed=1)

    async def many():
        return await asyncio.gather(*(gen.generate([1], SamplingParams(max_tokens=100_000)) for _ in range(2000)))

    lengths = np.array([len(o.token_ids) for o in asyncio.run(many())])
    logs = np.log(lengths)
    assert abs(np.median(lengths) - 40) < 4 and abs(logs.std() - 1.0) < 0.06
    capped = asyncio.run(gen.generate([1], SamplingParams(max_tokens=3, seed=5)))
    assert len(capped.token_ids) <= 3


def test_a_swap_mid_request_tags_later_tokens_with_the_new_version():
    gen = SimGenerator(SimConfig(median_tokens=1e9, sigma=0.0, token_s=0.01))  # every request 100 tokens

    async def swap_during():
        task = asyncio.create_task(gen.generate([1], SamplingParams(max_tokens=100)))
        await asyncio.sleep(0.5)
        gen.load_weights("unused", 3)
        return await task

    versions = asyncio.run(swap_during()).versions.tolist()
    assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 3
    assert 30 <= versions.index(3) <= 70  # the tokens timed after the swap, about half


def test_tool_latency_delays_each_continuing_step_off_the_event_loop():
    """A 3-turn episode has two tool calls; eight such episodes at once overlap their calls."""
    import random

    from producers.envs import make_env
    from producers.episode import TrajectoryIds, run_episode
    from producers.generate.sim import ToolLatency

    env = make_env("toy-multiturn")
    gen = SimGenerator(SimConfig(median_tokens=4, token_s=0.0))
    tasks = [env.sample_task(random.Random(i)) for i in range(8)]

    async def eight():
        return await asyncio.gather(*(run_episode(
            ToolLatency(env.episode(t), tool_s=0.3), gen, SamplingParams(max_tokens=8),
            TrajectoryIds(id=f"t{i}", prompt_id=f"p{i}", env=env.name, producer_id="sim")) for i, t in enumerate(tasks)))

    trajs = asyncio.run(eight())
    for t in trajs:
        assert t.num_turns >= 2 and t.timing["env_s"] >= 0.3 * (t.num_turns - 1)
    assert max(t.timing["total_s"] for t in trajs) < sum(t.timing["env_s"] for t in trajs)  # concurrent


def test_sim_trajectories_go_through_the_real_producer_kafka_and_learner(kafka_cfg, tmp_path):
    """`sao producer --backend sim` feeds a real `sao learner`, which trains a step on them
    (nothing dead-lettered: the tokens, log-probs and settings are ones it accepts)."""
    import json
    import subprocess
    import sys

    from schemas import topics as T
    from tests.producers.util import REPO, producer_process, make_prompts, publish_prompts, read_topic

    publish_prompts(kafka_cfg, make_prompts("toy-target", [{"target": i % 4} for i in range(8)]))
    env = {"SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix,
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    learner = subprocess.Popen([sys.executable, "-m", "sao", "learner", "--run-dir", str(tmp_path / "run"),
                                "--weights-dir", str(tmp_path / "weights"), "--batch-trajectories", "8",
                                "--max-steps", "1"], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    producer = producer_process(kafka_cfg, "sim", "--backend", "sim", "--env", "toy-target", "--model", "tiny-llama",
                    "--concurrency", "8", "--sim.median-tokens", "30", "--sim.token-s", "0.001", "--max-tokens", "200")
    try:
        assert learner.wait(300) == 0
    finally:
        learner.kill()
        producer.p.kill()
    [step] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if "perf/step_s" in line]
    assert step["batch/trajectories"] == 8
    assert read_topic(kafka_cfg, T.DLQ, 1, timeout=2) == []

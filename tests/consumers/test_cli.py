"""The consumer subcommands of `sao`, run as a user would, on the real broker."""

from __future__ import annotations

import os
import subprocess
import sys

from consumers.control import CONTROL, decode
from schemas.kafka import make_consumer
from tests.consumers.util import REPO, read_topic
from schemas import topics as T


def _sao(kafka, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SAO_KAFKA_BOOTSTRAP": kafka.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka.topic_prefix}
    return subprocess.run([sys.executable, "-m", "sao", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_reward_publish_and_judge_set_criterion_reach_their_topics(kafka_cfg):
    done = _sao(kafka_cfg, "reward", "publish", "--trajectory", "traj-7", "--reward", "1.5", "--criterion", "human")
    assert done.returncode == 0, done.stderr
    [r] = read_topic(kafka_cfg, T.REWARDS, 1)
    assert (r.trajectory_id, r.reward, r.source, r.criterion) == ("traj-7", 1.5, "cli", "human")
    done = _sao(kafka_cfg, "judge", "set-criterion", "--criterion", "digits")
    assert done.returncode == 0, done.stderr
    consumer = make_consumer(kafka_cfg, "test-control")
    consumer.subscribe([kafka_cfg.topic(CONTROL)])
    msg = None
    while msg is None or msg.error():
        msg = consumer.poll(1.0)
    consumer.close()
    assert decode(msg.value()) == "digits"


def test_usage_lists_the_consumer_commands_and_bad_settings_fail_in_one_line(kafka_cfg):
    usage = _sao(kafka_cfg, "--help").stdout
    for name in ("reward-join", "reward publish", "reward serve", "judge", "judge set-criterion"):
        assert f"  {name} " in usage
    done = _sao(kafka_cfg, "reward", "serve", "--host", "0.0.0.0")
    assert done.returncode == 2 and "--reward-token" in done.stderr and "Traceback" not in done.stderr
    assert "--reward-timeout" in _sao(kafka_cfg, "reward-join", "--help").stdout

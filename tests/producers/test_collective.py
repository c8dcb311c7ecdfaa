"""The collective weight transport on the real broker: a `sao learner` broadcasting over gloo to two
`sao serve` engines; one engine is stopped and SIGKILLed while an update is being broadcast to it,
the learner goes on with the other, and the engine, restarted, catches up from the anchor and
deltas and links again."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import httpx

from sao.broker import free_port
from schemas import topics as T
from tests.learner.service_util import ROOT, learner_cmd, metrics, ONE_PARTITION, publish, rollouts
from tests.producers.util import wait_until


class Engine:
    """`sao serve` following the weights, linked to the learner's collective endpoint."""

    def __init__(self, kafka_cfg, collective_port: int):
        self.port = free_port()
        env = {**os.environ, "SAO_KAFKA_BOOTSTRAP": kafka_cfg.bootstrap, "SAO_KAFKA_TOPIC_PREFIX": kafka_cfg.topic_prefix,
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sao", "serve", "--model", "tiny-llama", "--port", str(self.port),
             "--weights.collective-addr", f"127.0.0.1:{collective_port}", "--weights.collective-timeout-s", "15"],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def version(self) -> int:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/weight_info", timeout=2).json()["weight_version"]
        except httpx.HTTPError:
            return -1  # not serving yet

    def by_link(self) -> int:
        """Updates this engine loaded from the broadcast (its Prometheus gauge)."""
        text = httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=2).text
        return int(float(re.search(r'sao_serve_weight_updates_by_source\{source="collective"\} (\S+)', text)[1]))


def test_two_engines_by_broadcast_one_killed_mid_broadcast_the_learner_goes_on_and_it_rejoins(kafka_cfg, tmp_path):
    port = free_port()
    batches = iter(rollouts(2 * 16, seed=3)[i:i + 2] for i in range(0, 32, 2))
    learner = subprocess.Popen(learner_cmd(
        kafka_cfg, tmp_path, "--batch-trajectories", "2", "--max-steps", "16", "--max-staleness", "-1",
        "--weights.transport", "collective", "--weights.collective-port", str(port),
        "--weights.collective-timeout-s", "15"), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    a, b = Engine(kafka_cfg, port), Engine(kafka_cfg, port)
    engines = [a, b]
    step = 0

    def next_step(*following: Engine) -> int:
        """Feed one step's trajectories; wait until the learner and `following` are on its version."""
        nonlocal step
        publish(kafka_cfg, T.TRAJECTORIES, [t.encode() for t in next(batches)], key=ONE_PARTITION)
        step += 1
        wait_until(lambda: len(metrics(tmp_path)) >= step, timeout=120)
        version = metrics(tmp_path)[-1]["weights/version"]
        for e in following:
            wait_until(lambda: e.version() >= version, timeout=60)
        return version

    try:
        wait_until(lambda: a.version() == b.version() == 0, timeout=120)
        while min(a.by_link(), b.by_link()) < 1:  # both linked once they held version 0's state
            next_step(a, b)
        b.proc.send_signal(signal.SIGSTOP)  # b stops reading: the next broadcast to it cannot finish
        got = a.by_link()
        next_step(a)
        assert a.by_link() == got + 1  # a has this version by broadcast; b has not taken it
        b.proc.kill()  # mid-broadcast: the learner is still sending it this version, or it sits unread
        b.proc.wait()
        for _ in range(2):
            version = next_step(a)  # the learner goes on, a by broadcast
        assert a.by_link() == got + 3
        assert metrics(tmp_path)[-1]["weights/engines_linked"] == 1  # b is out of the broadcast
        b = Engine(kafka_cfg, port)  # restarted: catches up from the anchor and the deltas after it
        engines.append(b)
        wait_until(lambda: b.version() == version, timeout=120)
        assert b.by_link() == 0
        while b.by_link() < 1:  # and links again
            next_step(a, b)
        taken = a.by_link(), b.by_link()
        version = next_step(a, b)
        assert (a.by_link(), b.by_link()) == (taken[0] + 1, taken[1] + 1)  # one broadcast to both again
        assert a.version() == b.version() == version
        while step < 16:
            next_step()
        assert learner.wait(120) == 0
    finally:
        for p in [learner] + [e.proc for e in engines]:
            if p.poll() is None:
                p.kill()
                p.wait()

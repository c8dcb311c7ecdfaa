"""One long agent episode through the whole pipeline (producer, Kafka, learner), token by token.

A producer (hf engine, the learner's tiny byte-level model) plays a plug-in env whose every turn is
a tool turn: the reply goes to the episode's stateful sandbox session, its output comes back as
observation tokens, and a slow tool makes the turn last. One long task (four turns) is played
beside many short ones, which keep the learner stepping and publishing, so the long episode's
turns are sampled by several versions. The trajectory is then checked token by token: every action
token carries a version, the versions never go back and span at least three, observation tokens
carry none and are masked; each action token's rollout log-prob is what the weights of its own
version give (recomputed from the published weights, replaying the engine's KV cache, which a swap
mid-turn keeps), not what a neighbouring version gives; and the learner trained it, its fresh
tokens counted.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from learner.models import ModelConfig, build_policy
from producers.envs.base import Step
from producers.envs.chat import Chat
from producers.envs.tools import tool_response
from producers.sandbox import Sandbox, SandboxConfig
from producers.session import PythonSession
from schemas import topics as T
from schemas.messages import Prompt
from tests.kafka_util import Service, publish, read_topic, wait_until
from tests.learner.service_util import announcements, learner_cmd, metrics, published

ROOT = Path(__file__).resolve().parents[1]
ENV = "tests.test_long_episode:SlowToolEnv"


@dataclass
class SlowToolEpisode:
    prompt_ids: list[int]
    chat: Chat
    session: PythonSession
    max_turns: int
    tool_s: float
    turn: int = 0

    def step(self, action_ids: list[int]) -> Step:
        self.turn += 1
        if self.turn >= self.max_turns:
            return Step(reward=float(action_ids[0] % 2), done=True)  # varies: the policy moves
        out = self.session.run(f"import time\ntime.sleep({self.tool_s})\nlen({action_ids!r})").output.strip()
        return Step(observation=self.chat.observation_ids(action_ids, tool_response([out])), tool_calls=1)

    def close(self) -> None:
        self.session.close()


@dataclass(kw_only=True)
class SlowToolEnv:
    """Tasks {"turns": n, "tool_s": s}: n turns, each but the last a tool call of s seconds."""

    tokenizer: object = None
    sandbox: Sandbox | None = None
    name: str = "slow-tool"

    def sample_task(self, rng) -> dict:
        return {"turns": 1, "tool_s": 0.0}

    def episode(self, task: dict) -> SlowToolEpisode:
        chat = Chat(self.tokenizer)
        ids = chat.prompt_ids([{"role": "user", "content": f"Call the tool {task['turns'] - 1} times."}])
        return SlowToolEpisode(ids, chat, PythonSession(self.sandbox or Sandbox(SandboxConfig(timeout_s=30))),
                               task["turns"], task["tool_s"])


def test_a_long_episode_spans_versions_and_tool_turns_and_every_token_is_checked(kafka_cfg, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_LOG_LEVEL": "WARNING", "PYTHONPATH": str(ROOT)}
    learner = subprocess.Popen(learner_cmd(kafka_cfg, tmp_path, "--model.name", "tiny-llama-bytes",
                                           "--batch-trajectories", "4", "--max-steps", "30",
                                           "--update.lr-policy", "1e-2", "--weights.dtype", "float32"),
                               cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    producer = Service(kafka_cfg, "producer", "--backend", "hf", "--model", "learner", "--env", ENV,
                       "--max-tokens", "8", "--max-turns", "8", "--concurrency", "4", "--max-lag", "0",
                       "--producer-id", "p", env={"PYTHONPATH": str(ROOT)})
    try:
        long = Prompt(id="long", env=ENV, task={"turns": 4, "tool_s": 3.0})
        short = [Prompt(id=f"s{i}", env=ENV, task={"turns": 1, "tool_s": 0.0}) for i in range(120)]
        publish(kafka_cfg, T.PROMPTS, [long])  # first, so that the short ones train while it plays
        wait_until(lambda: "long" in producer.started(), timeout=240, every=0.5)
        publish(kafka_cfg, T.PROMPTS, short)
        trajs = read_topic(kafka_cfg, T.TRAJECTORIES, 0, timeout=300,
                           until=lambda ms: any(m.prompt_id == "long" for m in ms))
        wait_until(lambda: learner.poll() is not None or len(metrics(tmp_path)) >= 30, timeout=300, every=1)
    finally:
        producer.stop()
        learner.terminate()
        learner.wait(120)
    [traj] = [t for t in trajs if t.prompt_id == "long"]
    acted = traj.action_mask.astype(bool)
    # the episode: four turns, three of them tool calls whose outputs are observation tokens
    assert traj.num_turns == 4 and traj.tool_calls == 3 and traj.finish_reason in ("stop", "length")
    assert (traj.versions[~acted] == -1).all() and (traj.versions[acted] >= 0).all()
    assert not acted[:traj.prompt_len].any() and (~acted[traj.prompt_len:]).sum() > 0
    versions = traj.versions[acted]
    assert (np.diff(versions) >= 0).all(), "a later token carries an older version"
    assert len(set(versions.tolist())) >= 3, f"versions {sorted(set(versions.tolist()))}: fewer than three"
    # each token's rollout log-prob is its own version's (the producer loaded float32 weights),
    # replayed as the engine computed it: a swap between two decode steps keeps the KV cache the old
    # weights built, so a turn's prompt is prefilled by the version of its first token and every
    # later position by the version of the token it predicts
    ws = announcements(kafka_cfg)
    model = build_policy(ModelConfig(name="tiny-llama-bytes")).eval()
    tokens = torch.tensor(traj.tokens, dtype=torch.long)[None]
    weights = {v: published(ws, v) for v in sorted(set(versions.tolist()))}

    def logprob(logits: torch.Tensor, token: int) -> float:
        return torch.log_softmax(logits.float(), -1)[token].item()

    def forward(ids: torch.Tensor, version: int, cache=None):
        model.load_state_dict(weights[version])
        with torch.no_grad():
            return model(input_ids=ids, past_key_values=cache, use_cache=True)

    replayed = np.full(len(traj.tokens), np.nan, np.float32)
    positions = np.flatnonzero(acted)
    for q in positions:
        v = int(traj.versions[q])
        if not acted[q - 1]:  # a turn starts: the engine prefills everything before it
            out = forward(tokens[:, :q], v)
        else:
            out = forward(tokens[:, q - 1:q], v, out.past_key_values)
        replayed[q] = logprob(out.logits[0, -1], int(traj.tokens[q]))
    for v in weights:
        mine = positions[traj.versions[positions] == v]
        np.testing.assert_allclose(replayed[mine], traj.rollout_logprobs[mine], atol=1e-4,
                                   err_msg=f"tokens tagged v{v} are not what v{v}'s weights sample")
    later = max(weights)
    newest = forward(tokens, later).logits[0, :-1]
    earlier = positions[traj.versions[positions] < later]
    newest_lp = np.array([logprob(newest[q - 1], int(traj.tokens[q])) for q in earlier])
    assert np.abs(newest_lp - traj.rollout_logprobs[earlier]).max() > 1e-3, \
        "the newest version gives the older tokens the same log-probs: the versions did not differ"
    # the learner trained it, with its staleness judged token by token
    steps = metrics(tmp_path)
    trained_in = [s for s in steps if traj.id in s["trajectory_ids"]]
    assert len(trained_in) == 1 and 0 < trained_in[0]["policy/trained_token_frac"] <= 1
    assert trained_in[0]["episode/tool_calls"] > 0 and trained_in[0]["stale/max"] >= 1

"""A fixed set of SmolLM2-135M-Instruct rollouts with rewards, sampled once by the rollout engine
(vLLM's float32 engine where it runs, else the hf backend) and cached, for benches that train on
the same data run after run (bench/learner_precision.py, bench/critic_claims.py).

Tasks: the `writing` env's instructions; rewards from the style judge (`concise` by default, the
`make run` task), given on load, so one set of texts serves every criterion.
"""

from __future__ import annotations

import random
from pathlib import Path

import msgpack

from consumers.judges import style
from producers.envs import make_env
from producers.envs.chat import Chat
from producers.episode import play_tasks
from producers.generate.base import SamplingParams
from producers.models import engine_folder, load_model
from schemas.messages import Trajectory
from schemas.tokenizers import load_tokenizer

CACHE = Path.home() / ".cache" / "sao-stream" / "rollouts"


def generator(engine: str):
    """The rollout engine: vllm (float32) or hf, on SmolLM2's initial weights."""
    if engine == "vllm":
        from producers.generate.vllm import VLLMConfig, VLLMGenerator
        return VLLMGenerator(engine_folder("smollm2"), seed=0, cfg=VLLMConfig(dtype="float32", max_model_len=1024))
    from producers.generate.hf import HFGenerator
    return HFGenerator(load_model("smollm2"), seed=0)


def smollm2_rollouts(n: int, *, tokens: int = 24, criterion: str = "concise", engine: str = "vllm",
                     seed: int = 0) -> list[Trajectory]:
    """`n` rollouts of the writing env, cached by their settings, scored by the style judge on
    `criterion` (the same texts under every criterion)."""
    path = CACHE / f"smollm2-writing-{engine}-n{n}-t{tokens}-s{seed}.msgpack"
    if path.exists():
        trajs = [Trajectory.decode(b) for b in msgpack.unpackb(path.read_bytes())]
    else:
        trajs = _play(n, tokens, engine, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgpack.packb([t.encode() for t in trajs]))
        tmp.rename(path)
    tokenizer = load_tokenizer("smollm2")
    for t in trajs:
        completion = tokenizer.decode(t.tokens[t.prompt_len:][t.action_mask[t.prompt_len:] == 1].tolist(),
                                      skip_special_tokens=True)
        t.reward = style("", completion, criterion)
    return trajs


def _play(n: int, tokens: int, engine: str, seed: int) -> list[Trajectory]:
    tokenizer = load_tokenizer("smollm2")
    env, gen = make_env("writing", tokenizer=tokenizer), generator(engine)
    stops = Chat(tokenizer).stop_token_ids()  # as a producer samples: the turn ends at the template's end
    trajs = play_tasks(env, gen, SamplingParams(max_tokens=tokens, stop_token_ids=stops), random.Random(seed),
                       num_prompts=n, id_prefix=f"w{seed}-", concurrent=True)
    if hasattr(gen, "close"):
        gen.close()
    return trajs

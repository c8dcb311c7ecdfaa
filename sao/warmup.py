"""`sao warmup`: the cold start of agentic RL. A base model that never calls the environment's tools
is taught the environment's own demonstrations first (producers/demos.py, learner/sft.py), then
RL starts from the folder this writes (`sao up --model FOLDER`, `make run-agent`).

It scores the model on the held-out tasks (greedy, on the hf engine, as `sao eval` does) before
and after, so the warm-up is reported as its own figure and RL's gain is measured against the
warm-started model, not the base. The demonstrations come from the training split only
(`--heldout-frac`, the feeder's and the evaluator's). The folder (config.json, model.safetensors,
the tokenizer with its chat template, warmup.json with the figures) is written whole or not at
all; a folder that already holds a finished warm-up of the same settings and the same
demonstrations (their tokens, hashed into its name) is reused (`--force`: train again). Standard
output is that folder's path alone; progress and figures go to stderr.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from learner.sft import SFTConfig, save, warm_up
from producers.sandbox import SandboxConfig


@dataclass(kw_only=True)
class WarmupConfig:
    env: str = "calc-agent"
    """Environment whose demonstrations are learned (it must write some: `demonstration(task)`)."""
    model: str = "smollm2"
    """Base model: smollm2 | a transformers folder | ... (a model with a tokenizer)."""
    out: Path = Path("runs/warmup")
    """Parent folder of the warm-started model; the model goes in <out>/<env>-<model>-<hash of the
    settings and the demonstrations>, whose path the last output line prints."""
    demos: int = 400
    """Demonstrations trained on, from the env's training split."""
    heldout_frac: float = 0.1
    """Share of the env's tasks held out (the feeder's and evaluator's --heldout-frac)."""
    eval_tasks: int = 32
    """Held-out tasks scored before and after (greedy)."""
    max_tokens: int = 96
    """Most tokens per model turn when scoring."""
    threads: int = 2
    """Torch threads."""
    seed: int = 0
    """Which demonstrations (tasks), and the held-out tasks scored."""
    force: bool = False
    """Train again even if the folder holds a finished warm-up."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def folder(self, demos: list) -> Path:
        """Where the warm-up of these settings on these demonstrations goes: the key hashes the
        demonstrations' tokens too, so an env whose demonstrations changed (its code, its chat
        template) is never served a warm start taught the old ones."""
        settings = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("out", "threads", "force",
                                                                                     "sandbox")}
        key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
        for d in demos:
            key.update(d.tokens.tobytes() + d.action_mask.tobytes())
        return self.out / f"{self.env}-{Path(self.model).name}-{key.hexdigest()[:10]}"


def held_out_score(cfg: WarmupConfig, model, env, tokenizer) -> dict:
    """Greedy figures of `model` on the env's held-out tasks (producers/evaluate), and each task's
    (`tasks`: its reward in task order), as `sao eval --out` writes them."""
    from producers.envs.chat import Chat
    from producers.evaluate.service import EvalConfig, suite_tasks
    from producers.evaluate.suite import Suite, figures, per_task
    from producers.generate.hf import HFGenerator

    ecfg = EvalConfig(env=cfg.env, samples=0, tasks=cfg.eval_tasks, heldout_frac=cfg.heldout_frac,
                      max_tokens=cfg.max_tokens, seed=cfg.seed)
    tasks, split = suite_tasks(ecfg, env)
    generator = HFGenerator(model, seed=cfg.seed)
    try:
        suite = Suite(cfg=ecfg, env=env, generator=generator, tasks=tasks, split=split,
                      stops=Chat(tokenizer).stop_token_ids())
        played = asyncio.run(suite.play(0))
        return figures(ecfg, played, 0) | per_task(ecfg, played)
    finally:
        generator.close()


def run(cfg: WarmupConfig) -> Path:
    import torch

    from learner.models import ModelConfig, build_policy
    from producers.demos import demonstrations
    from producers.envs import make_env
    from producers.envs.chat import Chat
    from producers.sandbox import Sandbox
    from schemas.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    env = make_env(cfg.env, tokenizer=tokenizer, sandbox=Sandbox(cfg.sandbox))
    demos = demonstrations(env, Chat(tokenizer), cfg.demos, cfg.heldout_frac, cfg.seed)
    folder = cfg.folder(demos)
    if (folder / "warmup.json").is_file() and not cfg.force:
        say(f"warm-up cached: {json.loads((folder / 'warmup.json').read_text())['summary']}")
        print(folder)
        return folder
    torch.set_num_threads(cfg.threads)
    tokens = sum(d.num_tokens for d in demos)
    say(f"{len(demos)} demonstrations of {cfg.env}, {tokens} tokens ({sum(int(d.action_mask.sum()) for d in demos)} "
          f"action tokens), turns {min(d.num_turns for d in demos)}-{max(d.num_turns for d in demos)}")
    model = build_policy(ModelConfig(name=cfg.model))
    t0 = time.perf_counter()
    before = held_out_score(cfg, model, env, tokenizer)
    say(f"base model on {cfg.eval_tasks} held-out tasks: greedy/mean {before['greedy/mean']:.3f} "
        f"({time.perf_counter() - t0:.0f} s)")
    t0 = time.perf_counter()
    losses = warm_up(model, demos, cfg.sft, progress=lambda i, n, loss: print(
        f"\rstep {i}/{n} loss {loss:.3f}", end="" if i < n else "\n", file=sys.stderr, flush=True))
    train_s = time.perf_counter() - t0
    after = held_out_score(cfg, model, env, tokenizer)
    summary = (f"held-out greedy/mean {before['greedy/mean']:.3f} -> {after['greedy/mean']:.3f} after "
               f"{len(losses)} steps on {len(demos)} demonstrations ({train_s:.0f} s of training); loss "
               f"{losses[0]:.3f} -> {losses[-1]:.3f}")
    record = {"summary": summary, "settings": dataclasses.asdict(cfg) | {"out": str(cfg.out)}, "before": before,
              "after": after, "losses": losses, "train_s": train_s, "tokens": tokens}

    def extra(tmp: Path) -> None:
        tokenizer.save_pretrained(tmp)
        (tmp / "warmup.json").write_text(json.dumps(record, indent=1, default=str))
    save(model, folder, extra)
    say(summary)
    print(folder)
    return folder


def say(line: str) -> None:
    """Progress on stderr: stdout is the folder alone, for `$(sao warmup)` in a Makefile."""
    print(line, file=sys.stderr, flush=True)

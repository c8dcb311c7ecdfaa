"""`sao warmup`: SmolLM2 taught a few of calc-agent's own demonstrations, scored on held-out tasks
before and after, written as a folder the learner and the producers load (model and tokenizer with
its chat template), and reused when asked again."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from producers.demos import demonstrations, training_tasks
from producers.envs import make_env
from producers.envs.chat import Chat
from producers.heldout import held_out
from producers.sandbox import Sandbox
from sao.warmup import WarmupConfig
from schemas.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def test_a_demonstration_is_laid_out_as_an_episode_of_its_task():
    tok = load_tokenizer("smollm2")
    env = make_env("calc-agent", tokenizer=tok, sandbox=Sandbox())
    [demo] = demonstrations(env, Chat(tok), 1, heldout_frac=0.5, seed=3)
    assert not held_out(next(training_tasks(env, 1, 0.5, 3)), 0.5)
    text = tok.decode(demo.tokens.tolist())
    actions = tok.decode(demo.tokens[demo.action_mask == 1].tolist())
    assert text.startswith(tok.decode(demo.tokens[:demo.prompt_len].tolist()))
    assert "<tool_call>" in actions and "Answer:" in actions and "<tool_response>" not in actions
    assert "<tool_response>" in text and demo.num_turns >= 2
    assert np.all(demo.action_mask[:demo.prompt_len] == 0)


def test_the_warm_start_folder_is_named_by_the_demonstrations_too():
    """Demonstrations that changed (the env's code, its chat template) under the same settings get
    another folder, so a cached warm start taught the old ones is never reused."""
    tok = load_tokenizer("smollm2")
    env = make_env("calc-agent", tokenizer=tok, sandbox=Sandbox())
    demos = demonstrations(env, Chat(tok), 2, heldout_frac=0.5, seed=3)
    cfg = WarmupConfig(demos=2, heldout_frac=0.5, seed=3)
    assert cfg.folder(demos) == cfg.folder(demonstrations(env, Chat(tok), 2, heldout_frac=0.5, seed=3))
    edited = dataclasses.replace(demos[1], tokens=demos[1].tokens.copy())
    edited.tokens[-2] += 1
    assert cfg.folder([demos[0], edited]) != cfg.folder(demos)
    assert cfg.folder(demos) != dataclasses.replace(cfg, seed=4).folder(demos)


def test_warmup_writes_a_folder_the_learner_loads_and_reuses_it(tmp_path):
    args = [sys.executable, "-m", "sao", "warmup", "--demos", "2", "--sft.epochs", "1", "--eval-tasks", "2",
            "--max-tokens", "8", "--out", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    folder = Path(out.stdout.strip())
    assert folder.parent == tmp_path and {"config.json", "model.safetensors", "warmup.json"} <= {
        p.name for p in folder.iterdir()}
    record = json.loads((folder / "warmup.json").read_text())
    assert {"greedy/mean"} <= set(record["before"]) & set(record["after"]) and len(record["losses"]) >= 1
    assert "held-out greedy/mean" in out.stderr
    code = ("import sys; from learner.models import ModelConfig, build_policy; from schemas.tokenizers import "
            "load_tokenizer; m = build_policy(ModelConfig(name=sys.argv[1])); t = load_tokenizer(sys.argv[1]); "
            "print(type(m).__name__, '<|im_start|>' in t.apply_chat_template([{'role': 'user', 'content': 'x'}], "
            "tokenize=False))")
    check = subprocess.run([sys.executable, "-c", code, str(folder)], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert check.stdout.split() == ["LlamaForCausalLM", "True"], check.stderr[-2000:]
    again = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.strip() == str(folder) and "cached" in again.stderr

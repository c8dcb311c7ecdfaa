"""Supervised warm-up: the policy taught demonstrations before RL, when the base model never acts
as the environment needs (the cold start; `sao warmup`).

The loss is the negative log-likelihood of the demonstrations' action tokens under the policy at
temperature 1, `-Σ_t log π_θ(a_t|s_t) / N` over the N action tokens of a batch; prompt and
observation tokens are context only, as in RL (`token_logprobs`, learner/logprobs.py, computes
the log-probs from the hidden states in chunks, never the float32 logits of the whole batch).
Batches close at `batch_tokens` tokens, trajectories in a new order each epoch. The forward is
padded (packed rows were 1.4-1.9x slower on 2 CPU cores: a block-diagonal mask over the whole
row) and runs under bf16 autocast where the CPU computes in bf16 natively, with float32 master
weights and AdamW.

Deliberately absent: a learning-rate schedule, weight decay and gradient accumulation. A warm-up
of a few hundred demonstrations is over in one or two epochs; it only has to teach the format.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from learner.logprobs import collate, token_logprobs
from schemas.messages import Trajectory


@dataclass(kw_only=True)
class SFTConfig:
    epochs: int = 2
    """Passes over the demonstrations."""
    lr: float = 5e-5
    """AdamW learning rate."""
    batch_tokens: int = 2048
    """Tokens per optimizer step (whole demonstrations)."""
    clip_grad: float = 1.0
    """Gradient norm clip."""
    bf16: bool = True
    """bf16 autocast where the CPU has native bf16 (or on a GPU); float32 otherwise."""
    seed: int = 0
    """Order of the demonstrations in each epoch."""


def sft_loss(logp: Tensor, action_mask: Tensor) -> Tensor:
    """-Σ log π(a_t|s_t) / N over action tokens. logp, action_mask: (B, T)."""
    return -(logp * action_mask).sum() / action_mask.sum().clamp(min=1)


def batches(demos: Sequence[Trajectory], batch_tokens: int, rng: random.Random) -> list[list[Trajectory]]:
    """The demonstrations shuffled into batches of at most `batch_tokens` tokens (a longer one alone)."""
    order = list(demos)
    rng.shuffle(order)
    out, size = [[]], 0
    for traj in order:
        if out[-1] and size + traj.num_tokens > batch_tokens:
            out.append([])
            size = 0
        out[-1].append(traj)
        size += traj.num_tokens
    return out


def warm_up(model: torch.nn.Module, demos: Sequence[Trajectory], cfg: SFTConfig,
            progress: Callable[[int, int, float], None] = lambda step, steps, loss: None) -> list[float]:
    """Train `model` in place on `demos`; the loss of every step."""
    from schemas.process import cpu_flags

    device = next(model.parameters()).device
    bf16 = cfg.bf16 and (device.type == "cuda" or "avx512_bf16" in cpu_flags() or "amx_bf16" in cpu_flags())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    rng, losses = random.Random(cfg.seed), []
    plan = [b for _ in range(cfg.epochs) for b in batches(demos, cfg.batch_tokens, rng)]
    model.train()
    for i, group in enumerate(plan):
        batch = collate(group, device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logp, _ = token_logprobs(model, batch, temperature=1.0)  # padded: packing is slower on CPU
        loss = sft_loss(logp, batch.action_mask)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        progress(i + 1, len(plan), losses[-1])
    model.eval()
    return losses


def save(model: torch.nn.Module, out: Path, extra: Callable[[Path], None] = lambda folder: None) -> Path:
    """The policy as a transformers folder (config.json, model.safetensors), written whole or not
    at all: into a temporary folder beside `out`, `extra` adding its files (a tokenizer), then
    renamed over `out`. Not `save_pretrained` on the model itself: one loaded from a GGUF stays
    marked quantized although its weights are plain floats, and transformers refuses to save it."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    save_file(untied_state(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
    extra(tmp)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def untied_state(model: torch.nn.Module) -> dict[str, Tensor]:
    """The state dict to write, a tied output head left out: its weight is the input embedding's,
    stored once under the embedding's name as transformers writes it. vLLM builds a tied model's
    head from `model.embed_tokens.weight` and skips `lm_head.weight`, so a file holding only the
    head's name (what safetensors' `save_model` kept) left vLLM's embedding unloaded: it sampled
    `<|endoftext|>` forever from a `sao warmup` folder."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if out is not None and out.weight is inp.weight:
        names = {id(m): n for n, m in model.named_modules()}
        state.pop(f"{names[id(out)]}.weight")
    return state

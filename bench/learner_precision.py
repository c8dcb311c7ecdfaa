"""The learner on CPU in float32 against bf16 compute (FSDP2's mixed precision: bf16 parameters
in forward and backward, float32 master weights, gradients reduced in float32) for the critic
alone (the policy float32, so its ratios stay exact) and for both, on SmolLM2-135M:

- tokens/s of SAO steps on the same cached rollouts (bench/rollouts.py), each precision in this run;
- the DIS kept fraction, and the spread of the importance ratio, at the first step (the policy
  still the rollout engine's, so every ratio would be exactly 1 with exact arithmetic): how far
  each precision's recomputed log-probs are from the float32 engine's.

    .venv/bin/python bench/learner_precision.py [--steps 4] [--batch 8] [--threads 2]
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import tyro  # noqa: E402

from bench.rollouts import smollm2_rollouts  # noqa: E402
from learner.models import ModelConfig, build_models, build_policy  # noqa: E402
from learner.parallel import ParallelConfig, init_distributed  # noqa: E402
from learner.update import SAOUpdate, UpdateConfig  # noqa: E402
from schemas.process import native_bf16  # noqa: E402


@dataclass(kw_only=True)
class LearnerPrecisionConfig:
    """The steps each precision runs."""

    steps: int = 4
    """SAO steps per precision"""
    batch: int = 8
    """cached rollouts per step"""
    threads: int = 2
    """torch CPU threads"""
    out: Path = REPO / "bench" / "results" / "learner_precision.md"
    """where the table goes"""


def run(parallel: ParallelConfig, trajs, steps: int, batch: int) -> dict:
    _, _, device = init_distributed("cpu")
    torch.manual_seed(0)
    sao = SAOUpdate(*build_models(build_policy(ModelConfig(name="smollm2")), True,
                                  parallel, device),
                    UpdateConfig(warmup_steps=0, lr_policy=5e-5, lr_critic=1e-4))
    first, ends, tokens = None, [], 0
    t0 = time.perf_counter()
    for i in range(steps):
        step = trajs[i * batch:(i + 1) * batch]
        metrics = sao.step(step)
        first = first or metrics
        ends.append(time.perf_counter())
        tokens += sum(t.num_tokens for t in step) if i else 0
    return {"tokens/s (steps 2..)": tokens / (ends[-1] - ends[0]), "first step s": ends[0] - t0,
            "kept (reasoning)": first["dis/kept_frac"], "ratio min": first["dis/ratio_min"],
            "ratio max": first["dis/ratio_max"]}


def main() -> None:
    args = tyro.cli(LearnerPrecisionConfig, description=__doc__)
    torch.set_num_threads(args.threads)
    trajs = smollm2_rollouts(args.steps * args.batch)
    native = "native bf16" if native_bf16() else "no native bf16"
    variants = {"float32": (False, False), "bf16 critic": (False, True), "bf16 policy and critic": (True, True)}
    rows = {name: run(ParallelConfig(mixed_precision=policy, critic_mixed_precision=critic), trajs, args.steps,
                      args.batch) for name, (policy, critic) in variants.items()}
    head = (f"SmolLM2-135M-Instruct SAO steps (K = 2 critic updates), {args.steps} x {args.batch} cached vLLM-float32 "
            f"rollouts of the writing env, {args.threads} threads [{platform.machine()}, {native}, {os.cpu_count()} cores, "
            f"torch {torch.__version__}, load {os.getloadavg()[0]:.1f}, {datetime.date.today()}]")
    cols = list(rows["float32"])
    lines = [f"# Learner precision: {head}", "", "Command: `.venv/bin/python bench/learner_precision.py`", "",
             "| compute | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(f"{v:.4g}" for v in r.values()) + " |" for name, r in rows.items()]
    speed = {name: r["tokens/s (steps 2..)"] / rows["float32"]["tokens/s (steps 2..)"] for name, r in rows.items()}
    lines += ["", "÷ float32 tokens/s: " + ", ".join(f"{name} **{x:.2f}x**" for name, x in speed.items() if name != "float32"),
              f"default here: {'bf16' if ParallelConfig().bf16(critic=True) else 'float32'} critic, "
              f"{'bf16' if ParallelConfig().bf16() else 'float32'} policy"]
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()

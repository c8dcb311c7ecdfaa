"""The `make run-agent` learning problem in one process: a warm-started model (`sao warmup`) played on
`calc-agent` with its real sandboxed python tool by an in-process `HFGenerator`, trained by the real
`SAOUpdate`, its weights copied back to the generator after every step (on-policy by default;
`--lag`, `--publish-dtype bfloat16` and `--critic-bf16` emulate the pipeline's stale rollouts, bf16
publication and bf16 critic), and scored greedily on the held-out split as `sao warmup` scores it.
No Kafka, no vLLM: a step of 8 episodes takes 1-3 minutes on 2 shared CPU cores.

Prints per step: reward, turns, why episodes ended, the advantage split by what the turn did
(`<tool_call>` or answer, in episodes that succeeded or failed), and every `--eval-every` steps the
held-out greedy accuracy and turns. `--dump 0 3` also prints, for those steps, every turn of
every episode: its first tokens, reward, mean value, advantage at its first token and mean ratio.

Run: `python bench/agent_loop.py --start runs/warmup/calc-agent-smollm2-… --steps 10 --eval-every 5 --dump 3`
(bench/results/agent_run.md, "Diagnosing the collapse").
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from learner.logprobs import token_logprobs  # noqa: E402
from learner.update import SAOUpdate, UpdateConfig  # noqa: E402
from learner.value import ValueModel  # noqa: E402
from producers.demos import training_tasks  # noqa: E402
from producers.envs import make_env  # noqa: E402
from producers.envs.chat import Chat  # noqa: E402
from producers.episode import TrajectoryIds, run_episode  # noqa: E402
from producers.generate.base import SamplingParams  # noqa: E402
from producers.generate.hf import HFGenerator  # noqa: E402
from producers.sandbox import Sandbox, SandboxConfig  # noqa: E402
from schemas.messages import Trajectory  # noqa: E402
from schemas.tokenizers import load_tokenizer  # noqa: E402


@dataclass(kw_only=True)
class AgentLoopConfig:
    start: Path
    """The warm-started folder `sao warmup` printed."""
    steps: int = 8
    """Learner steps."""
    batch: int = 8
    """Episodes per step, one per training task."""
    max_tokens: int = 96
    """Most tokens per model turn (make run-agent's --max-tokens)."""
    eval_every: int = 4
    """Score the held-out split greedily every this many steps (and before the first); 0: never."""
    eval_tasks: int = 32
    """Held-out tasks scored."""
    heldout_frac: float = 0.1
    """The split make run-agent uses."""
    dump: tuple[int, ...] = (0,)
    """Steps whose every turn of every episode is printed."""
    publish_dtype: str = "float32"
    """dtype of the weights the generator gets after each step (`sao learner` publishes bfloat16 by
    default: `--weights.dtype`); the learner keeps float32 either way."""
    critic_bf16: bool = False
    """Run the critic's forward under bf16 autocast, as `sao learner` computes it on a CPU with native
    bf16 (`--parallel.critic-mixed-precision`, by default on there)."""
    lag: int = 0
    """Versions the rollouts lag the learner by (the pipeline's staleness; 0: on-policy)."""
    shuffle_rewards: bool = False
    """Train each episode on the reward of another episode of its batch (a random permutation): the
    update's noise without its signal, the null against which a run's drift is judged."""
    seed: int = 0
    threads: int = 2
    update: UpdateConfig = field(default_factory=lambda: UpdateConfig(
        warmup_steps=3, lr_policy=2e-5, lr_critic=5e-4, micro_batch_tokens=1024))
    """The learner step; defaults are make run-agent's learner flags."""


def play(env, generator: HFGenerator, params: SamplingParams, tasks: list[dict], prefix: str) -> list[Trajectory]:
    async def together():
        return await asyncio.gather(*[run_episode(env.episode(t), generator, params, TrajectoryIds(
            id=f"{prefix}{i}", prompt_id=str(i), env=env.name, producer_id="local")) for i, t in enumerate(tasks)])
    return list(asyncio.run(together()))


def turns(traj: Trajectory) -> list[tuple[int, int]]:
    """(start, end) of each action span."""
    acted = np.concatenate([[0], traj.action_mask.astype(int), [0]])
    edges = np.flatnonzero(np.diff(acted))
    return list(zip(edges[::2], edges[1::2]))


def evaluate(cfg: AgentLoopConfig, model, env, tokenizer) -> dict[str, float]:
    from sao.warmup import WarmupConfig, held_out_score
    wcfg = WarmupConfig(env="calc-agent", model=str(cfg.start), eval_tasks=cfg.eval_tasks, max_tokens=cfg.max_tokens,
                        heldout_frac=cfg.heldout_frac, seed=0)  # seed 0: the tasks `sao warmup` scored
    return held_out_score(wcfg, model, env, tokenizer)


def advantage_split(trajs: list[Trajectory], adv: list[np.ndarray], tokenizer) -> dict[str, str]:
    """Sum and token mean of Â by turn kind (call or answer) × outcome (ok or failed)."""
    sums, counts = Counter(), Counter()
    first = Counter()
    for t, a in zip(trajs, adv):
        ok = "ok" if t.reward > 0 else "fail"
        for s, e in turns(t):
            kind = "call" if "<tool_call>" in tokenizer.decode(t.tokens[s:e]) else "answer"
            sums[f"{kind}/{ok}"] += float(a[s:e].sum())
            counts[f"{kind}/{ok}"] += e - s
            first[f"{kind}/{ok}"] += float(a[s])
    return {k: f"Σ{sums[k]:+.1f} n{counts[k]} mean{sums[k] / counts[k]:+.3f} first-token Σ{first[k]:+.2f}"
            for k in sorted(counts)}


def dump(trajs: list[Trajectory], mbs, ratio: list[np.ndarray], tokenizer) -> None:
    rows = {}
    for mb in mbs:
        for j, i in enumerate(mb.rows):
            rows[i] = (mb.adv[j].float().numpy(), mb.values[j].float().numpy(), mb.returns[j].float().numpy())
    for i, t in enumerate(trajs):
        adv, values, returns = rows[i]
        print(f"  episode {i}: reward {t.reward} turns {t.num_turns} ended {t.finish_reason} tokens {len(t.tokens)} "
              f"(response {len(t.tokens) - t.prompt_len}, actions {int(t.action_mask.sum())})")
        for s, e in turns(t):
            text = tokenizer.decode(t.tokens[s:e]).replace("\n", "⏎")
            obs_end = next((s2 for s2, _ in turns(t) if s2 > e), len(t.tokens))
            obs = tokenizer.decode(t.tokens[e:obs_end]).replace("\n", "⏎")
            print(f"    [{s}:{e}] V {values[s]:+.3f}..{values[e - 1]:+.3f} R {returns[s]:+.2f} "
                  f"Â first {adv[s]:+.3f} mean {adv[s:e].mean():+.3f} ratio mean {ratio[i][s:e].mean():.3f} "
                  f"min {ratio[i][s:e].min():.3f} | {text[:90]!r} | obs {obs[:60]!r}")


def main(cfg: AgentLoopConfig) -> None:
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(str(cfg.start))
    env = make_env("calc-agent", tokenizer=tokenizer, sandbox=Sandbox(SandboxConfig()))
    policy = AutoModelForCausalLM.from_pretrained(cfg.start, dtype=torch.float32)
    critic = ValueModel.from_policy(policy)
    if cfg.critic_bf16:
        forward = critic.forward
        critic.forward = lambda **kw: torch.autocast("cpu", dtype=torch.bfloat16)(forward)(**kw)
    update = SAOUpdate(policy, critic, cfg.update)
    generator = HFGenerator(AutoModelForCausalLM.from_pretrained(cfg.start, dtype=torch.float32), seed=cfg.seed)
    params = SamplingParams(temperature=cfg.update.temperature, max_tokens=cfg.max_tokens,
                            stop_token_ids=Chat(tokenizer).stop_token_ids())
    tasks = training_tasks(env, 10 ** 9, cfg.heldout_frac, cfg.seed + 1)
    seen: dict = {}
    shuffle = random.Random(cfg.seed)
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    original = update.advantages

    def spy(mbs, *args, **kwargs):
        seen["mbs"] = mbs
        return original(mbs, *args, **kwargs)
    update.advantages = spy
    print(f"{cfg}", flush=True)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for step in range(cfg.steps + 1):
                if cfg.eval_every and step % cfg.eval_every == 0 or step == cfg.steps:
                    t0 = time.perf_counter()
                    f = evaluate(cfg, generator.model, env, tokenizer)
                    print(f"EVAL v{generator.version} (step {step}): " + " ".join(f"{k} {v:.3f}" for k, v in sorted(f.items())
                                                       if isinstance(v, float)) + f" ({time.perf_counter() - t0:.0f} s)",
                          flush=True)
                if step == cfg.steps:
                    break
                t0 = time.perf_counter()
                trajs = play(env, generator, params, [next(tasks) for _ in range(cfg.batch)], f"{step}.")
                play_s = time.perf_counter() - t0
                ratio = None
                if step in cfg.dump:
                    from learner.logprobs import collate
                    with torch.no_grad():
                        b = collate(trajs)
                        logp, _ = token_logprobs(policy, b, temperature=cfg.update.temperature)
                        ratio = [torch.exp(logp - b.logp_rollout)[i].numpy() for i in range(len(trajs))]
                if cfg.shuffle_rewards:
                    shuffled = shuffle.sample([t.reward for t in trajs], len(trajs))
                    trajs = [dataclasses.replace(t, reward=r) for t, r in zip(trajs, shuffled)]
                t0 = time.perf_counter()
                m = update.step(trajs)
                learn_s = time.perf_counter() - t0
                advs = {}
                for mb in seen["mbs"]:
                    for j, i in enumerate(mb.rows):
                        advs[i] = mb.adv[j, :len(trajs[i].tokens)].float().numpy()
                reasons = Counter(t.finish_reason for t in trajs)
                print(f"STEP {step}: reward {m['reward/mean']:.3f} turns {statistics.fmean(t.num_turns for t in trajs):.2f} "
                      f"tokens {sum(len(t.tokens) for t in trajs)} ended {dict(reasons)} value/mean {m.get('value/mean', 0):+.3f} "
                      f"adv/mean {m['adv/mean']:+.3f} ev {m.get('value/explained_var', float('nan')):.2f} "
                      f"kept {m.get('dis/kept_frac', float('nan')):.3f} entropy {m.get('policy/entropy', float('nan')):.3f} "
                      f"gn {m.get('grad_norm/policy', float('nan')):.2f} updated {m['step/policy_updated']} "
                      f"({play_s:.0f} s play, {learn_s:.0f} s learn)", flush=True)
                for k, v in advantage_split(trajs, [advs[i] for i in range(len(trajs))], tokenizer).items():
                    print(f"  adv {k}: {v}")
                if ratio is not None:
                    dump(trajs, seen["mbs"], ratio, tokenizer)
                dtype = getattr(torch, cfg.publish_dtype)
                snapshots[step + 1] = {k: v.detach().to(dtype, copy=True).contiguous()
                                       for k, v in policy.state_dict().items()}
                version = max(0, step + 1 - cfg.lag)
                snapshots = {v: w for v, w in snapshots.items() if v >= version}
                if version > generator.version:
                    save_file(snapshots[version], f"{tmp}/w.safetensors")
                    generator.load_weights(f"{tmp}/w.safetensors", version=version)
    finally:
        generator.close()


if __name__ == "__main__":
    main(tyro.cli(AgentLoopConfig))

"""Can SAO's critic learn a run's values before RL? Offline, from the episodes a finished calc-agent
run trained on: the critic (initialised from the warm start, attention frozen, `--update.lr-critic`,
K = 2 updates a batch) is trained on run A's first `--train` episodes in their order, 8 a batch,
through the learner's own step with the policy held still (the critic warm-up); each step's
`value/explained_var` is out of sample (computed before that batch's updates). After each pass it
values 64 episodes from run B of tasks it never trained on, at their first action token: explained variance and
correlation with the reward, and the mean value by the problem's number of operations, beside the
explained variance of each size's mean reward (what a baseline that knows only the size explains).

    python bench/critic_fit.py --model runs/warmup/FOLDER --train-run runs/agent-18 --test-run runs/agent-17
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import tyro  # noqa: E402

from bench.run_episodes import read_run  # noqa: E402
from learner.logprobs import collate  # noqa: E402
from learner.models import ModelConfig, build_policy  # noqa: E402
from learner.update import SAOUpdate, UpdateConfig  # noqa: E402
from learner.value import ValueModel, critic_values  # noqa: E402


@dataclass
class Args:
    model: str
    """The warm start the run began from (`sao warmup`'s folder)."""
    train_run: Path
    test_run: Path
    train: int = 128
    """Episodes the critic trains on: the train run's first, in the order trained; then 64 of the
    test run's episodes whose tasks are not among them are scored."""
    passes: int = 2
    lr_critic: float = 5e-4
    threads: int = 2


def sized(run: Path) -> tuple[list, dict[str, int]]:
    """The run's calc-agent episodes in the order trained (by their oldest version), and each
    prompt's number of operations."""
    episodes, tasks = read_run(run)
    kept = sorted((t for t in episodes if "steps" in tasks.get(t.prompt_id, {})),
                  key=lambda t: (t.min_version, t.id))
    return kept, {t.prompt_id: len(tasks[t.prompt_id]["steps"]) for t in kept}


@torch.no_grad()
def first_values(critic: ValueModel, episodes: list) -> np.ndarray:
    out = []
    for i in range(0, len(episodes), 8):
        batch = collate(episodes[i:i + 8])
        values = critic_values(critic, batch)
        out += [float(v[m.bool()][0]) for v, m in zip(values, batch.action_mask)]
    return np.array(out)


def score(critic: ValueModel, episodes: list, sizes: list[int]) -> str:
    r, v, s = np.array([t.reward for t in episodes]), first_values(critic, episodes), np.array(sizes)
    by_size = np.array([r[s == k].mean() for k in s])
    ev = 1 - np.var(r - v) / np.var(r)
    corr = np.corrcoef(v, r)[0, 1] if v.std() > 0 else float("nan")
    means = ", ".join(f"{k}: {v[s == k].mean():.2f}" for k in sorted(set(sizes)))
    return (f"explained variance {ev:.3f}, corr {corr:.3f} (each size's mean reward explains "
            f"{1 - np.var(r - by_size) / np.var(r):.3f}); mean value by operations {means}")


def main(args: Args) -> None:
    torch.set_num_threads(args.threads)
    train, _ = sized(args.train_run)
    train = train[:args.train]
    seen = {t.prompt_id for t in train}
    test, sizes = sized(args.test_run)
    test = [t for t in test if t.prompt_id not in seen][:64]  # tasks the critic never saw
    test_sizes = [sizes[t.prompt_id] for t in test]
    print(f"{len(train)} episodes of {args.train_run} to train on, {len(test)} of {args.test_run} (other tasks) to "
          f"score [{torch.get_num_threads()} threads]", flush=True)
    policy = build_policy(ModelConfig(name=args.model))
    critic = ValueModel.from_policy(policy)
    update = SAOUpdate(policy, critic, UpdateConfig(warmup_steps=10**9, lr_critic=args.lr_critic,
                                                    micro_batch_tokens=1024))
    print(f"before: {score(critic, test, test_sizes)}", flush=True)
    for p in range(args.passes):
        for i in range(0, len(train) - 7, 8):
            t0 = time.time()
            m = update.step(train[i:i + 8])
            print(f"pass {p} batch {i // 8}: out-of-sample explained variance {m['value/explained_var']:.3f} "
                  f"corr {m['value/return_corr']:.3f} ({time.time() - t0:.0f} s)", flush=True)
        print(f"after pass {p}: {score(critic, test, test_sizes)}", flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))

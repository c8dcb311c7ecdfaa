"""Can SAO's critic learn a run's values before RL? Offline, from the episodes a finished calc-agent
run trained on: the critic (initialised from the warm start, attention frozen, `--update.lr-critic`,
K = 2 updates a batch) is trained on run A's first `--train` episodes in their order, 8 a batch,
through the learner's own step with the policy held still (the critic warm-up); each step's
`value/explained_var` is out of sample (computed before that batch's updates). After each pass it
values 64 episodes from run B of tasks it never trained on, at their first action token: explained variance and
correlation with the reward, and the mean value by the problem's number of operations, beside the
explained variance of each size's mean reward (what a baseline that knows only the size explains).
Before training, a linear probe asks whether the information is there at all: ridge regression
from the warm start's last hidden state at the first action token (what the value head reads) to
the reward and to the size, fitted on the training episodes (its penalty chosen by 4-fold cross
validation on them) and scored on the test run's.

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
from learner.logprobs import collate, model_inputs  # noqa: E402
from learner.models import ModelConfig, build_policy  # noqa: E402
from learner.update import SAOUpdate, UpdateConfig  # noqa: E402
from learner.value import ValueModel  # noqa: E402


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
    """Passes over the training episodes (0: the probe and the untrained critic's score only)."""
    lr_critic: float = 5e-4
    lr_value_head: float | None = None
    """The value head's own rate (`--update.lr-value-head`); None: `--lr-critic`."""
    threads: int = 2


def sized(run: Path) -> tuple[list, dict[str, int]]:
    """The run's calc-agent episodes in the order trained (by their oldest version), and each
    prompt's number of operations."""
    episodes, tasks = read_run(run)
    kept = sorted((t for t in episodes if "steps" in tasks.get(t.prompt_id, {})),
                  key=lambda t: (t.min_version, t.id))
    return kept, {t.prompt_id: len(tasks[t.prompt_id]["steps"]) for t in kept}


@torch.no_grad()
def first_states(critic: ValueModel, episodes: list) -> np.ndarray:
    """The backbone's last hidden state at the state each episode's first action token was sampled in."""
    out = []
    for i in range(0, len(episodes), 8):
        batch = collate(episodes[i:i + 8])
        hidden = critic.backbone(**model_inputs(batch, False), use_cache=False).last_hidden_state
        out += [h[int(m.nonzero()[0]) - 1].float().numpy() for h, m in zip(hidden, batch.action_mask)]
    return np.stack(out)


def ridge(x: np.ndarray, y: np.ndarray, alpha: float):
    mu, sd = x.mean(0), x.std(0) + 1e-6
    z = (x - mu) / sd
    w = np.linalg.solve(z.T @ z + alpha * np.eye(z.shape[1]), z.T @ (y - y.mean()))
    return lambda x2: ((x2 - mu) / sd) @ w + y.mean()


def explained(y: np.ndarray, predicted: np.ndarray) -> float:
    return 1 - np.var(y - predicted) / np.var(y)


def probe(x: np.ndarray, y: np.ndarray, x_test: np.ndarray, y_test: np.ndarray) -> str:
    """Explained variance on the test episodes of a ridge fit on the training ones, its penalty the
    best of 4-fold cross validation on them."""
    folds = np.arange(len(y)) % 4

    def cv(alpha: float) -> float:
        return np.mean([explained(y[folds == k], ridge(x[folds != k], y[folds != k], alpha)(x[folds == k]))
                        for k in range(4)])
    alpha = max((10.0 ** k for k in range(5)), key=cv)
    return f"{explained(y_test, ridge(x, y, alpha)(x_test)):.3f} (penalty {alpha:g})"


def head_values(critic: ValueModel, states: np.ndarray) -> np.ndarray:
    """V at the first action token: the value head over `first_states` (as `critic_values` computes it)."""
    return states @ critic.head.weight.detach().float().numpy()[0] + critic.head.bias.item()


def score(critic: ValueModel, states: np.ndarray, episodes: list, sizes: list[int]) -> str:
    r, v, s = np.array([t.reward for t in episodes]), head_values(critic, states), np.array(sizes)
    by_size = np.array([r[s == k].mean() for k in s])
    ev = explained(r, v)
    corr = np.corrcoef(v, r)[0, 1] if v.std() > 0 else float("nan")
    means = ", ".join(f"{k}: {v[s == k].mean():.2f}" for k in sorted(set(sizes)))
    return (f"explained variance {ev:.3f}, corr {corr:.3f} (each size's mean reward explains "
            f"{explained(r, by_size):.3f}); mean value by operations {means}")


def main(args: Args) -> None:
    torch.set_num_threads(args.threads)
    train, train_sizes = sized(args.train_run)
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
                                                    lr_value_head=args.lr_value_head, micro_batch_tokens=1024))
    x, x_test = first_states(critic, train), first_states(critic, test)
    rewards, test_rewards = np.array([t.reward for t in train]), np.array([t.reward for t in test])
    ops = np.array([train_sizes[t.prompt_id] for t in train], float)
    print(f"linear probe of the warm start's state at the first action token, explained variance on the test "
          f"episodes: reward {probe(x, rewards, x_test, test_rewards)}, number of operations "
          f"{probe(x, ops, x_test, np.array(test_sizes, float))}", flush=True)
    print(f"before: {score(critic, x_test, test, test_sizes)}", flush=True)
    for p in range(args.passes):
        for i in range(0, len(train) - 7, 8):
            t0 = time.time()
            m = update.step(train[i:i + 8])
            print(f"pass {p} batch {i // 8}: out-of-sample explained variance {m['value/explained_var']:.3f} "
                  f"corr {m['value/return_corr']:.3f} ({time.time() - t0:.0f} s)", flush=True)
        print(f"after pass {p}: {score(critic, first_states(critic, test), test, test_sizes)}", flush=True)


if __name__ == "__main__":
    main(tyro.cli(Args))

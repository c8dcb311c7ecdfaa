"""What an evaluation reports, from the rewards of its episodes: pure functions over numbers.

Per task: one greedy episode (the policy's single most likely answer) and k sampled ones at the
training temperature. An episode is solved when its reward reaches `success` (1.0 for the
exact-answer environments; a judged style can set its own bar).

- `greedy/mean`, `greedy/pass@1`: mean greedy reward; share of tasks whose greedy episode is solved.
- `sampled/mean@k`: the mean reward of the k samples (verl's mean@N, prime-rl's avg@k).
- `sampled/pass@1`, `sampled/pass@k`: unbiased estimates of P(one of 1, of k, samples is solved),
  per task from its k samples (Chen et al. 2021), then averaged over tasks.
- `sampled/best@k`: the mean over tasks of the best of the k rewards (for graded rewards).
- `episode/*`: response tokens, turns, and the share of episodes cut at the token budget.

Two versions scored on the same tasks compare task by task (`paired_change`): the tasks one scores
higher on than the other, and an exact sign test on them. On a few dozen tasks a change of a few
tasks is within chance (32 tasks at 0.4 have a binomial standard error of 0.087), so a run's
before-and-after says how likely its change is under no change at all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from schemas.messages import Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n, of which c are solved, is
    solved) = 1 − C(n−c, k) / C(n, k), computed as a stable product."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def greedy_scores(rewards: Sequence[float], success: float) -> dict[str, float]:
    """The greedy figures of one reward per task."""
    r = np.asarray(rewards, float)
    return {"greedy/mean": float(r.mean()), "greedy/pass@1": float((r >= success).mean())}


def sampled_scores(rewards: Sequence[Sequence[float]], success: float) -> dict[str, float]:
    """The sampled figures of k rewards per task (every task the same k)."""
    r = np.asarray(rewards, float)  # (tasks, k)
    k = r.shape[1]
    solved = (r >= success).sum(axis=1)
    return {f"sampled/mean@{k}": float(r.mean()),
            "sampled/pass@1": float(np.mean([pass_at_k(k, int(c), 1) for c in solved])),
            f"sampled/pass@{k}": float(np.mean([pass_at_k(k, int(c), k) for c in solved])),
            f"sampled/best@{k}": float(r.max(axis=1).mean())}


def task_scores(rewards: Sequence[Sequence[float]], greedy: bool) -> list[float]:
    """One figure per task, in task order, for comparing versions task by task: its greedy
    episode's reward (the first of its row) where greedy episodes are played, else its samples' mean."""
    return [float(row[0]) if greedy else float(np.mean(row)) for row in rewards]


def sign_test(gained: int, lost: int) -> float:
    """Two-sided exact p-value of `gained` against `lost` under "each changed task is as likely to
    have gone either way" (the binomial sign test; McNemar's exact test on paired outcomes)."""
    n, k = gained + lost, min(gained, lost)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def paired_change(before: Sequence[float], after: Sequence[float]) -> dict[str, float]:
    """How `after` differs from `before` on the same tasks: tasks it scores higher on (gained; with
    a 0/1 reward, solved by after alone), lower on (lost), and the sign test's p-value of that split."""
    if len(before) != len(after):
        raise ValueError(f"paired scores need the same tasks: {len(before)} against {len(after)}")
    d = np.asarray(after, float) - np.asarray(before, float)
    gained, lost = int((d > 0).sum()), int((d < 0).sum())
    return {"gained": gained, "lost": lost, "p": sign_test(gained, lost)}


def episode_scores(episodes: Sequence[Trajectory]) -> dict[str, float]:
    """What the episodes looked like: response length, turns, and the share cut at the budget."""
    if not episodes:
        return {}
    return {"episode/response_tokens": float(np.mean([t.num_tokens - t.prompt_len for t in episodes])),
            "episode/turns": float(np.mean([t.num_turns for t in episodes])),
            "episode/truncated": float(np.mean([t.finish_reason == "length" for t in episodes]))}


def headline(metrics: dict[str, float]) -> tuple[str, float]:
    """The one figure to plot and print: the mean greedy reward, else the mean sampled one (with
    a 0/1 reward, that is the accuracy)."""
    for name in ("greedy/mean", *sorted(m for m in metrics if m.startswith("sampled/mean@"))):
        if name in metrics:
            return name, metrics[name]
    return "", math.nan


def by_env(results: list[dict]) -> dict[str, list[dict]]:
    """Evaluation records (eval.jsonl lines) per environment, environments in first-seen order and
    each one's records in the order measured."""
    grouped: dict[str, list[dict]] = {}
    for r in results:
        grouped.setdefault(r.get("env", ""), []).append(r)
    return grouped

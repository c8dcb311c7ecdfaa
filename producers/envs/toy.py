"""Toy environments over raw token ids, for learning tests and benchmarks with tiny models.

Both share one rule. Token ids below `FIRST` are reserved (0 pad, 1 BOS, 2 SEP); a content token
t ≥ FIRST belongs to target set i when (t − FIRST) mod n_tasks = i, and the task token of set i is
FIRST + i. A model that emits uniformly random tokens scores about 1/n_tasks; one that reads the
task token and emits only its set scores 1.

- `toy-target` (single turn): prompt [BOS, task token]; reward = fraction of the action span in
  the target set.
- `toy-multiturn`: n_turns action spans; after each but the last the environment appends the
  observation [SEP, task token of the next turn], so the target set changes between turns.
  The outcome is the mean over turns of each span's fraction; with `turn_rewards`, each turn's
  share (fraction / n_turns) arrives on its own turn instead, and the final step carries the last.
Rewards lie in [0, 1] (a trajectory's per-turn rewards and outcome sum to at most 1).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from producers.envs.base import Step

PAD, BOS, SEP = 0, 1, 2
FIRST = 3  # first content token


def target_fraction(action_ids: list[int], target: int, n_tasks: int) -> float:
    """Fraction of `action_ids` in target set `target`; 0 for an empty span."""
    hits = sum(t >= FIRST and (t - FIRST) % n_tasks == target for t in action_ids)
    return hits / len(action_ids) if action_ids else 0.0


def _check(vocab_size: int, n_tasks: int) -> None:
    if not 1 <= n_tasks <= vocab_size - FIRST:
        raise ValueError(f"n_tasks={n_tasks} must be in [1, vocab_size - {FIRST}] "
                         f"(vocab_size={vocab_size})")


@dataclass
class TargetEpisode:
    prompt_ids: list[int]
    target: int
    n_tasks: int
    max_turns: int = 1

    def step(self, action_ids: list[int]) -> Step:
        return Step(reward=target_fraction(action_ids, self.target, self.n_tasks), done=True)


@dataclass(kw_only=True)
class TargetEnv:
    """toy-target: emit tokens of the set named by the prompt's task token."""

    vocab_size: int = 64
    n_tasks: int = 4
    name: str = "toy-target"
    heldout = False  # n_tasks tasks: too few to set any aside from training (producers/heldout.py)

    def __post_init__(self):
        _check(self.vocab_size, self.n_tasks)

    def sample_task(self, rng: random.Random) -> dict:
        return {"target": rng.randrange(self.n_tasks)}

    def episode(self, task: dict) -> TargetEpisode:
        return TargetEpisode([BOS, FIRST + task["target"]], task["target"], self.n_tasks)


@dataclass
class MultiTurnEpisode:
    prompt_ids: list[int]
    targets: list[int]
    n_tasks: int
    turn_rewards: bool
    max_turns: int = 0
    turn: int = 0
    score: float = 0.0  # sum of shares so far

    def __post_init__(self):
        self.max_turns = len(self.targets)

    def step(self, action_ids: list[int]) -> Step:
        share = target_fraction(action_ids, self.targets[self.turn], self.n_tasks) / self.max_turns
        self.turn += 1
        self.score += share
        if self.turn == self.max_turns:
            return Step(reward=share if self.turn_rewards else self.score, done=True)
        return Step(observation=[SEP, FIRST + self.targets[self.turn]],
                    reward=share if self.turn_rewards else None)


@dataclass(kw_only=True)
class MultiTurnEnv:
    """toy-multiturn: each turn, emit tokens of the set the latest task token names."""

    vocab_size: int = 64
    n_tasks: int = 4
    n_turns: int = 3
    turn_rewards: bool = False
    name: str = "toy-multiturn"

    def __post_init__(self):
        _check(self.vocab_size, self.n_tasks)
        if self.n_turns < 1:
            raise ValueError(f"n_turns={self.n_turns} must be >= 1")

    def sample_task(self, rng: random.Random) -> dict:
        return {"targets": [rng.randrange(self.n_tasks) for _ in range(self.n_turns)]}

    def episode(self, task: dict) -> MultiTurnEpisode:
        targets = list(task["targets"])
        return MultiTurnEpisode([BOS, FIRST + targets[0]], targets, self.n_tasks, self.turn_rewards)

"""The rule-based judge's styles (consumers/judges.py `STYLES`) as reward functions
`(task, text, trajectory) -> float`, so a process that scores its own episodes, such as `sao eval`
on the `writing` env, scores them as `sao judge --judge style --criteria NAME` does:
`--reward consumers.style_rewards:concise`. Named by import path, not imported, by the producers.
"""

from __future__ import annotations

from consumers.judges import STYLES


def __getattr__(name: str):
    if name not in STYLES:
        raise AttributeError(f"no style {name!r}; the style judge knows {sorted(STYLES)}")

    def reward(task: dict, text: str, trajectory) -> float:
        return STYLES[name](text)
    reward.__name__ = name
    return reward

"""A reward function: 1 when the last number in the response is the task's answer, else 0.

sao calls it once per finished episode, as `score(task, text, trajectory)`: the prompt's task map,
the model's decoded response (every turn's actions), and the `schemas.messages.Trajectory` about
to be published (token ids, action mask, turns, ...). Its value replaces the env's reward; return
None to leave the episode to a live reward stream (`sao.trajectories.pending`: `sao judge`,
`sao reward publish`). An exception or a non-number dead-letters that one prompt.

    sao producer --env math --reward examples.reward:score --model tiny-llama-bytes
"""

import re


def score(task: dict, text: str, trajectory) -> float | None:
    if "answer" not in task:
        return None  # nothing to check against: a judge or a human decides
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return 1.0 if found and int(found[-1]) == task["answer"] else 0.0

"""A custom environment in plain text: guess a number in a few turns.

Gym-style, so no token ids: `reset` gives the prompt, `step` takes the model's reply as text and
gives (observation, reward, done); sao tokenises through the model's chat template and trains
on exactly the tokens the model sampled. One instance plays one episode.

    sao producer --env examples.custom_env:GuessNumber --model tiny-llama-bytes
"""

import random
import re


class GuessNumber:
    def __init__(self, max_turns: int = 4):  # sao offers max_turns (--max-turns) as it does to the built-ins
        self.turns_left = max_turns

    def sample_task(self, rng: random.Random) -> dict:
        return {"answer": rng.randint(1, 20)}  # tasks travel as JSON/msgpack maps

    def reset(self, task: dict) -> str:
        self.answer = task["answer"]
        return "I am thinking of a number from 1 to 20. Reply with your guess, a number only."

    def step(self, action: str) -> tuple[str, float | None, bool]:
        self.turns_left -= 1
        found = re.findall(r"-?\d+", action)
        guess = int(found[-1]) if found else None
        if guess == self.answer:
            return "", 1.0, True
        if self.turns_left == 0:
            return "", 0.0, True
        hint = "That is not a number." if guess is None else f"{guess} is too {'low' if guess < self.answer else 'high'}."
        return f"{hint} Guess again.", None, False

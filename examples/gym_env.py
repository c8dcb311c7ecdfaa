"""A Gymnasium environment with text observations and actions, for `--env gym://…`:

    sao up --env "gym://examples.gym_env:sao-examples/GuessDigit-v0" --model tiny-llama-bytes

`gymnasium.make("examples.gym_env:…")` imports this module, which registers the id. The agent
guesses a hidden digit; each wrong guess is answered "higher" or "lower"; reward 1 for finding it,
within four guesses (Gymnasium's own `max_episode_steps` truncates the episode).
"""

from __future__ import annotations

import string

import gymnasium
from gymnasium import spaces


class GuessDigit(gymnasium.Env):
    metadata = {"render_modes": []}

    def __init__(self):
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = spaces.Text(max_length=200, charset=string.printable)
        self.digit = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.digit = int(self.np_random.integers(0, 10))
        return "I picked a digit from 0 to 9. Guess it: reply with one digit.", {}

    def step(self, action: str):
        guess = next((int(c) for c in action if c.isdigit()), None)
        if guess == self.digit:
            return "Found it.", 1.0, True, False, {}
        hint = "not a digit" if guess is None else "higher" if guess < self.digit else "lower"
        return f"No: {hint}. Guess again.", 0.0, False, False, {}


gymnasium.register(id="sao-examples/GuessDigit-v0", entry_point=GuessDigit, max_episode_steps=4)

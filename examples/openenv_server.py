"""An OpenEnv environment server, for `--env openenv://HOST:PORT`:

    python -m examples.openenv_server --port 8001 &
    sao up --env openenv://127.0.0.1:8001 --model tiny-llama-bytes

The server is OpenEnv's own (`openenv-core`: `create_app` over an `Environment`), reached by the
producers over OpenEnv's WebSocket protocol, one session per episode. The agent must repeat a
word back; reward 1 when it does, within three tries.
"""

from __future__ import annotations

import argparse
import random
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

WORDS = ("apple", "river", "stone", "cloud", "lemon", "tiger")


class SayAction(Action):
    message: str = Field(..., description="What the agent says")


class SayObservation(Observation):
    prompt: str = Field(default="", description="What the environment says")


class RepeatEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state, self.word, self.tries = State(episode_id=str(uuid4()), step_count=0), "", 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> SayObservation:
        self.word, self.tries = random.Random(seed).choice(WORDS), 0
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return SayObservation(prompt=f"Say the word '{self.word}'.", done=False, reward=0.0)

    def step(self, action: SayAction, **kwargs) -> SayObservation:
        self.tries += 1
        self._state.step_count += 1
        said = self.word in action.message.lower()
        done = said or self.tries >= 3
        return SayObservation(prompt="Right." if said else f"No. Say '{self.word}'.", done=done,
                              reward=1.0 if said else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(RepeatEnvironment, SayAction, SayObservation, env_name="repeat", max_concurrent_envs=64)

if __name__ == "__main__":
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")

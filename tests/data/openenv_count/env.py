"""The environment, its Action and Observation, and OpenEnv's own server for it (`python -m openenv_count.env PORT`)."""

from __future__ import annotations

import sys
from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class CountAction(Action):
    number: int = Field(ge=0, le=9, description="a digit to add")


class CountObservation(Observation):
    prompt: str
    total: int = 0


class CountEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.total = 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> CountObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self.total = 0
        return CountObservation(prompt=f"Say a digit; reach exactly 10 (seed {seed}).")

    def step(self, action: CountAction, timeout_s: Optional[float] = None, **kwargs: Any) -> CountObservation:
        self._state.step_count += 1
        self.total += action.number
        done = self.total >= 10
        return CountObservation(prompt=f"total {self.total}", total=self.total, done=done,
                                reward=float(self.total == 10) if done else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(CountEnvironment, CountAction, CountObservation, env_name="count", max_concurrent_envs=8)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")

"""Environment faults through the adapters, as the agent loop meets them (issue 26): an environment that raises,
hangs past the step timeout, returns a non-text observation, or ends its episode twice. Each ends the trajectory
with an error naming the environment and the session, counted as failed (the router is told `dropped_failed`,
verl drops the GRPO group as failed), the session ended on the server; or, for a double end, the trajectory
completes and the failed close is counted.
verl's real agent-loop machinery with the LLM scripted (verl_tide/testing/agent_loop_harness.py)."""

from __future__ import annotations

import re
import time
from typing import Any, Optional

import gymnasium
import pytest
from pydantic import BaseModel, Field

from verl_tide.env.agent_loop import EnvAgentLoop, EnvTrajectoryFailed
from verl_tide.env.gym_adapter import register_gym_environment
from verl_tide.env.openenv_host import register_openenv_object
from verl_tide.testing.agent_loop_harness import ScriptedLLM, env_agent_loop
from verl_tide.testing.env_hosting import hosted

FAULTS = ("raise", "hang", "not_text", "double_end")
STEP_TIMEOUT_S = 1.0


class FaultyGym(gymnasium.Env):
    """A one-step text game that misbehaves as `fault` says, on its first step."""

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, fault: str = "", render_mode: Optional[str] = "ansi"):
        self.fault, self.render_mode, self.closes = fault, render_mode, 0
        self.action_space = gymnasium.spaces.Discrete(4)
        self.observation_space = gymnasium.spaces.Discrete(2)
        self.stepped = False

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action):
        self.stepped = True
        if self.fault == "raise":
            raise RuntimeError("physics blew up")
        if self.fault == "hang":
            time.sleep(3 * STEP_TIMEOUT_S)
        return 1, 1.0, True, False, {}

    def render(self):
        return [1, 2] if self.fault == "not_text" and self.stepped else "you are here"

    def close(self):
        self.closes += 1
        if self.fault == "double_end" and self.closes > 1:
            raise RuntimeError("episode already ended")


class DoubleClosingGym(FaultyGym):
    """Ends its episode twice: gymnasium's wrappers and the adapter both close it; the second close raises."""

    def step(self, action):
        out = super().step(action)
        self.close()
        return out


class Say(BaseModel):
    message: str = Field(min_length=1)


class Said(BaseModel):
    done: bool = False
    reward: Optional[float] = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    text: Any = "say something"


class FaultyOpenEnv:
    fault = ""

    def __init__(self):
        self.closes = 0

    def reset(self, seed: Optional[int] = None) -> Said:
        return Said()

    def step(self, action: Say) -> Any:
        if self.fault == "raise":
            raise RuntimeError("physics blew up")
        if self.fault == "hang":
            time.sleep(3 * STEP_TIMEOUT_S)
        if self.fault == "not_text":
            return object()
        if self.fault == "double_end":
            self.close()
        return Said(text="bye", done=True, reward=1.0)

    def close(self) -> None:
        self.closes += 1
        if self.fault == "double_end" and self.closes > 1:
            raise RuntimeError("episode already ended")


def _gym(fault: str) -> str:
    env_id = f"TideFaulty-{fault}-v0"
    if env_id not in gymnasium.registry:
        gymnasium.register(env_id, entry_point=DoubleClosingGym if fault == "double_end" else FaultyGym)
    return register_gym_environment(env_id, {"fault": fault}, name=f"gym-{fault}", max_turns=4)


def _openenv(fault: str) -> str:
    cls = type(f"FaultyOpenEnv_{fault}", (FaultyOpenEnv,), {"fault": fault})
    return register_openenv_object(cls, Say, name=f"openenv-{fault}", observation_field="text", max_turns=4)


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("adapter", [_gym, _openenv], ids=["gym", "openenv"])
async def test_a_faulty_environment_fails_its_trajectory_clearly_and_the_session_ends(tiny_tokenizer, adapter, fault):
    name = adapter(fault)
    row = {"raw_prompt": [{"role": "system", "content": "Play."}],
           "extra_info": {"tide_env": {"env": name, "task": {}, "seed": 0}}}
    before = dict(EnvAgentLoop.outcomes)
    async with hosted(name, step_timeout_s=STEP_TIMEOUT_S) as (server, url):
        loop = env_agent_loop(tiny_tokenizer, ScriptedLLM(tiny_tokenizer, ["1"] * 4), url,
                              request_timeout_s=10 * STEP_TIMEOUT_S)
        if fault == "double_end":  # the trajectory stands; the second end is counted, not fatal
            out = await loop.run({}, **row)
            assert out.extra_fields["tide_env_outcome"] == "done" and out.reward_score == 1.0
            assert server.counters["close_failed"] == 1
            assert EnvAgentLoop.outcomes["completed"] == before.get("completed", 0) + 1
        else:  # a training trajectory: verl drops its GRPO group as failed (tests/test_tide_trainer_e2e.py)
            with pytest.raises(EnvTrajectoryFailed) as failed:
                await loop.run({}, **row)
            assert EnvAgentLoop.outcomes["failed"] == before.get("failed", 0) + 1
            why = {"raise": "physics blew up", "hang": f"timed out after {STEP_TIMEOUT_S:g} s",
                   "not_text": "not text|a pydantic model or a dict, not object"}[fault]
            error = str(failed.value)
            assert f"'{name}'" in error and "(session s" in error, error
            assert re.search(why, error), error
        assert server.counters["started"] == server.counters["ended"] == 1 and not server.sessions

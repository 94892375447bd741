"""An OpenEnv Environment object hosted by the reference server (issue 26, direction b), with an environment in
OpenEnv's shape (pydantic Action and Observation with `done`, `reward`, `metadata`; reset(seed, episode_id);
step(action)). tests/test_openenv_real.py runs openenv-core's own classes and server."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Optional

import pytest
from pydantic import BaseModel, Field

from verl_tide.env.client import EnvClient, EnvError
from verl_tide.env.conformance import run_checks
from verl_tide.env.openenv_host import register_openenv_object
from verl_tide.testing.env_hosting import hosted


class CountAction(BaseModel):
    number: int = Field(ge=0, le=9)


class CountObservation(BaseModel):
    done: bool = False
    reward: Optional[float] = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    prompt: str
    total: int


class CountEnv:
    """Say digits until the total reaches 10: reward 1 when it lands exactly on 10, else 0 when it passes it."""

    instances: list["CountEnv"] = []

    def __init__(self):
        self.total, self.closed, self.seed, self.step_threads = 0, False, None, set()
        CountEnv.instances.append(self)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None) -> CountObservation:
        self.seed = seed
        return CountObservation(prompt="Say a digit; reach exactly 10.", total=0)

    def step(self, action: CountAction) -> CountObservation:
        self.step_threads.add(threading.get_ident())
        self.total += action.number
        done = self.total >= 10
        return CountObservation(prompt=f"total {self.total}", total=self.total, done=done,
                                reward=float(self.total == 10) if done else 0.0, metadata={"secret": 1})

    def close(self) -> None:
        self.closed = True


class AsyncCountEnv(CountEnv):
    async def step_async(self, action: CountAction) -> CountObservation:
        await asyncio.sleep(0)
        return CountObservation(prompt="async", total=action.number, done=True, reward=0.5)


@pytest.fixture
async def counting():
    CountEnv.instances.clear()
    name = register_openenv_object(CountEnv, CountAction, name="openenv-count", action_field="number",
                                   observation_field="prompt", max_turns=8, invalid_action_penalty=0.25)
    async with hosted(name, session_timeout_s=30.0) as (server, url):
        yield server, url


async def test_an_openenv_object_plays_an_episode_with_its_own_reward_and_done(counting):
    server, url = counting
    async with EnvClient(url) as c:
        r = await c.start(task={"seed": 7})
        assert r.observation == "Say a digit; reach exactly 10."
        await c.pause(r.session_id)
        await c.resume(r.session_id)
        steps = [await c.step(r.session_id, d) for d in ("4", "6")]
        await c.end(r.session_id)
    env = CountEnv.instances[-1]
    assert env.seed == 7 and env.closed  # the task's seed reached reset; the episode's end closed the object
    assert [s.observation for s in steps] == ["total 4", "total 10"]
    assert [s.reward for s in steps] == [0.0, 1.0] and [s.done for s in steps] == [False, True]
    assert threading.get_ident() not in env.step_threads  # a sync step ran off the server's event loop
    assert server.counters["started"] == server.counters["ended"] == 1


async def test_a_reply_the_action_model_rejects_is_an_invalid_action_with_the_penalty(counting):
    _, url = counting
    async with EnvClient(url) as c:
        r = await c.start()
        bad = await c.step(r.session_id, "twelve")
        assert bad.reward == -0.25 and not bad.done and "Invalid action for CountAction" in bad.observation
        assert bad.info["invalid_action"] is True
        ok = await c.step(r.session_id, "3")  # the episode goes on
        assert ok.observation == "total 3"
        await c.end(r.session_id)


async def test_the_whole_observation_without_openenvs_own_fields_when_no_field_is_named():
    name = register_openenv_object(AsyncCountEnv, CountAction, name="openenv-count-json", action_field="number")
    async with hosted(name) as (_, url):
        async with EnvClient(url) as c:
            r = await c.start()
            assert r.observation == '{"prompt": "Say a digit; reach exactly 10.", "total": 0}'
            s = await c.step(r.session_id, "2")  # the overridden step_async is awaited, not the sync step
            assert (s.observation, s.reward, s.done) == ('{"prompt": "async", "total": 2}', 0.5, True)
            await c.end(r.session_id)


async def test_an_environment_that_raises_is_an_error_naming_the_environment_and_session():
    class Broken(CountEnv):
        def step(self, action):
            raise RuntimeError("simulator crashed")

    name = register_openenv_object(Broken, CountAction, name="openenv-broken", action_field="number")
    async with hosted(name) as (server, url):
        async with EnvClient(url, max_retries=0) as c:
            r = await c.start()
            with pytest.raises(EnvError, match=r"openenv-broken.*session s\d+-.*simulator crashed"):
                await c.step(r.session_id, "1")
            await c.end(r.session_id)
        assert server.counters["ended"] == 1


async def test_the_conformance_kit_passes_a_hosted_openenv_object(counting):
    _, url = counting
    results = await run_checks(url, env="openenv-count")
    failed = [(r.name, r.detail) for r in results if r.status == "FAIL"]
    assert not failed and any(r.status == "PASS" for r in results), failed


def test_bad_registration_names_the_field_and_the_flags():
    with pytest.raises(ValueError, match=r"action field 'text' is not a field of CountAction \(fields: number\)"):
        register_openenv_object(CountEnv, CountAction, name="never", action_field="text")
    with pytest.raises(TypeError, match="not callable"):
        register_openenv_object(CountEnv(), CountAction, name="never2", action_field="number")
    from verl_tide.cli import main

    with pytest.raises(SystemExit):
        main(["env", "serve", "--openenv-env", "tests.test_openenv_host:CountEnv"])  # no --openenv-action

"""A Gymnasium environment this repository did not write, served through the environment service (issue 26)."""

from __future__ import annotations

import gymnasium  # in constraints/cpu.txt (the `gym` extra): a missing install fails here, never skips
import pytest

from verl_tide.env.client import EnvClient, EnvError
from verl_tide.env.conformance import run_checks
from verl_tide.env.gym_adapter import InvalidAction, discrete_action_parser, register_gym_environment, render_text
from verl_tide.testing.env_hosting import hosted

ACTIONS = ["left", "down", "right", "up"]  # FrozenLake's Discrete(4), in order


@pytest.fixture
async def frozen_lake():
    name = register_gym_environment("FrozenLake-v1", {"is_slippery": False}, name="frozen-test",
                                    action_names=ACTIONS, invalid_action_penalty=0.25)
    async with hosted(name, session_timeout_s=5.0) as served:
        yield served


async def test_an_episode_of_frozen_lake_walks_to_the_goal_through_text(frozen_lake):
    server, url = frozen_lake
    async with EnvClient(url) as c:
        r = await c.start(seed=0)
        assert "answer with one action: left, down, right, up" in r.observation
        assert "[S]FFF" in r.observation  # the ANSI highlight of the player's cell, shown as text
        assert r.info["max_turns"] == 100  # the environment's own TimeLimit
        # the model's words, not numbers; a reply the parser cannot read costs the penalty and nothing else
        s = await c.step(r.session_id, "I will jump")
        assert s.observation.startswith("Invalid action:") and "left, down, right, up" in s.observation
        assert s.reward == -0.25 and not s.done and s.info["invalid_action"]
        rewards = []
        for reply in ("Go right.", "right", "down", "2nd move: down", "down", "right"):
            s = await c.step(r.session_id, reply)
            rewards.append(s.reward)
        assert s.done and rewards[-1] == 1.0 and sum(rewards[:-1]) == 0.0
        assert "(Right)" in s.observation.splitlines()[0] and s.observation.endswith("HFF[G]")
        await c.end(r.session_id)
    assert server.counters["started"] == server.counters["ended"] == 1 and not server.sessions


async def test_falling_in_a_hole_ends_the_episode_with_no_reward(frozen_lake):
    _, url = frozen_lake
    async with EnvClient(url) as c:
        r = await c.start(seed=0)
        s = await c.step(r.session_id, "down")
        s = await c.step(r.session_id, "right")  # (1, 1) is a hole
        assert s.done and s.reward == 0.0
        await c.end(r.session_id)


async def test_pause_keeps_a_gym_episode_alive_past_the_timeout():
    """The server's pause freezes a Gymnasium episode's inactivity clock like any other's."""

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    name = register_gym_environment("FrozenLake-v1", {"is_slippery": False}, name="frozen-pause", action_names=ACTIONS)
    async with hosted(name, clock=clock, session_timeout_s=5.0) as (_, url):
        async with EnvClient(url, max_retries=0) as c:
            paused, idle = (await c.start(seed=0)).session_id, (await c.start(seed=1)).session_id
            await c.pause(paused)
            clock.now += 60.0  # far past the timeout
            with pytest.raises(EnvError, match="expired"):
                await c.step(idle, "right")
            await c.resume(paused)
            assert not (await c.step(paused, "right")).done  # still alive, same episode
            await c.end(paused)


async def test_the_conformance_kit_passes_the_gym_adapter(frozen_lake):
    _, url = frozen_lake
    results = await run_checks(url, env="frozen-test")
    failed = [(r.name, r.detail) for r in results if r.status == "FAIL"]
    assert not failed and any(r.status == "PASS" for r in results), failed


def test_an_environment_that_cannot_render_text_is_refused_at_registration_naming_the_fix():
    with pytest.raises(ValueError, match=r"CartPole-v1 cannot be served as text.*--gym-formatter MODULE:FUNC"):
        register_gym_environment("CartPole-v1", name="cartpole-refused")
    # with a formatter it is served
    assert register_gym_environment("CartPole-v1", name="cartpole-formatted",
                                    formatter=lambda obs, env: " ".join(f"{x:.2f}" for x in obs)) == "cartpole-formatted"


async def test_an_observation_that_is_not_text_is_a_clear_error_naming_the_environment():
    # a formatter that cannot render (here the default one, given explicitly, so registration does not check it)
    name = register_gym_environment("CartPole-v1", name="cartpole-test", formatter=render_text)
    async with hosted(name) as (server, url):
        async with EnvClient(url, max_retries=0) as c:
            with pytest.raises(EnvError, match=r"cartpole-test.*not text.*render_mode='ansi'"):
                await c.start()
        assert not server.sessions


def test_the_default_parser_reads_names_then_integers_in_range():
    space = gymnasium.spaces.Discrete(4)
    parse = discrete_action_parser(ACTIONS)
    assert parse("UP!", space) == 3 and parse("move 2", space) == 2 and parse("7 or 1", space) == 1
    with pytest.raises(InvalidAction, match="answer with left, down, right, up"):
        parse("north", space)
    with pytest.raises(InvalidAction, match="Discrete"):
        discrete_action_parser()("1", gymnasium.spaces.Box(0, 1, (2,)))


def test_serve_names_the_bad_flag():
    from verl_tide.cli import main

    with pytest.raises(SystemExit):
        main(["env", "serve", "--gym", "NoSuchEnv-v0"])
    with pytest.raises(SystemExit):
        main(["env", "serve", "--gym", "FrozenLake-v1", "--gym-kwargs", "[1, 2]"])


def test_env_tasks_writes_one_row_an_episode_for_the_named_environment(tmp_path):
    import pandas as pd

    from verl_tide.cli import main

    out = tmp_path / "train.parquet"
    assert main(["env", "tasks", "--env", "FrozenLake-v1", "--n", "3", "--seed", "7", "--out", str(out)]) == 0
    rows = pd.read_parquet(out)
    specs = [r["tide_env"] for r in rows["extra_info"]]
    assert [s["env"] for s in specs] == ["FrozenLake-v1"] * 3 and [s["seed"] for s in specs] == [7, 8, 9]
    assert all("task" not in s for s in specs)  # /start gets no task: the environment's own reset
    assert rows["prompt"][0][0]["content"].startswith("Play the game.")
    with pytest.raises(SystemExit):
        main(["env", "tasks", "--env", "FrozenLake-v1", "--n", "0", "--out", str(out)])

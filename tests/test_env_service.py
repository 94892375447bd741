"""Environment service: reference server, client and conformance kit, over real HTTP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from verl_tide.env.client import (
    EnvClient,
    EnvError,
    EnvMalformedResponse,
    EnvPayloadTooLarge,
    EnvSessionEnded,
    EnvUnavailable,
)
from verl_tide.env.conformance import format_table, run_checks
from verl_tide.env.envs import make_environment
from verl_tide.env.server import EnvServer, ServerConfig
from verl_tide.testing.eventually import eventually


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def served():
    servers = []

    async def start(clock=time.monotonic, **cfg):
        server = EnvServer(ServerConfig(**{"latency_scale": 0.0, **cfg}), clock=clock)
        servers.append(server)
        return server, await server.start()

    yield start
    for s in servers:
        await s.stop()


async def test_happy_path_guess_to_the_answer(served):
    server, url = await served(default_env="tiny")
    async with EnvClient(url) as c:
        r = await c.start(task={"low": 1, "high": 16, "target": 11}, seed=3)
        assert "between 1 and 16" in r.observation and r.info["max_turns"] == 6
        s1 = await c.step(r.session_id, "I guess 8")
        assert "too low" in s1.observation and s1.reward == 0.0 and not s1.done
        s2 = await c.step(r.session_id, "12")
        assert "too high" in s2.observation
        s3 = await c.step(r.session_id, "so 11")
        assert s3.done and s3.reward == 1.0 and s3.info["found"]
        with pytest.raises(EnvSessionEnded, match="episode is done"):
            await c.step(r.session_id, "11")
        assert await c.end(r.session_id) is True
        assert await c.end(r.session_id) is False  # idempotent
    assert server.counters["started"] == 1 and not server.sessions


async def test_an_injected_fault_fails_the_step_naming_environment_and_session(served):
    """`task.fail_at_turn` (training jobs' failure paths, tests/test_tide_trainer_e2e.py): the guessing game
    raises from that turn on; the server reports it with the environment and the session."""
    server, url = await served(default_env="tiny")
    async with EnvClient(url) as c:
        r = await c.start(task={"low": 1, "high": 16, "target": 11, "fail_at_turn": 2}, seed=3)
        assert not (await c.step(r.session_id, "8")).done
        with pytest.raises(EnvError, match=rf"step of 'guess' failed \(session {r.session_id}\): injected fault "
                                           r"at turn 2 \(task.fail_at_turn = 2\)"):
            await c.step(r.session_id, "11")  # (the right answer: the fault comes first)
        await c.end(r.session_id)
    assert not server.sessions


async def test_health_reports_when_the_first_episode_started(served):
    """A benchmark's one clock for every system: the first /start (benchmarks/e2e_compare.py)."""
    server, url = await served()
    async with aiohttp.ClientSession() as http:
        async with http.get(url + "/health") as r:
            assert (await r.json())["first_start_unix"] is None
        before = time.time()
        async with EnvClient(url) as c:
            await c.start()
            await c.start()
        async with http.get(url + "/health") as r:
            first = (await r.json())["first_start_unix"]
    assert before <= first <= time.time() and server.first_start_unix == first


async def test_shop_search_click_buy_reward(served):
    server, url = await served()
    async with EnvClient(url) as c:
        r = await c.start(env="shop", seed=5)
        env = make_environment("shop", 5)
        env.reset({})
        goal = env.goal  # the same seed gives the same catalog and goal
        assert f"{goal['size']} {goal['color']} {goal['kind']}" in r.observation
        found = await c.step(r.session_id, f"search[{goal['kind']} {goal['color']} {goal['size']}]")
        match = next(it for it in env.items if it["kind"] == goal["kind"] and it["color"] == goal["color"]
                     and it["size"] == goal["size"] and it["price"] <= goal["max_price"])
        assert match["id"] in found.observation
        await c.step(r.session_id, f"click[{match['id']}]")
        bought = await c.step(r.session_id, "buy")
        assert bought.done and bought.reward == 1.0
        await c.end(r.session_id)


def test_tiny_dense_grades_the_format_reward_by_the_share_of_digits_and_tiny_slow_does_not():
    dense, flat = make_environment("tiny_dense", 0), make_environment("tiny_slow", 0)
    for env in (dense, flat):
        env.reset({"low": 1, "high": 16, "target": 16})
    assert dense.step("3 or 4 ab")[1] == pytest.approx(0.1 * 2 / 9)  # two digits of nine characters
    assert flat.step("3 or 4 ab")[1] == pytest.approx(0.1)
    assert dense.step("none")[1] == 0.0 and dense.step("16")[1] == 1.0  # no number; the target


def test_environments_are_deterministic_under_a_seed():
    a, b = make_environment("webshop", 42), make_environment("webshop", 42)
    assert a.reset({}) == b.reset({})
    assert [a.step("search[red shirt]") for _ in range(3)] == [b.step("search[red shirt]") for _ in range(3)]
    with pytest.raises(KeyError, match="allowed: alfworld"):
        make_environment("nope", 0)


async def test_paused_session_outlives_the_timeout_unpaused_one_expires(served):
    clock = FakeClock()
    server, url = await served(session_timeout_s=5.0, clock=clock)
    async with EnvClient(url) as c:
        paused = (await c.start(seed=1)).session_id
        idle = (await c.start(seed=2)).session_id
        await c.pause(paused)
        clock.now += 60.0  # far past the timeout
        with pytest.raises(EnvSessionEnded, match="expired after 5 s"):
            await c.step(idle, "3")
        await c.resume(paused)
        assert (await c.step(paused, "3")).observation  # still alive
        clock.now += 4.0
        await c.step(paused, "4")  # activity keeps it alive
        clock.now += 5.5
        with pytest.raises(EnvSessionEnded):
            await c.step(paused, "5")
    assert server.counters["expired"] == 2


async def test_reaper_expires_idle_sessions_in_the_background(served):
    server, url = await served(session_timeout_s=0.2)
    async with EnvClient(url) as c:
        await c.start()
        await eventually(lambda: server.counters["expired"] == 1)  # session_timeout_s = 0.2
    assert not server.sessions


async def test_one_hundred_concurrent_sessions_and_back_pressure(served):
    server, url = await served(max_sessions=100)

    async def episode(c: EnvClient, i: int) -> float:
        r = await c.start(task={"low": 1, "high": 4, "target": 2}, seed=i)
        for guess in ("1", "2"):
            s = await c.step(r.session_id, guess)
            if s.done:
                return s.reward
        return 0.0

    async with EnvClient(url) as c:
        rewards = await asyncio.gather(*(episode(c, i) for i in range(100)))
        assert rewards == [1.0] * 100
        assert len(server.sessions) == 100
        async with EnvClient(url, max_retries=0) as impatient:
            with pytest.raises(EnvUnavailable, match="HTTP 429"):
                await impatient.start()
        async with aiohttp.ClientSession() as raw:
            async with raw.post(url + "/start", json={}) as resp:
                assert resp.status == 429 and resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "too_many_sessions"
        await asyncio.gather(*(c.end(sid) for sid in list(server.sessions)))
    assert not server.sessions and server.counters["ended"] == 100


async def test_malformed_requests_get_clear_errors(served):
    server, url = await served(max_body_bytes=1000)
    async with aiohttp.ClientSession() as raw:
        async def post(path, data):
            async with raw.post(url + path, data=data, headers={"Content-Type": "application/json"}) as r:
                return r.status, await r.json()

        assert await post("/start", b"[1, 2") == (400, {"error": {"code": "malformed_request", "message":
                                                                   "/start request: body is not JSON (Expecting ',' delimiter: line 1 column 6 (char 5))"}})
        status, body = await post("/observation", json.dumps({"session_id": "x", "action": 5}).encode())
        assert status == 400 and "field 'action' must be str" in body["error"]["message"]
        status, body = await post("/start", json.dumps({"seed": "one"}).encode())
        assert status == 400 and "field 'seed' must be int" in body["error"]["message"]
        status, body = await post("/start", json.dumps({"env": "nope"}).encode())
        assert status == 400 and body["error"]["code"] == "unknown_env" and "allowed:" in body["error"]["message"]
        status, body = await post("/start", json.dumps({"task": {"pad": "x" * 2000}}).encode())
        assert status == 413 and body["error"]["code"] == "payload_too_large"
        status, body = await post("/pause", json.dumps({"session_id": "ghost"}).encode())
        assert status == 404 and body["error"]["code"] == "unknown_session"
        status, body = await post("/start", json.dumps({"task": {"low": 9, "high": 1}}).encode())
        assert status == 500 and "task.high = 1 must be >= task.low = 9" in body["error"]["message"]
        async with raw.get(url + "/nope") as r:
            assert r.status == 404 and "error" in await r.json()


async def test_retried_action_is_not_applied_twice(served):
    server, url = await served()
    async with EnvClient(url) as c, aiohttp.ClientSession() as raw:
        sid = (await c.start(task={"low": 1, "high": 100, "target": 50})).session_id
        body = {"session_id": sid, "action": "10", "request_id": "r1"}
        replies = []
        for _ in range(2):
            async with raw.post(url + "/observation", json=body) as r:
                replies.append(await r.json())
        assert replies[0] == replies[1] and replies[0]["info"]["turns"] == 1
        assert (await c.step(sid, "20")).info["turns"] == 2


async def _fake_server(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize(
    "reply, error, match",
    [
        (web.Response(text="<html>oops</html>"), EnvMalformedResponse, "not JSON"),
        (web.json_response({"observation": "x"}), EnvMalformedResponse, "missing field 'session_id'"),
        (web.json_response({"session_id": 7, "observation": "x"}), EnvMalformedResponse, "'session_id' must be str"),
        (web.json_response([1, 2]), EnvMalformedResponse, "expected a JSON object"),
        (web.json_response({"weird": True}, status=400), EnvMalformedResponse, "missing field 'error'"),
        (web.json_response({"session_id": "s", "observation": "x" * 5000}), EnvPayloadTooLarge, "above the limit"),
    ],
)
async def test_malformed_responses_are_reported_with_the_field(reply, error, match):
    async def handler(request):
        return reply

    runner, url = await _fake_server(handler)
    try:
        async with EnvClient(url, max_payload_bytes=2000, max_retries=0) as c:
            with pytest.raises(error, match=match):
                await c.start()
    finally:
        await runner.cleanup()


async def test_a_hanging_server_times_out_instead_of_hanging():
    async def handler(request):
        await asyncio.sleep(5)
        return web.json_response({})

    runner, url = await _fake_server(handler)
    try:
        async with EnvClient(url, request_timeout_s=0.3, max_retries=1, backoff_s=0.01) as c:
            t0 = time.monotonic()
            with pytest.raises(EnvUnavailable, match="2 attempt"):
                await c.step("s", "a")
            assert time.monotonic() - t0 < 5
    finally:
        await runner.cleanup()


async def test_server_killed_mid_session_gives_a_clear_error(served):
    server, url = await served()
    async with EnvClient(url, max_retries=2, backoff_s=0.01, request_timeout_s=2) as c:
        sid = (await c.start()).session_id
        await server.stop()  # graceful stop ends the session; then the port is gone
        with pytest.raises(EnvUnavailable, match="failed after 3 attempt"):
            await c.step(sid, "1")
        with pytest.raises(EnvUnavailable):
            await c.end(sid)


async def test_conformance_kit_passes_the_reference_server(served):
    server, url = await served(session_timeout_s=0.5)
    results = await run_checks(url, timeout_check_max_s=2.0)
    table = format_table(results)
    assert all(r.status == "PASS" for r in results), table
    assert "12 passed, 0 failed, 0 skipped" in table


async def test_conformance_kit_fails_a_broken_server():
    async def handler(request):
        if request.path == "/health":
            return web.json_response({"status": "ok", "version": "other/0"})
        return web.json_response({"ok": True})

    runner, url = await _fake_server(handler)
    try:
        results = {r.name: r for r in await run_checks(url, request_timeout_s=2.0)}
    finally:
        await runner.cleanup()
    assert results["health"].status == "FAIL" and "expected 'tide-env/1'" in results["health"].detail
    assert results["start"].status == "FAIL" and "missing field 'session_id'" in results["start"].detail
    assert results["observation"].status == "SKIP"
    assert results["malformed JSON"].status == "FAIL"


def test_cli_serve_and_check(tmp_path):
    from verl_tide.testing.pytest_plugin import spawn_env_service

    server, url = spawn_env_service("--session-timeout", "1")
    try:
        check = subprocess.run([sys.executable, "-m", "verl_tide.cli", "env", "check", url],
                               capture_output=True, text=True, timeout=120)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "12 passed, 0 failed, 0 skipped" in check.stdout
    finally:
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=30)
    assert server.returncode == 0 and "stopped" in out
    bad = subprocess.run([sys.executable, "-m", "verl_tide.cli", "env", "serve", "--env", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--env 'nope': allowed:" in bad.stderr


async def test_an_action_on_a_paused_session_does_not_restart_its_clock(served):
    clock = FakeClock()
    server, url = await served(session_timeout_s=5.0, clock=clock)
    async with EnvClient(url) as c:
        sid = (await c.start(seed=1)).session_id
        await c.pause(sid)
        await c.step(sid, "3")  # CTB paused the task while its last action was in flight
        clock.now += 60.0
        await c.step(sid, "4")  # still paused: the timeout did not run
        await c.resume(sid)
        clock.now += 6.0
        with pytest.raises(EnvSessionEnded, match="expired"):
            await c.step(sid, "5")
    assert server.counters["paused"] == 1 and server.counters["resumed"] == 1


async def test_a_registered_custom_environment_is_hosted(served):
    from verl_tide.env.envs import ENVIRONMENTS, PRESETS, Environment, EnvPreset, register_environment

    class Echo(Environment):
        def reset(self, task):
            return "say something"

        def step(self, action):
            return f"you said {action}", float(len(action)), True, {}

    register_environment("echo", Echo, EnvPreset("echo", max_turns=1, observation_words=0, step_latency_s=0.0))
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_environment("echo", Echo)
        server, url = await served()
        async with EnvClient(url) as c:
            r = await c.start(env="echo")
            s = await c.step(r.session_id, "hi")
            assert (s.observation, s.reward, s.done) == ("you said hi", 2.0, True)
    finally:
        ENVIRONMENTS.pop("echo", None)
        PRESETS.pop("echo", None)

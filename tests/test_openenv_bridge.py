"""An OpenEnv server's episodes through the environment service (issue 26), against a server that speaks
openenv-core 0.3.0's WebSocket schema (openenv-core itself is not in the test bed's lock)."""

from __future__ import annotations

import json

import pytest
from aiohttp import WSMsgType, web

from verl_tide.env.client import EnvClient, EnvError
from verl_tide.env.conformance import run_checks
from verl_tide.env.openenv_bridge import register_openenv_environment, ws_url
from verl_tide.testing.env_hosting import hosted


class FakeOpenEnv:
    """OpenEnv's echo environment over /ws: reset says hello, each step echoes `message` and scores its length
    over 10; the third step ends the episode; an empty message is a validation error."""

    def __init__(self):
        self.sockets_opened = self.sockets_closed = self.close_messages = 0
        self.resets: list[dict] = []

    async def ws(self, request):
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets_opened += 1
        steps = 0
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                break
            m = json.loads(msg.data)
            if m["type"] == "reset":
                self.resets.append(m["data"])
                steps = 0
                await ws.send_json({"type": "observation", "data": {
                    "observation": {"echoed_message": "hello", "message_length": 0}, "reward": None, "done": False}})
            elif m["type"] == "step":
                text = m["data"].get("message", "")
                if not text:
                    await ws.send_json({"type": "error", "data": {"message": "message: field required",
                                                                  "code": "VALIDATION_ERROR"}})
                    continue
                steps += 1
                await ws.send_json({"type": "observation", "data": {
                    "observation": {"echoed_message": text, "message_length": len(text)},
                    "reward": len(text) / 10, "done": steps >= 3}})
            elif m["type"] == "close":
                self.close_messages += 1
                break
        self.sockets_closed += 1
        return ws

    async def start(self) -> tuple[web.AppRunner, str]:
        app = web.Application()
        app.router.add_get("/ws", self.ws)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def bridged():
    remote = FakeOpenEnv()
    runner, url = await remote.start()
    name = register_openenv_environment(url, name="openenv-echo", action_field="message",
                                        observation_field="echoed_message", max_turns=10, timeout_s=10)
    try:
        async with hosted(name, session_timeout_s=30.0) as (server, server_url):
            yield remote, server, server_url
    finally:
        await runner.cleanup()


def test_the_socket_url_is_the_one_openenvs_client_builds():
    assert ws_url("http://h:8000") == "ws://h:8000/ws" and ws_url("https://h/") == "wss://h/ws"
    assert ws_url("ws://h:1/ws") == "ws://h:1/ws"
    with pytest.raises(ValueError, match="expected http"):
        register_openenv_environment("h:8000", name="never")


async def test_an_openenv_episode_runs_through_the_service_with_pause_on_our_side(bridged):
    remote, server, url = bridged
    async with EnvClient(url) as c:
        r = await c.start(task={"episode_id": "e1"})
        assert r.observation == "hello" and remote.resets[-1]["episode_id"] == "e1" and "seed" in remote.resets[-1]
        await c.pause(r.session_id)  # OpenEnv has no pause: the reference server keeps it
        await c.resume(r.session_id)
        replies = [await c.step(r.session_id, text) for text in ("go", "left", "done!")]
        assert [s.observation for s in replies] == ["go", "left", "done!"]
        assert [s.reward for s in replies] == [0.2, 0.4, 0.5] and [s.done for s in replies] == [False, False, True]
        await c.end(r.session_id)
    assert remote.sockets_opened == 1 and remote.close_messages == 1  # one socket per episode, closed at its end
    assert server.counters["started"] == server.counters["ended"] == 1 and not server.sessions


async def test_a_refused_action_is_an_error_naming_the_environment_the_session_and_openenvs_reason(bridged):
    remote, server, url = bridged
    async with EnvClient(url, max_retries=0) as c:
        r = await c.start()
        with pytest.raises(EnvError, match=r"openenv-echo.*session s\d+-.*VALIDATION_ERROR"):
            await c.step(r.session_id, "")
        await c.end(r.session_id)  # ended and closed like any other
    assert server.counters["ended"] == 1
    await server.stop()
    assert remote.sockets_closed == 1


async def test_an_unreachable_openenv_server_fails_the_start_clearly():
    name = register_openenv_environment("http://127.0.0.1:9", name="openenv-down", timeout_s=2)
    async with hosted(name) as (server, url):
        async with EnvClient(url, max_retries=0) as c:
            with pytest.raises(EnvError, match=r"openenv-down.*cannot open OpenEnv session at ws://127.0.0.1:9/ws"):
                await c.start()
        assert not server.sessions


async def test_the_conformance_kit_passes_the_openenv_bridge(bridged):
    _, _, url = bridged
    results = await run_checks(url, env="openenv-echo")
    failed = [(r.name, r.detail) for r in results if r.status == "FAIL"]
    assert not failed and any(r.status == "PASS" for r in results), failed


def test_serve_names_the_bad_openenv_url():
    from verl_tide.cli import main

    with pytest.raises(SystemExit):
        main(["env", "serve", "--openenv", "localhost:8000"])

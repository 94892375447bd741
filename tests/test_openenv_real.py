"""openenv-core 0.3.0 itself, both directions (issue 26): its own server (`create_app`, uvicorn) played through
the bridge, and an environment written on its own base classes hosted by our server. openenv-core pulls gradio
and fastmcp, so it lives in its own virtual environment (`make openenv-venv`, constraints/openenv.txt), as an
OpenEnv server does in its own container; the environment is tests/data/openenv_count/env.py."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from verl_tide.env.client import EnvClient, EnvError
from verl_tide.env.conformance import run_checks
from verl_tide.env.openenv_bridge import register_openenv_environment
from verl_tide.testing.env_hosting import hosted
from verl_tide.testing.testbed import free_port, spawn_env_service

pytestmark = pytest.mark.openenv
ROOT = Path(__file__).resolve().parents[1]
OPENENV_PYTHON = ROOT / ".venv-openenv" / "bin" / "python"
PATH_ENV = {"PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'data'}"}


@pytest.fixture(scope="module")
def openenv_python() -> str:
    if not OPENENV_PYTHON.exists():
        pytest.fail(f"{OPENENV_PYTHON} is missing: `make openenv-venv` builds it (`make test` does)")
    return str(OPENENV_PYTHON)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                return json.load(r)
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.communicate(timeout=5)[0] if proc.poll() is not None else "(still running)"
                raise AssertionError(f"{url} never answered /health: {out}") from None
            time.sleep(0.2)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def openenv_server(openenv_python) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([openenv_python, "-m", "openenv_count.env", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, **PATH_ENV})
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait_healthy(url, proc).get("status") == "healthy"
        yield url
    finally:
        _stop(proc)


async def test_the_bridge_plays_openenvs_own_server(openenv_server):
    name = register_openenv_environment(openenv_server, name="openenv-real-count", action_field="number",
                                        observation_field="prompt", max_turns=10, timeout_s=30)
    async with hosted(name) as (server, url):
        async with EnvClient(url, max_retries=0) as c:
            r = await c.start(task={"seed": 5})
            assert r.observation == "Say a digit; reach exactly 10 (seed 5)."
            await c.pause(r.session_id)  # OpenEnv has no pause: ours
            await c.resume(r.session_id)
            steps = [await c.step(r.session_id, d) for d in ("4", "6")]
            assert [(s.observation, s.reward, s.done) for s in steps] == [("total 4", 0.0, False),
                                                                          ("total 10", 1.0, True)]
            await c.end(r.session_id)
            bad = await c.start()
            with pytest.raises(EnvError, match=r"openenv-real-count.*session s\d+-.*step refused"):
                await c.step(bad.session_id, "twelve")  # OpenEnv's own validation refuses it
            await c.end(bad.session_id)
        results = await run_checks(url, env=name)
        assert not [(x.name, x.detail) for x in results if x.status == "FAIL"]
        assert server.counters["started"] == server.counters["ended"]


async def test_an_environment_on_openenvs_base_classes_is_hosted_by_our_server(openenv_python):
    proc, url = spawn_env_service(
        "--openenv-env", "openenv_count.env:CountEnvironment", "--openenv-action", "openenv_count.env:CountAction",
        "--openenv-action-field", "number", "--openenv-observation-field", "prompt",
        python=openenv_python, extra_env=PATH_ENV)
    try:
        async with EnvClient(url, max_retries=0) as c:
            r = await c.start(task={"seed": 3})
            assert r.observation == "Say a digit; reach exactly 10 (seed 3)."
            bad = await c.step(r.session_id, "twelve")  # OpenEnv's Action model rejects it: a penalty, not a crash
            assert bad.reward == -0.1 and not bad.done and "Invalid action for CountAction" in bad.observation
            steps = [await c.step(r.session_id, d) for d in ("9", "1")]
            assert [(s.observation, s.reward, s.done) for s in steps] == [("total 9", 0.0, False),
                                                                          ("total 10", 1.0, True)]
            await c.end(r.session_id)
        results = await run_checks(url)
        assert not [(x.name, x.detail) for x in results if x.status == "FAIL"]
        health = _wait_healthy(url, proc)
        assert health["started"] == health["ended"] and health["close_failed"] == 0
    finally:
        _stop(proc)

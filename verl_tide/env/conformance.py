"""Conformance kit for environment authors: `verl-tide env check URL` exercises every endpoint of
`tide-env/1`, the pause/resume timeout semantics and the error cases, and prints a pass/fail table."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp

from verl_tide.env.client import EnvClient, EnvSessionEnded, EnvUnknownSession
from verl_tide.env.protocol import PROTOCOL_VERSION, parse_error


@dataclass
class CheckResult:
    name: str
    status: str  # PASS | FAIL | SKIP
    detail: str = ""


class _Skip(Exception):
    pass


async def run_checks(url: str, env: Optional[str] = None, timeout_check_max_s: float = 10.0,
                     oversize_bytes: int = 4 << 20, request_timeout_s: float = 30.0) -> list[CheckResult]:
    results: list[CheckResult] = []
    base = url.rstrip("/")
    async with EnvClient(base, request_timeout_s=request_timeout_s, max_retries=0,
                         max_payload_bytes=64 << 20) as client, \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=request_timeout_s)) as raw:
        state: dict[str, Any] = {}

        async def check(name: str, fn: Callable[[], Awaitable[str]]) -> None:
            try:
                results.append(CheckResult(name, "PASS", await fn() or ""))
            except _Skip as e:
                results.append(CheckResult(name, "SKIP", str(e)))
            except Exception as e:  # noqa: BLE001 - every failure becomes a row
                results.append(CheckResult(name, "FAIL", f"{type(e).__name__}: {e}"))

        async def post_raw(path: str, data: bytes) -> tuple[int, Any]:
            async with raw.post(base + path, data=data, headers={"Content-Type": "application/json"}) as r:
                body = await r.read()
                try:
                    return r.status, json.loads(body)
                except ValueError:
                    return r.status, body

        async def health() -> str:
            h = await client.health()
            state["health"] = h
            if h.get("version") != PROTOCOL_VERSION:
                raise AssertionError(f"version {h.get('version')!r}, expected {PROTOCOL_VERSION!r}")
            return f"{h.get('sessions')} open / max {h.get('max_sessions')}"

        async def start() -> str:
            r = await client.start(env=env, seed=0)
            state["sid"] = r.session_id
            return f"session {r.session_id}, {len(r.observation)} chars"

        async def observe() -> str:
            r = await client.step(_sid(state), "1")
            return f"reward {r.reward}, done {r.done}"

        async def pause_twice() -> str:
            await client.pause(_sid(state))
            await client.pause(_sid(state))
            return "idempotent"

        async def resume() -> str:
            await client.resume(_sid(state))
            return ""

        async def end_twice() -> str:
            first = await client.end(_sid(state))
            second = await client.end(_sid(state))
            if not first or second:
                raise AssertionError(f"first /end ended={first}, second ended={second}; expected True then False")
            return "idempotent"

        async def after_end() -> str:
            try:
                await client.step(_sid(state), "1")
            except EnvSessionEnded:
                return "410 session_ended"
            raise AssertionError("/observation after /end succeeded")

        async def unknown() -> str:
            try:
                await client.step("no-such-session", "1")
            except EnvUnknownSession:
                return "404 unknown_session"
            raise AssertionError("/observation on an unknown session succeeded")

        async def malformed_json() -> str:
            status, body = await post_raw("/observation", b"{not json")
            code, _ = parse_error(body)
            if status != 400 or code != "malformed_request":
                raise AssertionError(f"HTTP {status} {code}")
            return "400 malformed_request"

        async def missing_field() -> str:
            status, body = await post_raw("/observation", json.dumps({"action": "1"}).encode())
            code, message = parse_error(body)
            if status != 400 or "session_id" not in message:
                raise AssertionError(f"HTTP {status} {code}: {message}")
            return "400 names 'session_id'"

        async def oversize() -> str:
            status, body = await post_raw("/start", b'{"task": {"pad": "' + b"x" * oversize_bytes + b'"}}')
            if status != 413:
                raise AssertionError(f"HTTP {status} for a {oversize_bytes}-byte body")
            return f"413 for {oversize_bytes} bytes"

        async def pause_freezes_timeout() -> str:
            timeout = state.get("health", {}).get("session_timeout_s")
            if not isinstance(timeout, (int, float)) or timeout > timeout_check_max_s:
                raise _Skip(f"session timeout {timeout} s not reported or above {timeout_check_max_s} s; "
                            "serve with a short --session-timeout to check")
            paused = (await client.start(env=env, seed=1)).session_id
            idle = (await client.start(env=env, seed=2)).session_id
            await client.pause(paused)
            await asyncio.sleep(timeout * 1.5 + 0.5)
            try:
                await client.step(idle, "1")
                raise AssertionError("an idle, unpaused session outlived the timeout")
            except EnvSessionEnded:
                pass
            await client.resume(paused)
            await client.step(paused, "1")
            await client.end(paused)
            return f"paused session outlived {timeout:g} s; unpaused one expired"

        for name, fn in [("health", health), ("start", start), ("observation", observe),
                         ("pause (twice)", pause_twice), ("resume", resume), ("end (twice)", end_twice),
                         ("observation after end", after_end), ("unknown session", unknown),
                         ("malformed JSON", malformed_json), ("missing field", missing_field),
                         ("oversized body", oversize), ("pause freezes timeout", pause_freezes_timeout)]:
            await check(name, fn)
    return results


def _sid(state: dict[str, Any]) -> str:
    if "sid" not in state:
        raise _Skip("no session (start failed)")
    return state["sid"]


def format_table(results: list[CheckResult]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{r.name:<{width}}  {r.status:<6}  {r.detail}" for r in results]
    passed = sum(r.status == "PASS" for r in results)
    failed = sum(r.status == "FAIL" for r in results)
    lines.append(f"{passed} passed, {failed} failed, {len(results) - passed - failed} skipped")
    return "\n".join(lines)

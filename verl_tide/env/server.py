"""Reference environment server for `tide-env/1` (aiohttp), hosting the built-in environments.

- Binds 127.0.0.1 by default.
- Per-session inactivity timeout, frozen between /pause and /resume: a task that CTB paused
  keeps its environment however long the pause lasts (paper App. B.1).
- A cap on concurrent sessions: /start answers 429 with Retry-After when full.
- Request bodies above `max_body_bytes` get 413; every error has a JSON body.
- Graceful shutdown ends every open session.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from aiohttp import web

from verl_tide.env.envs import PRESETS, Environment, make_environment
from verl_tide.env.protocol import (
    ERROR_STATUS,
    PROTOCOL_VERSION,
    EnvProtocolError,
    error_body,
    parse_session_request,
    parse_start_request,
    parse_step_request,
)


@dataclass
class Session:
    env: Environment
    last_active: float
    paused: bool = False
    done: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_reply: Optional[tuple[str, dict[str, Any]]] = None  # (request_id, reply) for idempotent retries


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 0
    default_env: str = "tiny"
    session_timeout_s: float = 240.0
    max_sessions: int = 1024
    max_body_bytes: int = 1 << 20
    latency_scale: float = 1.0  # multiply environment latencies (0 = none, for tests)
    retry_after_s: int = 1
    # An environment step (or reset) that takes longer ends with an error naming the environment and the session,
    # below the client's own request timeout (tide.env.request_timeout_s, 30 s) so the agent loop reads why.
    step_timeout_s: float = 20.0
    tombstones: int = 10_000  # remembered ended session ids, for idempotent /end and clear 410s


class _Error(Exception):
    def __init__(self, code: str, message: str, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.code, self.message, self.headers = code, message, headers or {}


class EnvServer:
    def __init__(self, config: ServerConfig = ServerConfig(), clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # session id -> why it ended
        self.counters = {"started": 0, "ended": 0, "expired": 0, "rejected_full": 0, "paused": 0, "resumed": 0,
                         "close_failed": 0}
        self._closing: set[asyncio.Future] = set()
        # Wall-clock time (Unix seconds) of the first /start: a benchmark's one clock for every system it runs,
        # "from the first rollout request" (the agent loop starts an episode before its first generation).
        self.first_start_unix: Optional[float] = None
        # The agents' side of each turn: from a reply (/start's or /observation's) to the session's next action,
        # the policy's generation and the agent loop's host path (what a simulator needs beside the engine's time)
        self.agent_turns, self.agent_turn_s = 0, 0.0
        self._seq = itertools.count()
        self._runner: Optional[web.AppRunner] = None
        self._reaper: Optional[asyncio.Task] = None
        self.port: Optional[int] = None

    # ---- lifecycle -------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/start", self._start)
        app.router.add_post("/observation", self._observation)
        app.router.add_post("/end", self._end)
        app.router.add_post("/pause", self._pause)
        app.router.add_post("/resume", self._resume)
        app.router.add_get("/health", self._health)
        return app

    async def start(self) -> str:
        """Serve in the running event loop; returns the base URL."""
        # stop() ends every session first; what is left is idle keep-alive connections, not work to wait for
        self._runner = web.AppRunner(self.app(), handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # the bound port when port=0
        self._reaper = asyncio.create_task(self._reap_forever())
        return f"http://{self.config.host}:{self.port}"

    async def stop(self) -> None:
        """Graceful: stop accepting, end every open session, release the port."""
        if self._reaper is not None:
            self._reaper.cancel()
        for sid in list(self.sessions):
            self._finish(sid, "server shut down")
        if self._closing:  # remote episodes: give their closes a moment
            await asyncio.wait(list(self._closing), timeout=5)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ---- handlers --------------------------------------------------------------------------
    async def _start(self, request: web.Request) -> web.Response:
        env_name, task, seed = parse_start_request(await self._json(request))
        if len(self.sessions) >= self.config.max_sessions:
            self.counters["rejected_full"] += 1
            raise _Error("too_many_sessions", f"{len(self.sessions)} sessions open (max {self.config.max_sessions})",
                         {"Retry-After": str(self.config.retry_after_s)})
        name = env_name or self.config.default_env
        try:
            env = make_environment(name, seed)
        except KeyError as e:
            raise _Error("unknown_env", str(e.args[0])) from None
        sid = f"s{next(self._seq)}-{secrets.token_hex(6)}"
        if self.first_start_unix is None:
            self.first_start_unix = time.time()
        self.sessions[sid] = session = Session(env, self.clock())
        async with session.lock:
            try:
                observation = await self._bounded(env.reset(task), f"reset of {name!r}", sid)
            except _Error:
                self._finish(sid, "reset timed out")
                raise
            except Exception as e:  # a bad task spec or a broken environment: end it, report it
                self._finish(sid, "reset failed")
                raise _Error("env_error", f"reset of {name!r} failed (session {sid}): {e}") from None
            await self._sleep(env.preset.start_latency_s)
            session.last_active = self.clock()
        self.counters["started"] += 1
        return web.json_response({"session_id": sid, "observation": observation,
                                  "info": {"env": name, "max_turns": env.preset.max_turns}})

    async def _observation(self, request: web.Request) -> web.Response:
        sid, action, request_id = parse_step_request(await self._json(request))
        session = self._session(sid)
        if not session.paused:
            self.agent_turns += 1
            self.agent_turn_s += self.clock() - session.last_active
        async with session.lock:
            if request_id is not None and session.last_reply and session.last_reply[0] == request_id:
                return web.json_response(session.last_reply[1])  # a retried action: same answer, no second step
            self._session(sid)  # it may have ended while we waited for the lock
            if session.done:
                raise _Error("session_ended", f"session {sid}: the episode is done; call /end")
            try:
                observation, reward, done, info = await self._bounded(
                    session.env.step(action), f"step of {session.env.preset.env!r}", sid)
            except _Error:
                session.done = True  # the environment may still be working on it: no second step into it
                raise
            except Exception as e:
                raise _Error("env_error", f"step of {session.env.preset.env!r} failed (session {sid}): {e}") from None
            await self._sleep(session.env.step_latency())
            reply = {"observation": observation, "reward": reward, "done": done, "info": info}
            session.last_active, session.done = self.clock(), bool(done)
            if request_id is not None:
                session.last_reply = (request_id, reply)
        return web.json_response(reply)

    async def _end(self, request: web.Request) -> web.Response:
        sid = parse_session_request(await self._json(request), "/end")
        if sid in self.ended:
            return web.json_response({"session_id": sid, "ended": True, "already_ended": True,
                                      "reason": self.ended[sid]})
        self._session(sid)
        self._finish(sid, "ended by client")
        return web.json_response({"session_id": sid, "ended": True, "already_ended": False})

    async def _pause(self, request: web.Request) -> web.Response:
        sid = parse_session_request(await self._json(request), "/pause")
        self._session(sid).paused = True
        self.counters["paused"] += 1
        return web.json_response({"session_id": sid, "paused": True})

    async def _resume(self, request: web.Request) -> web.Response:
        sid = parse_session_request(await self._json(request), "/resume")
        session = self._session(sid)
        session.paused = False
        session.last_active = self.clock()  # the timeout restarts from the resume
        self.counters["resumed"] += 1
        return web.json_response({"session_id": sid, "paused": False})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": PROTOCOL_VERSION, "sessions": len(self.sessions),
                                  "max_sessions": self.config.max_sessions, "envs": sorted(PRESETS),
                                  "session_timeout_s": self.config.session_timeout_s,
                                  "first_start_unix": self.first_start_unix, "agent_turns": self.agent_turns,
                                  "agent_turn_s": round(self.agent_turn_s, 4), **self.counters})

    # ---- helpers ---------------------------------------------------------------------------
    async def _bounded(self, value: Any, what: str, sid: str) -> Any:
        """Await an environment call for at most `step_timeout_s` (a sync environment has already returned)."""
        if not inspect.isawaitable(value):
            return value
        try:
            return await asyncio.wait_for(value, self.config.step_timeout_s)
        except asyncio.TimeoutError:
            raise _Error("env_error", f"{what} timed out after {self.config.step_timeout_s:g} s (session {sid})") \
                from None

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except _Error as e:
            return web.json_response(error_body(e.code, e.message), status=ERROR_STATUS[e.code], headers=e.headers)
        except EnvProtocolError as e:
            return web.json_response(error_body("malformed_request", str(e)), status=400)
        except web.HTTPRequestEntityTooLarge:
            return web.json_response(
                error_body("payload_too_large", f"request body above {self.config.max_body_bytes} bytes"), status=413)
        except web.HTTPException as e:
            code = "unknown_session" if e.status == 404 else "malformed_request"
            return web.json_response(error_body(code, f"{request.method} {request.path}: {e.reason}"),
                                     status=e.status)

    async def _json(self, request: web.Request) -> Any:
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            raise web.HTTPRequestEntityTooLarge(max_size=self.config.max_body_bytes,
                                                actual_size=request.content_length)
        raw = await request.read()
        try:
            return json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise EnvProtocolError(f"{request.path} request: body is not JSON ({e})") from None

    def _session(self, sid: str) -> Session:
        self._expire_if_idle(sid)
        if sid in self.sessions:
            return self.sessions[sid]
        if sid in self.ended:
            raise _Error("session_ended", f"session {sid} has ended ({self.ended[sid]})")
        raise _Error("unknown_session", f"no session {sid}")

    def _expire_if_idle(self, sid: str) -> None:
        s = self.sessions.get(sid)
        if s is not None and not s.paused and not s.lock.locked() and \
                self.clock() - s.last_active > self.config.session_timeout_s:
            self.counters["expired"] += 1
            self._finish(sid, f"expired after {self.config.session_timeout_s:g} s without activity")

    def _finish(self, sid: str, reason: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is None:
            return
        try:
            closing = session.env.close()
            if inspect.isawaitable(closing):  # a remote episode: closed in the background, kept until done
                task = asyncio.ensure_future(closing)
                self._closing.add(task)
                task.add_done_callback(self._closed)
        except Exception:  # an environment that fails to close must not keep the session open
            self.counters["close_failed"] += 1
        self.counters["ended"] += 1
        self.ended[sid] = reason
        while len(self.ended) > self.config.tombstones:
            self.ended.popitem(last=False)

    def _closed(self, task: asyncio.Future) -> None:
        self._closing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self.counters["close_failed"] += 1

    async def _reap_forever(self) -> None:
        interval = max(0.05, min(1.0, self.config.session_timeout_s / 4))
        while True:
            await asyncio.sleep(interval)
            for sid in list(self.sessions):
                self._expire_if_idle(sid)

    async def _sleep(self, seconds: float) -> None:
        if seconds > 0 and self.config.latency_scale > 0:
            await asyncio.sleep(seconds * self.config.latency_scale)


def serve(config: ServerConfig) -> None:
    """Run until interrupted (SIGINT/SIGTERM), then shut down gracefully."""
    import signal

    async def main() -> None:
        server = EnvServer(config)
        url = await server.start()
        print(f"verl-tide env server ({PROTOCOL_VERSION}) on {url}: default env {config.default_env!r}, "
              f"session timeout {config.session_timeout_s:g} s, max {config.max_sessions} sessions", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()
        print("verl-tide env server stopped", flush=True)

    asyncio.run(main())

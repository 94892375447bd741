"""Async client of the environment service (`tide-env/1`).

Never hangs: every call has a total timeout. Retries only what is transient (connection
refused or reset, timeouts, 429, 502/503/504), with exponential backoff, a bounded number of
times; /observation carries a request id, so a retried action is not applied twice. Every
protocol violation raises a subclass of `EnvError` that says what was wrong.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Optional

import aiohttp

from verl_tide.env.protocol import (
    EnvProtocolError,
    StartReply,
    StepReply,
    parse_error,
    parse_start_reply,
    parse_step_reply,
)


class EnvError(RuntimeError):
    """Base of every environment-service failure the client reports."""


class EnvMalformedResponse(EnvError):
    """The server answered something that is not `tide-env/1` (bad JSON, missing or mistyped field)."""


class EnvPayloadTooLarge(EnvError):
    """A request or a response body is above the configured limit."""


class EnvUnknownSession(EnvError):
    """The server does not know the session id."""


class EnvSessionEnded(EnvError):
    """The session ended (by /end, by inactivity timeout, or its episode is done)."""


class EnvRejected(EnvError):
    """The server refused the request (bad request, unknown env, environment error)."""


class EnvUnavailable(EnvError):
    """The server could not be reached or kept failing transiently after all retries."""


_TRANSIENT_STATUS = {429, 502, 503, 504}
_BY_CODE = {"unknown_session": EnvUnknownSession, "session_ended": EnvSessionEnded,
            "payload_too_large": EnvPayloadTooLarge}


class EnvClient:
    """One client per process and base URL: it pools connections. Use as `async with EnvClient(url) as c:`."""

    def __init__(self, base_url: str, request_timeout_s: float = 30.0, max_retries: int = 3,
                 backoff_s: float = 0.2, max_payload_bytes: int = 1 << 20, max_connections: int = 256):
        if request_timeout_s <= 0 or max_retries < 0 or max_payload_bytes <= 0:
            raise ValueError("EnvClient: request_timeout_s and max_payload_bytes must be > 0, max_retries >= 0")
        self.base_url = base_url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_payload_bytes = max_payload_bytes
        self._max_connections = max_connections
        self._session: Optional[aiohttp.ClientSession] = None

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ---- protocol --------------------------------------------------------------------------
    async def start(self, env: Optional[str] = None, task: Optional[dict] = None, seed: Optional[int] = None) -> StartReply:
        body: dict[str, Any] = {"task": task or {}}
        if env is not None:
            body["env"] = env
        if seed is not None:
            body["seed"] = seed
        return self._parse(parse_start_reply, await self._call("POST", "/start", body))

    async def step(self, session_id: str, action: str) -> StepReply:
        body = {"session_id": session_id, "action": action, "request_id": uuid.uuid4().hex}
        return self._parse(parse_step_reply, await self._call("POST", "/observation", body))

    async def end(self, session_id: str) -> bool:
        """End a session; True if this call ended it, False if it had already ended (idempotent)."""
        reply = await self._call("POST", "/end", {"session_id": session_id})
        return not bool(reply.get("already_ended", False)) if isinstance(reply, dict) else True

    async def pause(self, session_id: str) -> None:
        await self._call("POST", "/pause", {"session_id": session_id})

    async def resume(self, session_id: str) -> None:
        await self._call("POST", "/resume", {"session_id": session_id})

    async def health(self) -> dict[str, Any]:
        reply = await self._call("GET", "/health", None)
        if not isinstance(reply, dict) or reply.get("status") != "ok":
            raise EnvMalformedResponse(f"/health reply: expected {{'status': 'ok', ...}}, got {reply!r:.200}")
        return reply

    # ---- transport -------------------------------------------------------------------------
    @staticmethod
    def _parse(parser: Any, reply: Any) -> Any:
        try:
            return parser(reply)
        except EnvProtocolError as e:
            raise EnvMalformedResponse(str(e)) from None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, connector=aiohttp.TCPConnector(limit=self._max_connections))
        return self._session

    async def _call(self, method: str, path: str, body: Optional[dict[str, Any]]) -> Any:
        data = None if body is None else json.dumps(body).encode()
        if data is not None and len(data) > self.max_payload_bytes:
            raise EnvPayloadTooLarge(f"{path} request: {len(data)} bytes, above the limit of {self.max_payload_bytes}")
        last: Optional[str] = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._http().request(method, self.base_url + path, data=data,
                                                headers={"Content-Type": "application/json"}) as resp:
                    raw = await self._read_limited(resp, path)
                    if resp.status in _TRANSIENT_STATUS:
                        last = f"HTTP {resp.status}"
                        retry_after = resp.headers.get("Retry-After")
                        if retry_after and retry_after.isdigit() and attempt < self.max_retries:
                            await asyncio.sleep(min(float(retry_after), 10.0))
                        continue
                    return self._decode(resp.status, raw, path)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
        raise EnvUnavailable(f"{method} {self.base_url}{path}: failed after {self.max_retries + 1} attempt(s); "
                             f"last error: {last}")

    async def _read_limited(self, resp: aiohttp.ClientResponse, path: str) -> bytes:
        if resp.content_length is not None and resp.content_length > self.max_payload_bytes:
            raise EnvPayloadTooLarge(f"{path} reply: {resp.content_length} bytes, above the limit of "
                                     f"{self.max_payload_bytes}")
        raw = await resp.content.read(self.max_payload_bytes + 1)
        if len(raw) > self.max_payload_bytes:
            raise EnvPayloadTooLarge(f"{path} reply: above the limit of {self.max_payload_bytes} bytes")
        return raw

    @staticmethod
    def _decode(status: int, raw: bytes, path: str) -> Any:
        try:
            msg = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise EnvMalformedResponse(f"{path} reply (HTTP {status}): not JSON: {raw[:200]!r}") from None
        if 200 <= status < 300:
            return msg
        try:
            code, message = parse_error(msg)
        except EnvProtocolError as e:
            raise EnvMalformedResponse(f"{path} reply (HTTP {status}): {e}") from None
        raise _BY_CODE.get(code, EnvRejected)(f"{path}: {code}: {message}")

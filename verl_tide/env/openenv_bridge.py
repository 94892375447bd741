"""An OpenEnv server's episodes through the environment service, with pause and resume kept on our side.

OpenEnv (openenv-core, used by TRL and SkyRL) keeps a session for the life of a WebSocket at `<base>/ws`; its
HTTP /reset and /step make a new environment per request, so a multi-turn episode needs the socket. Messages
(openenv-core 0.3.0's `EnvClient` and `WS*Message` types): the client sends `{"type": "reset", "data": {...}}`,
`{"type": "step", "data": <action fields>}`, `{"type": "state"}`, `{"type": "close"}`; the server answers
`{"type": "observation", "data": {"observation": {...}, "reward": r | null, "done": b}}`, `{"type": "state",
"data": {...}}` or `{"type": "error", "data": {"message": ..., "code": ...}}`.

`register_openenv_environment(url, ...)` hosts such a server's environment in the reference server: each
session opens its own socket; the model's reply goes into one action field (`action_field`, e.g. `message`
for OpenEnv's echo environment) and the observation comes back as text (one field, or the whole observation as
JSON). The reference server does what OpenEnv has no word for: `/pause` and `/resume` (the inactivity clock),
timeouts, and counting every session's end. Built against openenv-core's source (its wheel installs here but
pulls gradio and fastmcp, so it is not in the test bed's lock): tested against a server speaking that schema,
not against openenv-core's own.

    verl-tide env serve --openenv http://127.0.0.1:8000 --openenv-action-field message
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Optional

import aiohttp

from verl_tide.env.envs import Environment, EnvPreset, register_environment


class OpenEnvError(RuntimeError):
    """The OpenEnv server refused a message or broke the session."""


def observation_text(observation: dict[str, Any], field: Optional[str], where: str) -> str:
    """What the model reads: one field of an OpenEnv observation, or the whole observation as JSON."""
    if field is None:
        return json.dumps(observation, sort_keys=True, default=str)
    if field not in observation:
        raise OpenEnvError(f"{where}: the observation has no field {field!r} (fields: {sorted(observation)}); "
                           "set --openenv-observation-field")
    value = observation[field]
    return value if isinstance(value, str) else json.dumps(value, default=str)


def ws_url(base: str) -> str:
    """OpenEnv's socket for a base URL (http(s):// -> ws(s)://, then /ws), as its own client builds it."""
    base = base.rstrip("/")
    base = re.sub(r"^http", "ws", base)
    return base if base.endswith("/ws") else base + "/ws"


@dataclass(frozen=True)
class OpenEnvSpec:
    url: str
    action_field: str
    observation_field: Optional[str]
    timeout_s: float


class OpenEnvEnvironment(Environment):
    """One OpenEnv episode over its own WebSocket; `spec` is bound by `register_openenv_environment`."""

    spec: OpenEnvSpec
    _http: Any = None
    _ws: Any = None

    async def reset(self, task: dict[str, Any]) -> str:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, connect=self.spec.timeout_s))
        try:
            self._ws = await self._http.ws_connect(ws_url(self.spec.url))
        except (aiohttp.ClientError, OSError) as e:
            await self.close()
            raise OpenEnvError(f"cannot open OpenEnv session at {ws_url(self.spec.url)}: {e}") from None
        data = {"seed": self.rng.randrange(2**31), **(task or {})}
        reply = await self._ask({"type": "reset", "data": data})
        return self._text(reply)

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        out_of_turns = self._out_of_turns()
        reply = await self._ask({"type": "step", "data": {self.spec.action_field: action}})
        done = bool(reply.get("done")) or out_of_turns
        reward = reply.get("reward")
        text = self._text(reply)
        if done:
            await self.close()
        return text, float(reward or 0.0), done, {"turns": self.turns}

    async def close(self) -> None:
        ws, http, self._ws, self._http = self._ws, self._http, None, None
        if ws is not None and not ws.closed:
            try:
                await ws.send_json({"type": "close"})
            except Exception:  # best effort: the socket closes below either way
                pass
            await ws.close()
        if http is not None:
            await http.close()

    async def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._ws is None:
            raise OpenEnvError(f"{self.spec.url}: the OpenEnv session is closed")
        await self._ws.send_json(message)
        raw = await self._ws.receive(timeout=self.spec.timeout_s)
        if raw.type != aiohttp.WSMsgType.TEXT:
            raise OpenEnvError(f"{self.spec.url}: OpenEnv closed the session ({raw.type.name}) after {message['type']}")
        reply = json.loads(raw.data)
        if reply.get("type") == "error":
            err = reply.get("data") or {}
            raise OpenEnvError(f"{self.spec.url}: {message['type']} refused: {err.get('message', 'unknown error')} "
                               f"(code {err.get('code', 'UNKNOWN')})")
        if reply.get("type") != "observation" or not isinstance(reply.get("data"), dict):
            raise OpenEnvError(f"{self.spec.url}: expected an observation after {message['type']}, got {reply!r:.200}")
        return reply["data"]

    def _text(self, data: dict[str, Any]) -> str:
        return observation_text(data.get("observation") or {}, self.spec.observation_field, where=self.spec.url)


def register_openenv_environment(url: str, *, name: str = "openenv", action_field: str = "message",
                                 observation_field: Optional[str] = None, max_turns: int = 50,
                                 timeout_s: float = 60.0) -> str:
    """Host the OpenEnv server at `url` in the reference server under `name`; returns the name."""
    if not re.match(r"^(https?|wss?)://", url):
        raise ValueError(f"OpenEnv URL {url!r}: expected http(s):// or ws(s)://")
    spec = OpenEnvSpec(url, action_field, observation_field, timeout_s)
    cls = type(f"OpenEnv_{re.sub(r'[^0-9A-Za-z]', '_', name)}", (OpenEnvEnvironment,), {"spec": spec})
    register_environment(name, cls, EnvPreset(name, max_turns=max_turns, observation_words=0, step_latency_s=0.0))
    return name

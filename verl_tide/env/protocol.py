"""The environment service protocol, version `tide-env/1`: HTTP + JSON, documented in docs/env-protocol.md.

Pure Python. Both sides validate with the functions here, so a malformed message gets the same
clear error (naming the field) whichever side finds it.

Endpoints (all POST with a JSON object body, except GET /health):
  /start        {"env"?, "task"?, "seed"?}             -> {"session_id", "observation", "info"}
  /observation  {"session_id", "action", "request_id"?} -> {"observation", "reward", "done", "info"}
  /end          {"session_id"}                          -> {"session_id", "ended": true, "already_ended"}
  /pause        {"session_id"}                          -> {"session_id", "paused": true}
  /resume       {"session_id"}                          -> {"session_id", "paused": false}
  /health                                               -> {"status", "version", "sessions", "max_sessions", "envs"}
Errors: {"error": {"code", "message"}} with the HTTP status of `ERROR_STATUS`.
`/end` and `/pause` (and `/resume`) are idempotent. `request_id` on /observation makes a retried
action idempotent: the server answers a repeated id with the stored reply instead of acting twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

PROTOCOL_VERSION = "tide-env/1"

ERROR_STATUS = {
    "malformed_request": 400,
    "unknown_env": 400,
    "unknown_session": 404,
    "session_ended": 410,  # ended by /end, expired by inactivity, or finished (done)
    "payload_too_large": 413,
    "too_many_sessions": 429,
    "env_error": 500,
}


class EnvProtocolError(ValueError):
    """A message does not follow `tide-env/1`; the text names the message and the field."""


@dataclass(frozen=True)
class StartReply:
    session_id: str
    observation: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepReply:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


def _require(msg: Mapping[str, Any], what: str, key: str, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    if not isinstance(msg, Mapping):
        raise EnvProtocolError(f"{what}: expected a JSON object, got {type(msg).__name__}")
    if key not in msg or msg[key] is None:
        if optional:
            return None
        raise EnvProtocolError(f"{what}: missing field '{key}'")
    value = msg[key]
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise EnvProtocolError(f"{what}: field '{key}' must be {name}, got {type(value).__name__} {value!r:.80}")
    return value


def parse_start_request(msg: Any) -> tuple[Optional[str], dict[str, Any], Optional[int]]:
    env = _require(msg, "/start request", "env", str, optional=True)
    task = _require(msg, "/start request", "task", dict, optional=True) or {}
    seed = _require(msg, "/start request", "seed", int, optional=True)
    return env, task, seed


def parse_session_request(msg: Any, endpoint: str) -> str:
    return _require(msg, f"{endpoint} request", "session_id", str)


def parse_step_request(msg: Any) -> tuple[str, str, Optional[str]]:
    sid = _require(msg, "/observation request", "session_id", str)
    action = _require(msg, "/observation request", "action", str)
    request_id = _require(msg, "/observation request", "request_id", str, optional=True)
    return sid, action, request_id


def parse_start_reply(msg: Any) -> StartReply:
    return StartReply(
        session_id=_require(msg, "/start reply", "session_id", str),
        observation=_require(msg, "/start reply", "observation", str),
        info=_require(msg, "/start reply", "info", dict, optional=True) or {},
    )


def parse_step_reply(msg: Any) -> StepReply:
    return StepReply(
        observation=_require(msg, "/observation reply", "observation", str),
        reward=float(_require(msg, "/observation reply", "reward", float)),
        done=_require(msg, "/observation reply", "done", bool),
        info=_require(msg, "/observation reply", "info", dict, optional=True) or {},
    )


def parse_error(msg: Any) -> tuple[str, str]:
    """(code, message) of an error body; raises EnvProtocolError if the body is not one."""
    err = _require(msg, "error reply", "error", dict)
    return _require(err, "error reply", "code", str), _require(err, "error reply", "message", str)


def error_body(code: str, message: str) -> dict[str, Any]:
    if code not in ERROR_STATUS:
        raise ValueError(f"unknown error code {code!r}; allowed: {', '.join(ERROR_STATUS)}")
    return {"error": {"code": code, "message": message}}

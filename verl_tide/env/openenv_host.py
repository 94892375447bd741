"""Host an OpenEnv `Environment` object (openenv-core's server-side class) in the reference server.

The other direction from `openenv_bridge`: a user who wrote an environment for OpenEnv (a subclass of
`openenv.core.env_server.interfaces.Environment`, its `Action` and `Observation` pydantic models) serves it to
tide's agent loop without OpenEnv's own server. Each session gets its own object from `factory`; the model's reply
becomes `action_cls(**{action_field: reply})`, and a reply the action model rejects (pydantic's validation) is an
invalid action with a penalty, never a crash. The observation comes back as text (one field, or the whole
observation as JSON without OpenEnv's `done`, `reward`, `metadata`); `done` and `reward` come from the
observation, as OpenEnv's server reads them.

As OpenEnv's server does (0.3.0, `http_server.py`): an overridden `reset_async`/`step_async` is awaited, a sync
`reset`/`step` runs in a worker thread so one slow episode does not hold the others; keyword arguments go only
where the method's signature takes them (`seed`, `episode_id`, task fields). Duck-typed: nothing here imports
openenv, so any object with that shape works.

    verl-tide env serve --openenv-env my_pkg.server:MyEnvironment --openenv-action my_pkg.models:MyAction
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from verl_tide.env.envs import Environment, EnvPreset, register_environment
from verl_tide.env.openenv_bridge import observation_text

_OPENENV_FIELDS = ("done", "reward", "metadata")


@dataclass(frozen=True)
class HostedSpec:
    name: str
    factory: Callable[[], Any]
    action_cls: type
    action_field: str
    observation_field: Optional[str]
    invalid_action_penalty: float


class HostedOpenEnv(Environment):
    """One episode of an OpenEnv Environment object; `spec` is bound by `register_openenv_object`."""

    spec: HostedSpec
    env: Any = None

    async def reset(self, task: dict[str, Any]) -> str:
        self.env = self.spec.factory()
        kwargs = {"seed": self.rng.randrange(2**31), **(task or {})}
        return self._text(await _call(self.env, "reset", **kwargs))

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        out_of_turns = self._out_of_turns()
        try:
            chosen = self.spec.action_cls(**{self.spec.action_field: action})
        except (ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            reason = str(e).splitlines()[0]
            return (f"Invalid action for {self.spec.action_cls.__name__}: {reason}.", -self.spec.invalid_action_penalty,
                    out_of_turns, {"invalid_action": True, "turns": self.turns})
        observation = await _call(self.env, "step", chosen)
        data = _dump(observation)
        done = bool(data.get("done")) or out_of_turns
        return self._text(observation), float(data.get("reward") or 0.0), done, {"turns": self.turns}

    def close(self) -> None:
        """The server closes the episode when it ends (done, /end, expiry); an error here is counted there."""
        env, self.env = self.env, None
        if env is not None and hasattr(env, "close"):
            env.close()

    def _text(self, observation: Any) -> str:
        data = {k: v for k, v in _dump(observation).items() if k not in _OPENENV_FIELDS}
        return observation_text(data, self.spec.observation_field, where=self.spec.name)


def _dump(observation: Any) -> dict[str, Any]:
    if hasattr(observation, "model_dump"):
        return observation.model_dump()
    if isinstance(observation, dict):
        return observation
    raise TypeError(f"an OpenEnv observation is a pydantic model or a dict, not {type(observation).__name__}")


async def _call(env: Any, verb: str, *args: Any, **kwargs: Any) -> Any:
    """`verb_async` when the class overrides it (not openenv's default), else the sync `verb` in a thread."""
    async_method = getattr(env, f"{verb}_async", None)
    if async_method is not None and not _defined_by_openenv(type(env), f"{verb}_async"):
        return await async_method(*args, **_accepted(async_method, kwargs))
    method = getattr(env, verb)
    return await asyncio.to_thread(method, *args, **_accepted(method, kwargs))


def _defined_by_openenv(cls: type, attr: str) -> bool:
    owner = next((c for c in cls.__mro__ if attr in vars(c)), None)
    return owner is not None and owner.__module__.startswith("openenv.")


def _accepted(method: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(method).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def register_openenv_object(factory: Callable[[], Any], action_cls: type, *, name: str = "openenv",
                            action_field: str = "message", observation_field: Optional[str] = None,
                            max_turns: int = 50, invalid_action_penalty: float = 0.1) -> str:
    """Host the OpenEnv Environment that `factory` builds (a class or a function) under `name`; returns the name."""
    if not callable(factory):
        raise TypeError(f"openenv factory {factory!r} is not callable (a class or a function returning an Environment)")
    fields = getattr(action_cls, "model_fields", None)
    if fields is not None and action_field not in fields:
        raise ValueError(f"action field {action_field!r} is not a field of {action_cls.__name__} "
                         f"(fields: {', '.join(sorted(fields))}); set --openenv-action-field")
    spec = HostedSpec(name, factory, action_cls, action_field, observation_field, invalid_action_penalty)
    cls = type(f"Hosted_{re.sub(r'[^0-9A-Za-z]', '_', name)}", (HostedOpenEnv,), {"spec": spec})
    register_environment(name, cls, EnvPreset(name, max_turns=max_turns, observation_words=0, step_latency_s=0.0))
    return name

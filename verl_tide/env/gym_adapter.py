"""Serve a Gymnasium environment through the environment service: the model reads text and writes text.

A verl user already has environments; rewriting one for `tide-env/1` is the largest barrier to trying the
plugin. `register_gym_environment` hosts any registered `gymnasium.Env` in the reference server: observations
become text (a text observation as is, else the environment's `render_mode="ansi"` rendering, else a
formatter you pass), and the model's reply becomes an action through a parser (default: the first integer, or
an action name you list, for a `Discrete` action space). A reply the parser cannot read is never a crash: the
episode answers with what went wrong and the allowed actions, and the step scores `-invalid_action_penalty`.
Pause and resume are the server's (the episode's inactivity clock stops while paused), as for every
environment it hosts.

    verl-tide env serve --gym FrozenLake-v1 --gym-kwargs '{"is_slippery": false}' --gym-actions left,down,right,up
"""

from __future__ import annotations

import asyncio
import importlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from verl_tide.env.envs import Environment, EnvPreset, register_environment

ActionParser = Callable[[str, Any], Any]  # (reply text, action space) -> action; raises InvalidAction
ObservationFormatter = Callable[[Any, Any], str]  # (observation, env) -> text

_ANSI_HIGHLIGHT = re.compile(r"\x1b\[[0-9;]*m(.*?)\x1b\[0m", re.S)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_INT = re.compile(r"-?\d+")


class InvalidAction(ValueError):
    """The model's reply names no action the environment accepts."""


class NotText(TypeError):
    """An observation the adapter cannot show the model as text."""


def discrete_action_parser(names: Sequence[str] = ()) -> ActionParser:
    """A `Discrete(n)` action from a reply: the first of `names` it mentions (case-insensitive, whole word), else
    its first integer in range."""
    lowered = [n.lower() for n in names]

    def parse(text: str, space: Any) -> Any:
        n, start = int(getattr(space, "n", 0)), int(getattr(space, "start", 0))
        if n <= 0:
            raise InvalidAction(f"the default parser reads Discrete action spaces, not {space}; pass a parser")
        for word in re.findall(r"[a-z_]+", text.lower()):
            if word in lowered:
                return lowered.index(word) + start
        for match in _INT.finditer(text):
            if start <= int(match.group()) < start + n:
                return int(match.group())
        allowed = ", ".join(names) if names else f"an integer {start}..{start + n - 1}"
        raise InvalidAction(f"no action in {text[:80]!r}; answer with {allowed}")

    return parse


def render_text(observation: Any, env: Any) -> str:
    """A text observation as is; else the environment's ANSI rendering, highlights shown as [X]."""
    if isinstance(observation, str):
        return observation
    if getattr(env, "render_mode", None) == "ansi":
        rendered = env.render()
        if isinstance(rendered, str):
            return _ANSI.sub("", _ANSI_HIGHLIGHT.sub(r"[\1]", rendered)).strip("\n")
    raise NotText(f"observation of type {type(observation).__name__} is not text and the environment does not "
                  "render as ANSI text: make it with render_mode='ansi' (--gym-kwargs) or pass a formatter")


@dataclass(frozen=True)
class GymSpec:
    env_id: str
    kwargs: dict[str, Any]
    parser: ActionParser
    formatter: ObservationFormatter
    invalid_action_penalty: float
    instructions: str


class GymEnvironment(Environment):
    """One episode of a Gymnasium environment; `spec` is bound by `register_gym_environment`. Its reset and step
    run in a worker thread: a slow simulator holds its own episode, not the server's other sessions, and one that
    hangs meets the server's step timeout."""

    spec: GymSpec

    async def reset(self, task: dict[str, Any]) -> str:
        return await asyncio.to_thread(self._reset, task)

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        return await asyncio.to_thread(self._step, action)

    def _reset(self, task: dict[str, Any]) -> str:
        import gymnasium

        kwargs = dict(self.spec.kwargs)
        if self.spec.formatter is render_text and "render_mode" not in kwargs and _renders_ansi(self.spec.env_id):
            kwargs["render_mode"] = "ansi"  # text from its ANSI rendering (without one: text observations only)
        self.env = gymnasium.make(self.spec.env_id, **kwargs)
        seed = int((task or {}).get("seed", self.rng.randrange(2**31)))
        observation, _info = self.env.reset(seed=seed)
        return self._text(self.spec.instructions, observation)

    def _step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        out_of_turns = self._out_of_turns()
        try:
            chosen = self.spec.parser(action, self.env.action_space)
        except InvalidAction as e:
            return (f"Invalid action: {e}.", -self.spec.invalid_action_penalty, out_of_turns,
                    {"invalid_action": True, "turns": self.turns})
        observation, reward, terminated, truncated, _info = self.env.step(chosen)
        done = bool(terminated or truncated or out_of_turns)
        text = self._text("", observation)
        return text, float(reward), done, {"turns": self.turns, "action": str(chosen)}

    def _text(self, prefix: str, observation: Any) -> str:
        text = self.spec.formatter(observation, self.env)
        if not isinstance(text, str):
            raise NotText(f"{self.spec.env_id}: the observation formatter returned {type(text).__name__}, not str")
        return f"{prefix}\n{text}" if prefix else text

    def close(self) -> None:
        """The server closes the episode when it ends (done, /end, expiry); an error here is counted there."""
        env, self.env = getattr(self, "env", None), None
        if env is not None:
            env.close()


def register_gym_environment(env_id: str, kwargs: dict[str, Any] | None = None, *, name: str | None = None,
                             parser: ActionParser | None = None, formatter: ObservationFormatter | None = None,
                             action_names: Sequence[str] = (), invalid_action_penalty: float = 0.1,
                             max_turns: int | None = None, instructions: str | None = None) -> str:
    """Host Gymnasium's `env_id` in the reference server under `name` (default: the id); returns the name.

    `max_turns` defaults to the environment's own step limit (its TimeLimit), else 50."""
    import gymnasium

    if env_id not in gymnasium.registry:
        raise KeyError(f"no Gymnasium environment {env_id!r} is registered (gymnasium {gymnasium.__version__})")
    spec = gymnasium.registry[env_id]
    turns = max_turns or spec.max_episode_steps or 50
    if instructions is None:
        allowed = ", ".join(action_names) if action_names else "an action number"
        instructions = f"You are playing {env_id}. Each turn, answer with one action: {allowed}."
    if formatter is None:
        _check_renders_text(env_id, dict(kwargs or {}))
    bound = GymSpec(env_id, dict(kwargs or {}), parser or discrete_action_parser(action_names),
                    formatter or render_text, invalid_action_penalty, instructions)
    name = name or env_id
    cls = type(f"Gym_{re.sub(r'[^0-9A-Za-z]', '_', name)}", (GymEnvironment,), {"spec": bound})
    register_environment(name, cls, EnvPreset(name, max_turns=turns, observation_words=0, step_latency_s=0.0))
    return name


def _check_renders_text(env_id: str, kwargs: dict[str, Any]) -> None:
    """Refuse at start-up, not at every /start, an environment the default formatter cannot show as text."""
    import gymnasium

    if "render_mode" not in kwargs and _renders_ansi(env_id):
        kwargs["render_mode"] = "ansi"
    env = gymnasium.make(env_id, **kwargs)
    try:
        observation, _ = env.reset(seed=0)
        render_text(observation, env)
    except NotText as e:
        raise ValueError(f"{env_id} cannot be served as text: {e}. Pass a formatter: --gym-formatter MODULE:FUNC, "
                         "a function (observation, env) -> str") from e
    finally:
        env.close()


def _renders_ansi(env_id: str) -> bool:
    import gymnasium
    from gymnasium.envs.registration import load_env_creator

    entry = gymnasium.spec(env_id).entry_point
    creator = load_env_creator(entry) if isinstance(entry, str) else entry
    return "ansi" in (getattr(creator, "metadata", {}) or {}).get("render_modes", [])


def load_callable(path: str) -> Callable:
    """`module:function` (a user's parser or formatter from the command line)."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise ValueError(f"{path!r}: expected module:function")
    return getattr(importlib.import_module(module), attr)

"""Built-in text environments with verifiable rewards, deterministic under a seed (pure Python).

- `guess`: find a hidden number by guesses answered "higher" / "lower" (a navigation/search task);
  turn count depends on the policy, reward 1 when found.
- `shop`: a WebShop-like search-and-buy task: `search[words]`, `click[item id]`, `buy`; reward is
  the fraction of the requested attributes the bought item matches.

Presets shape turn limits, observation size and per-step latency after the paper's Table 4
(WebShop ~8 rounds / ~3,400 tokens, ALFWorld ~16 / ~7,400, OSWorld ~35 / ~12,000,
ScienceBoard ~39 / ~24,000), so load tests and demos see agent-like variability.
"""

from __future__ import annotations

import math
import random
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from dataclasses import replace as dataclass_replace
from typing import Any

_FILLER = ("the", "page", "shows", "a", "list", "of", "options", "and", "status", "lines", "with", "details",
           "about", "each", "element", "near", "your", "current", "position")


def filler_text(rng: random.Random, words: int) -> str:
    """Observation padding (about one token a word) so observations have realistic sizes."""
    return " ".join(rng.choice(_FILLER) for _ in range(words))


@dataclass(frozen=True)
class EnvPreset:
    env: str
    max_turns: int
    observation_words: int  # padding per observation, ~tokens
    step_latency_s: float  # mean of a log-normal per-step latency
    latency_sigma: float = 0.5
    start_latency_s: float = 0.0
    task: tuple[tuple[str, Any], ...] = ()


LEARN_HIGH = 10**6  # tiny_learn's range: 1 to a million

PRESETS: dict[str, EnvPreset] = {
    "webshop": EnvPreset("shop", max_turns=20, observation_words=400, step_latency_s=0.5),
    "alfworld": EnvPreset("guess", max_turns=20, observation_words=460, step_latency_s=0.3, task=(("high", 1000),)),
    "osworld": EnvPreset("guess", max_turns=50, observation_words=340, step_latency_s=1.5, start_latency_s=5.0,
                         task=(("high", 10**9),)),
    "sciboard": EnvPreset("guess", max_turns=50, observation_words=600, step_latency_s=1.0, start_latency_s=3.0,
                          task=(("high", 10**12),)),
    "tiny": EnvPreset("guess", max_turns=6, observation_words=8, step_latency_s=0.0, task=(("high", 16),)),
    # `make demo`: the tiny game with a format reward (0.1 per numeric answer: a dense signal that a tiny
    # random policy can learn) and an agentic environment's latency (heavy-tailed, ~0.4 s a step).
    "tiny_slow": EnvPreset("guess", max_turns=6, observation_words=8, step_latency_s=0.4, latency_sigma=1.0,
                           task=(("high", 16), ("format_reward", 0.1))),
    # Tests that need a step to update the actor: the format reward graded by the answer's share of digits, so
    # two samples of a group almost never tie (with the flat 0.1 a 4-group step had zero advantages about a
    # quarter of the time on the test bed). No latency.
    "tiny_dense": EnvPreset("guess", max_turns=6, observation_words=8, step_latency_s=0.0,
                            task=(("high", 16), ("format_reward", 0.1), ("format_by_digits", True))),
    # The learning-parity benchmark: a reward the tiny random policy raises by answering with more digits (each
    # turn scores its answer's share of digits), with tiny_slow's latency so that the trainers differ in pace as
    # in the demo. The range is too wide for lucky guesses (1.0 each), which would drown the signal in noise.
    "tiny_learn": EnvPreset("guess", max_turns=6, observation_words=8, step_latency_s=0.4, latency_sigma=1.0,
                            task=(("high", LEARN_HIGH), ("format_reward", 1.0), ("format_by_digits", True))),
}


class Environment(ABC):
    """One session's state. `reset` gives the first observation; `step` acts; `close` runs when the session ends
    for any reason (ended, expired, server stopped). `reset`, `step` and `close` may be coroutine functions
    (an environment that is itself a client of a remote one): the server awaits them."""

    def __init__(self, rng: random.Random, preset: EnvPreset):
        self.rng = rng
        self.preset = preset
        self.turns = 0

    @abstractmethod
    def reset(self, task: dict[str, Any]) -> str: ...

    @abstractmethod
    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]: ...

    def close(self) -> Any:
        """Release what the episode holds (a process, a connection); the default holds nothing."""
        return None

    def step_latency(self) -> float:
        mean = self.preset.step_latency_s
        if mean <= 0:
            return 0.0
        sigma = self.preset.latency_sigma
        return self.rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)

    def _out_of_turns(self) -> bool:
        self.turns += 1
        return self.turns >= self.preset.max_turns


class GuessEnv(Environment):
    def reset(self, task: dict[str, Any]) -> str:
        self.low = int(task.get("low", 1))
        self.high = int(task.get("high", dict(self.preset.task).get("high", 100)))
        if self.high < self.low:
            raise ValueError(f"task.high = {self.high} must be >= task.low = {self.low}")
        self.target = int(task["target"]) if "target" in task else self.rng.randint(self.low, self.high)
        # Optional shaping: a small reward for an answer that is a number at all (dense signal for tiny policies).
        self.format_reward = float(task.get("format_reward", dict(self.preset.task).get("format_reward", 0.0)))
        # ... or that reward times the answer's share of digit characters (a graded signal: `tiny_dense`)
        self.format_by_digits = bool(task.get("format_by_digits", dict(self.preset.task).get("format_by_digits", False)))
        # Fault injection for training jobs' failure paths: the environment raises from this turn on
        self.fail_at_turn = int(task.get("fail_at_turn") or 0)  # (a parquet column: None in the other rows)
        return (f"Find the hidden number between {self.low} and {self.high}. Answer with one number per turn. "
                + filler_text(self.rng, self.preset.observation_words))

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        numbers = re.findall(r"-?\d+", action)
        last = self._out_of_turns()
        if self.fail_at_turn and self.turns >= self.fail_at_turn:
            raise RuntimeError(f"injected fault at turn {self.turns} (task.fail_at_turn = {self.fail_at_turn})")
        if not numbers:
            obs, reward, done = "No number found in your answer.", 0.0, last
        else:
            guess = int(numbers[-1])
            if guess == self.target:
                return f"Correct: {guess}.", 1.0, True, {"turns": self.turns, "found": True}
            shaping = self.format_reward * (sum(c.isdigit() for c in action) / len(action) if self.format_by_digits
                                            else 1.0)
            obs, reward, done = f"{guess} is too {'low' if guess < self.target else 'high'}.", shaping, last
        info = {"turns": self.turns, "found": False}
        return obs + " " + filler_text(self.rng, self.preset.observation_words), reward, done, info


_COLORS = ("red", "blue", "green", "black", "white", "grey")
_SIZES = ("small", "medium", "large")
_KINDS = ("shirt", "shoes", "jacket", "bag", "hat", "lamp")


class ShopEnv(Environment):
    def reset(self, task: dict[str, Any]) -> str:
        n_items = int(task.get("catalog_size", 60))
        self.items = [
            {"id": f"B{i:04d}", "kind": self.rng.choice(_KINDS), "color": self.rng.choice(_COLORS),
             "size": self.rng.choice(_SIZES), "price": round(self.rng.uniform(5, 100), 2)}
            for i in range(n_items)
        ]
        want = self.rng.choice(self.items)
        self.goal = {"kind": want["kind"], "color": want["color"], "size": want["size"],
                     "max_price": math.ceil(want["price"] + 10)}
        self.current: dict[str, Any] | None = None
        g = self.goal
        return (f"Instruction: buy a {g['size']} {g['color']} {g['kind']} under {g['max_price']} dollars. "
                "Actions: search[words], click[item id], buy. " + filler_text(self.rng, self.preset.observation_words))

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        last = self._out_of_turns()
        action = action.strip()
        pad = " " + filler_text(self.rng, self.preset.observation_words)
        if m := re.search(r"search\[(.*?)\]", action):
            words = set(m.group(1).lower().split())
            hits = [it for it in self.items if words & {it["kind"], it["color"], it["size"]}][:10]
            listing = "; ".join(f"{it['id']}: {it['size']} {it['color']} {it['kind']} ${it['price']}" for it in hits)
            return f"Results: {listing or 'none'}." + pad, 0.0, last, {"turns": self.turns}
        if m := re.search(r"click\[(\w+)\]", action):
            found = [it for it in self.items if it["id"].lower() == m.group(1).lower()]
            if found:
                self.current = found[0]
                it = self.current
                return f"Item {it['id']}: {it['size']} {it['color']} {it['kind']}, ${it['price']}." + pad, 0.0, last, \
                    {"turns": self.turns}
            return "No such item." + pad, 0.0, last, {"turns": self.turns}
        if re.search(r"\bbuy\b", action):
            if self.current is None:
                return "Open an item before buying." + pad, 0.0, last, {"turns": self.turns}
            it, g = self.current, self.goal
            checks = [it["kind"] == g["kind"], it["color"] == g["color"], it["size"] == g["size"],
                      it["price"] <= g["max_price"]]
            return f"Bought {it['id']}.", sum(checks) / len(checks), True, {"turns": self.turns, "matched": sum(checks)}
        return "Invalid action." + pad, 0.0, last, {"turns": self.turns}


ENVIRONMENTS: dict[str, type[Environment]] = {"guess": GuessEnv, "shop": ShopEnv}


def register_environment(name: str, cls: type[Environment], preset: EnvPreset | None = None) -> None:
    """Host your own environment in the reference server: an `Environment` subclass under `name`
    (and optionally a preset of the same name for its turn limit, observation size and latency)."""
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"register_environment({name!r}): {cls!r} is not an Environment subclass")
    if name in ENVIRONMENTS or name in PRESETS:
        raise ValueError(f"environment {name!r} is already registered")
    ENVIRONMENTS[name] = cls
    if preset is not None:
        PRESETS[name] = dataclass_replace(preset, env=name)


def make_environment(preset_name: str, seed: int | None) -> Environment:
    """An environment for a preset name (see PRESETS) or a bare environment name."""
    preset = PRESETS.get(preset_name) or (
        EnvPreset(preset_name, max_turns=20, observation_words=50, step_latency_s=0.0)
        if preset_name in ENVIRONMENTS else None
    )
    if preset is None:
        allowed = ", ".join(sorted(set(PRESETS) | set(ENVIRONMENTS)))
        raise KeyError(f"unknown env {preset_name!r}; allowed: {allowed}")
    return ENVIRONMENTS[preset.env](random.Random(seed), preset)

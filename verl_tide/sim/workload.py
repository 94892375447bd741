"""Workloads for the simulator: one documented YAML schema, validated with errors that name the key.

Pure Python (PyYAML only). A workload says what one training step asks of the system: GRPO groups
of multi-turn trajectories (turns, tokens per action and observation, environment latency), the
evaluation cadence, and the model size that sets engine and trainer costs. Presets shaped after
the TideRL paper's Table 4 ship in `verl_tide/sim/workloads/`; `load_workload(NAME | PATH)`.

Schema (every key; distributions are `{dist, mean, sigma, min, max}` with dist in DIST_KINDS):

    name: str                      # shown in tables
    description: str
    model: {params_b: float, kv_bytes_per_token: int}   # e.g. 7B Qwen2.5: 7.6, 57344
    prompt_tokens: dist            # the prompt, shared by the tasks of a GRPO group
    turns: dist                    # turns per trajectory (rounded, >= 1)
    action_tokens: dist            # tokens the model generates per turn
    observation_tokens: dist       # tokens the environment returns per turn
    env_latency_s: dist            # environment step latency
    env_start_s: dist              # environment start-up before the first turn
    context_window: null | {max_tokens: int, keep_tokens: int}   # sliding-window pruning (images)
    group_size: int                # GRPO n
    groups_per_step: int           # train groups per step at `reference_gpus`
    reference_gpus: int            # groups_per_step scales linearly with --gpus
    steps: int                     # training steps simulated
    max_staleness: int             # policy versions a trajectory may lag (async systems)
    eval: {every_steps: int, at_start: bool, at_end: bool, groups: int, group_size: int}   # every_steps 0 = never
                                   # at_end: one more after the last step, the run's clock ending with it (verl
                                   # validates after its last step whenever trainer.test_freq > 0)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from importlib.resources import files
from pathlib import Path
from typing import Any, Optional

import yaml

DIST_KINDS = ("fixed", "uniform", "lognormal", "exponential")


class WorkloadError(ValueError):
    """A workload file is invalid; the message lists every bad key with what is allowed."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"invalid workload {source} ({len(problems)} problem(s)):\n"
                         + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class Dist:
    """A positive random quantity. `mean` is the mean of the distribution before clamping to [min, max]."""

    dist: str
    mean: float
    sigma: float = 0.0  # lognormal: sigma of log; uniform: half-width as a fraction of mean
    min: float = 0.0
    max: float = math.inf

    def sample(self, rng: random.Random) -> float:
        if self.dist == "fixed":
            x = self.mean
        elif self.dist == "uniform":
            x = rng.uniform(self.mean * (1 - self.sigma), self.mean * (1 + self.sigma))
        elif self.dist == "exponential":
            x = rng.expovariate(1.0 / self.mean)
        else:  # lognormal with the given mean
            x = rng.lognormvariate(math.log(self.mean) - self.sigma ** 2 / 2, self.sigma)
        return min(max(x, self.min), self.max)

    def sample_int(self, rng: random.Random) -> int:
        return max(1, int(round(self.sample(rng))))


@dataclass(frozen=True)
class ModelSpec:
    params_b: float
    kv_bytes_per_token: int


@dataclass(frozen=True)
class ContextWindow:
    max_tokens: int
    keep_tokens: int


@dataclass(frozen=True)
class EvalSpec:
    every_steps: int = 0
    at_start: bool = False
    at_end: bool = False
    groups: int = 0
    group_size: int = 1


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    model: ModelSpec
    prompt_tokens: Dist
    turns: Dist
    action_tokens: Dist
    observation_tokens: Dist
    env_latency_s: Dist
    env_start_s: Dist
    context_window: Optional[ContextWindow]
    group_size: int
    groups_per_step: int
    reference_gpus: int
    steps: int
    max_staleness: int
    eval: EvalSpec

    def groups_for(self, gpus: int) -> int:
        """Train groups per step at this cluster size (the batch grows with the cluster, as users scale it)."""
        return max(1, round(self.groups_per_step * gpus / self.reference_gpus))

    def is_eval_step(self, step: int) -> bool:
        """Evaluation before `step` (0-based): at the start if asked, then every `every_steps` steps."""
        e = self.eval
        if e.groups <= 0:
            return False
        return (step == 0 and e.at_start) or (e.every_steps > 0 and step > 0 and step % e.every_steps == 0)

    def eval_after(self, consumed: int) -> bool:
        """Evaluation once `consumed` steps are done: every `every_steps`, and after the last step if `at_end`
        (one evaluation there, as verl's `is_last_step or global_steps % test_freq == 0`)."""
        if consumed >= self.steps:
            return consumed == self.steps and self.eval.at_end and self.eval.groups > 0
        return self.is_eval_step(consumed)


_SCALARS = {"name": str, "description": str, "group_size": int, "groups_per_step": int, "reference_gpus": int,
            "steps": int, "max_staleness": int}
_DISTS = ("prompt_tokens", "turns", "action_tokens", "observation_tokens", "env_latency_s", "env_start_s")
_KEYS = (*_SCALARS, "model", *_DISTS, "context_window", "eval")


def presets() -> list[str]:
    return sorted(p.name[:-5] for p in files("verl_tide.sim").joinpath("workloads").iterdir()
                  if p.name.endswith(".yaml"))


def load_workload(name_or_path: str) -> Workload:
    """A preset name (see `presets()`) or a path to a YAML file of the schema above."""
    path = Path(name_or_path)
    if name_or_path in presets():
        text = files("verl_tide.sim").joinpath("workloads", f"{name_or_path}.yaml").read_text()
    elif path.is_file():
        text = path.read_text()
    else:
        raise WorkloadError(repr(name_or_path), [f"--workload {name_or_path!r}: not a preset "
                                                 f"({' | '.join(presets())}) and not a file"])
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise WorkloadError(repr(name_or_path), [f"not valid YAML: {e}"]) from None
    return parse_workload(raw, source=repr(name_or_path))


def parse_workload(raw: Any, source: str = "<mapping>") -> Workload:
    problems: list[str] = []
    if not isinstance(raw, dict):
        raise WorkloadError(source, [f"top level = {raw!r}: must be a mapping with keys {', '.join(_KEYS)}"])
    for key in raw:
        if key not in _KEYS:
            problems.append(f"{key} = {raw[key]!r}: unknown key; allowed keys: {', '.join(_KEYS)}")
    for key in _KEYS:
        if key not in raw and key not in ("description", "context_window", "eval", "env_start_s"):
            problems.append(f"{key}: missing (required)")
    if problems:
        raise WorkloadError(source, problems)
    values: dict[str, Any] = {}
    for key, tp in _SCALARS.items():
        if key == "description" and key not in raw:
            values[key] = ""
            continue
        v = raw[key]
        if tp is int and (not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "max_staleness" else 1)):
            problems.append(f"{key} = {v!r}: must be an integer >= {0 if key == 'max_staleness' else 1}")
        elif tp is str and not isinstance(v, str):
            problems.append(f"{key} = {v!r}: must be a string")
        values[key] = v
    values["model"] = _model(raw["model"], problems)
    for key in _DISTS:
        values[key] = _dist(raw.get(key, {"dist": "fixed", "mean": 0.0}), key, problems,
                            allow_zero=key in ("env_latency_s", "env_start_s"))
    values["context_window"] = _window(raw.get("context_window"), problems)
    values["eval"] = _eval(raw.get("eval"), problems)
    if problems:
        raise WorkloadError(source, problems)
    return Workload(**values)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _dist(raw: Any, key: str, problems: list[str], allow_zero: bool = False) -> Dist:
    allowed = "{dist, mean, sigma, min, max}"
    if _number(raw):  # a bare number means fixed
        raw = {"dist": "fixed", "mean": raw}
    if not isinstance(raw, dict):
        problems.append(f"{key} = {raw!r}: must be a number or a mapping {allowed}")
        return Dist("fixed", 1.0)
    for k in raw:
        if k not in {f.name for f in fields(Dist)}:
            problems.append(f"{key}.{k}: unknown key; allowed keys: dist, mean, sigma, min, max")
    kind = raw.get("dist", "fixed")
    if kind not in DIST_KINDS:
        problems.append(f"{key}.dist = {kind!r}: must be one of {' | '.join(DIST_KINDS)}")
        kind = "fixed"
    mean = raw.get("mean")
    lower = 0 if allow_zero else 0 + 1e-12
    if not _number(mean) or mean < lower or (mean == 0 and not allow_zero):
        problems.append(f"{key}.mean = {mean!r}: must be a number {'>= 0' if allow_zero else '> 0'}")
        mean = 1.0
    if kind in ("exponential", "lognormal") and mean == 0:
        kind = "fixed"
    sigma, lo, hi = raw.get("sigma", 0.0), raw.get("min", 0.0), raw.get("max", math.inf)
    if not _number(sigma) or sigma < 0 or (kind == "uniform" and sigma > 1):
        problems.append(f"{key}.sigma = {sigma!r}: must be a number >= 0 (<= 1 for uniform)")
        sigma = 0.0
    if not _number(lo) or lo < 0:
        problems.append(f"{key}.min = {lo!r}: must be a number >= 0")
        lo = 0.0
    if not (_number(hi) or hi == math.inf) or hi < lo:
        problems.append(f"{key}.max = {hi!r}: must be a number >= {key}.min ({lo})")
        hi = math.inf
    return Dist(kind, float(mean), float(sigma), float(lo), float(hi))


def _model(raw: Any, problems: list[str]) -> ModelSpec:
    if not isinstance(raw, dict) or set(raw) != {"params_b", "kv_bytes_per_token"}:
        problems.append(f"model = {raw!r}: must be a mapping with exactly params_b, kv_bytes_per_token")
        return ModelSpec(1.0, 1)
    p, kv = raw["params_b"], raw["kv_bytes_per_token"]
    if not _number(p) or p <= 0:
        problems.append(f"model.params_b = {p!r}: must be a number > 0 (billions of parameters)")
        p = 1.0
    if not isinstance(kv, int) or isinstance(kv, bool) or kv <= 0:
        problems.append(f"model.kv_bytes_per_token = {kv!r}: must be an integer > 0 "
                        "(2 * layers * kv_heads * head_dim * bytes per element)")
        kv = 1
    return ModelSpec(float(p), kv)


def _window(raw: Any, problems: list[str]) -> Optional[ContextWindow]:
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"max_tokens", "keep_tokens"}:
        problems.append(f"context_window = {raw!r}: must be null or a mapping with max_tokens, keep_tokens")
        return None
    mx, keep = raw["max_tokens"], raw["keep_tokens"]
    if not (isinstance(mx, int) and isinstance(keep, int) and 0 < keep < mx):
        problems.append(f"context_window = {raw!r}: need integers 0 < keep_tokens < max_tokens")
        return None
    return ContextWindow(mx, keep)


def _eval(raw: Any, problems: list[str]) -> EvalSpec:
    if raw is None:
        return EvalSpec()
    allowed = {f.name for f in fields(EvalSpec)}
    if not isinstance(raw, dict):
        problems.append(f"eval = {raw!r}: must be a mapping with keys {', '.join(sorted(allowed))}")
        return EvalSpec()
    for k in raw:
        if k not in allowed:
            problems.append(f"eval.{k}: unknown key; allowed keys: {', '.join(sorted(allowed))}")
    spec = EvalSpec(**{k: v for k, v in raw.items() if k in allowed})
    for k in ("every_steps", "groups"):
        v = getattr(spec, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            problems.append(f"eval.{k} = {v!r}: must be an integer >= 0")
    if not isinstance(spec.group_size, int) or spec.group_size < 1:
        problems.append(f"eval.group_size = {spec.group_size!r}: must be an integer >= 1")
    for k in ("at_start", "at_end"):
        if not isinstance(getattr(spec, k), bool):
            problems.append(f"eval.{k} = {getattr(spec, k)!r}: must be true or false")
    return spec

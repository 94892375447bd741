"""A workload description measured from an environment, not hand-set: a short probe through its service.

Plays `episodes` episodes against a running environment service (`/start`, `/observation`, `/end`, the protocol
every tide job uses) with a fixed action, and times each call from the client's side, as an agent loop sees it
(HTTP included). Turns, observation tokens (with the job's tokenizer, else whitespace words) and the latencies
become the bench schema's distributions (`sim/workload.py`): lognormal with the sample's mean and log-spread, clamped
to what was seen. What the policy writes (tokens per turn) and how long it plays (an agent that solves the task
sooner) come from the job, not from this probe.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class EnvSamples:
    start_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    turns: list[int] = field(default_factory=list)
    first_observation_tokens: list[int] = field(default_factory=list)
    observation_tokens: list[int] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        def stats(xs: list[float]) -> dict[str, float]:
            return {"n": len(xs), "mean": round(statistics.fmean(xs), 4), "min": round(min(xs), 4),
                    "max": round(max(xs), 4)} if xs else {"n": 0}
        return {"start_s": stats(self.start_s), "step_s": stats(self.step_s), "turns": stats(self.turns),
                "first_observation_tokens": stats(self.first_observation_tokens),
                "observation_tokens": stats(self.observation_tokens)}

    def environment(self) -> dict[str, dict[str, Any]]:
        """The environment's part of a workload, in the bench's schema: turns, observation tokens, latencies."""
        if not self.turns:
            raise ValueError("the environment probe played no episode: nothing to describe")
        return {"turns": fit(self.turns, integer=True),
                "observation_tokens": fit(self.observation_tokens or [0], integer=True),
                "env_latency_s": fit(self.step_s), "env_start_s": fit(self.start_s)}

    def workload(self, name: str, description: str, model: dict, prompt_tokens: float, action_tokens: int,
                 group_size: int, groups_per_step: int, gpus: int, steps: int, max_staleness: int) -> dict:
        """A workload in the bench's schema: the environment's part from this probe, the job's part given."""
        return {
            "name": name, "description": description, "model": model,
            # the job's prompt holds the first observation (the agent loop puts /start's reply there)
            "prompt_tokens": {"dist": "fixed", "mean": round(prompt_tokens, 1)},
            "action_tokens": {"dist": "fixed", "mean": action_tokens},
            **self.environment(),
            "context_window": None, "group_size": group_size, "groups_per_step": groups_per_step,
            "reference_gpus": gpus, "steps": steps, "max_staleness": max_staleness,
            "eval": {"every_steps": 0, "at_start": False, "groups": 0, "group_size": 1},
        }


def fit(xs: list[float], integer: bool = False) -> dict[str, Any]:
    """A lognormal with the sample's mean and log standard deviation, clamped to the sample's range (fixed when
    every sample is the same)."""
    lo, hi, mean = min(xs), max(xs), statistics.fmean(xs)
    if hi - lo < 1e-9 or len(xs) < 2:
        return {"dist": "fixed", "mean": round(mean, 4)}
    logs = [math.log(max(x, 1e-6)) for x in xs]
    out = {"dist": "lognormal", "mean": round(mean, 4), "sigma": round(statistics.stdev(logs), 4),
           "min": round(lo, 4), "max": round(hi, 4)}
    return {**out, "min": int(lo), "max": int(math.ceil(hi))} if integer else out


async def probe_environment(url: str, episodes: int = 16, env: Optional[str] = None, task: Optional[dict] = None,
                            tokenizer_path: Optional[str] = None, action: str = "I am not sure.",
                            concurrency: int = 8) -> EnvSamples:
    """`episodes` episodes against the service at `url`, `concurrency` at a time (as a job's agent loops run them)."""
    from verl_tide.env.client import EnvClient

    count = _token_counter(tokenizer_path)
    samples = EnvSamples()
    gate = asyncio.Semaphore(concurrency)

    async def episode(client: EnvClient, i: int) -> None:
        async with gate:
            t0 = time.perf_counter()
            start = await client.start(env=env, task=task, seed=i)
            samples.start_s.append(time.perf_counter() - t0)
            samples.first_observation_tokens.append(count(start.observation))
            turns = 0
            try:
                while True:
                    t0 = time.perf_counter()
                    reply = await client.step(start.session_id, action)
                    samples.step_s.append(time.perf_counter() - t0)
                    turns += 1
                    if reply.done:
                        break
                    samples.observation_tokens.append(count(reply.observation))
            finally:
                await client.end(start.session_id)
            samples.turns.append(turns)

    async with EnvClient(url) as client:
        await asyncio.gather(*(episode(client, i) for i in range(episodes)))
    return samples


def _token_counter(tokenizer_path: Optional[str]):
    if tokenizer_path is None:
        return lambda text: len(text.split())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])

"""Rule rewards for the CPU test bed, loaded by verl's `reward.custom_reward_function`.

A random tiny model never answers arithmetic right, so GSM8K scoring gives all-zero rewards,
zero GRPO advantages and no weight change. This dense reward varies between samples, so
every step really updates the actor (and a weight sync has something to carry).
"""

from __future__ import annotations

from typing import Any


def digit_fraction(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs: Any) -> float:
    """Fraction of the response's characters that are digits, in [0, 1]."""
    if not solution_str:
        return 0.0
    return sum(ch.isdigit() for ch in solution_str) / len(solution_str)

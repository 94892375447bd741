"""The stock systems' step clocks, beside RA2P's (`cost.py`): what a trainer without RA2P spends on one step's
micro-batches given their ready times. The simulator's baselines run them, and `benchmarks/ra2p_step.py` holds
them against real workers. Pure Python; times as in `cost.py`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

from verl_tide.ra2p.cost import StageTimes, _arrivals, _wait_for


def global_batch_cost(ready_times: Sequence[float], times: StageTimes, waits: Optional[list[float]] = None) -> float:
    """verl's default: wait for the whole batch, swap in Ref for every micro-batch, swap in Actor for all.
    `waits`: see `colocated_cost`."""
    m = len(ready_times)
    return _wait_for(max(ready_times, default=0.0), 0.0, waits) + 2 * times.t_swap + m * (
        times.t_ref + times.t_act_f + times.t_act_b)


def streaming_swap_cost(ready_times: Sequence[float], times: StageTimes,
                        waits: Optional[list[float]] = None) -> float:
    """Streaming with Ref and Actor sharing a device: two swaps per micro-batch, as each arrives. `waits`: see
    `colocated_cost`."""
    clock = 0.0
    for a in sorted(ready_times):
        clock = _wait_for(a, clock, waits) + 2 * times.t_swap + times.t_ref + times.t_act_f + times.t_act_b
    return clock


def mini_batch_cost(ready_times: Sequence[float], times: StageTimes, per_mini_batch: int, poll_s: float = 0.0,
                    waits: Optional[list[float]] = None) -> float:
    """verl V1's asynchronous trainers (`separate_async`, `fully_async`): PPO mini-batches of `per_mini_batch`
    micro-batches trained one after another, each as soon as the sampler sees it whole (Ref then Actor on the
    trainer's GPUs, two swaps per mini-batch). The sampler looks every `poll_s` seconds while it waits (verl's
    replay buffer: 2 s; fully_async's message queue blocks: 0). `waits`: see `colocated_cost`."""
    if per_mini_batch < 1:
        raise ValueError(f"per_mini_batch = {per_mini_batch}: must be >= 1")
    arrivals, clock = _arrivals(ready_times), 0.0
    for i in range(0, len(arrivals), per_mini_batch):
        chunk = arrivals[i:i + per_mini_batch]
        ready = chunk[-1]
        if ready > clock and poll_s > 0:
            ready = clock + math.ceil((ready - clock) / poll_s - 1e-9) * poll_s
        clock = _wait_for(ready, clock, waits) + 2 * times.t_swap + len(chunk) * (
            times.t_ref + times.t_act_f + times.t_act_b)
    return clock

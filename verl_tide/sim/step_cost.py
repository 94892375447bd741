"""A simulated step's trainer time, by the way its system takes ready data: stock verl's clocks
(`ra2p/stock_cost.py`) or RA2P's for the mode the step runs in (`ra2p/cost.py`), the production cost models."""

from __future__ import annotations

from typing import Optional

from verl_tide.ra2p.cost import RA2PMode, StageTimes, colocated_cost, decoupled_cost, split_cost
from verl_tide.ra2p.stock_cost import global_batch_cost, mini_batch_cost, streaming_swap_cost
from verl_tide.sim.records import Consume, SystemSpec


def step_cost(spec: SystemSpec, mode: Optional[RA2PMode], share: float, ready_rel: list[float], times: StageTimes,
              per_mini_batch: int, ref_ranks_t_ref: float, in_step: list[float]) -> tuple[float, str]:
    """(seconds from the step's start to the end of its update, the mode it ran in). `in_step` collects the
    Actor's waits for data inside the step."""
    if spec.consume is Consume.GLOBAL:
        return global_batch_cost([0.0] * len(ready_rel), times, in_step), "global"
    if spec.consume is Consume.MINI_BATCH:
        return mini_batch_cost(ready_rel, times, per_mini_batch, spec.poll_s, in_step), "mini_batch"
    if spec.consume is Consume.STREAM_SWAP:
        return streaming_swap_cost(ready_rel, times, in_step), "stream_swap"
    if mode is RA2PMode.DECOUPLED:
        return decoupled_cost(ready_rel, times, 1, in_step), "decoupled"
    if share:
        return split_cost(ready_rel, times, ref_ranks_t_ref, share, spec.max_aggregate, in_step), "split"
    return colocated_cost(ready_rel, times, spec.max_aggregate, in_step), "colocated"

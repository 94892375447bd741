"""RA2P's analytical cost model (paper Appendix A) and the per-step mode choice.

Pure Python. Times are seconds per micro-batch; the caller measures them online from the
workers (`StageTimes.from_token_rates` scales per-token rates to a micro-batch). Ready times
are relative to the start of the training step (<= 0: ready at start).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from verl_tide.readiness import ready_gaps


class RA2PMode(str, Enum):
    DECOUPLED = "decoupled"  # Ref on its own ranks, KL deferred to the Actor's backward
    COLOCATED = "colocated"  # Ref and Actor share ranks; ready-batch aggregation


@dataclass(frozen=True)
class StageTimes:
    """Per-micro-batch times: Ref forward, Actor forward, Actor backward, one Ref<->Actor swap."""

    t_ref: float
    t_act_f: float
    t_act_b: float
    t_swap: float

    def __post_init__(self) -> None:
        for name in ("t_ref", "t_act_f", "t_act_b", "t_swap"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"StageTimes.{name} = {value!r}: must be >= 0 seconds")

    @classmethod
    def from_token_rates(cls, tokens: int, ref_s_per_token: float, act_f_s_per_token: float,
                         act_b_s_per_token: float, t_swap: float) -> StageTimes:
        return cls(tokens * ref_s_per_token, tokens * act_f_s_per_token, tokens * act_b_s_per_token, t_swap)


def decoupled_cost(ready_times: Sequence[float], times: StageTimes, actor_ranks: int) -> float:
    """C_dec: the pipeline-fill bubble sum_{i<M} i*t_ref, plus the Actor pipeline run event by event.

    Appendix A writes the second term as sum_i max(delta_i, t_act_f + t_act_b) with delta_i the gap
    between consecutive arrivals. That double-counts when the Actor finishes a burst before the next
    arrival (the wait is from its last completion, not from the last arrival) and drops the last
    micro-batch's compute when arrivals are slow; measured per-step times (benchmarks/ra2p_step.py)
    followed the event form: each micro-batch starts at max(Actor free, its arrival); its forward
    needs no ref log-probs (deferred KL), its backward waits for them from the Ref rank, which
    serves micro-batches in arrival order."""
    if actor_ranks < 1:
        raise ValueError(f"actor_ranks = {actor_ranks}: must be >= 1")
    fill = sum(i * times.t_ref for i in range(actor_ranks))
    actor_free = ref_free = 0.0
    for a in sorted(max(t, 0.0) for t in ready_times):
        ref_free = max(ref_free, a) + times.t_ref
        actor_free = max(max(actor_free, a) + times.t_act_f, ref_free) + times.t_act_b
    return fill + actor_free


def colocated_cost(ready_times: Sequence[float], times: StageTimes, max_aggregate: int) -> float:
    """C_col by simulating ready-batch aggregation: wait, swap in Ref for k ready, swap in Actor for k."""
    if max_aggregate < 1:
        raise ValueError(f"max_aggregate = {max_aggregate}: must be >= 1")
    arrivals = sorted(max(a, 0.0) for a in ready_times)
    clock, j, n = 0.0, 0, len(arrivals)
    while j < n:
        clock = max(clock, arrivals[j])
        k = 1
        while j + k < n and k < max_aggregate and arrivals[j + k] <= clock:
            k += 1
        clock += times.t_swap + k * times.t_ref
        clock += times.t_swap + k * (times.t_act_f + times.t_act_b)
        j += k
    return clock


def global_batch_cost(ready_times: Sequence[float], times: StageTimes) -> float:
    """verl's default: wait for the whole batch, swap in Ref for every micro-batch, swap in Actor for all."""
    m = len(ready_times)
    return max(max(ready_times, default=0.0), 0.0) + 2 * times.t_swap + m * (
        times.t_ref + times.t_act_f + times.t_act_b)


def streaming_swap_cost(ready_times: Sequence[float], times: StageTimes) -> float:
    """Streaming with Ref and Actor sharing a device: two swaps per micro-batch, as each arrives."""
    clock = 0.0
    for a in sorted(ready_times):
        clock = max(clock, a) + 2 * times.t_swap + times.t_ref + times.t_act_f + times.t_act_b
    return clock


class StageTimer:
    """Per-token rates of Ref forward, Actor forward and Actor backward, and the swap time, learned
    online from what the workers report (exponentially smoothed), so the cost model runs on
    measured times rather than guesses. Feed `observe(stage, tokens, seconds)` after each pass."""

    STAGES = ("ref", "act_f", "act_b", "swap")

    def __init__(self, smoothing: float = 0.2):
        if not 0 < smoothing <= 1:
            raise ValueError(f"StageTimer.smoothing = {smoothing!r}: must be 0 < x <= 1")
        self.smoothing = smoothing
        self._rate: dict[str, float] = {}

    def observe(self, stage: str, tokens: int, seconds: float) -> None:
        if stage not in self.STAGES:
            raise ValueError(f"stage = {stage!r}: must be one of {' | '.join(self.STAGES)}")
        if seconds < 0 or (stage != "swap" and tokens <= 0):
            raise ValueError(f"{stage}: tokens = {tokens}, seconds = {seconds}: need tokens > 0, seconds >= 0")
        value = seconds if stage == "swap" else seconds / tokens  # swap time does not scale with tokens
        old = self._rate.get(stage)
        self._rate[stage] = value if old is None else self.smoothing * value + (1 - self.smoothing) * old

    @property
    def ready(self) -> bool:
        return all(s in self._rate for s in self.STAGES)

    def stage_times(self, tokens_per_micro_batch: int) -> StageTimes:
        """The measured times for a micro-batch of this many tokens."""
        if not self.ready:
            missing = [s for s in self.STAGES if s not in self._rate]
            raise RuntimeError(f"no measurement yet for stage(s) {missing}")
        r = self._rate
        return StageTimes.from_token_rates(tokens_per_micro_batch, r["ref"], r["act_f"], r["act_b"], r["swap"])


@dataclass(frozen=True)
class ModeChoice:
    mode: RA2PMode
    decoupled_s: float
    colocated_s: float
    reason: str


def choose_mode(ready_times: Sequence[float], times: StageTimes, actor_ranks: int, max_aggregate: int,
                previous: Optional[RA2PMode] = None, hysteresis: float = 0.1,
                colocated_times: Optional[StageTimes] = None) -> ModeChoice:
    """The cheaper mode; a switch away from `previous` needs a relative gain above `hysteresis`.
    `colocated_times`: stage times when Ref runs on the Actor's ranks, if they differ from `times`
    (decoupled Ref ranks of their own)."""
    if not 0 <= hysteresis < 1:
        raise ValueError(f"hysteresis = {hysteresis!r}: must be 0 <= x < 1")
    c_dec = decoupled_cost(ready_times, times, actor_ranks)
    c_col = colocated_cost(ready_times, colocated_times or times, max_aggregate)
    best = RA2PMode.DECOUPLED if c_dec < c_col else RA2PMode.COLOCATED
    cost = {RA2PMode.DECOUPLED: c_dec, RA2PMode.COLOCATED: c_col}
    if previous is not None and best is not previous and cost[best] > (1 - hysteresis) * cost[previous]:
        return ModeChoice(previous, c_dec, c_col,
                          f"keep {previous.value}: {best.value} saves less than {hysteresis:.0%}")
    return ModeChoice(best, c_dec, c_col, f"{best.value}: C_dec={c_dec:.3f}s C_col={c_col:.3f}s")


def decoupled_break_even_ras(n_micro_batches: int, tprm: float, times: StageTimes, actor_ranks: int,
                             max_aggregate: int) -> Optional[int]:
    """Smallest ready-at-start count N0 for which decoupled is no slower than colocated, when the
    other micro-batches arrive every `tprm` seconds; None if colocated wins even with all ready."""
    for n0 in range(n_micro_batches + 1):
        ready = [0.0] * n0 + [tprm * (k + 1) for k in range(n_micro_batches - n0)]
        if decoupled_cost(ready, times, actor_ranks) <= colocated_cost(ready, times, max_aggregate):
            return n0
    return None


def ref_ranks_for_decoupled(ready_times: Sequence[float], times_with_ref_ranks: Callable[[int], StageTimes],
                            colocated_times: StageTimes, max_aggregate: int, max_ref_ranks: int) -> Optional[int]:
    """Fewest Ref ranks (1..max_ref_ranks) with which decoupled mode beats colocated on these arrivals;
    None if none does. `times_with_ref_ranks(k)` gives the stage times when k Ref ranks serve the Actor."""
    c_col = colocated_cost(ready_times, colocated_times, max_aggregate)
    for k in range(1, max_ref_ranks + 1):
        if decoupled_cost(ready_times, times_with_ref_ranks(k), actor_ranks=1) < c_col:
            return k
    return None

"""RA2P's analytical cost model (paper Appendix A) and the per-step mode choice.

Pure Python. Times are seconds per micro-batch; the caller measures them online from the
workers (`StageTimes.from_token_rates` scales per-token rates to a micro-batch). Ready times
are relative to the start of the training step (<= 0: ready at start).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Optional

from verl_tide.core.readiness import ready_gaps


class RA2PMode(str, Enum):
    DECOUPLED = "decoupled"  # Ref on its own ranks, KL deferred to the Actor's backward
    COLOCATED = "colocated"  # Ref and Actor share ranks; ready-batch aggregation
    # Colocated aggregation with too few Ref ranks for decoupled mode: they score a share of each Ref pass
    # beside the Actor's ranks (the rest), so every Ref rank ERS lends takes work off the trainer.
    SPLIT = "split"


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


def decoupled_cost(ready_times: Sequence[float], times: StageTimes, actor_ranks: int,
                   waits: Optional[list[float]] = None) -> float:
    """C_dec: the pipeline-fill bubble sum_{i<M} i*t_ref, plus the Actor pipeline run event by event.

    Appendix A writes the second term as sum_i max(delta_i, t_act_f + t_act_b) with delta_i the gap
    between consecutive arrivals. That double-counts when the Actor finishes a burst before the next
    arrival (the wait is from its last completion, not from the last arrival) and drops the last
    micro-batch's compute when arrivals are slow; measured per-step times (benchmarks/ra2p_step.py)
    followed the event form: each micro-batch starts at max(Actor free, its arrival); its forward
    needs no ref log-probs (deferred KL), its backward waits for them from the Ref rank, which
    serves micro-batches in arrival order. `waits`: see `colocated_cost`."""
    return _pipeline_fill(times, actor_ranks) + _decoupled_clock(_arrivals(ready_times), times, waits)


def _pipeline_fill(times: StageTimes, actor_ranks: int) -> float:
    if actor_ranks < 1:
        raise ValueError(f"actor_ranks = {actor_ranks}: must be >= 1")
    return sum(i * times.t_ref for i in range(actor_ranks))


def _decoupled_clock(arrivals: list[float], times: StageTimes, waits: Optional[list[float]] = None) -> float:
    """The event form over sorted arrivals, one burst of equal ready times at a time (trainer `tide` gives a
    mini-batch's groups one ready time, so ERS weighs hundreds of groups per plan as tens of bursts). Within
    a burst of k at time a, with R = max(Ref free, a): the Ref serves them back to back (the i-th done at
    R + i t_ref), and the Actor's i-th backward ends at f_i = max(f_{i-1} + t_act_f + t_act_b, R + i t_ref +
    t_act_b) from the second on; unrolled, that maximum is at its ends: f_k = max(f_1 + (k-1)(t_act_f +
    t_act_b), R + k t_ref + t_act_b). Equal to the item-by-item loop (tests/test_ra2p_cost.py)."""
    t_ref, t_act_f, t_act_b = times.t_ref, times.t_act_f, times.t_act_b
    per_item = t_act_f + t_act_b
    actor_free = ref_free = 0.0
    i, n = 0, len(arrivals)
    while i < n:  # conditionals, not max(): ERS runs this many times per plan
        a = arrivals[i]
        j = bisect_right(arrivals, a, lo=i)
        first_ref = (ref_free if ref_free > a else a)
        if waits is not None and a > actor_free:
            waits.append(a - actor_free)
        start = (actor_free if actor_free > a else a) + t_act_f
        done = first_ref + t_ref
        actor_free = (start if start > done else done) + t_act_b
        ref_free = first_ref + (j - i) * t_ref
        if j - i > 1:
            chain, last = actor_free + (j - i - 1) * per_item, ref_free + t_act_b
            actor_free = chain if chain > last else last
        i = j
    return actor_free


def colocated_cost(ready_times: Sequence[float], times: StageTimes, max_aggregate: int,
                   waits: Optional[list[float]] = None) -> float:
    """C_col by simulating ready-batch aggregation: wait, swap in Ref for k ready, swap in Actor for k.

    `waits` (each cost function takes one): the Actor's waits for data inside the step are appended to it, one
    per time it was idle until the next micro-batch was ready. Not the cost minus the compute: aggregation
    runs a swap pair per burst, work rather than waiting, and trainer `tide` measures its TWT as the
    sampler's wait for ready data, which those swaps are not part of."""
    _check_aggregate(max_aggregate)
    return _colocated_clock(_arrivals(ready_times), times, max_aggregate, waits)


def _check_aggregate(max_aggregate: int) -> None:
    if max_aggregate < 1:
        raise ValueError(f"max_aggregate = {max_aggregate}: must be >= 1")


def _arrivals(ready_times: Sequence[float]) -> list[float]:
    """Sorted ready times, none before the step's start: what the aggregation simulations walk (computed once
    where one plan weighs many costs over the same arrivals)."""
    return sorted([a if a > 0.0 else 0.0 for a in ready_times])


def _colocated_clock(arrivals: list[float], times: StageTimes, max_aggregate: int,
                     waits: Optional[list[float]] = None) -> float:
    clock, j, n = 0.0, 0, len(arrivals)
    while j < n:
        clock = _wait_for(arrivals[j], clock, waits)
        k = _burst(arrivals, j, clock, max_aggregate)
        clock += times.t_swap + k * times.t_ref
        clock += times.t_swap + k * (times.t_act_f + times.t_act_b)
        j += k
    return clock


def _wait_for(arrival: float, clock: float, waits: Optional[list[float]]) -> float:
    """The clock once the micro-batch arriving at `arrival` is there; the idle time, if any, into `waits`."""
    if arrival <= clock:
        return clock
    if waits is not None:
        waits.append(arrival - clock)
    return arrival


def _burst(arrivals: list[float], j: int, clock: float, max_aggregate: int) -> int:
    """How many micro-batches from the j-th one aggregated pass takes at `clock`: those ready by then, at least
    one, at most `max_aggregate` (a bisection: arrivals come in mini-batch bursts of equal times)."""
    return max(1, min(max_aggregate, bisect_right(arrivals, clock, lo=j) - j))


def split_cost(ready_times: Sequence[float], times: StageTimes, ref_ranks_t_ref: float, share: float,
               max_aggregate: int, waits: Optional[list[float]] = None) -> float:
    """Colocated aggregation where Ref ranks score `share` of every Ref pass: the Actor's ranks run the
    rest of it (between the two swaps), the Ref ranks their part from the burst's start, concurrently;
    the burst's last backward waits for the Ref ranks (the KL term is deferred to the backward).
    `times` are the colocated stage times (Ref on the Actor's ranks); `ref_ranks_t_ref` is one micro-batch's
    Ref forward on the Ref ranks. share = 0 is `colocated_cost`. `waits`: see `colocated_cost` (the Actor's
    wait for the Ref ranks' part is not a wait for data)."""
    if not 0 <= share < 1:
        raise ValueError(f"share = {share!r}: must be 0 <= x < 1 (all of it on Ref ranks is decoupled mode)")
    _check_aggregate(max_aggregate)
    return _split_clock(_arrivals(ready_times), times, ref_ranks_t_ref, share, max_aggregate, waits)


def _split_clock(arrivals: list[float], times: StageTimes, ref_ranks_t_ref: float, share: float,
                 max_aggregate: int, waits: Optional[list[float]] = None) -> float:
    clock = ref_free = 0.0
    j, n = 0, len(arrivals)
    while j < n:
        clock = _wait_for(arrivals[j], clock, waits)
        k = _burst(arrivals, j, clock, max_aggregate)
        ref_free = max(ref_free, clock) + share * k * ref_ranks_t_ref
        clock += 2 * times.t_swap + (1 - share) * k * times.t_ref + k * (times.t_act_f + times.t_act_b)
        if share > 0:
            clock = max(clock, ref_free + times.t_act_b)
        j += k
    return clock


SHARE_STEPS = 40  # resolution of the Ref ranks' share: 2.5 %


def best_split(ready_times: Sequence[float], times: StageTimes, ref_ranks_t_ref: float,
               max_aggregate: int) -> tuple[float, float]:
    """(share, C_split): the share of each Ref pass that Ref ranks score with the lowest cost; the smallest
    share among equal costs (share 0 = colocated)."""
    _check_aggregate(max_aggregate)
    arrivals = _arrivals(ready_times)
    costs = {0: _colocated_clock(arrivals, times, max_aggregate)}

    def cost(i: int) -> float:
        if i not in costs:
            costs[i] = _split_clock(arrivals, times, ref_ranks_t_ref, i / SHARE_STEPS, max_aggregate)
        return costs[i]

    # A coarse pass, then every step around its best (ERS weighs this for several Ref-rank counts per plan,
    # within its 1 ms budget): the cost falls with the share while the Actor's ranks are the bottleneck and
    # rises once the Ref ranks are, so the refined optimum is nearly always the grid's (bursts can bend the
    # curve: on random cases exact 490+ times in 500, never 5% off; tests/test_ra2p_cost.py).
    coarse = SHARE_STEPS // 8
    best = min(range(0, SHARE_STEPS, coarse), key=lambda i: (cost(i), i))
    best = min(range(max(0, best - coarse + 1), min(SHARE_STEPS, best + coarse)), key=lambda i: (cost(i), i))
    return best / SHARE_STEPS, cost(best)


def next_step_mode(configured: str, chosen: Optional[RA2PMode], ref_replicas_up: int, can_split: bool,
                   ref_service_ready: bool = True) -> RA2PMode:
    """The mode the next step's mini-batches run in, from `tide.ra2p.mode` (`configured`), the planner's choice at
    the last boundary (`chosen`, None before anything was measured) and what exists to run it: decoupled needs Ref
    replicas (and the service the deferred-KL loss reads them from), split needs them beside the Actor's own Ref;
    everything else runs colocated. Trainer `tide` and the simulator both take the mode from here."""
    if not ref_service_ready or ref_replicas_up < 1 or configured == "colocated":
        return RA2PMode.COLOCATED
    if configured == "decoupled":
        return RA2PMode.DECOUPLED
    if configured == "split":
        return RA2PMode.SPLIT if can_split else RA2PMode.COLOCATED
    mode = chosen or RA2PMode.DECOUPLED
    return RA2PMode.COLOCATED if mode is RA2PMode.SPLIT and not can_split else mode


class StageTimer:
    """Per-token rates of Ref forward, Actor forward and Actor backward, and the swap time, learned
    online from what the workers report (exponentially smoothed), so the cost model runs on
    measured times rather than guesses. Feed `observe(stage, tokens, seconds)` after each pass."""

    STAGES = ("ref", "act_f", "act_b", "swap")
    # Ref forward on one Ref replica (seconds per token): what split mode and ERS weigh when Ref also runs on
    # the Actor's ranks ("ref"); not needed for `ready`.
    OPTIONAL = ("ref_rank",)

    def __init__(self, smoothing: float = 0.2):
        if not 0 < smoothing <= 1:
            raise ValueError(f"StageTimer.smoothing = {smoothing!r}: must be 0 < x <= 1")
        self.smoothing = smoothing
        self._rate: dict[str, float] = {}

    def observe(self, stage: str, tokens: int, seconds: float) -> None:
        if stage not in self.STAGES + self.OPTIONAL:
            raise ValueError(f"stage = {stage!r}: must be one of {' | '.join(self.STAGES + self.OPTIONAL)}")
        if seconds < 0 or (stage != "swap" and tokens <= 0):
            raise ValueError(f"{stage}: tokens = {tokens}, seconds = {seconds}: need tokens > 0, seconds >= 0")
        value = seconds if stage == "swap" else seconds / tokens  # swap time does not scale with tokens
        old = self._rate.get(stage)
        self._rate[stage] = value if old is None else self.smoothing * value + (1 - self.smoothing) * old

    def rate(self, stage: str) -> Optional[float]:
        """Seconds per token (per swap for `swap`), None before the first observation."""
        return self._rate.get(stage)

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
    split_s: Optional[float] = None  # None: split mode was not a candidate
    ref_share: float = 0.0  # split mode: the share of each Ref pass the Ref ranks score


def choose_mode(ready_times: Sequence[float], times: StageTimes, actor_ranks: int, max_aggregate: int,
                previous: Optional[RA2PMode] = None, hysteresis: float = 0.1,
                colocated_times: Optional[StageTimes] = None, split_ref_t_ref: Optional[float] = None) -> ModeChoice:
    """The cheapest mode; a switch away from `previous` needs a relative gain above `hysteresis`.
    `colocated_times`: stage times when Ref runs on the Actor's ranks, if they differ from `times`
    (decoupled Ref ranks of their own). `split_ref_t_ref`: one micro-batch's Ref forward on the Ref
    ranks, which makes split mode a candidate (Ref ranks exist beside a Ref on the Actor's ranks)."""
    if not 0 <= hysteresis < 1:
        raise ValueError(f"hysteresis = {hysteresis!r}: must be 0 <= x < 1")
    col_times = colocated_times or times
    cost = {RA2PMode.DECOUPLED: decoupled_cost(ready_times, times, actor_ranks),
            RA2PMode.COLOCATED: colocated_cost(ready_times, col_times, max_aggregate)}
    share = 0.0
    if split_ref_t_ref is not None:
        share, c_split = best_split(ready_times, col_times, split_ref_t_ref, max_aggregate)
        if share > 0:
            cost[RA2PMode.SPLIT] = c_split
    best = min(cost, key=lambda m: (cost[m], m is not RA2PMode.COLOCATED))
    split_s = cost.get(RA2PMode.SPLIT) if split_ref_t_ref is not None else None
    c_dec, c_col = cost[RA2PMode.DECOUPLED], cost[RA2PMode.COLOCATED]
    # Colocated and split run the same way (aggregated Ref passes between two swaps), the share of Ref ranks
    # 0 or more: moving between them changes no placement, so only a switch to or from decoupled needs the margin.
    if previous is not None and previous in cost and _placement(best) is not _placement(previous) \
            and cost[best] > (1 - hysteresis) * cost[previous]:
        keep_share = share if previous is RA2PMode.SPLIT else 0.0
        return ModeChoice(previous, c_dec, c_col, f"keep {previous.value}: {best.value} saves less than "
                          f"{hysteresis:.0%}", split_s, keep_share)
    detail = f" (Ref ranks score {share:.0%} of each Ref pass)" if best is RA2PMode.SPLIT else ""
    costs = " ".join(f"C_{m.value[:3]}={c:.3f}s" for m, c in cost.items())
    return ModeChoice(best, c_dec, c_col, f"{best.value}{detail}: {costs}", split_s,
                      share if best is RA2PMode.SPLIT else 0.0)


def decoupled_break_even_ras(n_micro_batches: int, tprm: float, times: StageTimes, actor_ranks: int,
                             max_aggregate: int, per_mini_batch: int = 1) -> Optional[int]:
    """Smallest ready-at-start count N0 for which decoupled is no slower than colocated, when the
    other micro-batches arrive every `tprm` seconds; None if colocated wins even with all ready.
    `per_mini_batch`: micro-batches the trainer takes at once (trainer `tide`: GRPO groups per PPO mini-batch):
    they arrive together, every `per_mini_batch` x `tprm`, and N0 counts whole mini-batches (at most the
    last is partial), so a step of hundreds of groups weighs tens of candidates, not hundreds."""
    if per_mini_batch < 1:
        raise ValueError(f"per_mini_batch = {per_mini_batch}: must be >= 1")
    _check_aggregate(max_aggregate)
    fill = _pipeline_fill(times, actor_ranks)
    candidates = list(range(0, n_micro_batches, per_mini_batch)) + [n_micro_batches]
    # Every candidate's later arrivals are a prefix of the first's (n0 is whole mini-batches); built sorted
    # and >= 0, so the clocks take them directly (no re-sort per candidate)
    later = [tprm * per_mini_batch * (k // per_mini_batch + 1) for k in range(n_micro_batches)]
    for n0 in candidates:
        ready = [0.0] * n0 + later[:n_micro_batches - n0]
        if fill + _decoupled_clock(ready, times) <= _colocated_clock(ready, times, max_aggregate):
            return n0
    return None


class _CostsByRefRanks:
    """The step's predicted time with k Ref ranks, in the best mode they allow (colocated with 0; also decoupled,
    and split when Ref on the Actor's ranks remains available), each k computed once over one step's arrivals:
    ERS weighs several counts per plan, within its 1 ms budget."""

    def __init__(self, ready_times: Sequence[float], times_with_ref_ranks: Callable[[int], StageTimes],
                 colocated_times: StageTimes, max_aggregate: int, split: bool):
        _check_aggregate(max_aggregate)
        self.arrivals = _arrivals(ready_times)
        self.times_with_ref_ranks, self.colocated_times = times_with_ref_ranks, colocated_times
        self.max_aggregate, self.split = max_aggregate, split
        self.colocated = _colocated_clock(self.arrivals, colocated_times, max_aggregate)
        self._cost: dict[int, float] = {}

    def __call__(self, ref_ranks: int) -> float:
        if ref_ranks < 1:
            return self.colocated
        if ref_ranks not in self._cost:
            t = self.times_with_ref_ranks(ref_ranks)
            best = min(self.colocated, _decoupled_clock(self.arrivals, t))  # one Actor rank group: no fill
            if self.split:
                best = min(best, best_split(self.arrivals, self.colocated_times, t.t_ref, self.max_aggregate)[1])
            self._cost[ref_ranks] = best
        return self._cost[ref_ranks]

    def fewest_paying(self, max_ref_ranks: int) -> Optional[int]:
        return next((k for k in range(1, max_ref_ranks + 1) if self(k) < self.colocated), None)

    def saving(self, have: int, target: int) -> float:
        now, then = self(have), self(target)
        return max(0.0, (now - then) / now) if now > 0 else 0.0


def ref_ranks_for_decoupled(ready_times: Sequence[float], times_with_ref_ranks: Callable[[int], StageTimes],
                            colocated_times: StageTimes, max_aggregate: int, max_ref_ranks: int,
                            split: bool = False) -> Optional[int]:
    """Fewest Ref ranks (1..max_ref_ranks) with which decoupled mode (or split mode, with `split`) beats
    colocated on these arrivals; None if none does. `times_with_ref_ranks(k)` gives the stage times when k
    Ref ranks serve the Actor."""
    return _CostsByRefRanks(ready_times, times_with_ref_ranks, colocated_times, max_aggregate,
                            split).fewest_paying(max_ref_ranks)


def _placement(mode: RA2PMode) -> RA2PMode:
    return RA2PMode.COLOCATED if mode is RA2PMode.SPLIT else mode


def cost_with_ref_ranks(ready_times: Sequence[float], times_with_ref_ranks: Callable[[int], StageTimes],
                        colocated_times: StageTimes, max_aggregate: int, ref_ranks: int, split: bool) -> float:
    """The step's predicted time with `ref_ranks` Ref ranks, in the best mode they allow (colocated with 0;
    also decoupled, and split when Ref on the Actor's ranks remains available)."""
    return _CostsByRefRanks(ready_times, times_with_ref_ranks, colocated_times, max_aggregate, split)(ref_ranks)


def ref_rank_outlook(ready_times: Sequence[float], times_with_ref_ranks: Callable[[int], StageTimes],
                     colocated_times: StageTimes, max_aggregate: int, have: int, max_ref_ranks: int,
                     split: bool) -> tuple[Optional[int], Optional[float]]:
    """What ERS weighs before lending a rollout rank to Ref: (the fewest Ref ranks with which a mode using them
    pays, the saving of the next move toward that count from `have`); (None, 0.0) if no count up to
    `max_ref_ranks` pays: each count then costs what colocated does (its cost is its best mode's), so one more
    Ref rank saves nothing."""
    costs = _CostsByRefRanks(ready_times, times_with_ref_ranks, colocated_times, max_aggregate, split)
    needed = costs.fewest_paying(max_ref_ranks)
    if needed is None:
        return None, 0.0
    return needed, costs.saving(have, max(have + 1, needed))


def ref_rank_saving(ready_times: Sequence[float], times_with_ref_ranks: Callable[[int], StageTimes],
                    colocated_times: StageTimes, max_aggregate: int, have: int, target: int, split: bool) -> float:
    """Relative step-time saving the cost model predicts from `have` Ref ranks to `target` (>= 0; what ERS
    weighs before taking a rank from rollout)."""
    return _CostsByRefRanks(ready_times, times_with_ref_ranks, colocated_times, max_aggregate,
                            split).saving(have, target)

"""Readiness signals of the global trajectory buffer, computed in one place for RA2P and ERS.

Pure Python (no verl, ray or torch), clock injected. Vocabulary of the paper (Sec. 5, App. A):

- ready-at-start (RAS, N0): micro-batches already ready when a training step begins;
- time per ready micro-batch (TPRM): the post-start gaps between later ready times;
- head-of-line (HoL) latency: how long the oldest ready, unconsumed micro-batch has waited;
- generation deficit: the trainer waited for data, or ready volume below B_ideal while rollout
  did not wait for the trainer (rollout is the bottleneck, TWT grows);
- consumption deficit: rollout held back by the trainer, or (unless the trainer waited) HoL
  latency above tau x mean step time or RAS beyond the decoupled break-even point (the trainer is
  the bottleneck, RWT grows);
- RWT / TWT: rollout and trainer wait time, accounted per step (RWT: paused for the weight sync, or
  out of work at the staleness limit; per rank, averaged);
- the rollout's rate over its working time, its utilization (the share of that time its ranks were
  busy) and how KV-bound it was (the share of that time work waited for KV budget): what fewer rollout
  ranks could still make, and whether more would make more.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional


def ready_at_start(ready_times: Sequence[float]) -> int:
    """N0 = |{i : a_i <= 0}| for ready times relative to the step start."""
    return sum(1 for a in ready_times if a <= 0)


def ready_gaps(ready_times: Sequence[float]) -> list[float]:
    """delta_i for every micro-batch (App. A): 0 for i <= N0, delta_{N0+1} = max(a_{N0+1}, 0),
    then a_i - a_{i-1}."""
    times = sorted(ready_times)
    n0 = ready_at_start(times)
    gaps = [0.0] * n0
    for i in range(n0, len(times)):
        gaps.append(max(times[i], 0.0) if i == n0 else times[i] - times[i - 1])
    return gaps


def post_start_gaps(ready_times: Sequence[float]) -> list[float]:
    """The gaps delta_i for i > N0: what TPRM summarizes."""
    return ready_gaps(ready_times)[ready_at_start(ready_times):]


def time_per_ready_microbatch(ready_times: Sequence[float]) -> Optional[float]:
    """Mean post-start gap (TPRM); None when every micro-batch was ready at the start."""
    gaps = post_start_gaps(ready_times)
    return sum(gaps) / len(gaps) if gaps else None


def step_time_fed(duration: float, ready_times: Sequence[float]) -> float:
    """A step's time from its first ready micro-batch to its update: the trainer's own pace. The step begins
    before its sampler waits (trainer `tide`'s `on_step_begin`), and a wait before any data was there is the
    rollout's, not the step's: counted in, the cold start's wait inflated the mean step time for steps after it
    and ERS's consumption check read the trainer as slower than it trains (found in the simulator: ALFWorld at
    100 steps moved rollout ranks to Ref until the rollout starved, 32% of goodput)."""
    first = min(ready_times, default=0.0)
    return max(0.0, duration - max(0.0, first))


def mini_batch_ready_times(ready_times: Sequence[float], per_mini_batch: int) -> list[float]:
    """Ready times as the trainer can use them, one per unit (sorted): verl's replay buffer hands out whole PPO
    mini-batches of `per_mini_batch` ready groups, so no group of a mini-batch trains before its last group is
    ready. Fed per group, RA2P's cost model would stream each group as it arrived, which the trainer never does."""
    if per_mini_batch < 1:
        raise ValueError(f"per_mini_batch = {per_mini_batch}: must be >= 1")
    times = sorted(ready_times)
    out: list[float] = []
    for start in range(0, len(times), per_mini_batch):  # each unit's last time, repeated at C speed
        stop = min(start + per_mini_batch, len(times))
        out += [times[stop - 1]] * (stop - start)
    return out


@dataclass(frozen=True)
class ReadinessSignals:
    """What RA2P's mode choice and ERS's scaling plan read after a step."""

    ready_at_start: int
    time_per_ready_microbatch: Optional[float]  # last step's TPRM (seconds), None if all ready at start
    tprm_smoothed: Optional[float]  # exponentially smoothed TPRM
    hol_latency: float  # seconds the oldest unconsumed ready micro-batch has waited (0 if none)
    ready_volume: int  # sequences ready and not yet consumed
    mean_step_time: Optional[float]
    generation_deficit: bool
    consumption_deficit: bool
    rollout_wait_s: float  # RWT of the last step
    trainer_wait_s: float  # TWT of the last step
    # Sequences the rollout made ready per second of its working time (the last step cycle, minus RWT):
    # what ERS checks before taking a rank from rollout. None before the first full cycle.
    rollout_capacity_rate: Optional[float] = None
    # The share of that working time the rollout ranks had a request in flight (busy rank-seconds over ranks x
    # working seconds, at most 1): below 1 fewer ranks could have done the same work. None when not reported.
    rollout_utilization: Optional[float] = None
    # The share of that working time CTB held work back for KV budget (tasks paused, or queued with no rank able to
    # hold them): the rollout was saturated, so more ranks would have run that work. None when not reported.
    rollout_kv_bound: Optional[float] = None
    # Mean context (tokens) of the turns in flight per rollout rank over that working time: the KV a decode
    # iteration reads. Against the model's weight bytes it says whether more ranks decode faster. None if unknown.
    rollout_decode_context: Optional[float] = None
    # The most KV the rollout's resident tasks held at once during the cycle, in ranks' worth of budget (CTB's
    # `kv_held_ranks`): the work in flight needs that many ranks. None if not reported.
    rollout_kv_held_peak: Optional[float] = None
    # The last step cycle (end of one step to the end of the next), seconds; None before the first.
    cycle_s: Optional[float] = None

    def rollout_rate_with(self, ranks: int, of: int) -> Optional[float]:
        """Sequences per second `ranks` of the `of` rollout ranks could make, from the last cycle: the same rate
        while the work the ranks did fits on fewer (utilization below `ranks / of`), proportionally less beyond.
        Work-conserving, so cautious where merged decode batches would run more efficiently. None when unknown."""
        if self.rollout_capacity_rate is None or of < 1:
            return None
        busy = self.rollout_utilization if self.rollout_utilization is not None else 1.0
        return self.rollout_capacity_rate * min(1.0, ranks / (of * max(busy, 1e-9)))

    def kv_fits(self, ranks: int, kv_bound_min: float = 0.5) -> bool:
        """Whether the work the rollout held fits in the KV of `ranks` rollout ranks: at least the peak it held at
        once (`rollout_kv_held_peak`), or work already waited for KV budget (`kv_bound_min` of the working time:
        it pauses at any size, and the rate scales with the ranks). Below that peak an unsaturated rollout starts
        pausing tasks and re-prefilling them, which neither the time-share model (`rollout_rate_with`) nor any
        other measured figure predicts. True when the peak is not reported."""
        if self.rollout_kv_held_peak is None or (self.rollout_kv_bound or 0.0) >= kv_bound_min:
            return True
        return ranks >= self.rollout_kv_held_peak - 1e-9


def rollout_shares(busy: Optional[tuple[float, int]], kv_wait_s: Optional[float], working_s: float
                   ) -> tuple[Optional[float], Optional[float]]:
    """(utilization, KV-bound share) of `working_s` seconds of the rollout's working time: the share of it the
    ranks had a request in flight (`busy`: busy rank-seconds, ranks), and the share during which work waited for
    KV budget; None where not measured. The one formula for a step cycle and for `RolloutInterval`."""
    utilization = None if busy is None else min(1.0, busy[0] / (busy[1] * working_s))
    kv_bound = None if kv_wait_s is None else min(1.0, kv_wait_s / working_s)
    return utilization, kv_bound


@dataclass
class RolloutInterval:
    """The rollout's utilization and KV-bound share since the last `read`, from the same cumulative clocks as
    `ReadinessTracker.rollout_clocks` (CTB's router keeps them). CTB's budget window reads them over the time since
    it last decided: a step cycle at each boundary, a shorter stretch while the trainer waits for data between
    boundaries (`ctb/window.py`), so no stretch of rollout time counts towards two of its decisions. Working time is
    the stretch less the ranks' out-of-work time (as in a cycle). A weight sync's pause is left out by reading
    again when it ends (the callers do): it idles the engines while work waits, the very pattern that grows the
    window, and a short stretch can be all pause (in the simulator one such read grew the window at a
    rollout-starved split, ALFWorld at 0.125 of 32 GPUs: -34% goodput)."""

    _mark: Optional[tuple[float, dict, float, float]] = None  # t, busy s per rank, out-of-work rank-s, KV-wait s

    def read(self, t: float, busy_s: Mapping[Hashable, float], idle_rank_s: float, kv_wait_s: float
             ) -> tuple[Optional[float], Optional[float]]:
        """(utilization, KV-bound share) since the last read, (None, None) at the first or without ranks or working
        time; the mark moves to `t` either way. A rank not seen at the last read counts from 0."""
        mark, self._mark = self._mark, (t, dict(busy_s), idle_rank_s, kv_wait_s)
        if mark is None or not busy_s:
            return None, None
        t0, busy0, idle0, kv0 = mark
        ranks = len(busy_s)
        working = (t - t0) - max(0.0, idle_rank_s - idle0) / ranks
        if working <= 0:
            return None, None
        busy = sum(max(0.0, v - busy0.get(r, 0.0)) for r, v in busy_s.items())
        return rollout_shares((busy, ranks), max(0.0, kv_wait_s - kv0), working)


@dataclass
class _Ready:
    at: float
    sequences: int


@dataclass
class ReadinessTracker:
    """Follows micro-batches through the global buffer and derives `ReadinessSignals`.

    Feed it events as they happen: `micro_batch_ready`, `step_started`, `micro_batch_consumed`,
    `step_finished`, plus measured waits (`rollout_waited`, `trainer_waited`). Every time is
    taken from `clock` unless given, so the simulator and tests drive it deterministically.
    """

    clock: Callable[[], float]
    smoothing: float = 0.3  # weight of the newest TPRM / step time in the moving averages
    _ready: dict[Hashable, _Ready] = field(default_factory=dict)
    _step_start: Optional[float] = None
    _step_ready_times: list[float] = field(default_factory=list)
    last_ready_times: list[float] = field(default_factory=list)  # last finished step's, seconds after its start
    _last_ras: int = 0
    _last_tprm: Optional[float] = None
    _tprm_smoothed: Optional[float] = None
    _mean_step_time: Optional[float] = None
    _rwt: float = 0.0
    _twt: float = 0.0
    _last_rwt: float = 0.0
    _last_twt: float = 0.0
    _cycle_start: Optional[float] = None  # end of the previous step (or `rollout_started`, or the first arrival)
    _cycle_sequences: int = 0  # sequences made ready since then
    _last_capacity_rate: Optional[float] = None
    _cycle_busy: Optional[tuple[float, int]] = None  # (busy rank-seconds, ranks) reported for this cycle
    _cycle_load: Optional[tuple[float, float, int]] = None  # (KV-wait s, generating token-s, ranks) reported
    _busy_marks: dict[Hashable, float] = field(default_factory=dict)
    _clock_marks: dict[str, float] = field(default_factory=dict)  # cumulative router clocks at the last read
    _last_utilization: Optional[float] = None
    _last_kv_bound: Optional[float] = None
    _last_decode_context: Optional[float] = None
    _cycle_kv_held_peak: Optional[float] = None  # the most KV held at once reported since the cycle began
    _last_kv_held_peak: Optional[float] = None
    _last_cycle_s: Optional[float] = None

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"ReadinessTracker.smoothing = {self.smoothing!r}: must be 0 < x <= 1")

    def _now(self, t: Optional[float]) -> float:
        return self.clock() if t is None else t

    def micro_batch_ready(self, mb_id: Hashable, sequences: int, t: Optional[float] = None) -> None:
        """A micro-batch entered the global buffer (all its trajectories, whole GRPO groups, are done)."""
        if mb_id in self._ready:
            raise ValueError(f"micro-batch {mb_id!r} is already in the buffer")
        if sequences <= 0:
            raise ValueError(f"micro-batch {mb_id!r}: sequences = {sequences}, must be > 0")
        now = self._now(t)
        self._ready[mb_id] = _Ready(now, sequences)
        if self._cycle_start is None:
            self._cycle_start = now
        self._cycle_sequences += sequences

    def rollout_started(self, t: Optional[float] = None) -> None:
        """Rollout got its first prompts: the first cycle's working time counts from here. Without it the first
        cycle starts at the first arrival, and the sequences generated before it inflate the first rate (on the
        CPU test bed the whole first batch arrived within a second of the first group: 8 seq/s read as far more)."""
        if self._cycle_start is None:
            self._cycle_start = self._now(t)

    def step_started(self, t: Optional[float] = None) -> None:
        self._step_start = self._now(t)
        self._step_ready_times = []

    def micro_batch_consumed(self, mb_id: Hashable, t: Optional[float] = None) -> None:
        """The trainer took the micro-batch (its ready time counts towards this step's RAS/TPRM)."""
        if self._step_start is None:
            raise RuntimeError("micro_batch_consumed before step_started")
        try:
            ready = self._ready.pop(mb_id)
        except KeyError:
            raise KeyError(f"micro-batch {mb_id!r} was never reported ready (or was consumed twice)") from None
        self._step_ready_times.append(ready.at - self._step_start)

    def micro_batch_dropped(self, mb_id: Hashable) -> None:
        """The micro-batch left the buffer without training (stale, filtered): it no longer ages HoL."""
        self._ready.pop(mb_id, None)

    def rollout_waited(self, seconds: float) -> None:
        """Rollout idled (staleness bound reached, buffer full, waiting for weights)."""
        self._rwt += max(0.0, seconds)

    def trainer_waited(self, seconds: float) -> None:
        """The trainer idled for want of a ready micro-batch."""
        self._twt += max(0.0, seconds)

    def rollout_busy(self, busy_rank_seconds: float, ranks: int) -> None:
        """Rank-seconds the `ranks` rollout ranks had a request in flight during this step cycle (reported once,
        before `step_finished`): how much of the rollout's capacity its rate used."""
        if ranks < 1 or busy_rank_seconds < 0:
            raise ValueError(f"rollout_busy: busy_rank_seconds = {busy_rank_seconds}, ranks = {ranks}: "
                             "must be >= 0 and >= 1")
        self._cycle_busy = (busy_rank_seconds, ranks)

    def rollout_clocks(self, busy_s: Mapping[Hashable, float], idle_rank_s: Optional[float] = None,
                       report: bool = True, kv_wait_s: Optional[float] = None,
                       generating_token_s: Optional[float] = None, kv_held_peak: Optional[float] = None) -> None:
        """Cumulative rollout clocks, as CTB's router keeps them: per rank, seconds with a request in flight;
        rank-seconds with nothing in flight while no task waited for admission (out of work); seconds during which
        work waited for KV budget; and token-seconds of the context of the turns in flight (decode load). What
        they gained since the last call is this cycle's `rollout_busy`, per rank `rollout_waited`, and the cycle's
        KV-bound time and decode load (the last two together or not at all); `report=False` only moves the mark,
        to leave out time counted apart (the weight sync's pause). A rank not seen at the last call (relaunched
        under a new address, back from Ref) counts from 0. `kv_held_peak`: the most KV resident tasks held at once
        since the last call (ranks' worth); every call's counts toward the cycle's `rollout_kv_held_peak`."""
        if kv_held_peak is not None:
            if kv_held_peak < 0:
                raise ValueError(f"rollout_clocks: kv_held_peak = {kv_held_peak}: must be >= 0")
            self._cycle_kv_held_peak = max(self._cycle_kv_held_peak or 0.0, kv_held_peak)
        clocks = {"idle_rank_s": idle_rank_s, "kv_wait_s": kv_wait_s, "generating_token_s": generating_token_s}
        if any(v is not None and v < 0 for v in clocks.values()) or any(v < 0 for v in busy_s.values()):
            raise ValueError(f"rollout_clocks: busy_s = {dict(busy_s)}, " + ", ".join(
                f"{k} = {v}" for k, v in clocks.items()) + ": must be >= 0")
        gained = {k: max(0.0, v - self._clock_marks.get(k, 0.0)) for k, v in clocks.items() if v is not None}
        mark_busy, self._busy_marks = self._busy_marks, dict(busy_s)
        self._clock_marks.update({k: v for k, v in clocks.items() if v is not None})
        if not report or not busy_s:
            return
        self.rollout_busy(sum(max(0.0, v - mark_busy.get(r, 0.0)) for r, v in busy_s.items()), len(busy_s))
        if "idle_rank_s" in gained:
            self.rollout_waited(gained["idle_rank_s"] / len(busy_s))
        if "kv_wait_s" in gained and "generating_token_s" in gained:
            self._cycle_load = (gained["kv_wait_s"], gained["generating_token_s"], len(busy_s))

    def step_finished(self, t: Optional[float] = None) -> None:
        if self._step_start is None:
            raise RuntimeError("step_finished before step_started")
        now = self._now(t)
        duration = now - self._step_start
        if self._cycle_start is not None:
            working = (now - self._cycle_start) - self._rwt
            if working > 0:
                self._last_capacity_rate = self._cycle_sequences / working
                busy = self._cycle_busy  # not reported for this cycle: unknown, never the last cycle's
                load = self._cycle_load
                self._last_utilization, self._last_kv_bound = rollout_shares(
                    busy, None if load is None else load[0], working)
                self._last_decode_context = None if load is None else load[1] / (working * load[2])
            self._last_cycle_s = now - self._cycle_start
        self._last_kv_held_peak = self._cycle_kv_held_peak
        self._cycle_start, self._cycle_sequences, self._cycle_busy, self._cycle_load = now, 0, None, None
        self._cycle_kv_held_peak = None
        self.last_ready_times = sorted(self._step_ready_times)
        self._last_ras = ready_at_start(self._step_ready_times)
        self._last_tprm = time_per_ready_microbatch(self._step_ready_times)
        if self._last_tprm is not None:
            self._tprm_smoothed = _ewma(self._tprm_smoothed, self._last_tprm, self.smoothing)
        self._mean_step_time = _ewma(self._mean_step_time, step_time_fed(duration, self._step_ready_times),
                                     self.smoothing)
        self._last_rwt, self._last_twt = self._rwt, self._twt
        self._rwt = self._twt = 0.0
        self._step_start = None

    def signals(self, ideal_batch: int, tau: float, ras_break_even: Optional[int] = None,
                t: Optional[float] = None, wait_tolerance: float = 0.1) -> ReadinessSignals:
        """Signals after the last finished step. `ras_break_even` comes from RA2P's cost model.

        Waits decide first, both found in the simulator. Rollout that waited for the trainer (RWT above
        `wait_tolerance` x mean step time: held by the staleness bound beyond the unavoidable weight sync)
        had capacity to spare: a small ready volume then reflects the staleness bound, not a generation
        deficit, and the wait itself is the consumption deficit (with max_staleness=1 the ready volume
        rarely reaches B_ideal, so volume alone flagged both deficits on every step and ERS never moved).
        A trainer that waited for data (TWT above the same share) has a generation deficit whatever the
        RAS says (when arrivals are sparse the decoupled break-even is 0, so any RAS looked like a
        backlog: ERS held while rollout starved the trainer)."""
        now = self._now(t)
        hol = max((now - r.at for r in self._ready.values()), default=0.0)
        volume = sum(r.sequences for r in self._ready.values())
        hol_too_old = self._mean_step_time is not None and hol > tau * self._mean_step_time
        backlog = ras_break_even is not None and self._last_ras > ras_break_even
        tolerance = None if self._mean_step_time is None else wait_tolerance * self._mean_step_time
        rollout_held = tolerance is not None and self._last_rwt > tolerance
        trainer_starved = tolerance is not None and self._last_twt > tolerance
        return ReadinessSignals(
            ready_at_start=self._last_ras,
            time_per_ready_microbatch=self._last_tprm,
            tprm_smoothed=self._tprm_smoothed,
            hol_latency=hol,
            ready_volume=volume,
            mean_step_time=self._mean_step_time,
            generation_deficit=trainer_starved or (volume < ideal_batch and not rollout_held),
            consumption_deficit=rollout_held or ((hol_too_old or backlog) and not trainer_starved),
            rollout_wait_s=self._last_rwt,
            trainer_wait_s=self._last_twt,
            rollout_capacity_rate=self._last_capacity_rate,
            rollout_utilization=self._last_utilization,
            rollout_kv_bound=self._last_kv_bound,
            rollout_decode_context=self._last_decode_context,
            rollout_kv_held_peak=self._last_kv_held_peak,
            cycle_s=self._last_cycle_s,
        )


def _ewma(old: Optional[float], new: float, alpha: float) -> float:
    return new if old is None else alpha * new + (1 - alpha) * old

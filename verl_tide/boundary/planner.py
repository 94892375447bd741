"""The step-boundary decision, in one place: RA2P's mode (and split share) for the next step, the decoupled
break-even RAS, the Ref-rank outlook ERS weighs, ERS's scaling plan, whether the Actor's GPUs roll out
until the next step (`ers/lending.py`), and how far CTB's token budgets reach past KV capacity (`ctb/window.py`).

Why one module: trainer `tide` and the simulator decide at the same moment (after the Actor's update,
before the weight sync) from the same inputs: the last step's ready times, the per-token stage rates the
job measured, and the Ref ranks it has. Written twice, the two had drifted (the break-even point on
different Ref-rank counts, different aggregation limits, a pipeline-fill term on one side only). Both now
build a `BoundaryInputs` and call `BoundaryPlanner.decide`; `tests/test_planner_replay.py` replays a trace
the simulator recorded through the planner as the trainer builds it, from inputs built by the trainer's
adapter (`verl_tide/trainer/boundary.py`).

Pure Python (no verl, ray or torch); the readiness signals come in through a callable, computed once by
the caller's `ReadinessTracker`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Optional

from verl_tide.core.config import CTBConfig, ERSConfig, RA2PConfig
from verl_tide.core.readiness import ReadinessSignals, mini_batch_ready_times
from verl_tide.ctb.window import BudgetDecision, BudgetInputs, BudgetWindow
from verl_tide.ers import lending
from verl_tide.ers.lending import LendDecision, LendingInputs, LendingRecord
from verl_tide.ers.policy import ERSPolicy, Phase, RefRankOutlook, Role, ScalingPlan
from verl_tide.ers.resize import ResizeDecision, ResizeInputs, TrainerResizer
from verl_tide.ra2p.cost import (ModeChoice, RA2PMode, StageTimer, StageTimes, best_split, choose_mode,
                                 decoupled_break_even_ras, ref_rank_outlook)


@dataclass(frozen=True)
class StageRates:
    """Seconds per token as the running job measures them (`StageTimer`): Ref forward where verl runs it (the
    Actor's ranks, the whole pass), Actor forward and backward, one Ref<->Actor swap (seconds, not per token),
    and one Ref replica's forward (None before a replica ran)."""

    ref: float
    act_f: float
    act_b: float
    swap_s: float
    ref_rank: Optional[float] = None

    @classmethod
    def from_timer(cls, timer: StageTimer) -> Optional[StageRates]:
        """None until every required stage was measured once."""
        if not timer.ready:
            return None
        return cls(timer.rate("ref"), timer.rate("act_f"), timer.rate("act_b"), timer.rate("swap"),
                   timer.rate("ref_rank"))

    def stage_times(self, tokens: float) -> StageTimes:
        return StageTimes(tokens * self.ref, tokens * self.act_f, tokens * self.act_b, self.swap_s)


@dataclass(frozen=True)
class BoundaryInputs:
    """Everything the step-boundary decision reads besides the readiness signals (recordable: a replay feeds
    the same inputs through every caller)."""

    step: int
    ready_times: tuple[float, ...]  # each ready unit (GRPO group) of the last step, seconds after its start
    units_per_mini_batch: int  # units the trainer takes at once (verl: whole PPO mini-batches of groups)
    step_tokens: float  # tokens the last step trained
    rates: Optional[StageRates]  # None: nothing measured yet (RA2P keeps its mode, ERS decides on signals)
    actor_ranks: int  # the Actor's ranks (they run Ref in colocated mode)
    fixed_ref_ranks: int = 0  # Ref ranks of their own (tide.ra2p.ref_ranks)
    elastic_ref_ranks: int = 0  # rollout ranks ERS lent to Ref
    replicas_up: int = 0  # Ref replicas answering now (fixed and elastic)
    ref_beside_actor: bool = False  # Ref also runs on the Actor's ranks beside the replicas: split is possible
    uses_ref: bool = True  # the job has a Ref model at all
    lending: Optional[LendingInputs] = None  # the Actor's GPUs may roll out (tide.ers.lend_actor); None: they may not
    ctb: Optional[BudgetInputs] = None  # CTB's budgets as they ran (None: CTB off, or not read)
    resize: Optional[ResizeInputs] = None  # the Actor's group may be resized (`ers/resize.py`); None: it may not


@dataclass(frozen=True)
class BoundaryDecision:
    mode: Optional[RA2PMode]  # the cost model's choice for the next step (None: not decided)
    share: Optional[float]  # split mode: the share of a Ref pass the replicas score
    choice: Optional[ModeChoice]
    break_even: Optional[int]
    signals: Optional[ReadinessSignals]
    plan: Optional[ScalingPlan]
    lend: Optional[LendDecision] = None  # whether the Actor's GPUs roll out after this boundary, and until when
    budget: Optional[BudgetDecision] = None  # CTB's budget factor for the next step
    resize: Optional[ResizeDecision] = None  # the Actor's GPUs after this boundary

    def summary(self) -> dict:
        """What a replay compares: every decision and its reason."""
        c, p = self.choice, self.plan
        return {"mode": self.mode.value if self.mode else None, "share": self.share, "break_even": self.break_even,
                "choice": None if c is None else (c.mode.value, round(c.decoupled_s, 9), round(c.colocated_s, 9),
                                                  c.reason),
                "plan": None if p is None else (tuple((m.rank, m.src.value, m.dst.value) for m in p.moves),
                                                p.batch_size, p.reason),
                "lend": None if self.lend is None else (self.lend.lend, self.lend.return_at_units,
                                                        self.lend.reason),
                "budget": _budget_summary(self.budget),
                **({} if self.resize is None else {"resize": (self.resize.actor_gpus, self.resize.reason)})}


def _budget_summary(budget: Optional[BudgetDecision]) -> Optional[tuple[float, str]]:
    return None if budget is None else (budget.factor, budget.reason)


@dataclass
class BoundaryPlanner:
    """RA2P's per-step mode choice and ERS's plan, with the state they carry from step to step (the previous mode
    for RA2P's hysteresis; ERS's confirmations and cooldowns live in its `ERSPolicy`)."""

    ra2p: RA2PConfig
    ers: Optional[ERSPolicy]  # None: no elastic ranks (RA2P decides alone)
    mode: Optional[RA2PMode] = None  # the last choice (`tide.ra2p.mode=auto`)
    share: Optional[float] = None  # split mode: the replicas' share of a Ref pass
    window: Optional[BudgetWindow] = None  # CTB's budget factor (None: CTB off; budgets stay at Alg. 1's)
    resizer: TrainerResizer = field(default_factory=TrainerResizer)  # asked only where inputs.resize is given
    lend_record: LendingRecord = field(default_factory=LendingRecord)  # cycles after each lending answer
    trace: Optional[list] = field(default=None, repr=False)  # set to a list to record (inputs, decision) pairs

    @classmethod
    def build(cls, ra2p: RA2PConfig, ers: ERSConfig, ideal_batch: int, elastic: bool = True,
              ctb: Optional[CTBConfig] = None) -> BoundaryPlanner:
        """The one construction trainer `tide` and the simulator use."""
        window = BudgetWindow(ctb.max_budget_factor, ctb.window_interval_s) if ctb is not None and ctb.enabled \
            else None
        return cls(ra2p, ERSPolicy(ers, ideal_batch=ideal_batch) if elastic else None, window=window,
                   lend_record=LendingRecord(ers.lend_trials))

    def decide(self, inputs: BoundaryInputs, signals_for: Callable[[Optional[int]], ReadinessSignals],
               roles: Optional[Mapping[int, Role]] = None, phase: Phase = Phase.TRAIN, elastic_ref: bool = True,
               ref_floor: int = 0) -> BoundaryDecision:
        """`signals_for(break_even)`: the readiness signals with this decoupled break-even RAS (the caller's
        tracker). `roles`: the rollout ranks' roles, for ERS (None: no plan). ERS plans first (it reads RA2P's
        break-even point and Ref-rank outlook); RA2P then chooses the next step's mode for the Ref ranks the plan
        leaves, as the next step will run."""
        if self.trace is not None:
            signals_for = _Recorded(signals_for)
        costs = _StepCosts.of(inputs, self.ra2p.max_aggregate)
        break_even, outlook = (None, None) if costs is None else self._for_ers(costs, inputs, signals_for)
        signals = signals_for(break_even)
        plan = None
        if self.ers is not None and roles is not None:
            plan = self.ers.plan(inputs.step, signals, roles, phase=phase, ref_outlook=outlook,
                                 elastic_ref=elastic_ref, ref_floor=ref_floor)
        choice = None if costs is None else self._choose(costs, inputs, replicas_after(inputs.replicas_up, plan))
        lend = None
        if inputs.lending is not None:
            self.lend_record.cycle_ended(signals.cycle_s)
            lend = lending.decide(inputs.lending, phase, signals.tprm_smoothed, signals.rollout_kv_bound,
                                  self.ers.config.lend_kv_bound if self.ers is not None else 0.0, self.lend_record)
            self.lend_record.answered(lend)
        budget = self._budget(inputs.ctb)
        resize = None if inputs.resize is None else self.resizer.decide(signals, inputs.resize, phase is Phase.EVAL)
        decision = BoundaryDecision(self.mode, self.share, choice, break_even, signals, plan, lend, budget, resize)
        if self.trace is not None:
            self.trace.append(TraceRecord(inputs, dict(signals_for.seen), roles and dict(roles), phase, elastic_ref,
                                          ref_floor, decision.summary()))
        return decision

    def decide_budget(self, ctb: Optional[BudgetInputs]) -> Optional[BudgetDecision]:
        """CTB's budget factor between boundaries, while the trainer waits for data, from the rollout since the
        window last decided (`ctb/window.py`; at a boundary `decide` makes it). None without CTB or its inputs."""
        decision = self._budget(ctb)
        if self.trace is not None and ctb is not None:
            self.trace.append(BudgetRecord(ctb, {"budget": _budget_summary(decision)}))
        return decision

    def _budget(self, ctb: Optional[BudgetInputs]) -> Optional[BudgetDecision]:
        return None if ctb is None or self.window is None else self.window.decide(ctb)

    def _for_ers(self, costs: _StepCosts, inputs: BoundaryInputs,
                 signals_for: Callable[[Optional[int]], ReadinessSignals]
                 ) -> tuple[Optional[int], Optional[RefRankOutlook]]:
        """The decoupled break-even RAS (on the Ref ranks decoupled mode would have: at least one per
        `actors_per_ref_rank`) and the Ref-rank outlook ERS asks when it weighs a move to Ref."""
        have = inputs.fixed_ref_ranks + inputs.elastic_ref_ranks
        break_even = None
        tprm = signals_for(None).tprm_smoothed
        if tprm:
            would_have = max(have, math.ceil(costs.n_actor / self.ra2p.actors_per_ref_rank))
            break_even = decoupled_break_even_ras(len(costs.ready), tprm, costs.on_ref_ranks(would_have), 1,
                                                  costs.aggregate, per_mini_batch=inputs.units_per_mini_batch)
        fixed, split = inputs.fixed_ref_ranks, inputs.ref_beside_actor

        def outlook(reach: int) -> tuple[Optional[int], Optional[float]]:  # ERS counts elastic ranks
            needed, saving = ref_rank_outlook(costs.ready, costs.on_ref_ranks, costs.times, costs.aggregate, have,
                                              max(1, reach + fixed), split=split)
            return (None if needed is None else max(0, needed - fixed)), saving
        return break_even, outlook

    def _choose(self, costs: _StepCosts, inputs: BoundaryInputs, replicas: int) -> ModeChoice:
        """RA2P's mode for the next step, with `replicas` Ref replicas up. The Actor's data-parallel ranks take each
        micro-batch together: one rank group (no pipeline fill)."""
        ready, times, aggregate = costs.ready, costs.times, costs.aggregate
        if inputs.ref_beside_actor and replicas:  # the replicas' measured speed, for decoupled too
            dec_times = costs.on_ref_ranks(replicas)
            split_t_ref: Optional[float] = dec_times.t_ref
        else:  # Appendix A's form: Ref ranks grouped with the Actor's, at the Ref speed measured
            dec_times, split_t_ref = times, None
        choice = choose_mode(ready, dec_times, actor_ranks=1, max_aggregate=aggregate, previous=self.mode,
                             hysteresis=self.ra2p.hysteresis, colocated_times=times, split_ref_t_ref=split_t_ref)
        if not replicas and choice.mode is not RA2PMode.COLOCATED:  # no Ref rank to decouple onto
            choice = dataclasses.replace(choice, mode=RA2PMode.COLOCATED, ref_share=0.0,
                                         reason=f"colocated: no Ref rank of its own ({choice.reason})")
        if self.ra2p.mode == "auto":
            self.mode, self.share = choice.mode, choice.ref_share
        elif self.ra2p.mode == "split" and split_t_ref is not None:
            self.share = best_split(ready, times, split_t_ref, aggregate)[0]
        return choice


def replicas_after(replicas: int, plan: Optional[ScalingPlan]) -> int:
    """Ref replicas up once the plan's moves are applied (before the next step)."""
    if plan is None:
        return replicas
    return max(0, replicas + sum(m.dst is Role.REF for m in plan.moves) - sum(m.src is Role.REF for m in plan.moves))


@dataclass(frozen=True)
class _StepCosts:
    """The last step's arrivals and stage times, as RA2P's cost model reads them."""

    ready: list[float]
    times: StageTimes
    on_ref_ranks: Callable[[int], StageTimes]
    aggregate: int
    n_actor: int

    @classmethod
    def of(cls, inputs: BoundaryInputs, max_aggregate: Optional[int]) -> Optional[_StepCosts]:
        """None when there is nothing to decide from (no Ref model, nothing measured, no ready times)."""
        ready = mini_batch_ready_times(inputs.ready_times, inputs.units_per_mini_batch) if inputs.ready_times else []
        if not (inputs.uses_ref and inputs.rates is not None and ready):
            return None
        n_actor = max(1, inputs.actor_ranks)
        per_unit = max(1.0, inputs.step_tokens / len(ready))
        times = inputs.rates.stage_times(per_unit)
        return cls(ready, times, _times_on_ref_ranks(inputs, times, per_unit, n_actor), max_aggregate or len(ready),
                   n_actor)


def _times_on_ref_ranks(inputs: BoundaryInputs, times: StageTimes, per_unit: float,
                        n_actor: int) -> Callable[[int], StageTimes]:
    """Stage times with k Ref ranks doing a unit's Ref forward: one replica's measured rate over k; before a
    replica ran, the Actor's ranks' Ref time scaled by n_actor / k."""
    rate = inputs.rates.ref_rank if inputs.rates is not None else None
    if rate is not None and inputs.ref_beside_actor:
        return lambda k: dataclasses.replace(times, t_ref=rate * per_unit / max(1, k))
    return lambda k: dataclasses.replace(times, t_ref=times.t_ref * n_actor / max(1, k))


@dataclass(frozen=True)
class TraceRecord:
    """One boundary as decided: its inputs, the readiness signals it read (by break-even RAS), ERS's arguments,
    and the decision."""

    inputs: BoundaryInputs
    signals: dict
    roles: Optional[dict]
    phase: Phase
    elastic_ref: bool
    ref_floor: int
    decision: dict


@dataclass(frozen=True)
class BudgetRecord:
    """A budget decision between boundaries (`BoundaryPlanner.decide_budget`): its inputs and the decision."""

    inputs: BudgetInputs
    decision: dict


class _Recorded:
    """`signals_for`, remembering what it answered (a replay answers the same, and fails on anything else)."""

    def __init__(self, signals_for: Callable[[Optional[int]], ReadinessSignals]):
        self.signals_for, self.seen = signals_for, {}

    def __call__(self, break_even: Optional[int]) -> ReadinessSignals:
        if break_even not in self.seen:
            self.seen[break_even] = self.signals_for(break_even)
        return self.seen[break_even]


def replay(planner: BoundaryPlanner, trace: Sequence[TraceRecord | BudgetRecord]) -> list[dict]:
    """The decisions `planner` makes on a recorded trace, boundaries and budget decisions between them in their
    order. A planner asking for signals the recording never computed (another break-even RAS) fails: it did not
    decide as the recorded one did."""
    out = []
    for rec in trace:
        if isinstance(rec, BudgetRecord):
            out.append({"budget": _budget_summary(planner.decide_budget(rec.inputs))})
            continue
        def signals_for(break_even: Optional[int], seen: dict = rec.signals) -> ReadinessSignals:
            if break_even not in seen:
                raise KeyError(f"step {rec.inputs.step}: break-even RAS {break_even} was never recorded "
                               f"(recorded: {sorted(seen, key=str)})")
            return seen[break_even]
        out.append(planner.decide(rec.inputs, signals_for, rec.roles, rec.phase, rec.elastic_ref,
                                  rec.ref_floor).summary())
    return out

"""CTB's budget window in trainer `tide`: what it reads, and its decisions while the trainer waits for data.

The planner decides the factor at each step boundary with the rest of its plan, and `BoundaryPlanner.decide_budget`
every `tide.ctb.window_interval_s` while the trainer waits for data (`ctb/window.py` says why). Both read the rollout
since the window last decided: CTB's router's clocks through `RolloutInterval`, and the engines' prefix-cache hit
rate, prompt tokens pooled, from their `/metrics`. At a boundary, at the rollout's start and at a sync's end the
trainer has just read both for its readiness signals and step metrics: the reader takes those reads rather than
asking again; only a decision in a wait reads for itself. The simulator reads its own clocks the same way
(`sim/boundary.py`'s `budget_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional

from verl_tide.core.readiness import RolloutInterval
from verl_tide.ctb.window import BudgetDecision, BudgetInputs
from verl_tide.trainer.reporting import pooled_hit_rate

if TYPE_CHECKING:
    from verl_tide.boundary.planner import BoundaryPlanner
    from verl_tide.trainer.reporting import RolloutReport


class BudgetWindowReader:
    def __init__(self, report: RolloutReport, planner: BoundaryPlanner, clock: Callable[[], float]):
        self.report, self.planner, self.clock = report, planner, clock
        self.factor = 1.0  # in force on CTB's router (it starts at Alg. 1's budget; not checkpointed)
        self.decided_at: Optional[float] = None
        self.decisions_in_wait = 0  # decisions made while the trainer waited (step metrics, cumulative)
        self.changes_in_wait = 0  # of which changed the factor
        self._interval = RolloutInterval()
        self._scrapes: dict[str, Any] = {}

    def mark(self, clocks: Optional[Mapping[str, Any]], scrapes: Optional[Mapping[str, Any]] = None) -> None:
        """The next interval counts from these router clocks, just read by the caller: the rollout's start, and the
        end of each weight sync (its pause is no stretch of rollout the window should read, `RolloutInterval`).
        `scrapes` ({address: `/metrics`}): the engines' counters the hit rate counts from (at the rollout's start)."""
        if scrapes is not None:
            self._scrapes = dict(scrapes)
        if clocks is not None:
            self._read(clocks)

    def inputs(self, quarantined: Mapping[int, str], clocks: Optional[Mapping[str, Any]] = None,
               scrapes: Optional[Mapping[str, Any]] = None) -> Optional[BudgetInputs]:
        """The factor in force and the rollout since the last decision or mark, from `clocks` and `scrapes` where the
        caller just read them (else read here); None when CTB's router cannot be read."""
        clocks = self.report.rollout_time() if clocks is None else clocks
        if clocks is None:
            return None
        if scrapes is None:
            scrapes = {address: now for address, (_, now) in self.report.scrape_engines(quarantined).items()}
        hit, self._scrapes = pooled_hit_rate(self._scrapes, scrapes), dict(scrapes)
        utilization, kv_bound = self._read(clocks)
        return BudgetInputs(self.factor, hit, kv_bound=kv_bound, utilization=utilization)

    def _read(self, clocks: Mapping[str, Any]) -> tuple[Optional[float], Optional[float]]:
        self.decided_at = now = self.clock()
        return self._interval.read(now, clocks["busy_s"], float(clocks["idle_rank_s"]), float(clocks["kv_wait_s"]))

    def set(self, factor: float) -> None:
        """The planner's factor, to CTB's router (a Ray call and a CTB tick only when it changes)."""
        if factor != self.factor:
            self.report.set_budget_factor(factor)
            self.factor = factor

    def at_boundary(self, decision: BudgetDecision, step: int) -> dict[str, float]:
        """The planner's factor at a step boundary, to CTB's router; the step's window metrics."""
        self.set(decision.factor)
        print(f"verl-tide step {step}: CTB budget factor {decision.factor:g} ({decision.reason})", flush=True)
        return {"tide/ctb/next_budget_factor": decision.factor, **self.metrics()}

    def metrics(self) -> dict[str, float]:
        return {"tide/ctb/budget_decisions_in_wait": float(self.decisions_in_wait),
                "tide/ctb/budget_changes_in_wait": float(self.changes_in_wait)}

    def while_waiting(self, step: int, quarantined: Mapping[int, str]) -> None:
        """Called at each of the trainer's looks for ready data while it waits: decides when the interval is up."""
        window = self.planner.window
        if window is None or not window.due_in_wait(self.clock(), self.decided_at):
            return
        decision = self.planner.decide_budget(self.inputs(quarantined))
        if decision is None:
            return
        self.decisions_in_wait += 1
        if decision.factor == self.factor:
            return
        self.set(decision.factor)
        self.changes_in_wait += 1
        print(f"verl-tide step {step}: CTB budget factor {decision.factor:g} while the trainer waits for data "
              f"({decision.reason})", flush=True)

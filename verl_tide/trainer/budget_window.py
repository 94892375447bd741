"""CTB's budget window in trainer `tide`: what it reads, and its decisions while the trainer waits for data.

The planner decides the factor at each step boundary with the rest of its plan, and `BoundaryPlanner.decide_budget`
every `tide.ctb.window_interval_s` while the trainer waits for data (`ctb/window.py` says why). Both read the rollout
since the window last decided: CTB's router's clocks through `RolloutInterval`, and the engines' prefix-cache hit
rate, prompt tokens pooled, from scrapes of their `/metrics` kept apart from the per-step hit-rate metrics. The
simulator reads its own clocks the same way (`sim/cluster.py`'s `budget_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Optional

from verl_tide.core.readiness import RolloutInterval
from verl_tide.ctb.window import BudgetInputs

if TYPE_CHECKING:
    from verl_tide.core.planner import BoundaryPlanner
    from verl_tide.trainer.reporting import RolloutReport


class BudgetWindowReader:
    def __init__(self, report: RolloutReport, planner: BoundaryPlanner, clock: Callable[[], float],
                 interval_s: float):
        self.report, self.planner, self.clock, self.interval_s = report, planner, clock, interval_s
        self.factor = 1.0  # in force on CTB's router (it starts at Alg. 1's budget; not checkpointed)
        self.decided_at: Optional[float] = None
        self.decisions_in_wait = 0  # decisions made while the trainer waited (step metrics, cumulative)
        self.changes_in_wait = 0  # of which changed the factor
        self._interval = RolloutInterval()
        self._scrapes: dict[str, Any] = {}

    def start(self, quarantined: Mapping[int, str]) -> None:
        """The next interval counts from now: the rollout's start, and the end of each weight sync (its pause is
        no stretch of rollout the window should read, `RolloutInterval`)."""
        self.inputs(quarantined)

    def inputs(self, quarantined: Mapping[int, str]) -> Optional[BudgetInputs]:
        """The factor in force and the rollout since the last call; None when CTB's router cannot be read."""
        clocks = self.report.rollout_time()
        if clocks is None:
            return None
        now = self.clock()
        hit, self._scrapes = self.report.pooled_hit_rate(self._scrapes, quarantined)
        utilization, kv_bound = self._interval.read(now, clocks["busy_s"], float(clocks["idle_rank_s"]),
                                                    float(clocks["kv_wait_s"]))
        self.decided_at = now
        return BudgetInputs(self.factor, hit, kv_bound=kv_bound, utilization=utilization)

    def set(self, factor: float) -> None:
        """The planner's factor, to CTB's router (a Ray call and a CTB tick only when it changes)."""
        if factor != self.factor:
            self.report.set_budget_factor(factor)
            self.factor = factor

    def metrics(self) -> dict[str, float]:
        return {"tide/ctb/budget_decisions_in_wait": float(self.decisions_in_wait),
                "tide/ctb/budget_changes_in_wait": float(self.changes_in_wait)}

    def while_waiting(self, step: int, quarantined: Mapping[int, str]) -> None:
        """Called at each of the trainer's looks for ready data while it waits: decides when the interval is up."""
        if self.interval_s <= 0 or self.planner.window is None or (
                self.decided_at is not None and self.clock() - self.decided_at < self.interval_s):
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

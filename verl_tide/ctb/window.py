"""How far CTB's token budgets may reach past the engines' KV capacity, decided at each step boundary and while
the trainer waits for data.

Alg. 1 bounds a rank's resident contexts by its KV capacity (x `kv_headroom`), so a task waiting on its
environment keeps its prefix cached. That protection pays where a re-prefill is dear (long contexts). Where
contexts are short it idles the engines instead: on the every-part job (2026-12-03) CTB's budget held work back
most of the rollout's time, and the same job with an unbounded budget recovered most of what CTB cost there
(`docs/ctb.md`); the engine's own queue and preemption are cheap when a re-prefill is. So the budget reaches
past KV capacity as long as that costs nothing measurable, in the manner of a congestion window:

- grow (x2, or to factor / utilization where that is more, up to a ceiling, at first `max_budget_factor`) while
  work waited for budget at least `GROW_KV_BOUND` of the rollout's working time and the engines had nothing in
  flight at least 1 - `GROW_MAX_UTILIZATION` of it (the budget idled them: the waste the window is for), and the
  engines' prefix-cache hit rate is known (the cost signal below needs it). Without the idle engines, work
  waiting for budget is Alg. 1 doing its job: a KV-bound rollout whose engines are busy. In the simulator (2026-12-03,
  eleventh session) the previous form of this rule, which read the wait alone, grew there and cost up to 32%
  goodput at rollout-starved splits (ALFWorld at a 0.125 rollout ratio);
- shrink (/2, down to 1) when the hit rate fell `HIT_DROP` below what it was at the fixed budget: the tasks let
  in evicted prefixes the waiting tasks come back to (a re-prefill each). The ceiling then drops to the shrunk
  factor, so the window does not grow back into the same evictions. Only where the fixed budget's hit rate was
  at least `PROTECTED_HIT`: below it the cache held little to protect (at most that share of the prompt tokens
  is re-prefilled), and a per-step hit rate that low is mostly noise (the every-part job's moved 0.03-0.16
  from step to step, and a 0.13 "fall" locked its window at 1 in a first form of this rule).

The occupancy of the engines' KV by turns in flight (`rollout_decode_context`) is deliberately not a reason to
stop: tried first, it held the every-part job's budget near 1 while the engines' own queueing was what made
that job fast.

Each decision reads the rollout over the time since the window last decided (`core/readiness.RolloutInterval`):
a step cycle at a boundary; while the trainer waits for data, every `tide.ctb.window_interval_s` as well, since a
budget that idles the engines then is what starves the trainer now. Boundaries alone left the whole first step,
the cold start where nothing is ready to train, at Alg. 1's budget (on the every-part job, 2026-12-03, work waited
for budget 79% of step 1 while the engines had nothing in flight 22% of it).

Pure: no verl, Ray or torch; trainer `tide` and the simulator both reach it through the planner
(`BoundaryPlanner.decide` at a boundary, `BoundaryPlanner.decide_budget` in a wait).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GROW_KV_BOUND = 0.25  # share of the rollout's working time work waited for CTB's budget
HIT_DROP = 0.1  # absolute fall of the prefix-cache hit rate, against the fixed budget's, that undoes growth
PROTECTED_HIT = 0.5  # the fixed budget's hit rate from which the cache is worth guarding
GROW_MAX_UTILIZATION = 0.9  # the engines had a request in flight at most this share of the rollout's working time


@dataclass(frozen=True)
class BudgetInputs:
    """What the last step ran under and what it measured."""

    factor: float  # the budget factor in force since the last decision
    hit_rate: Optional[float] = None  # the engines' prefix-cache hit rate since then; None: unknown
    # the rollout's shares since then (`RolloutInterval`): of its working time, work waited for budget
    # (`kv_bound`), its engines had a request in flight (`utilization`); None: not measured
    kv_bound: Optional[float] = None
    utilization: Optional[float] = None


@dataclass(frozen=True)
class BudgetDecision:
    factor: float
    reason: str


class BudgetWindow:
    """The factor by which every rank's budget is scaled for the next step (1 = Alg. 1's)."""

    def __init__(self, max_factor: float, interval_s: float = 0.0):
        if max_factor < 1:
            raise ValueError(f"tide.ctb.max_budget_factor = {max_factor}: must be >= 1")
        self.max_factor = max_factor
        self.interval_s = interval_s  # tide.ctb.window_interval_s: between decisions in a wait (0: boundaries only)
        self.ceiling = max_factor  # lowered to the factor a shrink leaves
        self.base_hit_rate: Optional[float] = None  # the hit rate last seen at factor 1

    def due_in_wait(self, now: float, decided_at: Optional[float]) -> bool:
        """The trainer waits for data: whether the interval since the last decision (or mark) is up."""
        return self.interval_s > 0 and (decided_at is None or now - decided_at >= self.interval_s)

    def decide(self, inputs: BudgetInputs) -> BudgetDecision:
        factor = min(max(inputs.factor, 1.0), self.max_factor)
        hit, kv_bound, utilization = inputs.hit_rate, inputs.kv_bound, inputs.utilization
        if factor <= 1.0 and hit is not None:
            self.base_hit_rate = hit
        if self.max_factor <= 1.0:
            return BudgetDecision(1.0, "fixed budget (max_budget_factor = 1)")
        base = self.base_hit_rate
        if factor > 1.0 and hit is not None and base is not None and base >= PROTECTED_HIT and hit < base - HIT_DROP:
            factor = self.ceiling = max(1.0, factor / 2)
            return BudgetDecision(factor, f"shrink: prefix-cache hit rate {hit:.2f} fell from "
                                          f"{self.base_hit_rate:.2f} at the fixed budget; ceiling now {factor:g}")
        if kv_bound is None or hit is None:
            return BudgetDecision(factor, "keep: rollout's KV wait or the engines' hit rate not measured")
        if utilization is None:
            return BudgetDecision(factor, "keep: the engines' utilization not measured")
        if kv_bound >= GROW_KV_BOUND and factor < self.ceiling and utilization <= GROW_MAX_UTILIZATION:
            return BudgetDecision(self._grown(factor, utilization),
                                  f"grow: work waited for budget {kv_bound:.0%} of the time while the engines had "
                                  f"nothing in flight {1 - utilization:.0%} of it, hit rate {hit:.2f}")
        return BudgetDecision(factor, f"keep: waited {kv_bound:.0%} of the time, engines busy {utilization:.0%}, "
                                      f"hit rate {hit:.2f}")

    def _grown(self, factor: float, utilization: float) -> float:
        """x2, or to the factor that would have kept the engines busy (factor / utilization) where that is more:
        the budget let them run `utilization` of the time, so that many times the work fills them."""
        if utilization <= 0:
            return self.ceiling
        return min(self.ceiling, max(factor * 2, round(factor / utilization, 2)))

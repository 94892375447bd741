"""Rollout on the trainer's GPUs in the simulation: verl `separate_async`'s hybrid replicas (eager, or verl's own
switch rule, `sim/stock.py`) and tide's lending of the Actor's GPUs (ERS decides, through the boundary round).
While lent, the trainer's GPUs are rollout ranks; taking them back aborts their requests (re-routed, a fresh
prefill elsewhere, or resumed with their tokens where the system rolls out partially)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from verl_tide.sim.stock import HybridSwitch, StepWaits

if TYPE_CHECKING:
    from verl_tide.sim.cluster import Simulation


class HybridReplicas:
    def __init__(self, ranks: range, switch: Optional[HybridSwitch]):
        self.ranks = ranks  # the trainer's GPUs, as rollout ranks
        self.switch = switch  # verl's own rule for its hybrid replicas; None for the eager model and for tide
        self.on = False
        self.since = 0.0  # rolling out since (after the switch)
        self.served_s = 0.0  # time lent since the last step began (not trainer waiting time)
        self.step_lent = False  # lent until this step began (verl: its sampler did not wait)
        self.sampler_waits = StepWaits(0.0, 0)  # what verl's sampler counted in the last step
        self.round_trips = 0  # lent after a sync and taken back (verl measures the switch then)

    def set(self, sim: Simulation, wake: bool, switch_s: Optional[float] = None) -> None:
        """`switch_s`: the switch to rollout (none at job start: verl's hybrid engine comes up in rollout mode)."""
        if wake:
            switch = sim.costs.lend_switch_s if switch_s is None else switch_s
            for r in self.ranks:
                sim.rollout.add_rank(r, sim.t + switch, colocated=True)
            self.since = sim.t + switch
            if sim.rollout.ctb is None:  # CTB routes every turn itself
                self._rebalance(sim)
        else:
            for r in self.ranks:
                sim.rollout.remove_rank(r)
            self.served_s += max(0.0, sim.t - self.since)
        self.on = wake

    @staticmethod
    def _rebalance(sim: Simulation) -> None:
        """Stock hybrid replicas lent: verl clears its load balancer's sticky cache (fully_async also aborts and
        resubmits what is in flight), so each unfinished trajectory's next turn goes to the least-loaded server.
        Tasks between turns move here; a running turn finishes where it is."""
        movable = [tr for tr in sim.rollout.trajs.values() if not tr.done and tr.in_engine is None and tr.rank is not None]
        for tr in movable:
            target = min(sim.rollout.ranks, key=lambda r: (sim.rollout.assigned[r], r))
            if tr.rank in sim.rollout.assigned and sim.rollout.assigned[target] + 1 >= sim.rollout.assigned[tr.rank]:
                continue
            if tr.rank in sim.rollout.ranks:
                sim.rollout.ranks[tr.rank].forget(tr.tid)
            if tr.rank in sim.rollout.assigned:
                sim.rollout.assigned[tr.rank] -= 1
            tr.rank = target
            sim.rollout.assigned[target] += 1

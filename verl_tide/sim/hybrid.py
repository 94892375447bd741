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

    def after_update(self, sim: Simulation, sync_end: float) -> None:
        """verl's own rule (`switch`) after an update: adapt, and lend the replicas for the next step or not.
        fully_async activates them in its weight-sync phase (its next step waits), and its rebalance after the
        activation waits (up to its 30 s timeout) for the turns it aborted to drain: the activation's measured
        cost where turns are in flight, the switch one way where none are."""
        c = sim.costs
        ready_next = len(sim.rollout.ready) + sum(mb.sequences for mb in sim.rollout.micro_batches)
        lend = self.switch.step_ended(self.sampler_waits, ready_next, 2 * c.lend_switch_s if self.round_trips else None)
        lend = lend and not self.on and sim.consumed_steps < sim.w.steps
        in_sync = self.switch.activation_in_sync
        in_flight = lend and in_sync and any(tr.in_engine is not None for tr in sim.rollout.trajs.values()
                                             if not tr.done)
        activate_s = c.activate_s if in_flight else c.lend_switch_s
        if lend:
            self.round_trips += 1
            self.set(sim, wake=True, switch_s=max(0.0, sync_end - sim.t) + activate_s)
            if in_sync:
                sim.trainer_free_at = max(sim.trainer_free_at, sync_end + activate_s)
        # the cycle's switches as verl times them: taken back at the step's start, lent again now
        self.switch.cycle_switched(c.lend_switch_s * int(self.step_lent) + (activate_s if lend else 0.0))

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

"""verl's synchronous trainer in the simulation: [evaluation rollout] -> every GPU rolls out the step's batch
-> barrier -> switch -> train (Ref, then Actor) -> switch and sync -> the next step. Its own cycle, on an enum."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from verl_tide.ra2p.stock_cost import global_batch_cost
from verl_tide.sim.records import MicroBatch, StepRecord

if TYPE_CHECKING:
    from verl_tide.sim.cluster import Simulation


class SyncPhase(Enum):
    """verl sync's cycle: [evaluation rollout] -> the batch's rollout starts -> rollout -> (train) -> start."""

    START = "start"
    EVAL = "eval"
    ROLLOUT_BEGIN = "rollout_begin"
    ROLLOUT = "rollout"


class SyncCycle:
    def __init__(self) -> None:
        self.phase = SyncPhase.START
        self.phase_end = 0.0  # end of the current switch, training and sync
        self.rollout_started = 0.0  # when the current step's rollout began (its step record's start)

    def rollout_blocked(self, t: float) -> bool:
        """Idle at the barrier; during the train phase these GPUs train."""
        return self.phase in (SyncPhase.ROLLOUT, SyncPhase.EVAL) and t >= self.phase_end

    def tick(self, sim: Simulation) -> None:
        if sim.t < self.phase_end or sim.consumed_steps >= sim.w.steps:
            return
        if self.phase is SyncPhase.START:
            if sim.w.is_eval_step(sim.consumed_steps):
                sim.rollout.release_eval()
                self.phase = SyncPhase.EVAL
                return
            self.phase = SyncPhase.ROLLOUT_BEGIN
        if self.phase is SyncPhase.EVAL:
            if any(g.done + g.failed < g.size for g in sim.rollout.eval_pending):
                return
            self.phase = SyncPhase.ROLLOUT_BEGIN
        if self.phase is SyncPhase.ROLLOUT_BEGIN:
            for _ in range(sim.w.groups_for(sim.gpus)):
                sim.rollout.new_group(sim.consumed_steps, sim.w.group_size)
            self.phase = SyncPhase.ROLLOUT
            return
        if len(sim.rollout.ready) + sum(mb.sequences for mb in sim.rollout.micro_batches) < sim.B - sim._failed_this_step():
            return
        self._train(sim)

    def _train(self, sim: Simulation) -> None:
        sim.rollout.form_micro_batches()
        mbs = list(sim.rollout.micro_batches)
        if sim.rollout.ready:
            ready = sim.rollout.ready
            mbs.append(MicroBatch(0, sim.t, len(ready), sum(tok for _, tok, _ in ready), [tid for _, _, tid in ready]))
        sim.rollout.micro_batches.clear()
        sim.rollout.ready.clear()
        tokens = sum(mb.tokens for mb in mbs)
        times = sim._stage_times(tokens / len(mbs))
        train = global_batch_cost([0.0] * len(mbs), times)
        start = sim.t + sim.costs.switch_s
        end = start + train + sim.costs.step_overhead_s
        self.phase_end = end + sim.costs.switch_s + sim.costs.sync_s
        sim._consume(mbs)
        sim.consumed_steps += 1
        sim.step_records.append(StepRecord(sim.consumed_steps, self.rollout_started, end, len(mbs), 0, "sync",
                                           len(sim.rollout.ranks), 0))
        self.phase = SyncPhase.START
        self.rollout_started = self.phase_end
        if sim.progress:
            sim.progress(f"{sim.spec.name}: step {sim.consumed_steps}/{sim.w.steps} at {end:.0f}s")

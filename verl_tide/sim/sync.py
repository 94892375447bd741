"""verl's synchronous trainer in the simulation: [evaluation rollout] -> every GPU rolls out the step's batch
-> barrier -> switch -> train (Ref, then Actor) -> switch and sync -> the next step. Its own cycle, on an enum.
The barrier is verl V1's sampler: the batch (and a validation's results) count from its first look after they are
ready (`SystemSpec.poll_s`, verl's 2 s; `sim/evaluation.py`)."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING

from verl_tide.ra2p.stock_cost import global_batch_cost
from verl_tide.sim.evaluation import first_look
from verl_tide.sim.records import MicroBatch, StepRecord

if TYPE_CHECKING:
    from verl_tide.sim.cluster import Simulation


class SyncPhase(Enum):
    """verl sync's cycle: [evaluation rollout] -> the batch's rollout starts -> rollout -> (train) -> start."""

    START = "start"
    EVAL = "eval"
    ROLLOUT_BEGIN = "rollout_begin"
    ROLLOUT = "rollout"
    DONE = "done"  # the last step and the validation after it are over


class SyncCycle:
    def __init__(self) -> None:
        self.phase = SyncPhase.START
        self.phase_end = 0.0  # end of the current switch, training and sync
        self.rollout_started = 0.0  # when the current step's rollout began (its step record's start)
        self.sample_started = 0.0  # when the trainer's sampler began looking for this step's batch
        self.batch_ready_at: float | None = None  # when the whole batch was ready

    def rollout_blocked(self, t: float) -> bool:
        """Idle at the barrier; during the train phase these GPUs train."""
        return self.phase in (SyncPhase.ROLLOUT, SyncPhase.EVAL) and t >= self.phase_end

    def tick(self, sim: Simulation) -> None:
        if sim.t < self.phase_end or self.phase is SyncPhase.DONE:
            return
        if self.phase is SyncPhase.START:
            if sim.w.eval_after(sim.consumed_steps):
                sim.release_eval()
                self.phase = SyncPhase.EVAL
                return
            self.phase = SyncPhase.ROLLOUT_BEGIN
        if self.phase is SyncPhase.EVAL:
            if not sim.evaluation.done(sim.t):
                return
            self.phase = SyncPhase.ROLLOUT_BEGIN
        if sim.consumed_steps >= sim.w.steps:
            self.phase = SyncPhase.DONE
            return
        if self.phase is SyncPhase.ROLLOUT_BEGIN:
            for _ in range(sim.w.groups_for(sim.gpus)):
                sim.rollout.new_group(sim.consumed_steps, sim.w.group_size)
            self.phase = SyncPhase.ROLLOUT
            self.sample_started, self.batch_ready_at = sim.t, None
            return
        if len(sim.rollout.ready) + sum(mb.sequences for mb in sim.rollout.micro_batches) < sim.B - sim._failed_this_step():
            return
        if self.batch_ready_at is None:
            self.batch_ready_at = sim.t
        if sim.t < first_look(self.sample_started, self.batch_ready_at, sim.spec.poll_s):
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

"""The discrete-time cluster simulation: tasks, rollout ranks, a router, a trainer, one system's rules.

Every system runs the same modeled engines (`engine.RolloutRank`) and trainer costs
(`hardware.Costs`); they differ in the rules a `SystemSpec` names:

- `verl_sync`: every GPU rolls out the whole batch, waits for its slowest trajectory (barrier),
  switches to training (Ref then Actor, one swap each), switches back. Evaluation blocks.
- fixed-ratio asynchronous (verl `separate_async`, AReaL-like): `rollout_ratio` of the GPUs roll
  out continuously within `max_staleness`; the trainer waits for a full global batch, then Ref
  and Actor in turn on its GPUs; evaluation blocks the trainer. `streamrl` streams micro-batches
  to the trainer with a Ref<->Actor swap per micro-batch.
- `tide`: CTB admits and pauses tasks (the production `CTBScheduler`), the trainer streams ready
  micro-batches with RA2P (the production cost model executes the step: decoupled when ERS gave it
  Ref ranks, colocated aggregation otherwise), ERS (the production `ERSPolicy` fed by the production
  `ReadinessTracker`) moves one rank at a time between rollout and Ref at the post-update
  boundary, evaluation runs at CTB's top priority without stopping the trainer.

Policies are imported, never copied. Goodput counts the tokens of trajectories consumed by an
actor update per second of simulated wall-clock time.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from typing import Optional

from verl_tide.core.config import CTBConfig, ERSConfig, RA2PConfig
from verl_tide.core.ledger import GoodputLedger, Outcome
from verl_tide.boundary.planner import BoundaryPlanner
from verl_tide.core.readiness import ReadinessTracker
from verl_tide.ctb.policy import CTBScheduler, TaskState
from verl_tide.ers.advice import SplitAdvice
from verl_tide.ers.policy import ERSPolicy
from verl_tide.ra2p.cost import RA2PMode, StageTimes, next_step_mode
from verl_tide.sim.boundary import SimBoundaryPort
from verl_tide.sim.engine import Request, RolloutRank
from verl_tide.sim.evaluation import Evaluation, first_look
from verl_tide.sim.hardware import Costs, Hardware
# the records lived here first; callers import SystemSpec and Result from the simulation
from verl_tide.sim.records import (CONSUME_MODES, Consume, Group, OpenStep, Result, StepRecord,  # noqa: F401
                                   SystemSpec, Traj)
from verl_tide.sim.rollout import Rollout
from verl_tide.sim.step_cost import step_cost
from verl_tide.sim.hybrid import HybridReplicas
from verl_tide.sim.stock import StepWaits, hybrid_switch
from verl_tide.sim.sync import SyncCycle
from verl_tide.sim.workload import Workload


class Simulation:
    def __init__(self, workload: Workload, gpus: int, spec: SystemSpec, hw: Hardware = Hardware(),
                 seed: int = 0, dt: float = 0.5, tide_ctb: CTBConfig = CTBConfig(),
                 tide_ers: ERSConfig = ERSConfig(), tide_ra2p: RA2PConfig = RA2PConfig(), progress: Optional[Callable[[str], None]] = None):
        if spec.resize_trainer:  # as trainer tide resizes: no tide Ref replicas beside it (its config refuses them)
            tide_ers = dataclasses.replace(tide_ers, max_ref_ranks=0)
        if gpus < 2:
            raise ValueError(f"gpus = {gpus}: the simulator needs at least 2")
        self.w, self.gpus, self.spec, self.hw, self.dt = workload, gpus, spec, hw, dt
        self.costs = Costs.of(workload.model, hw)
        self.rng = random.Random(seed)
        self.progress = progress
        self.B = workload.groups_for(gpus) * workload.group_size
        self.t = self.costs.start_s  # the clock runs from the first request; nothing is served before start_s
        self.consumed_steps = 0
        self.consumed_sequences = 0
        self.step_records: list[StepRecord] = []
        self.rwt_gpu_s = self.twt_gpu_s = 0.0
        self.rwt_sync_gpu_s = 0.0  # part of RWT: paused by weight syncs (the rest: out of work)
        self.twt_in_step_gpu_s = 0.0  # part of TWT: the Actor's waits for data inside steps (the rest: before them)
        self.actor_in_step_waits: list[float] = []  # each of them, seconds (what lending inside a step could use)
        self.ref_idle_gpu_s = 0.0  # part of TWT: lent Ref ranks idle while the Actor computes (no data wait)
        # Goodput: the product's ledger. Its unit of settlement here is a sequence (the simulator's micro-batches
        # split GRPO groups; trainer tide's take whole groups), so its "groups" count sequences.
        self.ledger = GoodputLedger(clock=lambda: self.t)
        # roles
        if spec.sync:
            n_rollout = gpus
            self.actor_ranks = gpus
        else:
            n_rollout = min(gpus - 1, max(1, round(gpus * spec.rollout_ratio)))
            self.actor_ranks = gpus - n_rollout
        cap = self.costs.kv_capacity_colocated if spec.sync else self.costs.kv_capacity_tokens
        self.rollout = Rollout(self, {r: RolloutRank(r, cap, self.costs) for r in range(n_rollout)},
                               CTBScheduler(tide_ctb, {r: cap for r in range(n_rollout)}) if spec.routing == "ctb" else None)
        self.ref_ranks: list[int] = []
        self._size_micro_batches()
        self._resized_since_sizing = False  # the Actor's group changed size: micro-batches sized again once none waits
        # the trainer's GPUs rolling out: verl's hybrid replicas (its own rule, sim/stock.py) or tide's lending
        self.hybrid = HybridReplicas(range(gpus - self.actor_ranks, gpus), hybrid_switch(
            spec.hybrid_switch, self.B, spec.parameter_sync_step, gpus, n_rollout, spec.poll_s) if spec.hybrid else None)
        # trainer
        self.trainer_free_at = 0.0  # end of the last update + sync
        self.step_open: Optional[OpenStep] = None
        self.tracker = ReadinessTracker(clock=lambda: self.t)
        # the step-boundary decision, as trainer tide makes it (verl_tide/boundary/planner.py); RA2P's aggregation cap is
        # this system's (the memory limit of one Ref load), given as the trainer is given it: tide.ra2p.max_aggregate
        self.planner = BoundaryPlanner.build(dataclasses.replace(tide_ra2p, max_aggregate=spec.max_aggregate),
                                             tide_ers, self.B, elastic=spec.elastic,
                                             ctb=tide_ctb if self.rollout.ctb is not None else None)
        self.ers = self.planner.ers
        self._step_M = self.M  # micro-batches the next step trains: ERS's elastic batch, else all M
        self.ers_cfg = tide_ers
        self.budget_factors: list[float] = []  # CTB's budget factor chosen at each boundary (ctb/window.py)
        self.lend_decisions: list[tuple[int, bool, str]] = []  # lend_actor: (step, lent, why) at each boundary
        self._lend_return_at = 1  # lend_actor: micro-batches ready before the Actor takes its GPUs back (ERS's)
        self.resizes: list[tuple] = []  # ERS's resizes of the Actor's group: (step, from, to, stall s, why)
        self.ers_plan_ms: list[float] = []  # wall-clock cost of each ERS plan (a policy budget: < 1 ms)
        self._last_tokens_per_mb = 0.0
        self.tide_ra2p = tide_ra2p
        self._kv_wait_s = 0.0  # seconds CTB held work back for KV budget (as its router counts them)
        self._generating_token_s = 0.0  # time integral of CTB's `generating_tokens` (the decode load)
        self._kv_held_peak = 0.0  # the most KV CTB's resident tasks held at once since the last boundary (ranks)
        self.split_advice: Optional[SplitAdvice] = None  # ERS's split advice, the last that stood
        self.boundary = SimBoundaryPort(self, eval_in_first_cycle=workload.is_eval_step(0))

    # ---- the trainer -----------------------------------------------------------------------
    def _size_micro_batches(self) -> None:
        """M micro-batches of equal size per step, M * mb_size <= B (the few left over wait for the next step): one
        micro-batch is `micro_batch_per_gpu` sequences on each of the Actor's GPUs, so a resized group has its own."""
        self.M = max(1, math.ceil(self.B / (self.actor_ranks * self.spec.micro_batch_per_gpu)))
        self.mb_size = self.B // self.M
        self.per_mini_batch = max(1, math.ceil(self.M / self.spec.parameter_sync_step))  # verl's PPO mini-batch

    def actor_group_resized(self) -> None:
        """The Actor's group changed size: its micro-batches follow (`_size_micro_batches_after_resize`)."""
        self._resized_since_sizing = True
        self._size_micro_batches_after_resize()

    def _size_micro_batches_after_resize(self) -> None:
        """After a resize, once no formed micro-batch waits (they keep the size they were formed at): the new
        group's size, the next step's elastic batch in the same sequences."""
        if not self._resized_since_sizing or self.rollout.micro_batches or self.step_open is not None:
            return
        sequences = self._step_M * self.mb_size
        self._size_micro_batches()
        self._step_M = ERSPolicy.mini_batches(sequences, self.mb_size, self.M)
        self._resized_since_sizing = False
        self.rollout.form_micro_batches()

    def _stage_times(self, tokens_per_mb: float, ref_ranks: int = 0) -> StageTimes:
        """Per global micro-batch: Actor passes spread over the actor ranks (data parallel); the Ref forward
        on `ref_ranks` decoupled Ref ranks, or on the actor ranks themselves when 0 (colocated)."""
        c, t = self.costs, self.actor_ranks
        t_ref = tokens_per_mb * c.ref_s_per_token / (ref_ranks or t)
        return StageTimes(t_ref, tokens_per_mb * c.act_f_s_per_token / t, tokens_per_mb * c.act_b_s_per_token / t,
                          c.swap_s)

    def _step_ra2p_mode(self) -> RA2PMode:
        """As trainer tide takes it (`ra2p.cost.next_step_mode`): the planner's choice, where ERS gave Ref ranks
        (the simulation's Ref ranks always sit beside the Actor's own Ref, so split is possible)."""
        return next_step_mode(self.tide_ra2p.mode, self.planner.mode, len(self.ref_ranks), can_split=True)

    def _trainer_tick(self) -> None:
        if self.t < self.trainer_free_at or self.consumed_steps >= self.w.steps:
            return
        if self._post_update is not None:  # the last step's boundary first (a sync shorter than a tick)
            return
        if self.step_open is None:
            self._size_micro_batches_after_resize()
            need = {Consume.GLOBAL: self.M, Consume.MINI_BATCH: min(self.per_mini_batch, self._step_M)}.get(
                self.spec.consume, 1)
            eval_blocked = self.spec.eval_blocks_trainer and self.evaluation is not None and not self.evaluation.done(
                self.t)
            if self.hybrid.on and self.spec.lend_actor:  # ERS's: enough ready that the rest arrives in training
                need = max(need, min(self._lend_return_at, self._step_M))
            if self.hybrid.on and self.hybrid.switch is not None:  # verl's threshold of the batch ready first
                need = max(need, min(self._step_M, math.ceil(self.hybrid.switch.threshold() / self.mb_size)))
            if eval_blocked or len(self.rollout.micro_batches) < need or not self._sampler_sees(need):
                if self.spec.hybrid and not self.hybrid.on and self.hybrid.switch is None:
                    self.hybrid.set(self, wake=True)
                self.boundary.budget_in_wait()
                return
            start = self.t
            self.hybrid.step_lent = self.hybrid.on
            if self.hybrid.on:
                self.hybrid.set(self, wake=False)
                start += self.costs.lend_switch_s + self.costs.actor_after_switch_s  # sleep the replicas, train after
            mode = self._step_ra2p_mode() if self.spec.consume is Consume.RA2P else None
            self.step_open = OpenStep(start, len(self.rollout.micro_batches), mode,
                                      (self.planner.share or 0.0) if mode is RA2PMode.SPLIT else 0.0)
            # trainer tide's step begins before its sampler waits (`on_step_begin`), so RAS and TPRM count from
            # when the trainer was free: a step whose data arrives during the wait has none ready at its start
            self.tracker.step_started(t=min(start, self.trainer_free_at))
        step = self.step_open
        while self.rollout.micro_batches and len(step.mbs) < self._step_M:
            mb = self.rollout.micro_batches.popleft()
            self.tracker.micro_batch_consumed(mb.mb_id, t=self.t)
            step.mbs.append(mb)
        if len(step.mbs) == self._step_M:
            self._finish_step(step)
        else:
            self.boundary.budget_in_wait()  # streaming: the open step waits for its next micro-batch

    def _sampler_sees(self, need: int) -> bool:
        """verl separate_async's sampler looks at its replay buffer every `poll_s` from when it starts waiting
        (after the last weight sync): the `need`-th ready micro-batch counts from its first look after it."""
        if self.spec.consume is not Consume.MINI_BATCH:
            return True
        return self.t >= first_look(self.trainer_free_at, self.rollout.micro_batches[need - 1].ready_at, self.spec.poll_s)

    def _finish_step(self, step: OpenStep) -> None:
        start, mbs = step.start, step.mbs
        ready_rel = [mb.ready_at - start for mb in mbs]
        tokens = sum(mb.tokens for mb in mbs)
        tide = self.spec.consume is Consume.RA2P
        decoupled = tide and step.mode is RA2PMode.DECOUPLED
        share = step.share if tide and step.mode is RA2PMode.SPLIT else 0.0
        times = self._stage_times(tokens / len(mbs), len(self.ref_ranks) if decoupled else 0)
        self._last_tokens_per_mb = tokens / len(mbs)
        ref_ranks_t_ref = self._stage_times(tokens / len(mbs), len(self.ref_ranks)).t_ref if share else 0.0
        in_step: list[float] = []  # the Actor's waits for data inside the step
        cost, mode = step_cost(self.spec, step.mode, share, ready_rel, times, self.per_mini_batch, ref_ranks_t_ref,
                               in_step)
        end = start + cost + self.costs.step_overhead_s
        busy_actor = len(mbs) * (times.t_act_f + times.t_act_b) + (0 if decoupled else
                                                                   (1 - share) * len(mbs) * times.t_ref)
        wait_from = self.trainer_free_at
        # TWT as trainer tide measures it (its sampler's waits for ready data): before the step (less the time
        # the Actor's replica was lent; its switches count) and inside it; not the swaps between aggregated
        # bursts, nor the Actor's waits for Ref ranks' log-probs (work elsewhere, not data missing).
        before_step = max(0.0, start - wait_from - self.hybrid.served_s)
        actor_wait = before_step + sum(in_step)
        self.twt_in_step_gpu_s += self.actor_ranks * sum(in_step)
        self.actor_in_step_waits.extend(in_step)
        self.hybrid.served_s = 0.0
        self.twt_gpu_s += self.actor_ranks * actor_wait
        # what verl's sampler counts (a wait while the replicas were lent is its switch_wait, not a sample wait)
        sampler_s = sum(in_step) + (0.0 if self.hybrid.step_lent else before_step)
        self.hybrid.sampler_waits = StepWaits(sampler_s, (len(in_step) + (0 if self.hybrid.step_lent or not before_step else 1))
                                        * self.per_mini_batch * self.mb_size)
        self.tracker.trainer_waited(actor_wait)
        if self.ref_ranks:  # Ref ranks idle unless decoupled or split mode feeds them
            ref_busy = len(mbs) * (times.t_ref if decoupled else share * ref_ranks_t_ref)
            ref_idle = max(0.0, end - wait_from - ref_busy)
            self.twt_gpu_s += len(self.ref_ranks) * ref_idle
            # of which not waiting for data (the Actor did not either): idle beside the Actor's passes
            self.ref_idle_gpu_s += len(self.ref_ranks) * max(0.0, ref_idle - actor_wait)
        self._consume(mbs)
        self.consumed_steps += 1
        self.consumed_sequences += sum(mb.sequences for mb in mbs)
        self.step_open = None
        rec = StepRecord(self.consumed_steps, start, end, len(mbs), step.ras, mode, len(self.rollout.ranks),
                         len(self.ref_ranks))
        self.step_records.append(rec)
        self.trainer_free_at = end + self.costs.rollout_sync_s  # no new step before the update and its sync
        self._post_update = (end, times, rec)

    def _post_update_boundary(self) -> None:
        """After the actor update, before the weight sync: ERS moves ranks, then the sync pauses rollout."""
        end, times, rec = self._post_update
        self._post_update = None
        # As trainer tide reads CTB's router: each rank's seconds with a request in flight. Idling under the
        # staleness bound is fed to RWT tick by tick (`run`), so no idle clock here.
        self.tracker.rollout_clocks({r: rr.busy_s for r, rr in self.rollout.ranks.items()}, kv_wait_s=self._kv_wait_s,
                                    generating_token_s=self._generating_token_s,
                                    kv_held_peak=self._kv_held_peak if self.rollout.ctb is not None else None)
        self._kv_held_peak = self.rollout.ctb.kv_held_ranks if self.rollout.ctb is not None else 0.0
        self.tracker.step_finished(t=end)
        sync_end = end + self.costs.rollout_sync_s
        eval_next = self.w.eval_after(self.consumed_steps)
        if self.ers is not None or self.spec.consume is Consume.RA2P:
            rec.plan = self.boundary.decide(end, sync_end, eval_next, times)
        if self.hybrid.switch is not None:  # verl's rule, after the update and before the sync (its on_step_end)
            self.hybrid.after_update(self, sync_end)
        for rr in self.rollout.ranks.values():
            rr.paused_until = max(rr.paused_until, sync_end)  # the weight sync pauses generation
        if self.progress:
            self.progress(f"{self.spec.name}: step {self.consumed_steps}/{self.w.steps} at {end:.0f}s ({rec.mode})")
        self._pending_after_sync = (sync_end, eval_next)

    def _consume(self, mbs: list) -> None:
        """The update took these micro-batches: each sequence settles as consumed in the goodput ledger."""
        for mb in mbs:
            for tid in mb.tids:
                self.ledger.settle(tid, Outcome.CONSUMED)

    def sequences_held(self) -> int:
        """Training sequences generating, or ready and not consumed, counted from the simulation's own state
        (not from the ledger): the ledger's check, as trainer tide counts what TransferQueue holds."""
        generating = sum(1 for t in self.rollout.trajs.values() if not t.done and not t.group.is_eval)
        waiting_for_siblings = sum(len(g.finished) for g in self.rollout.groups if not g.is_eval and g.done + g.failed < g.size)
        taken = sum(mb.sequences for mb in self.step_open.mbs) if self.step_open else 0  # by the step being trained
        return generating + waiting_for_siblings + len(self.rollout.ready) + sum(mb.sequences for mb in self.rollout.micro_batches) + taken

    def _failed_this_step(self) -> int:
        return sum(g.failed for g in self.rollout.groups if g.step == self.consumed_steps)

    # ---- the loop --------------------------------------------------------------------------
    def run(self, max_sim_s: float = 1e6) -> Result:
        self._pending_after_sync = None
        self._post_update = None
        self.evaluation: Optional[Evaluation] = None  # the last validation round released
        self.sync = SyncCycle() if self.spec.sync else None  # verl's synchronous trainer (sim/sync.py)
        if not self.spec.sync:
            if self.w.is_eval_step(0):
                self.release_eval()
            if self.spec.lend_actor or self.spec.hybrid:  # verl's hybrid engine starts in rollout mode
                self.hybrid.set(self, wake=True, switch_s=0.0)
            self.rollout.release_train_groups()
            self.tracker.rollout_started(t=self.t)
            if self.rollout.ctb is not None:
                self.boundary.budget_inputs(mark_only=True)  # the window's first interval counts from the rollout's start
        while self.consumed_steps < self.w.steps or self._final_eval_open():
            if self.t > max_sim_s:
                raise RuntimeError(f"{self.spec.name}: not finished after {max_sim_s:.0f} simulated seconds")
            if self.sync is not None:
                self.sync.tick(self)
            if self._post_update is not None and self.t >= self._post_update[0]:
                self._post_update_boundary()
            if self._pending_after_sync and self.t >= self._pending_after_sync[0]:
                _, eval_next = self._pending_after_sync
                self._pending_after_sync = None
                if self.rollout.ctb is not None:
                    self.boundary.budget_inputs(mark_only=True)  # the window's next interval counts from the sync's end
                if eval_next:
                    self.release_eval()
                self.rollout.release_train_groups()
            while self.rollout.env and self.rollout.env[0][0] <= self.t:
                _, _, kind, tr = heapq.heappop(self.rollout.env)
                if kind == "turn":
                    self.rollout.turn_due(tr)
                elif kind == "ctb_add":
                    g = tr.group
                    self.rollout.ctb.add_task(tr.tid, g.gid, g.prompt, g.size, is_eval=g.is_eval)
                elif kind == "final":
                    self.rollout.trajectory_finished(tr)
                else:
                    self.rollout.observation(tr)
            if self.rollout.ctb is not None:
                self.rollout.ctb_tick()
                self._kv_wait_s += self.dt if self.rollout.ctb.waiting_for_kv else 0.0
                if not self.rollout.ctb.count(TaskState.QUEUED):
                    self.boundary.idle_rank_s += self.dt * sum(1 for rr in self.rollout.ranks.values() if rr.idle)
                self._generating_token_s += self.dt * self.rollout.ctb.generating_tokens
                self._kv_held_peak = max(self._kv_held_peak, self.rollout.ctb.kv_held_ranks)
            for rr in list(self.rollout.ranks.values()):
                idle_before = rr.idle or self.t < rr.paused_until
                for req in rr.advance(self.t, self.dt):
                    self.rollout.turn_finished(self.rollout.trajs[req.task])
                if idle_before and self._rollout_blocked(rr):
                    self.rwt_gpu_s += self.dt
                    self.rwt_sync_gpu_s += self.dt if self.t < rr.paused_until else 0.0
                    self.tracker.rollout_waited(self.dt / len(self.rollout.ranks))  # wall-clock share of the rollout side
            self.t += self.dt
            if not self.spec.sync:
                self._trainer_tick()
        makespan = max(self.step_records[-1].end_s, self.t)
        return self._result(makespan)

    def release_eval(self) -> None:
        """A validation round starts: the trainer's sampler looks for its results every `poll_s`."""
        self.evaluation = Evaluation(self.rollout.release_eval(), self.t, self.consumed_steps, self.spec.poll_s)

    def _final_eval_open(self) -> bool:
        """verl's validation after the last step (`eval.at_end`) has not ended: the run's clock runs on."""
        ev = self.evaluation
        return self.w.eval_after(self.w.steps) and not (ev is not None and ev.after == self.w.steps and ev.done(self.t))

    def _rollout_blocked(self, rr: RolloutRank) -> bool:
        """Rollout waits for the trainer: paused by a weight sync, or out of work because of the staleness
        bound (async) or the global-batch barrier (sync)."""
        if self.t < rr.paused_until:
            return True
        if self.spec.sync:  # idle at the barrier; during the train phase these GPUs train
            return self.sync.rollout_blocked(self.t)
        if self.rollout.ctb is not None and self.rollout.ctb.count(TaskState.QUEUED):  # as CTB's router counts out-of-work time
            return False
        return self.rollout.throttled

    def _result(self, makespan: float) -> Result:
        hits = sum(r.hit_tokens for r in self.rollout.all_ranks_seen())
        prompts = sum(r.prompt_tokens for r in self.rollout.all_ranks_seen())
        in_flight = sum(t.generated for t in self.rollout.trajs.values() if not t.done or
                        (not t.group.is_eval and t.group.step >= self.consumed_steps))
        return Result(
            system=self.spec.name, gpus=self.gpus, rollout_ratio=None if self.spec.sync else self.spec.rollout_ratio,
            goodput_tok_s=self.ledger.tokens[Outcome.CONSUMED] / makespan, rwt_s=self.rwt_gpu_s / self.gpus,
            twt_s=self.twt_gpu_s / self.gpus, rwt_sync_s=self.rwt_sync_gpu_s / self.gpus,
            twt_in_step_s=self.twt_in_step_gpu_s / self.gpus, kv_hit_rate=hits / prompts if prompts else 0.0,
            step_time_s=makespan / max(1, self.consumed_steps), makespan_s=makespan,
            consumed_tokens=self.ledger.tokens[Outcome.CONSUMED], ledger=self._ledger_report(in_flight),
            steps=[vars(s) for s in self.step_records], split_advice=self.split_advice,
            twt_ref_idle_s=self.ref_idle_gpu_s / self.gpus)

    def _ledger_report(self, in_flight_tokens: int) -> dict:
        """The bench JSON's `ledger`: the goodput ledger's outcomes and the simulator's token statistics."""
        ledger, c, f = self.ledger, Outcome.CONSUMED, Outcome.DROPPED_FAILED
        return {"consumed_tokens": ledger.tokens[c], "consumed_sequences": ledger.samples[c],
                "eval_tokens": self.rollout.stats["eval_tokens"], "dropped_failed_tokens": ledger.tokens[f],
                "dropped_failed_sequences": ledger.samples[f], "regenerated_tokens": self.rollout.stats["regenerated_tokens"],
                "generated_tokens": self.rollout.stats["generated_tokens"], "in_flight_tokens": in_flight_tokens,
                "in_flight_sequences": ledger.in_flight_groups, "eval_failed_sequences": self.rollout.stats["eval_failed_sequences"]}

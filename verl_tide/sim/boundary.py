"""The simulation's port of the step-boundary round (`boundary/round.py`), as `trainer/boundary.py` is trainer
`tide`'s: the planner's inputs built from what the simulation measures, the round's effects applied to the model
(ERS's moves, the Actor's GPUs lent, CTB's budget factor), and CTB's budget window between boundaries."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional

from verl_tide.boundary.planner import BoundaryInputs, StageRates
from verl_tide.boundary.round import AdviceInputs, BoundaryRound, RoundContext, RoundResult
from verl_tide.core.readiness import ReadinessSignals, RolloutInterval
from verl_tide.ctb.window import BudgetDecision, BudgetInputs
from verl_tide.ers.advice import SplitAdviceCycle
from verl_tide.ers.lending import LendDecision, LendingInputs
from verl_tide.ers.policy import ERSPolicy, Phase, RankMove, Role
from verl_tide.ers.resize import ResizeDecision, ResizeInputs
from verl_tide.ra2p.cost import StageTimes
from verl_tide.sim.records import Consume

if TYPE_CHECKING:
    from verl_tide.sim.cluster import Simulation


class SimBoundaryPort:
    """One per simulation. `decide` runs the round at a post-update boundary; `budget_in_wait` is the window's
    decision while the trainer waits for data, as trainer `tide` makes it (`trainer/budget_window.py`)."""

    def __init__(self, sim: Simulation, eval_in_first_cycle: bool):
        self.sim = sim
        self.round = BoundaryRound(sim.planner, SplitAdviceCycle(eval_in_first_cycle))
        # CTB's budget window reads the rollout since it last decided (boundary or wait), as trainer tide does:
        # the engines' (hit, prompt) tokens and the router's clocks then
        self._hits_at_window = (0, 0)
        self._window_interval = RolloutInterval()
        self._window_decided_at = 0.0
        self.idle_rank_s = 0.0  # rank-seconds with nothing in flight while CTB queued no task (its router's clock)
        self.budget_factors_in_wait: list[float] = []  # factors changed while the trainer waited for data
        self.window_reads: list[dict] = []  # with a planner trace: the clocks each window decision read
        self._signals_at: float = 0.0
        self._sync_end: float = 0.0

    # ---- the round --------------------------------------------------------------------------
    def decide(self, end: float, sync_end: float, eval_next: bool, times: StageTimes) -> str:
        """The round at the post-update boundary: RA2P's next mode, ERS's plan and moves, the Actor's GPUs lent or
        not, CTB's budget factor, the split advice. Returns what the step record keeps of it."""
        sim = self.sim
        self._signals_at, self._sync_end = end, sync_end
        roles = {r: Role.ROLLOUT for r in sim.rollout.ranks} | {r: Role.REF for r in sim.ref_ranks}
        advice = None
        if sim.ers is not None:
            advice = AdviceInputs(len(sim.rollout.ranks), sim.actor_ranks + len(sim.ref_ranks), sim.B,
                                  sim.costs.weight_bytes / sim.costs.kv_bytes_per_token,
                                  sim.ers_cfg.split_advice_kv_bound)
        context = RoundContext(Phase.EVAL if eval_next else Phase.TRAIN, roles if sim.ers is not None else None,
                               last_step=sim.consumed_steps >= sim.w.steps, advice=advice)
        inputs = dataclasses.replace(self.boundary_inputs(), lending=self.lending_inputs(times),
                                     resize=self.resize_inputs())
        t0 = time.perf_counter()
        result = self.round.run(inputs, context, self)
        sim.ers_plan_ms.append((time.perf_counter() - t0) * 1e3)  # the whole round: RA2P's choice and ERS's plan
        decision = result.decision
        if sim.ers is None:
            return decision.choice.reason if decision.choice else "RA2P: nothing measured yet"
        return decision.plan.reason

    def signals(self, break_even: Optional[int]) -> ReadinessSignals:
        sim = self.sim
        return sim.tracker.signals(sim.B, sim.ers_cfg.tau, ras_break_even=break_even, t=self._signals_at)

    def set_budget(self, decision: BudgetDecision) -> None:
        if self.sim.rollout.ctb is not None:
            self.sim.rollout.ctb.set_budget_factor(decision.factor)
            self.sim.budget_factors.append(decision.factor)

    def lend(self, decision: LendDecision) -> None:
        sim = self.sim
        sim._lend_return_at = decision.return_at_units
        if decision.lend and not sim.hybrid.on:  # woken after the weight sync, with the new weights
            sim.hybrid.set(sim, wake=True, switch_s=max(0.0, self._sync_end - sim.t) + sim.costs.lend_switch_s)
        sim.lend_decisions.append((sim.consumed_steps, decision.lend, decision.reason))

    def move_ranks(self, moves: Sequence[RankMove]) -> list[RankMove]:
        """A rank to Ref leaves the rollout (never the last one); a rank back to rollout starts once loaded."""
        sim, applied = self.sim, []
        for move in moves:
            if move.dst is Role.REF and move.rank in sim.rollout.ranks and len(sim.rollout.ranks) > 1:
                sim.rollout.remove_rank(move.rank)
                sim.ref_ranks.append(move.rank)
                applied.append(move)
            elif move.dst is Role.ROLLOUT and move.rank in sim.ref_ranks:
                sim.ref_ranks.remove(move.rank)
                sim.rollout.add_rank(move.rank, max(self._sync_end, self._signals_at + sim.costs.load_s))
                applied.append(move)
        return applied

    def resize_trainer(self, decision: ResizeDecision) -> None:
        """The Actor's group grows by rollout ranks (the highest first) or gives ranks back to rollout: the trainer
        stops for the resize; a rank that joins rollout loads the weights after it."""
        sim = self.sim
        a0, stall = sim.actor_ranks, sim.costs.resize_s(sim.actor_ranks)
        if decision.actor_gpus > a0:
            for rank in sorted(sim.rollout.ranks, reverse=True)[:decision.actor_gpus - a0]:
                if len(sim.rollout.ranks) > 1:
                    sim.rollout.remove_rank(rank)
                    sim.actor_ranks += 1
        else:
            actor_ids = set(range(sim.gpus)) - set(sim.rollout.ranks) - set(sim.ref_ranks)
            for rank in sorted(actor_ids)[:a0 - decision.actor_gpus]:
                sim.rollout.add_rank(rank, max(self._sync_end, self._signals_at + stall) + sim.costs.load_s)
                sim.actor_ranks -= 1
        if sim.actor_ranks != a0:
            sim.trainer_free_at += stall
            sim.actor_group_resized()
            sim.resizes.append((sim.consumed_steps, a0, sim.actor_ranks, stall, decision.reason))

    def report(self, result: RoundResult) -> None:
        sim, plan = self.sim, result.decision.plan
        if plan is None:
            return
        sim.split_advice = self.round.advice.last
        # trainer tide's elastic batch (its `step`): the plan's sequences in whole micro-batches
        sim._step_M = ERSPolicy.mini_batches(plan.batch_size, sim.mb_size, sim.M)
        sim.step_records[-1].moves.extend((move.rank, move.dst.value) for move in result.moves)  # applied ones

    # ---- the planner's inputs ---------------------------------------------------------------
    def boundary_inputs(self) -> BoundaryInputs:
        """The planner's inputs, as trainer tide's adapter builds them (trainer/boundary.py) from what it measures:
        the last step's ready times, its tokens, the per-token stage rates (here the modeled ones: the Actor's
        passes spread over its data-parallel ranks, one Ref rank's forward), and the Ref ranks ERS lent."""
        sim = self.sim
        c, t = sim.costs, sim.actor_ranks
        ready = tuple(sim.tracker.last_ready_times)
        rates = StageRates(c.ref_s_per_token / t, c.act_f_s_per_token / t, c.act_b_s_per_token / t, c.swap_s,
                           ref_rank=c.ref_s_per_token) if sim._last_tokens_per_mb else None
        return BoundaryInputs(step=sim.consumed_steps, ready_times=ready, units_per_mini_batch=1,
                              step_tokens=sim._last_tokens_per_mb * len(ready), rates=rates, actor_ranks=t,
                              elastic_ref_ranks=len(sim.ref_ranks), replicas_up=len(sim.ref_ranks),
                              ref_beside_actor=True, uses_ref=sim.spec.consume is Consume.RA2P, ctb=self.budget_inputs())

    def lending_inputs(self, times: StageTimes) -> Optional[LendingInputs]:
        """ERS's lending inputs as trainer tide builds them (trainer/lending.py): what is ready for the next step,
        the switch's round trip (to rollout and back), the Actor's time to train a micro-batch."""
        sim = self.sim
        if not sim.spec.lend_actor:
            return None
        return LendingInputs(ready_units=len(sim.rollout.micro_batches), units_per_mini_batch=1, mini_batches=sim._step_M,
                             switch_cost_s=2 * sim.costs.lend_switch_s,
                             train_s_per_mini_batch=times.t_act_f + times.t_act_b,
                             last_step=sim.consumed_steps >= sim.w.steps)

    def resize_inputs(self) -> Optional[ResizeInputs]:
        sim = self.sim
        if not sim.spec.resize_trainer:
            return None
        return ResizeInputs(len(sim.rollout.ranks), sim.actor_ranks, sim.B, sim.costs.resize_s(sim.actor_ranks),
                            sim.w.steps - sim.consumed_steps, sim.costs.weight_bytes / sim.costs.kv_bytes_per_token,
                            sim.ers_cfg.split_advice_kv_bound, max_staleness=sim.w.max_staleness)

    # ---- CTB's budget window ----------------------------------------------------------------
    def budget_inputs(self, mark_only: bool = False) -> Optional[BudgetInputs]:
        """CTB's budget factor in force, the engines' prefix-cache hit rate (prompt tokens pooled) and the rollout's
        shares since the window last decided, as trainer tide reads them (trainer/budget_window.py)."""
        sim = self.sim
        if sim.rollout.ctb is None or not sim.rollout.ctb.ranks:
            return None
        ranks = sim.rollout.all_ranks_seen()
        hits, prompts = sum(r.hit_tokens for r in ranks), sum(r.prompt_tokens for r in ranks)
        (hits0, prompts0) = self._hits_at_window
        if not mark_only:  # a mark moves the rollout's interval only, as trainer tide's (budget_window.py)
            self._hits_at_window = (hits, prompts)
        busy = {r: rr.busy_s for r, rr in sim.rollout.ranks.items()}
        utilization, kv_bound = self._window_interval.read(sim.t, busy, self.idle_rank_s, sim._kv_wait_s)
        if sim.planner.trace is not None:  # what trainer tide's router and engines would have said
            self.window_reads.append({"t": sim.t, "busy_s": busy, "idle_rank_s": self.idle_rank_s,
                                      "kv_wait_s": sim._kv_wait_s, "hit_tokens": hits, "prompt_tokens": prompts,
                                      "mark_only": mark_only})
        self._window_decided_at = sim.t
        return BudgetInputs(factor=sim.rollout.ctb.budgets.factor,
                            hit_rate=(hits - hits0) / (prompts - prompts0) if prompts > prompts0 else None,
                            kv_bound=kv_bound, utilization=utilization)

    def budget_in_wait(self) -> None:
        """The trainer waits for data: CTB's budget window also decides every `window_interval_s`
        (`BoundaryPlanner.decide_budget`, as trainer tide calls it)."""
        sim = self.sim
        window = sim.planner.window
        if sim.rollout.ctb is None or window is None or sim._pending_after_sync or \
                not window.due_in_wait(sim.t, self._window_decided_at):
            return  # (a sync whose end the loop has not yet marked: its pause is no stretch the window reads)
        decision = sim.planner.decide_budget(self.budget_inputs())
        if decision is not None and decision.factor != sim.rollout.ctb.budgets.factor:
            sim.rollout.ctb.set_budget_factor(decision.factor)
            self.budget_factors_in_wait.append(decision.factor)

"""The simulation's side of the step-boundary planner (`core/planner.py`), as `trainer/boundary.py`,
`trainer/lending.py` and `trainer/budget_window.py` are trainer `tide`'s: the planner's inputs built from what the
simulation measures, its decision applied (ERS's moves, the Actor's GPUs lent, CTB's budget factor), and CTB's
budget window between boundaries. A mixin of `cluster.Simulation`, whose state it reads."""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

from verl_tide.core.planner import BoundaryInputs, StageRates
from verl_tide.core.readiness import RolloutInterval
from verl_tide.ctb.window import BudgetInputs
from verl_tide.ers.lending import LendingInputs
from verl_tide.ers.policy import ERSPolicy, Phase, Role
from verl_tide.ra2p.cost import StageTimes


class PlannerSide:
    def _init_budget_window(self) -> None:
        # CTB's budget window reads the rollout since it last decided (boundary or wait), as trainer tide does
        # (trainer/budget_window.py): the engines' (hit, prompt) tokens and the router's clocks then
        self._hits_at_window = (0, 0)
        self._window_interval = RolloutInterval()
        self._window_decided_at = 0.0
        self._idle_rank_s = 0.0  # rank-seconds with nothing in flight while CTB queued no task (its router's clock)
        self.budget_factors_in_wait: list[float] = []  # factors changed while the trainer waited for data
        self.window_reads: list[dict] = []  # with a planner trace: the clocks each window decision read

    def boundary_inputs(self) -> BoundaryInputs:
        """The planner's inputs, as trainer tide's adapter builds them (trainer/boundary.py) from what it measures:
        the last step's ready times, its tokens, the per-token stage rates (here the modeled ones: the Actor's
        passes spread over its data-parallel ranks, one Ref rank's forward), and the Ref ranks ERS lent."""
        c, t = self.costs, self.actor_ranks
        ready = tuple(self.tracker.last_ready_times)
        rates = StageRates(c.ref_s_per_token / t, c.act_f_s_per_token / t, c.act_b_s_per_token / t, c.swap_s,
                           ref_rank=c.ref_s_per_token) if self._last_tokens_per_mb else None
        return BoundaryInputs(step=self.consumed_steps, ready_times=ready, units_per_mini_batch=1,
                              step_tokens=self._last_tokens_per_mb * len(ready), rates=rates, actor_ranks=t,
                              elastic_ref_ranks=len(self.ref_ranks), replicas_up=len(self.ref_ranks),
                              ref_beside_actor=True, uses_ref=self.spec.consume == "ra2p", ctb=self.budget_inputs())

    def budget_inputs(self, mark_only: bool = False) -> Optional[BudgetInputs]:
        """CTB's budget factor in force, the engines' prefix-cache hit rate (prompt tokens pooled) and the rollout's
        shares since the window last decided, as trainer tide reads them (trainer/budget_window.py)."""
        if self.ctb is None or not self.ctb.ranks:
            return None
        ranks = self._all_ranks_seen()
        hits, prompts = sum(r.hit_tokens for r in ranks), sum(r.prompt_tokens for r in ranks)
        (hits0, prompts0) = self._hits_at_window
        if not mark_only:  # a mark moves the rollout's interval only, as trainer tide's (budget_window.py)
            self._hits_at_window = (hits, prompts)
        busy = {r: rr.busy_s for r, rr in self.ranks.items()}
        utilization, kv_bound = self._window_interval.read(self.t, busy, self._idle_rank_s, self._kv_wait_s)
        if self.planner.trace is not None:  # what trainer tide's router and engines would have said
            self.window_reads.append({"t": self.t, "busy_s": busy, "idle_rank_s": self._idle_rank_s,
                                      "kv_wait_s": self._kv_wait_s, "hit_tokens": hits, "prompt_tokens": prompts,
                                      "mark_only": mark_only})
        self._window_decided_at = self.t
        return BudgetInputs(factor=self.ctb.budgets.factor,
                            hit_rate=(hits - hits0) / (prompts - prompts0) if prompts > prompts0 else None,
                            kv_bound=kv_bound, utilization=utilization)

    def _budget_in_wait(self) -> None:
        """The trainer waits for data: CTB's budget window also decides every `window_interval_s`
        (`BoundaryPlanner.decide_budget`, as trainer tide calls it)."""
        window = self.planner.window
        if self.ctb is None or window is None or self._pending_after_sync or \
                not window.due_in_wait(self.t, self._window_decided_at):
            return  # (a sync whose end the loop has not yet marked: its pause is no stretch the window reads)
        decision = self.planner.decide_budget(self.budget_inputs())
        if decision is not None and decision.factor != self.ctb.budgets.factor:
            self.ctb.set_budget_factor(decision.factor)
            self.budget_factors_in_wait.append(decision.factor)

    def lending_inputs(self, times: StageTimes) -> Optional[LendingInputs]:
        """ERS's lending inputs as trainer tide builds them (trainer/lending.py): what is ready for the next step,
        the switch's round trip (to rollout and back), the Actor's time to train a micro-batch."""
        if not self.spec.lend_actor:
            return None
        return LendingInputs(ready_units=len(self.micro_batches), units_per_mini_batch=1, mini_batches=self._step_M,
                             switch_cost_s=2 * self.costs.switch_s,
                             train_s_per_mini_batch=times.t_act_f + times.t_act_b,
                             last_step=self.consumed_steps >= self.w.steps)

    def _decide(self, end: float, sync_end: float, eval_next: bool, times: StageTimes) -> str:
        """The planner at the post-update boundary (RA2P's next mode, ERS's plan, the Actor's GPUs lent or not),
        then ERS's moves."""
        roles = {r: Role.ROLLOUT for r in self.ranks} | {r: Role.REF for r in self.ref_ranks}
        t0 = time.perf_counter()
        decision = self.planner.decide(
            dataclasses.replace(self.boundary_inputs(), lending=self.lending_inputs(times)),
            lambda be: self.tracker.signals(self.B, self.ers_cfg.tau, ras_break_even=be, t=end),
            roles if self.ers is not None else None, Phase.EVAL if eval_next else Phase.TRAIN)
        self.ers_plan_ms.append((time.perf_counter() - t0) * 1e3)  # RA2P's choice and ERS's plan together
        if decision.budget is not None and self.ctb is not None:
            self.ctb.set_budget_factor(decision.budget.factor)
            self.budget_factors.append(decision.budget.factor)
        if self.ers is None:
            return decision.choice.reason if decision.choice else "RA2P: nothing measured yet"
        self.advice.update(decision.signals, len(self.ranks), self.actor_ranks + len(self.ref_ranks), self.B,
                           self.costs.weight_bytes / self.costs.kv_bytes_per_token, self.ers_cfg.split_advice_kv_bound,
                           eval_next)
        self.split_advice = self.advice.last
        if decision.lend is not None:
            self._lend_return_at = decision.lend.return_at_units
            if decision.lend.lend and not self._hybrid_on:  # woken after the weight sync, with the new weights
                self._hybrid(wake=True, switch_s=max(0.0, sync_end - self.t) + self.costs.switch_s)
            self.lend_decisions.append((self.consumed_steps, decision.lend.lend, decision.lend.reason))
        plan = decision.plan
        # trainer tide's elastic batch (its `step`): the plan's sequences in whole micro-batches
        self._step_M = ERSPolicy.mini_batches(plan.batch_size, self.mb_size, self.M)
        rec_moves = self.step_records[-1].moves
        for move in plan.moves:
            rec_moves.append((move.rank, move.dst.value))
            if move.dst is Role.REF and move.rank in self.ranks and len(self.ranks) > 1:
                self._remove_rank(move.rank)
                self.ref_ranks.append(move.rank)
            elif move.dst is Role.ROLLOUT and move.rank in self.ref_ranks:
                self.ref_ranks.remove(move.rank)
                self._add_rank(move.rank, max(sync_end, end + self.costs.load_s))
        return plan.reason

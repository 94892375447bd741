"""Trainer `tide`'s port of the step-boundary round (`verl_tide.boundary.round`): what the running job measured, as
the planner's inputs, and the round's effects applied to the job (ERS's moves on the elastic ranks, the Actor's
GPUs lent through verl's hybrid switch, CTB's budget factor on its router) with what the step logs of them.

Why apart: these are the only lines where the trainer's state becomes decision inputs. Keeping them as
plain functions of plain values lets the planner replay test (tests/test_planner_replay.py) run the
trainer's adapter without a verl job, beside the simulator's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from verl_tide.boundary.planner import BoundaryDecision, BoundaryInputs, StageRates
from verl_tide.boundary.round import PlanOutcome, RoundResult
from verl_tide.core.readiness import ReadinessSignals
from verl_tide.ctb.window import BudgetDecision, BudgetInputs
from verl_tide.ers.lending import LendDecision, LendingInputs
from verl_tide.ers.policy import Phase, RankMove, Role
from verl_tide.ers.resize import ResizeDecision, ResizeInputs
from verl_tide.ra2p.cost import StageTimer
from verl_tide.trainer import lending


def observe_stage_times(timer: StageTimer, timing_raw: Mapping[str, float], step_tokens: int,
                        swap_s: Optional[float]) -> None:
    """The Actor's per-token rates from verl's step timers (Ref's are observed where each Ref pass runs), and one
    Ref<->Actor swap as the Actor's workers measured it (None: not measured this step, e.g. no colocated Ref)."""
    if step_tokens <= 0:
        return
    if "old_log_prob" in timing_raw:
        timer.observe("act_f", step_tokens, timing_raw["old_log_prob"])
    if "update_actor" in timing_raw:
        # update = forward + backward; the backward share is what is left after a forward pass
        timer.observe("act_b", step_tokens, max(timing_raw["update_actor"] - timing_raw.get("old_log_prob", 0.0), 0.0))
    if swap_s is not None:
        timer.observe("swap", 0, swap_s)
    elif timer.rate("swap") is None:
        # Ref and Actor never swapped (no Ref on the Actor's ranks): a swap costs nothing the cost model can save
        timer.observe("swap", 0, 0.0)


def observe_ref_replicas(timer: StageTimer, timing: Mapping[str, Any], metrics: MutableMapping[str, Any],
                         verls_ref_beside: bool) -> None:
    """One replica's seconds per token ("ref_rank") from a pass on tide's Ref replicas; RA2P's t_ref too when no
    verl Ref measures it."""
    if timing["tokens"] <= 0:
        return
    timer.observe("ref_rank", int(timing["tokens"]), timing["seconds"] * timing["replicas"])
    if not verls_ref_beside:
        timer.observe("ref", int(timing["tokens"]), timing["seconds"])
    metrics["tide/ra2p/ref_worker_s"] = metrics.get("tide/ra2p/ref_worker_s", 0.0) + timing["seconds"]
    metrics["tide/ra2p/ref_replicas_used"] = timing["replicas"]


def boundary_inputs(step: int, ready_times: Sequence[float], groups_per_mini_batch: int, step_tokens: int,
                    timer: StageTimer, actor_ranks: int, fixed_ref_ranks: int, roles: Mapping[int, Role],
                    replicas_up: int, ref_beside_actor: bool, uses_ref: bool,
                    lending: Optional[LendingInputs] = None, ctb: Optional[BudgetInputs] = None,
                    resize: Optional[ResizeInputs] = None) -> BoundaryInputs:
    """The planner's inputs from what trainer `tide` holds at the post-update boundary: the readiness tracker's
    ready times of the last step (per GRPO group), verl's mini-batch size in groups, the ledger's consumed tokens,
    the stage timer's rates, and the ranks in each role."""
    return BoundaryInputs(
        step=step, ready_times=tuple(ready_times), units_per_mini_batch=groups_per_mini_batch,
        step_tokens=step_tokens, rates=StageRates.from_timer(timer), actor_ranks=actor_ranks,
        fixed_ref_ranks=fixed_ref_ranks, elastic_ref_ranks=sum(r is Role.REF for r in roles.values()),
        replicas_up=replicas_up, ref_beside_actor=ref_beside_actor, uses_ref=uses_ref, lending=lending, ctb=ctb,
        resize=resize)


def ers_phase(global_steps: int, total_steps: int, test_freq: int, overlapped_eval: bool) -> Phase:
    """Evaluation starts after this step's sync and runs during the next step's rollout: ERS allocates rollout for
    it ahead of time (preemptive rollout allocation)."""
    last = global_steps >= total_steps
    if overlapped_eval and test_freq > 0 and global_steps % test_freq == 0 and not last:
        return Phase.EVAL
    return Phase.TRAIN


def roles_metrics(applied: Sequence[Any], roles: Mapping[int, Role]) -> dict[str, float]:
    return {
        "tide/ers/moves_applied": float(len(applied)),
        "tide/ers/ranks_rollout": float(sum(r is Role.ROLLOUT for r in roles.values())),
        "tide/ers/ranks_ref": float(sum(r is Role.REF for r in roles.values())),
        "tide/ers/switch_s": float(sum(a.seconds for a in applied)),
        "tide/ers/requests_resent": float(sum(a.requests_resent for a in applied)),
    }


def decision_metrics(decision: BoundaryDecision, step_tokens: int, timer: Optional[StageTimer]) -> dict[str, float]:
    """What the step logs of the boundary's decision: the cost model's predictions, the readiness signals it read,
    and ERS's plan."""
    signals, plan = decision.signals, decision.plan
    m = {"tide/ledger/step_tokens_consumed": float(step_tokens),
         "tide/ra2p/swap_s": float((timer.rate("swap") if timer is not None else None) or 0.0)}
    if decision.choice is not None:
        m["tide/ra2p/predicted_decoupled_s"] = decision.choice.decoupled_s
        m["tide/ra2p/predicted_colocated_s"] = decision.choice.colocated_s
        if decision.choice.split_s is not None:
            m["tide/ra2p/predicted_split_s"] = decision.choice.split_s
    m.update({
        "tide/readiness/ready_at_start": float(signals.ready_at_start),
        "tide/readiness/tprm_s": float(signals.tprm_smoothed or 0.0),
        "tide/readiness/hol_latency_s": float(signals.hol_latency),
        "tide/readiness/ready_volume": float(signals.ready_volume),
        "tide/readiness/rwt_s": float(signals.rollout_wait_s),
        "tide/readiness/twt_s": float(signals.trainer_wait_s),
    })
    if signals.rollout_utilization is not None:  # unknown without CTB's router
        m["tide/readiness/rollout_utilization"] = float(signals.rollout_utilization)
    if plan is not None:
        m["tide/ers/planned_moves"] = float(len(plan.moves))
        m["tide/ers/elastic_batch"] = float(plan.batch_size)
    return m


@dataclass
class TrainerBoundaryPort:
    """One boundary of a running job: the round reads the readiness tracker's signals through it and acts on the
    job's collaborators (each optional where the job has none); `metrics` collects what the step logs of the
    round, `lend_decision` what verl's hybrid switch is told after the weight sync."""

    step: int
    signals_for: Callable[[Optional[int]], ReadinessSignals]
    roles: MutableMapping[int, Role]  # the elastic ranks' roles, updated as ranks move
    quarantined: Mapping[int, str] = field(default_factory=dict)  # rollout ranks out of service (rank -> why)
    elastic: Optional[Any] = None  # `ers.elastic.ElasticRanks`: before_sync(moves) -> the moves applied
    budget_window: Optional[Any] = None  # `trainer.budget_window.BudgetWindowReader`
    advice: Optional[Any] = None  # `trainer.reporting.SplitAdviceReport`
    exporter: Optional[Any] = None  # the Prometheus exporter
    step_tokens: int = 0
    timer: Optional[StageTimer] = None
    metrics: dict = field(default_factory=dict)
    lend_decision: Optional[LendDecision] = None
    resize_decision: Optional[ResizeDecision] = None  # applied by the trainer after the round, before the sync
    applied: list = field(default_factory=list)

    def signals(self, break_even: Optional[int]) -> ReadinessSignals:
        return self.signals_for(break_even)

    def set_budget(self, decision: BudgetDecision) -> None:
        if self.budget_window is not None:
            self.metrics.update(self.budget_window.at_boundary(decision, self.step))

    def lend(self, decision: LendDecision) -> None:
        self.lend_decision = decision
        self.metrics.update(lending.decision_metrics(decision))
        print(f"verl-tide step {self.step}: ERS {'lends' if decision.lend else 'keeps'} the Actor's GPU "
              f"({decision.reason}); it trains again at {decision.return_at_units} ready groups", flush=True)

    def move_ranks(self, moves: Sequence[RankMove]) -> list[Any]:
        """Before the weight sync. ERS plans moves only where elastic ranks exist."""
        self.applied = list(self.elastic.before_sync(moves))
        for move in self.applied:
            self.roles[move.rank] = move.dst
        return self.applied

    def resize_trainer(self, decision: ResizeDecision) -> None:
        """Asked only with `tide.ers.resize_trainer` on; the trainer moves the GPUs (`trainer/resize.py`)."""
        self.resize_decision = decision

    def report(self, result: RoundResult) -> None:
        decision = result.decision
        if decision.resize is not None:
            print(f"verl-tide step {self.step}: ERS trainer resize: {decision.resize.reason}", flush=True)
        self.metrics.update(decision_metrics(decision, self.step_tokens, self.timer))
        self.metrics.update(roles_metrics(self.applied, self.roles))
        if self.advice is not None and decision.signals is not None:
            self.metrics.update(self.advice.metrics(decision.signals, self.roles, self.quarantined, self.step,
                                                    result.standing_advice, result.advice_changed))
        if self.exporter is not None and decision.plan is not None:
            self.exporter.update_from_ers(decision.plan, decision.signals, self.roles)

    def plan_note(self, result: RoundResult) -> str:
        """What became of ERS's plan, for the step's log line."""
        if result.plan_outcome is not PlanOutcome.APPLIED:
            return result.plan_outcome.value
        return "applied: " + "; ".join(f"rank {a.rank} -> {a.dst.value} ({a.seconds:.2f}s, {a.requests_resent} "
                                       "requests re-sent)" for a in self.applied)


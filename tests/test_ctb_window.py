"""CTB's budget window (ctb/window.py): when the planner lets budgets reach past KV capacity, and back."""

from __future__ import annotations

import pytest

from verl_tide.core.config import CTBConfig, TideConfigError, parse_tide_config
from verl_tide.boundary.planner import BoundaryInputs, BoundaryPlanner, replay
from verl_tide.core.readiness import ReadinessSignals, RolloutInterval
from verl_tide.ctb.policy import CTBScheduler, Outcome, TaskState
from verl_tide.ctb.window import BudgetInputs, BudgetWindow
from verl_tide.engine_metrics import EngineMetrics

RANK = 1000.0  # a rank's budget at factor 1 (the decode-context signal, which the window does not read)


def _decide(window: BudgetWindow, factor: float, kv_bound, hit=0.5, utilization=0.6):
    return window.decide(BudgetInputs(factor, hit, kv_bound=kv_bound, utilization=utilization))


def test_grows_while_work_waits_for_budget_up_to_the_cap():
    w = BudgetWindow(max_factor=4.0)
    factor, seen = 1.0, []
    for _ in range(4):
        factor = _decide(w, factor, kv_bound=0.8).factor
        seen.append(factor)
    assert seen == [2.0, 4.0, 4.0, 4.0]


def test_grows_to_the_factor_that_would_have_kept_the_engines_busy_when_that_is_more_than_double():
    """The budget let the engines run a quarter of the time: four times the work fills them, in one decision
    (a cold start at Alg. 1's budget, where x2 a decision took several decisions to get there)."""
    w = BudgetWindow(8.0)
    d = _decide(w, 1.0, kv_bound=0.9, utilization=0.25)
    assert d.factor == 4.0 and "nothing in flight 75%" in d.reason
    assert _decide(w, 2.0, kv_bound=0.9, utilization=0.3).factor == 6.67
    assert _decide(w, 4.0, kv_bound=0.9, utilization=0.25).factor == 8.0  # the ceiling bounds it
    assert _decide(w, 1.0, kv_bound=0.9, utilization=0.0).factor == 8.0  # nothing ran: straight to the ceiling
    assert _decide(w, 1.0, kv_bound=0.9, utilization=0.8).factor == 2.0  # x2 where that is more


@pytest.mark.parametrize("kv_bound, hit, utilization, why", [
    (0.1, 0.5, 0.6, "keep: waited 10%"), (None, 0.5, 0.6, "not measured"), (0.8, None, 0.6, "not measured"),
    (0.8, 0.5, None, "utilization not measured"),
    (0.8, 0.5, 0.95, "engines busy 95%"),  # a KV-bound rollout whose engines work: Alg. 1's budget doing its job
])
def test_keeps_when_work_did_not_wait_on_idle_engines_or_a_signal_is_missing(kv_bound, hit, utilization, why):
    d = _decide(BudgetWindow(8.0), 2.0, kv_bound, hit, utilization)
    assert d.factor == 2.0 and why in d.reason


def test_grows_only_while_the_budget_idled_the_engines():
    w = BudgetWindow(8.0)
    d = _decide(w, 1.0, kv_bound=0.8, utilization=0.9)
    assert d.factor == 2.0 and "nothing in flight 10%" in d.reason
    assert _decide(w, 2.0, kv_bound=0.8, utilization=0.91).factor == 2.0


def test_shrinks_when_the_hit_rate_falls_below_the_fixed_budgets_and_does_not_grow_back_past_it():
    w = BudgetWindow(8.0)
    assert _decide(w, 1.0, kv_bound=0.9, hit=0.8).factor == 2.0  # 0.8 seen at factor 1
    assert _decide(w, 2.0, kv_bound=0.9, hit=0.75).factor == 4.0  # within 0.1: keeps growing
    d = _decide(w, 4.0, kv_bound=0.9, hit=0.6)
    assert d.factor == 2.0 and "hit rate 0.60 fell from 0.80" in d.reason and "ceiling now 2" in d.reason
    assert w.base_hit_rate == 0.8  # recorded only while the budget was Alg. 1's
    assert _decide(w, 2.0, kv_bound=0.9, hit=0.78).factor == 2.0  # the ceiling holds
    assert _decide(w, 2.0, kv_bound=0.9, hit=0.5).factor == 1.0  # and falls again, never below 1
    assert _decide(w, 1.0, kv_bound=0.9, hit=0.5).factor == 1.0


def test_a_cache_that_hit_little_at_the_fixed_budget_is_not_guarded():
    """Below PROTECTED_HIT at factor 1 there is little to protect and the per-step rate is noise: no shrink."""
    w = BudgetWindow(8.0)
    assert _decide(w, 1.0, kv_bound=0.9, hit=0.16).factor == 2.0
    assert _decide(w, 2.0, kv_bound=0.9, hit=0.03).factor == 4.0


def test_a_factor_of_one_is_alg_1s_fixed_budget_and_below_one_is_refused():
    assert _decide(BudgetWindow(1.0), 1.0, kv_bound=1.0).factor == 1.0
    with pytest.raises(ValueError, match="max_budget_factor"):
        BudgetWindow(0.5)
    with pytest.raises(TideConfigError, match="tide.ctb.max_budget_factor"):
        parse_tide_config({"ctb": {"max_budget_factor": 0.5}})


def test_the_scheduler_scales_budgets_and_pauses_what_no_longer_fits_when_they_shrink():
    s = CTBScheduler(CTBConfig(kv_headroom=1.0, probe_first_turn=False), {"r0": 100})
    for i in range(4):
        s.add_task(i, group_id=i, prompt_tokens=40)
    assert len(s.tick().admissions) == 2  # 2 x 40 of 100
    s.set_budget_factor(4.0)
    assert s.ranks["r0"].budget == 400 and s.ranks["r0"].base == 100
    assert len(s.tick().admissions) == 2  # the other two now fit
    s.set_budget_factor(1.0)
    out = s.tick()
    assert len(out.pauses) == 2 and s.ranks["r0"].usage <= 100
    assert s.count(TaskState.RESIDENT) == 2 and s.count(TaskState.PAUSED) == 2
    s.add_rank("r1", 100)  # a rank joining later gets the factor in force
    s.set_budget_factor(2.0)
    assert s.ranks["r1"].budget == 200
    with pytest.raises(ValueError, match="must be >= 1"):
        s.set_budget_factor(0.5)


def test_what_no_rank_can_hold_is_judged_by_kv_capacity_not_the_scaled_budget():
    s = CTBScheduler(CTBConfig(kv_headroom=1.0), {"r0": 100})
    s.set_budget_factor(8.0)
    s.add_task("big", group_id="g", prompt_tokens=150)
    out = s.tick()
    assert [d.task_id for d in out.failed] == ["big"]
    assert s.tasks["big"].outcome is Outcome.DROPPED_FAILED


def _signals(kv_bound, decode_context, utilization=0.6):
    return ReadinessSignals(ready_at_start=0, time_per_ready_microbatch=None, tprm_smoothed=None, hol_latency=0.0,
                            ready_volume=0, mean_step_time=None, generation_deficit=False, consumption_deficit=False,
                            rollout_wait_s=0.0, trainer_wait_s=0.0, rollout_kv_bound=kv_bound,
                            rollout_decode_context=decode_context, rollout_utilization=utilization)


def test_the_planner_decides_the_factor_only_with_ctb_and_its_inputs():
    """At a boundary from the window's own interval (BudgetInputs), not the step cycle's readiness signals."""
    tide = parse_tide_config({})

    def inputs(ctb=None):
        return BoundaryInputs(step=1, ready_times=(), units_per_mini_batch=1, step_tokens=0, rates=None,
                              actor_ranks=1, uses_ref=False, ctb=ctb)
    planner = BoundaryPlanner.build(tide.ra2p, tide.ers, ideal_batch=8, ctb=tide.ctb)
    decision = planner.decide(inputs(BudgetInputs(1.0, 0.1, kv_bound=0.9, utilization=0.6)),
                              lambda _: _signals(0.0, 0.2 * RANK, utilization=1.0))
    assert "grow" in decision.budget.reason
    assert decision.budget.factor == 2.0 and decision.summary()["budget"][0] == 2.0
    busy = planner.decide(inputs(BudgetInputs(1.0, 0.1, kv_bound=0.9, utilization=1.0)),
                          lambda _: _signals(0.9, 0.2 * RANK, utilization=0.5))
    assert busy.budget.factor == 1.0 and "engines busy 100%" in busy.budget.reason
    off = parse_tide_config({"ctb": {"enabled": False}})
    assert BoundaryPlanner.build(off.ra2p, off.ers, ideal_batch=8, ctb=off.ctb).decide(
        inputs(BudgetInputs(1.0, 0.1, kv_bound=0.9, utilization=0.6)), lambda _: _signals(0.9, 0.2 * RANK)
    ).budget is None
    no_inputs = BoundaryPlanner.build(tide.ra2p, tide.ers, ideal_batch=8, ctb=tide.ctb).decide(
        inputs(), lambda _: _signals(0.9, 0.2 * RANK))
    assert no_inputs.budget is None


def test_between_boundaries_the_planner_decides_the_budget_alone_and_records_it():
    tide = parse_tide_config({})
    planner = BoundaryPlanner.build(tide.ra2p, tide.ers, ideal_batch=8, ctb=tide.ctb)
    planner.trace = []
    grown = planner.decide_budget(BudgetInputs(1.0, 0.3, kv_bound=0.8, utilization=0.5))
    assert grown.factor == 2.0 and "grow" in grown.reason
    assert planner.decide_budget(None) is None  # CTB's router unread: nothing decided, nothing recorded
    assert [rec.decision for rec in planner.trace] == [{"budget": (2.0, grown.reason)}]
    assert replay(BoundaryPlanner.build(tide.ra2p, tide.ers, ideal_batch=8, ctb=tide.ctb), planner.trace) == [
        {"budget": (2.0, grown.reason)}]
    with pytest.raises(TideConfigError, match="tide.ctb.window_interval_s"):
        parse_tide_config({"ctb": {"window_interval_s": -1}})


def test_the_rollout_interval_reads_each_stretch_once():
    """Shares since the last read: the busy rank-seconds over ranks x working time, where working time leaves out
    the ranks' out-of-work time; the KV wait over the same."""
    clock = RolloutInterval()
    assert clock.read(10.0, {"a": 0.0, "b": 0.0}, 0.0, 0.0) == (None, None)  # the first read only marks
    util, kv = clock.read(14.0, {"a": 2.0, "b": 3.0}, 2.0, 1.5)  # 4 s, 1 s out of work per rank: 3 s working
    assert util == pytest.approx(5.0 / 6.0) and kv == pytest.approx(0.5)
    util, kv = clock.read(16.0, {"a": 2.0, "b": 3.0, "c": 1.0}, 2.0, 1.5)  # a new rank counts from 0
    assert util == pytest.approx(1.0 / 6.0) and kv == 0.0
    assert clock.read(16.0, {"a": 2.0}, 2.0, 1.5) == (None, None)  # no working time


class _Rollout:
    """CTB's router's clocks and one engine's prefix-cache counters, advanced by the test; what trainer `tide`'s
    reader is told (the RolloutReport calls it makes), and the factors it set on the router."""

    def __init__(self):
        self.busy, self.idle, self.kv_wait, self.hit, self.queried = 0.0, 0.0, 0.0, 0.0, 0.0
        self.set_factors = []

    def rollout_time(self):
        return {"busy_s": {"r0": self.busy}, "idle_rank_s": self.idle, "kv_wait_s": self.kv_wait}

    def scrape_engines(self, quarantined):
        return {"e": (0, EngineMetrics("vllm", self.queried, self.hit, None, None, None))}

    def set_budget_factor(self, factor):
        self.set_factors.append(factor)


def test_trainer_tides_reader_decides_while_the_trainer_waits_once_an_interval_is_up():
    from verl_tide.trainer.budget_window import BudgetWindowReader

    tide = parse_tide_config({})
    now = [0.0]
    rollout = _Rollout()
    reader = BudgetWindowReader(rollout, BoundaryPlanner.build(tide.ra2p, tide.ers, ideal_batch=8, ctb=tide.ctb),
                                clock=lambda: now[0])
    reader.mark(rollout.rollout_time(), {a: m for a, (_, m) in rollout.scrape_engines({}).items()})

    def wait_until(t, busy_share=0.5, kv_share=1.0):
        rollout.busy += (t - now[0]) * busy_share
        rollout.kv_wait += (t - now[0]) * kv_share
        rollout.queried += 100.0
        rollout.hit += 20.0
        now[0] = t
        reader.while_waiting(step=1, quarantined={})

    wait_until(1.5)  # the interval is not up: nothing read, nothing decided
    assert reader.decisions_in_wait == 0 and rollout.set_factors == []
    wait_until(2.5)  # work waited for budget the whole time while the engine idled half of it: grow
    assert rollout.set_factors == [2.0] and reader.factor == 2.0
    assert reader.metrics() == {"tide/ctb/budget_decisions_in_wait": 1.0, "tide/ctb/budget_changes_in_wait": 1.0}
    wait_until(5.0, busy_share=1.0)  # busy engines: keep (a decision, no change, no Ray call)
    assert reader.metrics()["tide/ctb/budget_decisions_in_wait"] == 2.0 and rollout.set_factors == [2.0]
    inputs = reader.inputs({})  # a boundary's read covers only the time since the last decision
    assert inputs.factor == 2.0 and inputs.hit_rate is None  # no prompt token queried since: unknown, not 0
    boundaries_only = parse_tide_config({"ctb": {"window_interval_s": 0}})  # tide.ctb.window_interval_s=0
    off = BudgetWindowReader(rollout, BoundaryPlanner.build(boundaries_only.ra2p, boundaries_only.ers, ideal_batch=8,
                                                            ctb=boundaries_only.ctb), clock=lambda: now[0])
    now[0] = 100.0
    off.while_waiting(step=1, quarantined={})
    assert off.decisions_in_wait == 0

"""ERS's decision to lend the Actor's GPUs to rollout (`verl_tide/ers/lending.py`), alone and through the boundary
planner that trainer `tide` and the simulator both call. The end-to-end job: tests/test_ers_lend_actor_e2e.py."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verl_tide.core.config import ERSConfig, RA2PConfig
from verl_tide.boundary.planner import BoundaryInputs, BoundaryPlanner
from verl_tide.core.readiness import ReadinessSignals
from verl_tide.ers.lending import LendingInputs, LendingRecord, decide, return_threshold
from verl_tide.ers.policy import Phase, Role


def inputs(ready=0, g=2, m=2, cost=1.0, train=2.0, last=False) -> LendingInputs:
    return LendingInputs(ready_units=ready, units_per_mini_batch=g, mini_batches=m, switch_cost_s=cost,
                         train_s_per_mini_batch=train, last_step=last)


def test_lend_when_the_expected_wait_exceeds_the_measured_round_trip_and_not_otherwise():
    # 2 groups missing for the next step's first mini-batch, one every 0.8 s: 1.6 s of waiting > 1.0 s switch
    d = decide(inputs(ready=0, cost=1.0), Phase.TRAIN, seconds_per_unit=0.8)
    assert d.lend and d.expected_wait_s == pytest.approx(1.6), d
    d = decide(inputs(ready=1, cost=1.0), Phase.TRAIN, seconds_per_unit=0.8)  # one missing: 0.8 s
    assert not d.lend and d.expected_wait_s == pytest.approx(0.8) and "<= switch 1.00s" in d.reason, d
    d = decide(inputs(ready=2), Phase.TRAIN, seconds_per_unit=0.8)  # a mini-batch is ready: train
    assert not d.lend and d.expected_wait_s == 0.0, d


def test_no_lend_after_an_update_when_more_gpus_would_not_make_the_rollout_faster():
    """The rollout waited for KV budget only 10% of its working time (it waits on its environments): the wait is
    long, but the Actor's GPUs would not shorten it, and lending would cost the switch and the streaming."""
    d = decide(inputs(ready=0, cost=1.0), Phase.TRAIN, seconds_per_unit=5.0, rollout_kv_bound=0.1, kv_bound_min=0.25)
    assert not d.lend and "10% < 25%" in d.reason, d
    assert decide(inputs(ready=0, cost=1.0), Phase.TRAIN, 5.0, rollout_kv_bound=0.3, kv_bound_min=0.25).lend
    assert decide(inputs(ready=0, cost=1.0), Phase.TRAIN, 5.0, rollout_kv_bound=None, kv_bound_min=0.25).lend
    # evaluation lends preemptively whatever the rollout's saturation
    assert decide(inputs(ready=0), Phase.EVAL, 5.0, rollout_kv_bound=0.0, kv_bound_min=0.25).lend


def test_unknown_rate_or_cost_lends_and_the_first_switch_measures_it():
    assert decide(inputs(cost=None), Phase.TRAIN, seconds_per_unit=0.1).lend
    assert decide(inputs(cost=5.0), Phase.TRAIN, seconds_per_unit=None).lend


def test_evaluation_lends_preemptively_unless_a_mini_batch_is_ready_and_the_last_step_never_lends():
    d = decide(inputs(ready=1, cost=100.0), Phase.EVAL, seconds_per_unit=0.01)  # the wait would not pay: lends
    assert d.lend and "eval" in d.reason
    # a mini-batch ready: the Actor trains while the evaluation runs on the rollout ranks (the simulator's
    # 100-step WebShop run lost 4% goodput lending then)
    d = decide(inputs(ready=2, cost=0.0), Phase.EVAL, seconds_per_unit=10.0)
    assert not d.lend and "a mini-batch can train" in d.reason, d
    assert decide(inputs(ready=0), Phase.COLD_START, seconds_per_unit=None).lend
    assert not decide(inputs(last=True), Phase.EVAL, seconds_per_unit=10.0).lend


def test_the_actor_returns_once_the_rest_of_the_step_arrives_while_the_ready_part_trains():
    # 4 mini-batches of 2 groups, a group every 1 s, 2 s to train a mini-batch: with 2 mini-batches in hand
    # the other 2 (4 groups, 4 s) arrive while those train (4 s); with 1 they would not (6 s > 2 s)
    assert return_threshold(inputs(g=2, m=4, train=2.0), seconds_per_unit=1.0) == 4
    assert return_threshold(inputs(g=2, m=4, train=100.0), seconds_per_unit=1.0) == 2  # training is slow: 1
    assert return_threshold(inputs(g=2, m=4, train=0.01), seconds_per_unit=1.0) == 8  # arrivals slow: the whole
    assert return_threshold(inputs(g=2, m=4, train=None), seconds_per_unit=1.0) == 2  # unknown: one mini-batch
    assert return_threshold(inputs(g=2, m=4), seconds_per_unit=None) == 2


@given(g=st.integers(1, 8), m=st.integers(1, 16), s=st.floats(0.01, 50), t=st.floats(0.01, 50))
def test_the_return_threshold_is_the_fewest_mini_batches_that_cover_the_rest(g, m, s, t):
    k = return_threshold(inputs(g=g, m=m, train=t), seconds_per_unit=s) // g
    assert 1 <= k <= m
    assert k == m or (m - k) * g * s <= k * t * (1 + 1e-6)
    assert k == 1 or (m - k + 1) * g * s > (k - 1) * t * (1 - 1e-6)


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="units_per_mini_batch = 0"):
        inputs(g=0)


def _signals(tprm, cycle_s=None, kv_bound=None):
    return ReadinessSignals(ready_at_start=0, time_per_ready_microbatch=tprm, tprm_smoothed=tprm, hol_latency=0.0,
                            ready_volume=0, mean_step_time=10.0, generation_deficit=True, consumption_deficit=False,
                            rollout_wait_s=0.0, trainer_wait_s=5.0, rollout_kv_bound=kv_bound, cycle_s=cycle_s)


def test_the_planner_decides_lending_from_the_signals_tprm_and_records_it_in_the_summary():
    planner = BoundaryPlanner.build(RA2PConfig(), ERSConfig(), ideal_batch=8)
    base = BoundaryInputs(step=3, ready_times=(1.0, 2.0), units_per_mini_batch=2, step_tokens=100.0, rates=None,
                          actor_ranks=1, uses_ref=False)
    without = planner.decide(base, lambda be: _signals(1.5), {0: Role.ROLLOUT})
    assert without.lend is None and without.summary()["lend"] is None
    lend_in = inputs(ready=0, cost=2.0)
    decided = planner.decide(BoundaryInputs(**{**base.__dict__, "lending": lend_in}), lambda be: _signals(1.5),
                             {0: Role.ROLLOUT})
    # 3 s > 2 s, saturation unknown (by default the model alone decides: tide.ers.lend_trials = 0)
    assert decided.lend == decide(lend_in, Phase.TRAIN, 1.5) and decided.lend.lend
    assert decided.summary()["lend"] == (True, decided.lend.return_at_units, decided.lend.reason)
    evaluation = planner.decide(BoundaryInputs(**{**base.__dict__, "lending": inputs(ready=1, cost=2.0)}),
                                lambda be: _signals(0.1), {0: Role.ROLLOUT}, phase=Phase.EVAL)
    assert evaluation.lend.lend  # 0.1 s of waiting < the 2 s switch, but an evaluation is coming


def test_the_hybrid_switch_hooks_lending_relies_on_exist_in_verl_and_a_missing_one_is_named():
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from verl_tide.trainer.verl_compat import VerlChanged, check_hybrid_switch_hooks

    check_hybrid_switch_hooks(PPOTrainerSeparateAsync)

    class Renamed:
        _switch_threshold = _effective_switch_cost = switch_to_rollout = add_replicas_to_balancer = None

    with pytest.raises(VerlChanged, match=r"_init_hybrid_rollout_state .*verl 0\.9\.1"):
        check_hybrid_switch_hooks(Renamed)


def test_each_answer_is_tried_then_the_measured_step_cycles_decide_over_the_model():
    """The model (no KV wait: more GPUs would not help) says keep; a compute-bound rollout (the CPU test bed's
    fake GPUs) does get faster. A keep is tried first (the model's answer), then the trials alternate, then the
    shorter measured cycles win: here the lent ones, against the model."""
    record = LendingRecord(trials=2)
    answers = []
    for cycle_after_lend, cycle_after_keep in [(None, None)] + [(2.0, 3.0)] * 6:
        if answers:  # the cycle the last answer started ends
            record.cycle_ended(cycle_after_lend if answers[-1].lend else cycle_after_keep)
        d = decide(inputs(ready=0, cost=1.0), Phase.TRAIN, 5.0, rollout_kv_bound=0.0, kv_bound_min=0.25,
                   record=record)
        record.answered(d)
        answers.append(d)
    assert [d.lend for d in answers] == [False, True, False, True, True, True, True], [d.reason for d in answers]
    assert "trying a keep (0 of 2" in answers[0].reason and "the model: keep" in answers[0].reason
    assert "trying a lend (0 of 2" in answers[1].reason and "trying a lend (1 of 2" in answers[3].reason
    assert answers[4].lent_cycle_s == 2.0 and answers[4].kept_cycle_s == 3.0
    assert "2.00s after a lend vs 3.00s after a keep: lend" in answers[4].reason
    # the other way round: lent cycles measured longer (the switch costs more than the rollout gains): keep
    record = LendingRecord(trials=1, lent=[4.0], kept=[3.0])
    d = decide(inputs(ready=0, cost=1.0), Phase.TRAIN, 5.0, rollout_kv_bound=0.9, kv_bound_min=0.25, record=record)
    assert not d.lend and "keep" in d.reason.split(":")[-1], d


def test_only_real_questions_are_measured_and_the_window_keeps_the_last_cycles():
    record = LendingRecord(trials=1, window=2)
    settled = decide(inputs(ready=0, cost=10.0), Phase.TRAIN, 1.0, record=record)  # 2 s wait <= 10 s switch
    assert not settled.lend and not settled.question
    record.answered(settled)
    record.cycle_ended(50.0)  # not counted: the switch settled it, whatever the measurement
    for d in (decide(inputs(ready=2), Phase.TRAIN, 1.0, record=record),  # a mini-batch ready
              decide(inputs(ready=0), Phase.EVAL, 1.0, record=record), decide(inputs(last=True), Phase.TRAIN, 1.0)):
        assert not d.question
        record.answered(d)
        record.cycle_ended(50.0)
    assert record.lent == [] and record.kept == []
    for cycle in (1.0, 2.0, 3.0):
        record.answered(decide(inputs(ready=0, cost=None), Phase.TRAIN, 1.0, record=LendingRecord(trials=0)))
        record.cycle_ended(cycle)
    assert record.lent == [2.0, 3.0] and record.mean(True) == 2.5 and record.mean(False) is None
    # trials = 0: the model alone, as before the record existed
    assert decide(inputs(ready=0, cost=1.0), Phase.TRAIN, 5.0, rollout_kv_bound=0.0, kv_bound_min=0.25,
                  record=LendingRecord(trials=0)) == decide(inputs(ready=0, cost=1.0), Phase.TRAIN, 5.0,
                                                            rollout_kv_bound=0.0, kv_bound_min=0.25)


def test_the_planner_keeps_the_record_across_boundaries_from_the_signals_cycle():
    """One record, in the planner trainer `tide` and the simulator share: each boundary's signals close the cycle
    the previous answer started (`cycle_s`), and `tide.ers.lend_trials` sizes the trials."""
    planner = BoundaryPlanner.build(RA2PConfig(), ERSConfig(lend_trials=1), ideal_batch=8)
    base = BoundaryInputs(step=3, ready_times=(1.0, 2.0), units_per_mini_batch=2, step_tokens=100.0, rates=None,
                          actor_ranks=1, uses_ref=False, lending=inputs(ready=0, cost=1.0))
    lends = []
    for step, cycle in enumerate([None, 5.0, 2.0, 2.0, 2.0], start=3):
        d = planner.decide(BoundaryInputs(**{**base.__dict__, "step": step}), lambda be: _signals(2.0, cycle, 0.0),
                           {0: Role.ROLLOUT})
        lends.append(d.lend.lend)
    # keep tried (the model's answer: no KV wait), 5 s; lend tried, 2 s; from then on the measurement: lend
    assert lends == [False, True, True, True, True], lends
    assert planner.lend_record.kept == [5.0] and planner.lend_record.lent == [2.0, 2.0, 2.0]
    from verl_tide.core.config import TideConfigError, parse_tide_config

    with pytest.raises(TideConfigError, match=r"tide\.ers\.lend_trials.*>= 0"):
        parse_tide_config({"ers": {"lend_trials": -1}})

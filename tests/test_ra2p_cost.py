"""RA2P's cost model (Appendix A) against hand-computed cases, and the mode choice."""

from __future__ import annotations

import pytest

from verl_tide.ra2p.cost import (
    RA2PMode,
    StageTimes,
    choose_mode,
    colocated_cost,
    decoupled_break_even_ras,
    decoupled_cost,
)

T = StageTimes(t_ref=1.0, t_act_f=1.0, t_act_b=2.0, t_swap=3.0)


def test_all_ready_at_start():
    ready = [0.0, -1.0, 0.0]
    # fill: 0*1 + 1*1 = 1; three micro-batches at max(0, 1+2) = 3 each.
    assert decoupled_cost(ready, T, actor_ranks=2) == 10.0
    # one aggregate of 3: swap 3 + 3 refs, swap 3 + 3 x (1+2).
    assert colocated_cost(ready, T, max_aggregate=8) == 18.0


def test_aggregation_is_capped_by_memory():
    ready = [0.0, 0.0, 0.0]
    assert colocated_cost(ready, T, max_aggregate=1) == 30.0  # three swap pairs of 10 s
    assert colocated_cost(ready, T, max_aggregate=2) == 24.0  # 14 s for two, then 10 s for one


def test_sparse_arrivals_with_many_actor_ranks_favor_colocated():
    ready = [10.0, 20.0, 30.0]
    # fill with M=8: 1+2+...+7 = 28; gaps 10 each exceed the 3 s of actor compute.
    assert decoupled_cost(ready, T, actor_ranks=8) == 58.0
    # each arrival is processed alone before the next: arrival + 3 + 1 + 3 + 3.
    assert colocated_cost(ready, T, max_aggregate=8) == 40.0
    choice = choose_mode(ready, T, actor_ranks=8, max_aggregate=8)
    assert choice.mode is RA2PMode.COLOCATED
    assert (choice.decoupled_s, choice.colocated_s) == (58.0, 40.0)


def test_hysteresis_keeps_the_previous_mode_for_small_gains():
    ready = [0.0, 0.0, 0.0]
    t = StageTimes(t_ref=1.0, t_act_f=1.0, t_act_b=1.0, t_swap=1.0)
    # C_dec = (0+1+2+3) + 3*2 = 12, C_col = 1+3+1+6 = 11: colocated is 8.3% cheaper.
    assert choose_mode(ready, t, 4, 8).mode is RA2PMode.COLOCATED
    kept = choose_mode(ready, t, 4, 8, previous=RA2PMode.DECOUPLED, hysteresis=0.1)
    assert kept.mode is RA2PMode.DECOUPLED and "keep decoupled" in kept.reason
    assert choose_mode(ready, t, 4, 8, previous=RA2PMode.DECOUPLED, hysteresis=0.05).mode is RA2PMode.COLOCATED


def test_break_even_ras():
    t = StageTimes(t_ref=1.0, t_act_f=1.0, t_act_b=1.0, t_swap=1.0)
    # M=4 (fill 6), 8 micro-batches, the rest arriving every 10 s: colocated wins until all 8 are
    # ready at the start (C_dec 22 < C_col 26); with 7 ready, C_dec 30 > C_col 28.
    assert decoupled_break_even_ras(8, 10.0, t, actor_ranks=4, max_aggregate=8) == 8
    assert decoupled_break_even_ras(8, 10.0, t, actor_ranks=8, max_aggregate=8) is None
    # With two actor ranks the fill costs 1 s and decoupled wins from the start.
    assert decoupled_break_even_ras(8, 10.0, t, actor_ranks=2, max_aggregate=8) == 0


@pytest.mark.parametrize("bad", [dict(t_ref=-1.0), dict(t_swap=float("nan"))])
def test_bad_stage_times(bad):
    kwargs = dict(t_ref=1.0, t_act_f=1.0, t_act_b=1.0, t_swap=1.0) | bad
    with pytest.raises(ValueError, match="StageTimes"):
        StageTimes(**kwargs)


def test_bad_arguments():
    with pytest.raises(ValueError, match="actor_ranks"):
        decoupled_cost([0.0], T, 0)
    with pytest.raises(ValueError, match="max_aggregate"):
        colocated_cost([0.0], T, 0)
    with pytest.raises(ValueError, match="hysteresis"):
        choose_mode([0.0], T, 1, 1, hysteresis=1.0)


def test_stage_timer_learns_per_token_rates_online():
    from verl_tide.ra2p.cost import StageTimer

    timer = StageTimer(smoothing=0.5)
    assert not timer.ready
    with pytest.raises(RuntimeError, match=r"\['ref', 'act_f', 'act_b', 'swap'\]"):
        timer.stage_times(100)
    timer.observe("ref", 1000, 1.0)     # 1 ms / token
    timer.observe("ref", 1000, 3.0)     # 3 ms / token -> smoothed 2 ms
    timer.observe("act_f", 500, 1.0)
    timer.observe("act_b", 500, 2.0)
    timer.observe("swap", 0, 4.0)
    t = timer.stage_times(100)
    assert (t.t_ref, t.t_act_f, t.t_act_b, t.t_swap) == pytest.approx((0.2, 0.2, 0.4, 4.0))
    with pytest.raises(ValueError, match="must be one of ref"):
        timer.observe("critic", 1, 1.0)
    with pytest.raises(ValueError, match="need tokens > 0"):
        timer.observe("ref", 0, 1.0)

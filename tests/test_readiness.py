"""Readiness signals (pure): RAS, TPRM, HoL latency, deficits, RWT/TWT."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from verl_tide.core.readiness import (
    mini_batch_ready_times,
    step_time_fed,
    ReadinessTracker,
    post_start_gaps,
    ready_at_start,
    ready_gaps,
    time_per_ready_microbatch,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_ras_and_tprm_by_hand():
    ready = [-3.0, 0.0, 2.0, 5.0, 11.0]
    assert ready_at_start(ready) == 2
    assert ready_gaps(ready) == [0.0, 0.0, 2.0, 3.0, 6.0]
    assert post_start_gaps(ready) == [2.0, 3.0, 6.0]
    assert time_per_ready_microbatch(ready) == pytest.approx(11.0 / 3)
    assert time_per_ready_microbatch([-1.0, 0.0]) is None


@given(st.lists(st.floats(min_value=-100, max_value=100), max_size=30))
def test_gaps_reconstruct_the_last_ready_time(ready):
    gaps = ready_gaps(ready)
    assert len(gaps) == len(ready)
    assert all(g >= 0 for g in gaps)
    if ready:
        assert sum(gaps) == pytest.approx(max(max(ready), 0.0), abs=1e-9)


def _tracker():
    clock = FakeClock()
    return clock, ReadinessTracker(clock=clock, smoothing=0.5)


def test_tracker_step_signals():
    clock, tr = _tracker()
    tr.micro_batch_ready("a", 8, t=0.0)
    tr.micro_batch_ready("b", 8, t=1.0)
    tr.step_started(t=2.0)
    tr.micro_batch_consumed("a", t=2.0)
    tr.micro_batch_consumed("b", t=2.5)
    tr.micro_batch_ready("c", 8, t=4.0)
    tr.micro_batch_consumed("c", t=4.0)
    tr.micro_batch_ready("d", 8, t=7.0)
    tr.micro_batch_consumed("d", t=7.0)
    tr.trainer_waited(1.5)
    tr.trainer_waited(3.0)
    tr.step_finished(t=10.0)
    tr.micro_batch_ready("e", 4, t=11.0)
    s = tr.signals(ideal_batch=16, tau=1.0, t=20.0)
    assert s.ready_at_start == 2
    assert s.time_per_ready_microbatch == pytest.approx(2.5)  # gaps 2 (4-2) and 3 (7-4)
    assert s.mean_step_time == 8.0
    assert s.hol_latency == 9.0 and s.ready_volume == 4
    assert s.generation_deficit  # 4 ready < B_ideal 16, and the trainer waited 4.5 s of its 8 s step
    assert not s.consumption_deficit  # HoL 9 s > tau x 8 s, but a trainer that waits is not behind
    assert (s.trainer_wait_s, s.rollout_wait_s) == (4.5, 0.0)
    assert not tr.signals(ideal_batch=4, tau=2.0, t=20.0).consumption_deficit


def _one_step(rwt: float, twt: float, ready_at_start: int = 1):
    clock, tr = _tracker()
    for i in range(ready_at_start):
        tr.micro_batch_ready(i, 4, t=0.0)
    tr.step_started(t=1.0)
    for i in range(ready_at_start):
        tr.micro_batch_consumed(i, t=1.0)
    tr.rollout_waited(rwt)
    tr.trainer_waited(twt)
    tr.step_finished(t=11.0)  # a 10 s step
    tr.micro_batch_ready("late", 4, t=12.0)
    return tr


def test_waits_decide_which_side_is_the_bottleneck():
    # Neither side waited: an old ready micro-batch means the trainer is behind.
    s = _one_step(rwt=0.5, twt=0.5).signals(ideal_batch=64, tau=1.0, t=30.0)
    assert s.consumption_deficit and s.generation_deficit  # HoL 18 s > 10 s; 4 ready < 64: hold
    # Rollout sat out 3 s of a 10 s step held by the trainer: consumption deficit, not generation.
    s = _one_step(rwt=3.0, twt=0.0).signals(ideal_batch=64, tau=1.0, t=13.0)
    assert s.consumption_deficit and not s.generation_deficit
    # The trainer waited 3 s for data: generation deficit, even with RAS beyond the break-even.
    s = _one_step(rwt=0.0, twt=3.0, ready_at_start=5).signals(ideal_batch=1, tau=1.0, ras_break_even=0, t=13.0)
    assert s.generation_deficit and not s.consumption_deficit
    # Both waited (e.g. an evaluation took the rollout): both deficits, ERS holds.
    s = _one_step(rwt=3.0, twt=3.0).signals(ideal_batch=64, tau=1.0, t=13.0)
    assert s.generation_deficit and s.consumption_deficit


def test_ras_beyond_break_even_is_a_consumption_deficit():
    clock, tr = _tracker()
    for i in range(5):
        tr.micro_batch_ready(i, 4, t=0.0)
    tr.step_started(t=1.0)
    for i in range(5):
        tr.micro_batch_consumed(i, t=1.0)
    tr.step_finished(t=2.0)
    assert tr.signals(ideal_batch=1, tau=100, ras_break_even=4, t=2.0).consumption_deficit
    assert not tr.signals(ideal_batch=1, tau=100, ras_break_even=5, t=2.0).consumption_deficit


def test_smoothing_and_waits_reset_per_step():
    clock, tr = _tracker()
    for step, (gap, dur) in enumerate([(2.0, 10.0), (4.0, 6.0)]):
        start = step * 100.0
        tr.step_started(t=start)
        tr.micro_batch_ready(("x", step), 1, t=start + gap)
        tr.micro_batch_consumed(("x", step), t=start + gap)
        tr.rollout_waited(1.0)
        tr.step_finished(t=start + dur)
    s = tr.signals(ideal_batch=1, tau=1, t=200.0)
    assert s.tprm_smoothed == pytest.approx(0.5 * 4.0 + 0.5 * 2.0)
    # each step from its first ready micro-batch (10 - 2, 6 - 4): the wait before data is the rollout's
    assert s.mean_step_time == pytest.approx(0.5 * 2.0 + 0.5 * 8.0)
    assert s.rollout_wait_s == 1.0  # only the last step's RWT


def test_a_steps_time_counts_from_its_first_ready_micro_batch():
    """The step begins before its sampler waits (trainer tide's on_step_begin); its time for ERS's consumption
    check is the trainer's own pace, from the first data it could train to its update."""
    assert step_time_fed(60.0, [50.0, 55.0]) == 10.0  # a cold start: 50 s of waiting for the rollout
    assert step_time_fed(60.0, [-3.0, 0.0, 20.0]) == 60.0  # data there at the start: the whole step
    assert step_time_fed(60.0, []) == 60.0
    clock, tr = _tracker()
    tr.step_started(t=0.0)
    tr.micro_batch_ready("late", 1, t=50.0)
    tr.micro_batch_consumed("late", t=50.0)
    tr.step_finished(t=60.0)
    assert tr.signals(ideal_batch=1, tau=1, t=60.0).mean_step_time == pytest.approx(10.0)


def test_rollout_utilization_is_busy_time_over_the_ranks_working_time():
    clock, tr = _tracker()
    tr.micro_batch_ready("a", 8, t=0.0)  # the cycle starts at the first arrival
    tr.step_started(t=0.0)
    tr.micro_batch_consumed("a", t=0.0)
    tr.micro_batch_ready("b", 8, t=5.0)
    with pytest.raises(ValueError, match="ranks = 0"):
        tr.rollout_busy(1.0, ranks=0)
    tr.rollout_waited(2.0)  # of the 10 s cycle, 8 s working
    tr.rollout_busy(12.0, ranks=2)  # 12 of 2 x 8 rank-seconds
    tr.step_finished(t=10.0)
    s = tr.signals(ideal_batch=16, tau=1, t=10.0)
    assert s.rollout_capacity_rate == pytest.approx(16 / 8.0)
    assert s.rollout_utilization == pytest.approx(0.75)
    assert s.rollout_rate_with(2, of=2) == pytest.approx(2.0)
    assert s.rollout_rate_with(1, of=2) == pytest.approx(2.0 * 1 / 1.5)  # 1.5 ranks' work on one
    tr.step_started(t=10.0)
    tr.step_finished(t=20.0)  # nothing reported for this cycle: unknown, not the last value
    assert tr.signals(ideal_batch=16, tau=1, t=20.0).rollout_utilization is None


def test_cumulative_rollout_clocks_report_what_they_gained_since_the_mark():
    clock, tr = _tracker()
    tr.rollout_started(t=0.0)
    tr.rollout_clocks({"a": 100.0, "b": 50.0}, idle_rank_s=30.0, report=False)  # clocks kept since start-up
    tr.step_started(t=0.0)
    tr.micro_batch_ready("m", 8, t=4.0)
    tr.micro_batch_consumed("m", t=4.0)
    # a: 6 s busy; b: 2 s; c: a relaunched rank under a new address, 4 s since it came up; idle +6 over 3 ranks
    tr.rollout_clocks({"a": 106.0, "b": 52.0, "c": 4.0}, idle_rank_s=36.0)
    tr.step_finished(t=10.0)
    s = tr.signals(ideal_batch=8, tau=1, t=10.0)
    assert s.rollout_wait_s == pytest.approx(2.0)  # 6 idle rank-seconds, per rank
    assert s.rollout_utilization == pytest.approx(12.0 / (3 * 8.0))  # working time 10 - 2 s RWT
    tr.rollout_clocks({"a": 110.0, "b": 52.0, "c": 4.0}, idle_rank_s=40.0, report=False)  # the sync: left out
    tr.step_started(t=11.0)
    tr.rollout_clocks({"a": 111.0, "b": 53.0, "c": 5.0}, idle_rank_s=43.0)
    tr.step_finished(t=14.0)
    assert tr.signals(ideal_batch=8, tau=1, t=14.0).rollout_wait_s == pytest.approx(1.0)
    with pytest.raises(ValueError, match="idle_rank_s = -1"):
        tr.rollout_clocks({"a": 1.0}, idle_rank_s=-1.0)


def test_kv_bound_share_decode_context_and_cycle_from_the_router_clocks():
    clock, tr = _tracker()
    tr.rollout_started(t=0.0)
    tr.rollout_clocks({"a": 0.0, "b": 0.0}, report=False, kv_wait_s=50.0, generating_token_s=1e6)  # since start-up
    tr.step_started(t=0.0)
    tr.micro_batch_ready("m", 8, t=4.0)
    tr.micro_batch_consumed("m", t=4.0)
    tr.rollout_waited(2.0)  # of the 10 s cycle, 8 s working
    # 4 s of it with work waiting for KV; 2 ranks decoding 1,000 tokens of context each on average
    tr.rollout_clocks({"a": 8.0, "b": 8.0}, kv_wait_s=54.0, generating_token_s=1e6 + 2 * 1000 * 8.0)
    tr.step_finished(t=10.0)
    s = tr.signals(ideal_batch=8, tau=1, t=10.0)
    assert s.rollout_kv_bound == pytest.approx(0.5)
    assert s.rollout_decode_context == pytest.approx(1000.0)
    assert s.cycle_s == pytest.approx(10.0)
    tr.step_started(t=10.0)
    tr.rollout_clocks({"a": 9.0, "b": 9.0})  # without them: unknown, never the last cycle's
    tr.step_finished(t=16.0)
    s = tr.signals(ideal_batch=8, tau=1, t=16.0)
    assert s.rollout_kv_bound is None and s.rollout_decode_context is None and s.cycle_s == pytest.approx(6.0)
    with pytest.raises(ValueError, match="kv_wait_s = -1"):
        tr.rollout_clocks({"a": 1.0}, kv_wait_s=-1.0, generating_token_s=0.0)


def test_the_kv_held_at_once_is_the_cycle_s_peak_over_every_read():
    """The router's peak since each read; a read that only marks (the sync's pause) counts too: the tasks hold
    their KV through it. Not reported: unknown, never the last cycle's."""
    clock, tr = _tracker()
    tr.rollout_started(t=0.0)
    tr.step_started(t=0.0)
    tr.rollout_clocks({"a": 0.0}, report=False, kv_held_peak=3.5)
    tr.micro_batch_ready("m", 8, t=4.0)
    tr.micro_batch_consumed("m", t=4.0)
    tr.rollout_clocks({"a": 8.0}, kv_held_peak=2.0)
    tr.step_finished(t=10.0)
    s = tr.signals(ideal_batch=8, tau=1, t=10.0)
    assert s.rollout_kv_held_peak == pytest.approx(3.5)
    assert s.kv_fits(4) and not s.kv_fits(3)
    assert dataclasses.replace(s, rollout_kv_bound=0.5).kv_fits(1)  # it waited for KV anyway: proportional
    tr.step_started(t=10.0)
    tr.rollout_clocks({"a": 9.0})
    tr.step_finished(t=16.0)
    s = tr.signals(ideal_batch=8, tau=1, t=16.0)
    assert s.rollout_kv_held_peak is None and s.kv_fits(1)
    with pytest.raises(ValueError, match="kv_held_peak = -1"):
        tr.rollout_clocks({"a": 1.0}, kv_held_peak=-1.0)


def test_the_first_cycle_counts_from_the_first_prompts_when_told():
    def first_rate(started):
        clock, tr = _tracker()
        if started is not None:
            tr.rollout_started(t=started)
        tr.step_started(t=9.0)
        tr.micro_batch_ready("a", 8, t=9.0)  # the whole first batch arrives at once, generated since t=1
        tr.micro_batch_consumed("a", t=9.0)
        tr.step_finished(t=10.0)
        return tr.signals(ideal_batch=8, tau=1, t=10.0).rollout_capacity_rate

    assert first_rate(None) == pytest.approx(8 / 1.0)  # from the first arrival: 8 seq/s
    assert first_rate(1.0) == pytest.approx(8 / 9.0)  # from the first prompts: what rollout made


def test_misuse_is_reported():
    clock, tr = _tracker()
    tr.micro_batch_ready("a", 1, t=0)
    with pytest.raises(ValueError, match="already in the buffer"):
        tr.micro_batch_ready("a", 1, t=0)
    with pytest.raises(RuntimeError, match="before step_started"):
        tr.micro_batch_consumed("a")
    tr.step_started(t=0)
    tr.micro_batch_consumed("a")
    with pytest.raises(KeyError, match="consumed twice"):
        tr.micro_batch_consumed("a")
    with pytest.raises(ValueError, match="sequences = 0"):
        tr.micro_batch_ready("b", 0)
    with pytest.raises(ValueError, match="smoothing"):
        ReadinessTracker(clock=clock, smoothing=0)


def test_groups_train_when_their_mini_batch_is_complete():
    # 5 groups, mini-batches of 2 in ready order: (-1, 2) complete at 2, (3, 7) at 7, the last (partial) at 9
    assert mini_batch_ready_times([7.0, -1.0, 2.0, 9.0, 3.0], 2) == [2.0, 2.0, 7.0, 7.0, 9.0]
    assert mini_batch_ready_times([3.0, 1.0], 1) == [1.0, 3.0]
    assert mini_batch_ready_times([], 4) == []
    with pytest.raises(ValueError, match="per_mini_batch = 0"):
        mini_batch_ready_times([1.0], 0)

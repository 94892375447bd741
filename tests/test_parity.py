"""The learning-parity benchmark's arithmetic (verl_tide/testing/parity.py), on hand-made runs."""

from __future__ import annotations

import pytest

from verl_tide.testing.parity import moving_average, parity, time_to_reward


def _run(rewards: list[float], seconds_per_step: float) -> dict:
    return {"steps": {n + 1: {"reward": r, "wall_s": (n + 1) * seconds_per_step} for n, r in enumerate(rewards)}}


def test_moving_average_is_trailing_and_rejects_a_bad_window():
    assert moving_average([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    with pytest.raises(ValueError, match="window = 0"):
        moving_average([1.0], 0)


def test_time_to_reward_reads_the_moving_average_not_one_lucky_step():
    run = _run([0.0, 1.0, 0.0, 0.6, 0.6, 0.6], seconds_per_step=10.0)
    assert time_to_reward(run, 0.55, window=1) == 20.0  # the lucky step 2
    assert time_to_reward(run, 0.55, window=3) == 60.0  # trailing means 0, .5, .33, .53, .4, .6
    assert time_to_reward(run, 0.9, window=3) is None


def test_same_learning_twice_as_fast_is_parity_at_half_the_wall_clock():
    sync = [_run([0.1 * n for n in range(10)], 4.0), _run([0.1 * n + 0.02 for n in range(10)], 4.0),
            _run([0.1 * n - 0.02 for n in range(10)], 4.0)]
    tide = [_run([0.1 * n + 0.01 for n in range(10)], 2.0), _run([0.1 * n - 0.01 for n in range(10)], 2.0),
            _run([0.1 * n for n in range(10)], 2.0)]
    out = parity({"verl sync": sync, "tide": tide}, "verl sync", last=3, window=1, target_share=0.5)
    s, t = out["systems"]["verl sync"], out["systems"]["tide"]
    assert t["final_within_seed_noise"] and t["steps_within_seed_noise"] == t["steps_compared"] == 10
    assert t["time_to_target_s_median"] == pytest.approx(s["time_to_target_s_median"] / 2)
    assert out["target_reward"] == pytest.approx(0.5 * 0.8)  # half-way from 0 to sync's final mean (0.8)


def test_a_system_that_learns_less_is_out_of_seed_noise_and_never_reaches_the_target():
    sync = [_run([0.1 * n + d for n in range(10)], 4.0) for d in (0.0, 0.01, -0.01)]
    worse = [_run([0.02 * n + d for n in range(10)], 2.0) for d in (0.0, 0.01, -0.01)]
    out = parity({"verl sync": sync, "worse": worse}, "verl sync", last=3, window=1)
    w = out["systems"]["worse"]
    assert not w["final_within_seed_noise"] and w["final_difference_from_reference"] < -0.5
    assert w["steps_within_seed_noise"] < w["steps_compared"]
    assert w["time_to_target_s_median"] is None and w["time_to_target_s_by_seed"] == [None] * 3


def test_parity_names_a_missing_reference():
    with pytest.raises(ValueError, match="reference system 'verl sync' has no run"):
        parity({"tide": [_run([0.1], 1.0)]}, "verl sync")


def test_equivalence_needs_the_whole_interval_inside_the_margin_not_just_noise():
    """Two systems that end level are equivalent when the seeds agree; when the seeds scatter, the same mean
    difference is within seed noise yet not equivalent: noise cannot stand in for parity."""
    ref = [_run([0.1 * n + d for n in range(10)], 4.0) for d in (0.0, 0.01, -0.01)]
    tight = [_run([0.1 * n + d for n in range(10)], 2.0) for d in (0.005, -0.005, 0.0)]
    loose = [_run([0.1 * n + d for n in range(10)], 2.0) for d in (0.4, -0.4, 0.0)]
    out = parity({"verl sync": ref, "tight": tight, "loose": loose}, "verl sync", last=3, window=1,
                 margin_share=0.25)
    assert out["equivalence_margin"] == pytest.approx(0.25 * 0.8)  # a quarter of sync's gain 0 -> 0.8
    t, lo = out["systems"]["tight"], out["systems"]["loose"]
    assert t["final_equivalent"] and t["final_within_seed_noise"]
    assert lo["final_within_seed_noise"] and not lo["final_equivalent"], lo["final_difference_interval"]
    low, high = lo["final_difference_interval"]
    assert low < -0.2 < 0.2 < high

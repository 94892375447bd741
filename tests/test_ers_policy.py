"""ERS's scaling policy (pure): directions, limits, confirmation, cooldown, elastic batch."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_tide.core.config import ERSConfig
from verl_tide.core.readiness import ReadinessSignals
from verl_tide.ers.policy import ERSPolicy, Phase, Role
from verl_tide.ra2p.cost import RA2PMode


def signals(gen: bool = False, cons: bool = False, ready: int = 8) -> ReadinessSignals:
    return ReadinessSignals(ready_at_start=2, time_per_ready_microbatch=1.0, tprm_smoothed=1.0, hol_latency=3.0,
                            ready_volume=ready, mean_step_time=10.0, generation_deficit=gen,
                            consumption_deficit=cons, rollout_wait_s=0.0, trainer_wait_s=0.0)


def roles(n_rollout: int, n_ref: int) -> dict[int, Role]:
    return {i: Role.ROLLOUT if i < n_rollout else Role.REF for i in range(n_rollout + n_ref)}


def apply(r: dict[int, Role], plan) -> dict[int, Role]:
    r = dict(r)
    for m in plan.moves:
        assert r[m.rank] is m.src
        r[m.rank] = m.dst
    return r


def fixed(needed, saving=None):
    """An outlook that gives the same answer for any reach (RA2P's cost model is tested in test_ra2p_cost.py)."""
    return lambda reach: (needed, saving)


def policy(**cfg) -> ERSPolicy:
    return ERSPolicy(config=dataclasses.replace(ERSConfig(), **cfg), ideal_batch=16)


def test_consumption_deficit_moves_a_rollout_rank_to_ref_after_confirmation():
    p = policy()
    first = p.plan(1, signals(cons=True), roles(4, 0))
    assert first.moves == () and "confirmation (1/2)" in first.reason
    second = p.plan(2, signals(cons=True), roles(4, 0))
    assert [(m.rank, m.src, m.dst) for m in second.moves] == [(3, Role.ROLLOUT, Role.REF)]
    assert second.ra2p_mode is RA2PMode.DECOUPLED
    assert second.retain_ready_data
    assert "consumption deficit" in second.reason


def test_generation_deficit_returns_a_ref_rank_to_rollout():
    p = policy()
    r = roles(3, 1)
    p.plan(1, signals(gen=True, ready=2), r)
    plan = p.plan(2, signals(gen=True, ready=2), r)
    assert [(m.rank, m.dst) for m in plan.moves] == [(3, Role.ROLLOUT)]
    assert plan.ra2p_mode is RA2PMode.COLOCATED and not plan.retain_ready_data


def test_limits_min_rollout_max_ref_and_moves_per_step():
    p = policy(max_moves_per_step=3, min_rollout_ranks=2, max_ref_ranks=1, cooldown_steps=0)
    p.plan(1, signals(cons=True), roles(4, 0))
    plan = p.plan(2, signals(cons=True), roles(4, 0))
    assert len(plan.moves) == 1  # max_ref_ranks=1 caps it below max_moves_per_step=3
    p2 = policy(max_moves_per_step=3, min_rollout_ranks=2)
    p2.plan(1, signals(cons=True), roles(3, 0))
    assert len(p2.plan(2, signals(cons=True), roles(3, 0)).moves) == 1  # keeps 2 rollout ranks
    p3 = policy(min_rollout_ranks=1)
    p3.plan(1, signals(cons=True), roles(1, 0))
    none = p3.plan(2, signals(cons=True), roles(1, 0))
    assert none.moves == () and "no rollout rank may move" in none.reason


def test_cold_start_and_eval_preemptively_maximize_rollout():
    p = policy(max_moves_per_step=2)
    plan = p.plan(0, signals(), roles(2, 2), phase=Phase.COLD_START)
    assert {m.rank for m in plan.moves} == {2, 3} and all(m.dst is Role.ROLLOUT for m in plan.moves)
    assert plan.ra2p_mode is RA2PMode.COLOCATED and "cold_start" in plan.reason
    assert p.plan(1, signals(), roles(4, 0), phase=Phase.EVAL).moves == ()


def test_ref_ranks_evaluation_borrowed_go_back_when_it_is_over():
    p = policy()
    r = roles(3, 1)
    evaluation = p.plan(10, signals(), r, phase=Phase.EVAL)
    assert [(m.rank, m.dst) for m in evaluation.moves] == [(3, Role.ROLLOUT)]
    r = apply(r, evaluation)
    # No confirmation and no capacity check (the split before was ERS's), but the cooldown holds: rank 3 came
    # from Ref this step, so another rollout rank goes.
    back = p.plan(11, signals(), r)
    assert [(m.rank, m.src, m.dst) for m in back.moves] == [(2, Role.ROLLOUT, Role.REF)]
    assert "evaluation over" in back.reason
    p.cancel(back)  # not carried out (no rank could host Ref): still owed
    back = p.plan(12, signals(), r)
    assert [m.rank for m in back.moves] == [2] and "evaluation over" in back.reason
    r = apply(r, back)
    assert p.plan(13, signals(), r).moves == ()  # the debt is paid
    # A generation deficit after the evaluation cancels it: the split has to be earned again.
    p2 = policy()
    r2 = apply(roles(3, 1), p2.plan(10, signals(), roles(3, 1), phase=Phase.EVAL))
    assert p2.plan(11, signals(gen=True, ready=2), r2).moves == ()
    assert p2.plan(12, signals(), r2).moves == ()


def test_balanced_or_both_deficits_hold():
    p = policy()
    for s in (signals(), signals(gen=True, cons=True)):
        assert p.plan(1, s, roles(2, 1)).moves == ()
        assert p.plan(2, s, roles(2, 1)).moves == ()


def test_disabled_never_moves():
    p = policy(enabled=False)
    for step in range(5):
        assert p.plan(step, signals(cons=True), roles(4, 0)).moves == ()


def test_alternating_signals_never_move_anything():
    p = policy()
    r = roles(3, 1)
    for step in range(40):
        plan = p.plan(step, signals(cons=step % 2 == 0, gen=step % 2 == 1, ready=4), r)
        assert plan.moves == ()


def test_elastic_batch_within_bounds():
    p = ERSPolicy(config=dataclasses.replace(ERSConfig(), min_batch=4), ideal_batch=16)
    assert [p.elastic_batch(v) for v in (0, 3, 4, 9, 16, 50)] == [4, 4, 4, 9, 16, 16]
    assert ERSPolicy(config=ERSConfig(), ideal_batch=16).min_batch == 16  # null B_min = B_ideal


@settings(max_examples=200, deadline=None)
@given(
    seq=st.lists(st.tuples(st.booleans(), st.booleans(), st.sampled_from(list(Phase))), min_size=1, max_size=60),
    cooldown=st.integers(0, 5),
    max_moves=st.integers(0, 3),
    confirm=st.integers(1, 3),
)
def test_invariants_under_arbitrary_signal_sequences(seq, cooldown, max_moves, confirm):
    cfg = dataclasses.replace(ERSConfig(), cooldown_steps=cooldown, max_moves_per_step=max_moves,
                              min_rollout_ranks=2, max_ref_ranks=3)
    p = ERSPolicy(config=cfg, ideal_batch=16, confirm_steps=confirm)
    r = roles(5, 1)
    history: dict[int, list[tuple[int, Role, Role]]] = {}
    for step, (gen, cons, phase) in enumerate(seq):
        plan = p.plan(step, signals(gen=gen, cons=cons), r, phase=phase)
        assert len(plan.moves) <= max_moves
        assert len({m.rank for m in plan.moves}) == len(plan.moves)
        assert plan.reason
        r = apply(r, plan)
        assert sum(x is Role.ROLLOUT for x in r.values()) >= 2
        assert sum(x is Role.REF for x in r.values()) <= 3
        for m in plan.moves:
            for prev_step, src, dst in history.get(m.rank, []):
                if m.dst is src and m.src is dst:  # moving back
                    assert step - prev_step >= cooldown, (m, prev_step, step)
            history.setdefault(m.rank, []).append((step, m.src, m.dst))


def test_bad_arguments():
    with pytest.raises(ValueError, match="ideal_batch"):
        ERSPolicy(config=ERSConfig(), ideal_batch=0)
    with pytest.raises(ValueError, match="confirm_steps"):
        ERSPolicy(config=ERSConfig(), ideal_batch=1, confirm_steps=0)


def test_no_rank_leaves_rollout_if_the_rest_could_not_feed_the_trainer():
    """A backlog says the trainer was behind, not that rollout can spare a rank (found in the simulator:
    ERS drained the backlog into Ref ranks, then starved the trainer)."""
    def cons(rate):  # trainer consumes ideal_batch 16 per 10 s step = 1.6 seq/s
        return dataclasses.replace(signals(cons=True), rollout_capacity_rate=rate)

    p = policy(cooldown_steps=0)
    p.plan(1, cons(2.0), roles(4, 0))
    starve = p.plan(2, cons(2.0), roles(4, 0))  # 3 of 4 ranks make 1.5 seq/s < 1.6
    assert starve.moves == () and "would make 1.50 seq/s, below the 1.60 seq/s" in starve.reason
    p.plan(3, cons(4.0), roles(4, 0))
    far = p.plan(4, cons(4.0), roles(4, 0), ref_outlook=fixed(3))  # can spare 2 (4 -> 2 ranks make 2.0 seq/s)
    assert far.moves == () and "Ref ranks pay from 3, rollout can spare 2" in far.reason
    p.plan(5, cons(4.0), roles(4, 0), ref_outlook=fixed(2))
    ok = p.plan(6, cons(4.0), roles(4, 0), ref_outlook=fixed(2))
    assert [(m.rank, m.dst) for m in ok.moves] == [(3, Role.REF)]


def test_a_rollout_busy_only_part_of_its_working_time_can_spare_the_rank_its_rate_alone_could_not():
    def cons(busy):  # 4 ranks made 2.0 seq/s; the trainer consumes 1.6 seq/s
        return dataclasses.replace(signals(cons=True), rollout_capacity_rate=2.0, rollout_utilization=busy)

    p = policy(cooldown_steps=0)
    p.plan(1, cons(1.0), roles(4, 0))
    saturated = p.plan(2, cons(1.0), roles(4, 0))  # busy all the time: 3 ranks make 1.5 seq/s
    assert saturated.moves == () and "would make 1.50 seq/s" in saturated.reason and "busy 100%" in saturated.reason
    p.plan(3, cons(0.7), roles(4, 0))
    idle = p.plan(4, cons(0.7), roles(4, 0))  # busy 70%: the same work fits on 3 ranks (75%), the same 2.0 seq/s
    assert [(m.rank, m.dst) for m in idle.moves] == [(3, Role.REF)]
    p.plan(5, cons(0.9), roles(3, 1))
    busier = p.plan(6, cons(0.9), roles(3, 1))  # 3 ranks busy 90% = 2.7 ranks' work: 2 make 2.0 x 2 / 2.7
    assert busier.moves == () and "would make 1.48 seq/s, below the 1.60 seq/s" in busier.reason


def test_no_rank_moves_to_ref_when_the_cost_model_predicts_too_small_a_saving():
    p = policy(cooldown_steps=0, min_ref_gain=0.05)
    p.plan(1, signals(cons=True), roles(4, 0), ref_outlook=fixed(1, 0.04))
    small = p.plan(2, signals(cons=True), roles(4, 0), ref_outlook=fixed(1, 0.04))
    assert small.moves == () and "saves 4.0% of the step, below tide.ers.min_ref_gain 5.0%" in small.reason
    p.plan(3, signals(cons=True), roles(4, 0), ref_outlook=fixed(1, 0.06))
    enough = p.plan(4, signals(cons=True), roles(4, 0), ref_outlook=fixed(1, 0.06))
    assert [(m.rank, m.dst) for m in enough.moves] == [(3, Role.REF)]


def test_no_rank_moves_to_ref_when_no_ref_rank_count_pays():
    """A consumption deficit, but RA2P's cost model has no count of Ref ranks within what rollout can spare that
    beats colocated: ERS keeps the rollout rank (a backlog alone does not make a Ref rank pay). The cost model is
    asked only then, and only up to what rollout can spare."""
    from verl_tide.ra2p.cost import StageTimes, ref_rank_outlook

    col = StageTimes(1.0, 1.0, 2.0, 0.5)
    asked: list[int] = []

    def outlook(reach):  # Ref ranks far slower than the Actor's own: no share of a Ref pass on them pays
        asked.append(reach)
        return ref_rank_outlook([0.0] * 8, lambda k: StageTimes(4000.0 / k, 1.0, 2.0, 0.5), col, 8, have=0,
                                max_ref_ranks=reach, split=True)

    p = policy(cooldown_steps=0)
    p.plan(1, signals(), roles(4, 0), ref_outlook=outlook)  # balanced: no move on the table
    p.plan(2, signals(cons=True), roles(4, 0), ref_outlook=outlook)  # waiting for confirmation
    assert asked == []
    kept = p.plan(3, signals(cons=True), roles(4, 0), ref_outlook=outlook)
    assert kept.moves == () and "no count of Ref ranks up to 4 beats colocated" in kept.reason, kept.reason
    assert asked == [4]  # rollout capacity unknown here: every rank
    spare_two = dataclasses.replace(signals(cons=True), rollout_capacity_rate=4.0)  # 2 of 4 ranks make 2.0 seq/s
    p.plan(4, spare_two, roles(4, 0), ref_outlook=outlook)
    capped = p.plan(5, spare_two, roles(4, 0), ref_outlook=outlook)
    assert capped.moves == () and "up to 2 beats colocated (rollout can spare 2" in capped.reason, capped.reason
    assert asked[-1] == 2
    # unknown (no cost model yet): the deficit alone decides
    p.plan(6, signals(cons=True), roles(4, 0))
    moved = p.plan(7, signals(cons=True), roles(4, 0))
    assert [(m.rank, m.dst) for m in moved.moves] == [(3, Role.REF)]


def test_min_ref_ranks_is_a_floor_while_training_that_evaluation_borrows_back():
    p = policy(min_ref_ranks=1, cooldown_steps=0)
    first = p.plan(1, signals(), roles(3, 0))  # balanced signals: only the floor moves a rank
    assert [(m.rank, m.dst) for m in first.moves] == [(2, Role.REF)]
    assert "tide.ers.min_ref_ranks 1" in first.reason and first.ra2p_mode is RA2PMode.DECOUPLED
    r = apply(roles(3, 0), first)
    # a generation deficit does not take the floor's rank back ...
    for step in (2, 3):
        held = p.plan(step, signals(gen=True, ready=2), r)
        assert held.moves == (), held.reason
    # ... evaluation does (preemptive rollout allocation), and the floor takes it again after
    evaluation = p.plan(4, signals(), r, phase=Phase.EVAL)
    assert [(m.rank, m.dst) for m in evaluation.moves] == [(2, Role.ROLLOUT)]
    r = apply(r, evaluation)
    again = p.plan(5, signals(), r)
    assert [(m.rank, m.dst) for m in again.moves] == [(2, Role.REF)]


def test_min_ref_ranks_respects_min_rollout_ranks_and_cooldown():
    p = policy(min_ref_ranks=2, min_rollout_ranks=2, max_moves_per_step=3, cooldown_steps=5)
    plan = p.plan(1, signals(), roles(3, 0))
    assert len(plan.moves) == 1  # 3 rollout ranks, 2 must stay
    r = apply(roles(3, 0), plan)
    back = p.plan(2, signals(), r, phase=Phase.EVAL)
    assert back.moves == ()  # the rank moved at step 1 may not move back before step 6
    assert p.plan(6, signals(), r, phase=Phase.EVAL).moves


def test_no_rank_moves_to_ref_without_ref_work():
    """Without a Ref model (or a Ref pool that takes replicas) a Ref rank would idle: neither a consumption
    deficit nor min_ref_ranks moves one."""
    p = policy(min_ref_ranks=1)
    for step in (1, 2, 3):
        plan = p.plan(step, signals(cons=True), roles(4, 0), elastic_ref=False)
        assert plan.moves == ()
    assert "no Ref work" in plan.reason


def test_ref_floor_keeps_the_last_ref_rank_when_ref_has_no_ranks_of_its_own():
    """tide.ra2p.ref_ranks = 0: Ref runs on elastic ranks only, so neither evaluation nor a generation
    deficit takes the last one back."""
    p = policy(cooldown_steps=0)
    r = roles(2, 2)
    evaluation = p.plan(1, signals(), r, phase=Phase.EVAL, ref_floor=1)
    assert len(evaluation.moves) == 1
    r = apply(r, evaluation)
    assert p.plan(2, signals(), r, phase=Phase.EVAL, ref_floor=1).moves == ()
    for step in (3, 4, 5):
        assert p.plan(step, signals(gen=True, ready=2), r, ref_floor=1).moves == ()
    assert p.plan(6, signals(), r, phase=Phase.EVAL, ref_floor=0).moves  # with Ref ranks of its own it may go


def test_the_elastic_batch_trains_whole_mini_batches_within_the_window():
    from verl_tide.ers.policy import ERSPolicy

    assert ERSPolicy.mini_batches(4, per_mini_batch=4, most=2) == 1
    assert ERSPolicy.mini_batches(5, per_mini_batch=4, most=2) == 2  # rounded up: at least the batch trains
    assert ERSPolicy.mini_batches(64, per_mini_batch=4, most=2) == 2  # never past verl's sync window
    assert ERSPolicy.mini_batches(0, per_mini_batch=4, most=2) == 1
    with pytest.raises(ValueError, match="per_mini_batch = 0"):
        ERSPolicy.mini_batches(4, per_mini_batch=0, most=2)

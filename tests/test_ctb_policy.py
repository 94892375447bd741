"""CTB's policy (pure): Algorithm 1 by hand, and its invariants under arbitrary event sequences."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from verl_tide.core.config import CTBConfig
from verl_tide.ctb.policy import CTBScheduler, Outcome, TaskState


def sched(capacity: dict, **cfg) -> CTBScheduler:
    return CTBScheduler(dataclasses.replace(CTBConfig(), **{"kv_headroom": 1.0, **cfg}), capacity)


def test_budget_is_capacity_times_headroom():
    s = CTBScheduler(dataclasses.replace(CTBConfig(), kv_headroom=0.75), {0: 1000})
    assert s.ranks[0].budget == 750


def test_probe_admits_one_task_per_group_until_its_first_turn():
    s = sched({0: 1000})
    for i in range(4):
        s.add_task(i, group_id="g", prompt_tokens=50, group_size=4)
    assert [d.task_id for d in s.tick().admissions] == [0]
    assert s.tick().admissions == []  # the probe has not reported yet
    s.turn_started(0, 120)
    out = s.tick()
    assert [d.task_id for d in out.admissions] == [1, 2, 3]
    # The others are charged the probed footprint; the shared 50-token prompt is charged once.
    assert s.ranks[0].usage == 50 + 4 * (120 - 50)


def test_state_survives_a_checkpoint_and_reissued_groups_skip_the_probe():
    s = sched({0: 1000})
    for i in range(2):
        s.add_task(i, group_id="g", prompt_tokens=50, group_size=2)
    s.tick()
    s.turn_started(0, 120)
    s.tick()
    s.task_finished(0)
    state = s.state_dict()
    assert state["counters"]["admissions"] == 2 and state["group_probe"] == {"g": 120}

    fresh = sched({"new-rank": 1000})  # after a resume: fresh engines, same groups re-issued by verl
    fresh.load_state_dict(state)
    assert fresh.counters["admissions"] == 2 and fresh.counters["consumed"] == 1
    for i in range(2):
        fresh.add_task(("again", i), group_id="g", prompt_tokens=50, group_size=2)
    assert len(fresh.tick().admissions) == 2  # the probe is known: no one-task probe first
    with pytest.raises(ValueError, match="unknown counter 'admisions'"):
        fresh.load_state_dict({"counters": {"admisions": 1}})


def test_pause_lowest_priority_when_over_budget_and_resume_with_affinity():
    s = sched({0: 300}, probe_first_turn=False)
    s.add_task("eval", group_id="e", prompt_tokens=100, is_eval=True)
    s.add_task("a", group_id="g", prompt_tokens=100, group_size=2)
    assert len(s.tick().admissions) == 2
    s.turn_started("a", 160)
    s.turn_started("eval", 150)  # 310 > 300; the eval task is not generating any more than "a"
    out = s.tick()
    assert [d.task_id for d in out.pauses] == ["a"]  # never the eval task
    assert "310 > 300" in out.pauses[0].reason
    assert s.tasks["a"].state is TaskState.PAUSED and s.tasks["a"].rank == 0
    assert s.ranks[0].usage == 150
    s.task_finished("eval")
    out = s.tick()
    assert [(d.task_id, d.rank) for d in out.resumes] == [("a", 0)]
    assert "prefix" in out.resumes[0].reason
    assert s.ranks[0].usage == 160


def test_resume_falls_back_when_affinity_rank_has_no_headroom():
    s = sched({0: 300}, probe_first_turn=False)
    s.add_task("x", group_id="x", prompt_tokens=150)
    s.add_task("y", group_id="y", prompt_tokens=100)
    assert len(s.tick().admissions) == 2
    s.add_rank(1, 500)
    s.turn_started("x", 260)  # 360 > 300 on rank 0
    out = s.tick()
    assert [d.task_id for d in out.pauses] == ["y"]  # "x" is generating: higher priority
    assert [(d.task_id, d.rank) for d in out.resumes] == [("y", 1)]
    assert "affinity rank has no headroom" in out.resumes[0].reason


def test_an_active_budget_charges_turns_in_flight_or_due_not_tasks_waiting_on_their_environment():
    s = sched({0: 300}, probe_first_turn=False, budget_scope="active")
    s.add_task("a", group_id="a", prompt_tokens=100)
    s.tick()
    s.turn_started("a", 200)
    s.add_task("b", group_id="b", prompt_tokens=150)
    assert s.tick().admissions == [] and s.waiting_for_kv  # a's turn in flight holds 200 of 300
    s.turn_finished("a")  # a waits on its environment: its KV is evictable cache, its place on the rank kept
    out = s.tick()
    assert [(d.task_id, d.rank) for d in out.admissions] == [("b", 0)]
    r = s.ranks[0]
    assert (r.usage, r.active_usage) == (350, 150) and s.tasks["a"].state is TaskState.RESIDENT
    s.turn_started("b", 150)
    s.turn_finished("b")
    s.turn_started("a", 260)  # a returns: 260 + b's nothing in flight fits
    assert s.tick().pauses == [] and s.ranks[0].active_usage == 260
    s.turn_started("b", 180)  # 260 + 180 > 300: the lower-priority of the two turns waits, never a waiting task
    out = s.tick()
    assert [d.task_id for d in out.pauses] == ["b"] and "440 > 300" in out.pauses[0].reason
    s.turn_finished("a")
    assert [(d.task_id, d.rank) for d in s.tick().resumes] == [("b", 0)]  # affinity: its prefix may be there
    # the default, resident: a's whole context stays charged while it waits, and b waits for it
    strict = sched({0: 300}, probe_first_turn=False)
    assert strict.config.budget_scope == "resident"
    strict.add_task("a", group_id="a", prompt_tokens=100)
    strict.tick()
    strict.turn_started("a", 200)
    strict.turn_finished("a")
    strict.add_task("b", group_id="b", prompt_tokens=150)
    assert strict.tick().admissions == [] and strict.tasks["b"].state is TaskState.QUEUED


def test_paused_tasks_block_new_admissions():
    s = sched({0: 100}, probe_first_turn=False)
    s.add_task("big", group_id="b", prompt_tokens=60)
    s.add_task("small", group_id="s", prompt_tokens=30)
    s.tick()
    s.turn_started("big", 70)
    s.turn_started("small", 40)  # 110 > 100
    out = s.tick()
    paused = [d.task_id for d in out.pauses]
    assert len(paused) == 1
    s.add_task("new", group_id="n", prompt_tokens=5)
    out = s.tick()
    assert out.admissions == []  # a paused task is waiting


def test_oversize_task_is_dropped_failed_and_counted():
    s = sched({0: 100, 1: 100}, probe_first_turn=False)
    s.add_task("huge", group_id="h", prompt_tokens=150)
    out = s.tick()
    assert [d.task_id for d in out.failed] == ["huge"]
    assert s.tasks["huge"].outcome is Outcome.DROPPED_FAILED
    assert "exceeds the largest rank budget 100" in s.tasks["huge"].reason
    assert s.counters["dropped_failed"] == 1


def test_env_concurrency_and_staleness_throttle():
    s = sched({0: 10_000}, probe_first_turn=False, env_concurrency=2)
    for i in range(5):
        s.add_task(i, group_id=i, prompt_tokens=10)
    assert len(s.tick().admissions) == 2
    s2 = sched({0: 10_000}, probe_first_turn=False)
    for i in range(5):
        s2.add_task(i, group_id=i, prompt_tokens=10)
    s2.set_admission_allowance(3)
    assert len(s2.tick().admissions) == 3
    assert s2.tick().admissions == []
    s2.set_admission_allowance(None)
    assert len(s2.tick().admissions) == 2


def test_a_groups_shared_prompt_is_charged_once_per_rank():
    s = sched({0: 1000}, probe_first_turn=False)
    for i in range(3):
        s.add_task(i, group_id="g", prompt_tokens=600, group_size=3)
    # Three 600-token contexts would not fit 1000 tokens, but they share one cached prompt.
    assert len(s.tick().admissions) == 3 and s.ranks[0].usage == 600
    for i in range(3):
        s.turn_started(i, 800)  # each adds 200 own tokens: 600 + 3 x 200 = 1200 > 1000
    out = s.tick()
    assert [d.task_id for d in out.pauses] == [2] and s.ranks[0].usage == 1000  # tie: the latest arrival
    s.task_finished(0)
    s.task_finished(1)
    out = s.tick()
    assert [d.task_id for d in out.resumes] == [2] and s.ranks[0].usage == 800
    s.task_finished(2)
    assert s.ranks[0].usage == 0 and not s.ranks[0].group_residents


def test_diversity_penalty_spreads_task_types():
    s = sched({0: 1000, 1: 1000}, probe_first_turn=False, diversity_penalty=1.0)
    for i in range(4):
        s.add_task(i, group_id=i, prompt_tokens=10, task_type="webshop")
    ranks = [d.rank for d in s.tick().admissions]
    assert sorted(ranks) == [0, 0, 1, 1]


def test_removed_rank_hands_its_tasks_back_without_loss():
    s = sched({0: 1000, 1: 1000}, probe_first_turn=False)
    for i in range(4):
        s.add_task(i, group_id=i, prompt_tokens=100)
    s.tick()
    on0 = {t.task_id for t in s.tasks.values() if t.rank == 0}
    moved = s.remove_rank(0)
    assert set(moved) == on0
    assert all(s.tasks[t].state is TaskState.PAUSED and s.tasks[t].rank is None for t in moved)
    out = s.tick()
    assert {d.task_id for d in out.resumes} == on0 and all(d.rank == 1 for d in out.resumes)


def test_priority_defaults_keep_table_1_order():
    s = sched({0: 10_000})
    s.add_task("eval", group_id="e", prompt_tokens=90_000, is_eval=True)
    s.add_task("near_done", group_id="g", prompt_tokens=10, group_size=2)
    s.add_task("g2", group_id="g", prompt_tokens=10, group_size=2)
    s.add_task("long", group_id="l", prompt_tokens=90_000)
    s.task_finished("g2")
    p = {t: s.priority(s.tasks[t]) for t in ("eval", "near_done", "long")}
    assert p["eval"] > p["near_done"] > p["long"]


def test_misuse_is_reported():
    s = sched({0: 100})
    s.add_task("a", group_id="a", prompt_tokens=10)
    with pytest.raises(ValueError, match="already added"):
        s.add_task("a", group_id="a", prompt_tokens=10)
    with pytest.raises(ValueError, match="only a resident task"):
        s.turn_started("a", 10)
    with pytest.raises(KeyError, match="unknown"):
        s.turn_finished("nope")
    s.task_finished("a", Outcome.DROPPED_STALE)
    with pytest.raises(ValueError, match="already finished"):
        s.task_finished("a")


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 7), st.integers(10, 300), st.booleans()),
        st.tuples(st.just("turn"), st.integers(0, 60), st.integers(1, 150)),
        st.tuples(st.just("end_turn"), st.integers(0, 60)),
        st.tuples(st.just("finish"), st.integers(0, 60), st.sampled_from(list(Outcome))),
        st.tuples(st.just("tick"),),
        st.tuples(st.just("remove_rank"), st.integers(0, 3)),
        st.tuples(st.just("add_rank"), st.integers(0, 3), st.integers(200, 1000)),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(ops=ops, probe=st.booleans(), scope=st.sampled_from(["resident", "active"]))
def test_invariants_under_arbitrary_event_sequences(ops, probe, scope):
    s = sched({0: 600, 1: 400}, probe_first_turn=probe, diversity_penalty=0.05, budget_scope=scope)
    added = 0
    for op in ops:
        kind = op[0]
        live = [t for t in s.tasks.values() if t.state is not TaskState.DONE]
        if kind == "add":
            s.add_task(added, group_id=op[1], prompt_tokens=op[2], group_size=4, is_eval=op[3] and op[1] == 0)
            added += 1
        elif kind == "turn" and live:
            resident = [t for t in live if t.state is TaskState.RESIDENT]
            if resident:
                t = resident[op[1] % len(resident)]
                s.turn_started(t.task_id, max(t.context_tokens, t.prompt_tokens) + op[2])
        elif kind == "end_turn" and live:
            s.turn_finished(live[op[1] % len(live)].task_id)
        elif kind == "finish" and live:
            s.task_finished(live[op[1] % len(live)].task_id, op[2])
        elif kind == "remove_rank" and op[1] in s.ranks and len(s.ranks) > 1:
            s.remove_rank(op[1])
        elif kind == "add_rank" and op[1] not in s.ranks:
            s.add_rank(op[1], op[2])
        elif kind == "tick":
            out = s.tick()
            # A task paused in this tick may then resume elsewhere or be dropped; nothing else repeats.
            placed = [d.task_id for d in out.resumes + out.admissions + out.failed]
            assert len(placed) == len(set(placed))
            assert len(out.pauses) == len({d.task_id for d in out.pauses})
            assert not {d.task_id for d in out.pauses} & {d.task_id for d in out.admissions}
            for rank_id, rank in s.ranks.items():
                resident = [t for t in s.tasks.values() if t.state is TaskState.RESIDENT and t.rank == rank_id]
                shared = sum(s._group_prompt[g] for g in {t.group_id for t in resident})
                assert rank.usage == sum(t.charged for t in resident) + shared  # accounting
                assert set(rank.group_residents) == {t.group_id for t in resident}
                active = [t for t in resident if t.generating or t.due]
                assert rank.active_usage == sum(t.charged for t in active) + sum(
                    s._group_prompt[g] for g in {t.group_id for t in active})
                assert s.budgets.used(rank) <= rank.budget  # no rank over budget after a tick
            paused_now = [t for t in s.tasks.values() if t.state is TaskState.PAUSED]
            queued = [t for t in s.tasks.values() if t.state is TaskState.QUEUED]
            if paused_now:
                assert s.waiting_for_kv  # paused work waits for budget
            if not paused_now and not queued:
                assert not s.waiting_for_kv
            if s.waiting_for_kv and not paused_now:  # a queued task that no rank can hold now
                free = s.budgets.max_free()
                assert any(s.footprint(t) - s._shared_prompt(t) > free or s.budgets.best_rank(t, s.footprint(t)) is None
                           for t in queued)
            if out.admissions:
                assert not paused_now  # paused tasks resume before new admissions
            for d in out.pauses:
                t = s.tasks[d.task_id]
                if t.state is TaskState.PAUSED:
                    for other in s.tasks.values():
                        if other.state is TaskState.RESIDENT and other.rank == d.rank:
                            assert s.priority(other) >= s.priority(t)  # never paused under a lower one
        # the decode load: the context of every task with a turn in flight, kept by every event
        assert s.generating_tokens == sum(t.context_tokens for t in s.tasks.values() if t.generating)
    # nothing lost or duplicated: every task added is in exactly one state, outcomes counted once
    assert len(s.tasks) == added
    done = [t for t in s.tasks.values() if t.state is TaskState.DONE]
    assert sum(s.counters[o.value] for o in Outcome) == len(done)
    for t in s.tasks.values():
        if t.state is TaskState.RESIDENT:
            assert t.rank in s.ranks

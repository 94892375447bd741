"""CTB's turn gate: concurrent tasks under a tight budget finish, pause only at turn boundaries,
resume, and never push a rank over its budget."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from verl_tide.core.config import CTBConfig
from verl_tide.ctb.gate import TaskFailed, TurnGate
from verl_tide.ctb.policy import CTBScheduler, Outcome


def _gate(capacity, **cfg):
    paused, resumed = [], []

    async def on_pause(t):
        paused.append(t)

    async def on_resume(t):
        resumed.append(t)

    sched = CTBScheduler(dataclasses.replace(CTBConfig(), **{"kv_headroom": 1.0, **cfg}), capacity)
    return TurnGate(sched, on_pause, on_resume), paused, resumed


async def _task(gate, tid, group, turns, rng, log, prompt=100, step=60):
    rank = await gate.admit(tid, group, prompt, group_size=4)
    context = prompt
    for turn in range(turns):
        rank = await gate.before_turn(tid, context)
        log.append(("turn", tid, rank))
        for r in gate.scheduler.ranks.values():
            assert gate.scheduler.budgets.used(r) <= r.budget  # every resident's context, or the turns in flight or due
        await asyncio.sleep(rng.uniform(0, 0.002))  # generating
        gate.after_turn(tid)
        await asyncio.sleep(rng.uniform(0, 0.004))  # environment
        context += step
    gate.finish(tid)
    log.append(("done", tid, rank))


@pytest.mark.parametrize("scope", ["resident", "active"])
async def test_many_tasks_share_a_tight_budget_and_all_finish(scope):
    gate, paused, resumed = _gate({0: 1000, 1: 800}, budget_scope=scope)
    rng, log = random.Random(0), []
    await asyncio.wait_for(asyncio.gather(*(
        _task(gate, i, i // 4, rng.randint(2, 6), rng, log) for i in range(24))), timeout=30)
    assert sorted(t for kind, t, _ in log if kind == "done") == list(range(24))
    assert gate.scheduler.counters["consumed"] == 24
    assert paused and resumed  # the budget forced pauses; paused tasks came back (or ended in their last wait)
    await asyncio.sleep(0)
    assert set(resumed) <= set(paused)


async def test_removing_a_rank_moves_its_tasks_without_loss():
    gate, _, _ = _gate({0: 5000, 1: 5000})
    rng, log = random.Random(1), []
    tasks = [asyncio.create_task(_task(gate, i, i, 8, rng, log)) for i in range(8)]
    await asyncio.sleep(0.01)
    gate.remove_rank(0)
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)
    later = [r for kind, _, r in log[len(log) // 2:] if kind == "turn"]
    assert later and set(later) == {1}
    assert gate.scheduler.counters["consumed"] == 8


async def test_a_task_that_outgrows_every_rank_fails_clearly():
    gate, _, _ = _gate({0: 300})
    await gate.admit("t", "g", 100)
    with pytest.raises(TaskFailed, match="exceeds the largest rank budget"):
        await gate.before_turn("t", 400)
    assert gate.scheduler.tasks["t"].outcome is Outcome.DROPPED_FAILED

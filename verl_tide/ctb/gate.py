"""CTB's turn gate (asyncio mechanism): where a task's turns wait for the policy's decisions.

Every task calls `admit` once, `before_turn` before each generate request (with its real context
length), `after_turn` when the turn's generation is done, and `finish` once. The gate feeds these
events to `CTBScheduler`, runs a tick, and carries out the decisions at turn boundaries: a paused
task's next `before_turn` waits until it is resumed (never an abort of an in-flight request),
and the rank it is given is the one the policy chose (affinity). `on_pause` / `on_resume`
callbacks let the caller pause the task's environment session (`/pause`, `/resume`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Optional

from verl_tide.ctb.policy import CTBScheduler, Outcome, SchedulerOutput, TaskState

Callback = Callable[[Hashable], Awaitable[None]]


class TaskFailed(RuntimeError):
    """The policy dropped the task (e.g. its context exceeds every rank's budget)."""


class TurnGate:
    def __init__(self, scheduler: CTBScheduler, on_pause: Optional[Callback] = None,
                 on_resume: Optional[Callback] = None):
        self.scheduler = scheduler
        self.on_pause, self.on_resume = on_pause, on_resume
        self._runnable: dict[Hashable, asyncio.Event] = {}
        self._callbacks: set[asyncio.Task] = set()

    async def admit(self, task_id: Hashable, group_id: Hashable, prompt_tokens: int, group_size: int = 1,
                    task_type: str = "default", is_eval: bool = False) -> Hashable:
        """Register the task and wait until the policy admits it; returns its rank."""
        self.scheduler.add_task(task_id, group_id, prompt_tokens, group_size=group_size, task_type=task_type,
                                is_eval=is_eval)
        self._runnable[task_id] = asyncio.Event()
        self._tick()
        return await self._wait(task_id)

    async def before_turn(self, task_id: Hashable, context_tokens: int) -> Hashable:
        """Wait while the task is paused; report the turn's context; returns the rank to send it to."""
        await self._wait(task_id)
        while True:
            self.scheduler.turn_started(task_id, context_tokens)
            self._tick()
            if self.scheduler.tasks[task_id].state is TaskState.RESIDENT:
                return self.scheduler.tasks[task_id].rank
            await self._wait(task_id)  # paused by its own growth: wait for a resume, then re-report

    def after_turn(self, task_id: Hashable) -> None:
        self.scheduler.turn_finished(task_id)
        if self.scheduler.config.budget_scope == "active":  # the turn's KV is free now: waiting work may start
            self._tick()  # (a resident budget frees nothing when a turn ends: no tick on every turn)

    def finish(self, task_id: Hashable, outcome: Outcome = Outcome.CONSUMED, reason: str = "") -> None:
        if self.scheduler.tasks[task_id].state is not TaskState.DONE:
            self.scheduler.task_finished(task_id, outcome, reason)
        self._runnable.pop(task_id, None)
        self._tick()

    def set_budget_factor(self, factor: float) -> None:
        """Scale every rank's budget (the step-boundary planner's `ctb/window.py`); what fits now starts, what no
        longer fits pauses at its next turn boundary."""
        self.scheduler.set_budget_factor(factor)
        self._tick()

    def add_rank(self, rank: Hashable, kv_capacity_tokens: int) -> None:
        self.scheduler.add_rank(rank, kv_capacity_tokens)
        self._tick()

    def remove_rank(self, rank: Hashable) -> list[Hashable]:
        """Close a rank; its tasks wait for a resume elsewhere (a fresh prefill there)."""
        moved = self.scheduler.remove_rank(rank)
        for task_id in moved:
            self._runnable[task_id].clear()
        self._tick()
        return moved

    async def _wait(self, task_id: Hashable) -> Hashable:
        event = self._runnable.get(task_id)
        if event is None:
            raise KeyError(f"task {task_id!r} is not admitted or already finished")
        while True:
            await event.wait()
            task = self.scheduler.tasks[task_id]
            if task.state is TaskState.DONE:
                raise TaskFailed(f"task {task_id!r} dropped by CTB: {task.reason}")
            if task.state is TaskState.RESIDENT:
                return task.rank
            # Paused again by a later tick before this coroutine ran: the pause cleared the event.

    def _tick(self) -> SchedulerOutput:
        out = self.scheduler.tick()
        for d in out.pauses:
            self._runnable[d.task_id].clear()
            self._call(self.on_pause, d.task_id)
        for d in out.resumes:
            self._runnable[d.task_id].set()
            self._call(self.on_resume, d.task_id)
        for d in out.admissions:
            self._runnable[d.task_id].set()
        for d in out.failed:
            event = self._runnable.get(d.task_id)
            if event is not None:
                event.set()  # wake it so it sees TaskFailed
        return out

    def _call(self, callback: Optional[Callback], task_id: Hashable) -> None:
        if callback is not None:
            task = asyncio.ensure_future(callback(task_id))
            self._callbacks.add(task)
            task.add_done_callback(self._callbacks.discard)

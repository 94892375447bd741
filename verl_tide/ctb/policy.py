"""CTB's scheduling policy: task-level admission, pausing and resuming on rollout ranks (paper Sec. 4, Alg. 1).

Pure Python, deterministic. The mechanism (router / agent-loop manager) reports what happens —
tasks arrive, a turn starts with its real context length, a turn generates, a task ends — and
calls `tick()`, which returns the pauses, resumes and admissions to carry out at the next turn
boundaries. Verbs and states follow vLLM's scheduler: a few calls, an explicit state per task.

Budgets (`budgets.py`): each rank may hold `floor(kv_capacity_tokens * kv_headroom)` tokens, a GRPO group's
shared prompt charged once per rank. A paused task holds no budget (the engine may evict its KV); it remembers
the rank that held it, and resumes there when that rank has headroom (worker affinity), elsewhere otherwise.

What a budget bounds (`budget_scope`): `resident` (Alg. 1) charges every resident task's context, also while
the task waits on its environment, so its prefix stays cached. `active` charges only the tasks with a turn in
flight or due (admitted or resumed, not started yet): a task waiting on its environment keeps its place on the
rank, but its KV counts as evictable cache, so more tasks progress at once and a returning task may re-prefill.
Over budget, `active` pauses the lowest-priority task with a turn in flight or due.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterable
from typing import Optional

from verl_tide.core.config import CTBConfig
from verl_tide.ctb.budgets import RankBudget, RankBudgets
from verl_tide.ctb.tasks import Decision, Outcome, RankId, SchedulerOutput, Task, TaskId, TaskState

__all__ = ["CTBScheduler", "Decision", "Outcome", "RankId", "SchedulerOutput", "Task", "TaskId", "TaskState"]


class CTBScheduler:
    def __init__(self, config: CTBConfig, rank_kv_capacity: dict[RankId, int]):
        self.config = config
        self.tasks: dict[TaskId, Task] = {}
        self.budgets = RankBudgets(config, self._shared_prompt)
        self._group_done: dict[Hashable, int] = {}
        self._group_probe: dict[Hashable, int] = {}  # first-turn footprint per GRPO group
        self._group_probing: set[Hashable] = set()
        self._group_prompt: dict[Hashable, int] = {}  # shared prompt length per GRPO group
        self._admission_allowance: Optional[int] = None
        # Tasks by state (insertion-ordered) so a tick touches only the tasks that can change.
        self._by_state: dict[TaskState, dict[TaskId, Task]] = {s: {} for s in TaskState}
        # Queued tasks whose footprint may exceed every budget: checked next tick (new tasks, groups whose
        # probe arrived); all queued tasks are checked again only when the largest budget shrinks.
        self._recheck: dict[TaskId, Task] = {}
        self._checked_largest = 0
        # Admission index: queued tasks per GRPO group, and the groups ranked by priority (cached; re-ranked
        # only when a queued group's priority can have changed: new tasks, probes, completions).
        self._queued_by_group: dict[Hashable, dict[TaskId, Task]] = {}
        self._ranked_groups: Optional[list[Hashable]] = None
        # Resume index: paused tasks in a max-heap by (priority, earlier arrival), with lazy invalidation;
        # a paused task's priority changes only when its group completes a task (re-pushed then).
        self._paused_heap: list[tuple[float, int, int, TaskId]] = []
        self._heap_version: dict[TaskId, int] = {}
        self._paused_by_group: dict[Hashable, dict[TaskId, Task]] = {}
        self.counters = {"pauses": 0, "resumes": 0, "admissions": 0, **{o.value: 0 for o in Outcome}}
        # After the last tick: work waits for KV budget (a task paused, or one queued that no rank can hold).
        # The rollout is then saturated: more ranks would run it now (ERS's split advice reads the share of time).
        self.waiting_for_kv = False
        # Context tokens of the tasks generating now (a turn in flight), all ranks: the KV their decode iterations
        # read. Against the model's weights it says whether decode is bound by KV reads (more ranks run it faster)
        # or by weight reads (they do not): ERS's split advice reads its time average.
        self.generating_tokens = 0
        for rank, capacity in rank_kv_capacity.items():
            self.add_rank(rank, capacity)

    # ---- what the mechanism reports -------------------------------------------------------
    def add_task(self, task_id: TaskId, group_id: Hashable, prompt_tokens: int, group_size: int = 1,
                 task_type: str = "default", is_eval: bool = False) -> None:
        if task_id in self.tasks:
            raise ValueError(f"task {task_id!r} was already added")
        if prompt_tokens <= 0 or group_size <= 0:
            raise ValueError(f"task {task_id!r}: prompt_tokens and group_size must be > 0")
        self.tasks[task_id] = task = Task(task_id, group_id, group_size, task_type, is_eval, prompt_tokens,
                                          seq=len(self.tasks))
        self._by_state[TaskState.QUEUED][task_id] = task
        self._queued_by_group.setdefault(group_id, {})[task_id] = task
        self._recheck[task_id] = task
        self._ranked_groups = None
        self._group_prompt.setdefault(group_id, prompt_tokens)  # a GRPO group shares its first task's prompt

    def turn_started(self, task_id: TaskId, context_tokens: int) -> None:
        """A turn begins with this real context length (prompt, all turns so far, the observation)."""
        task = self._live(task_id)
        if task.state is not TaskState.RESIDENT:
            raise ValueError(f"task {task_id!r} is {task.state.value}: only a resident task starts turns")
        if context_tokens <= 0:
            raise ValueError(f"task {task_id!r}: context_tokens = {context_tokens}, must be > 0")
        if task.context_tokens == 0 and task.group_id not in self._group_probe:
            self._group_probe[task.group_id] = context_tokens  # the group's probe footprint
            self._group_probing.discard(task.group_id)
            self._group_changed(task.group_id)
        task.context_tokens = context_tokens
        self.budgets.recharge(task, context_tokens)  # estimate -> real context
        task.due = False
        self._set_generating(task, True)

    def turn_finished(self, task_id: TaskId) -> None:
        """Generation of the turn is done; the task now waits for its environment (a turn boundary)."""
        self._set_generating(self._live(task_id), False)

    def task_finished(self, task_id: TaskId, outcome: Outcome = Outcome.CONSUMED, reason: str = "") -> None:
        task = self._live(task_id)
        if task.state is TaskState.RESIDENT:
            self._release(task)
        if task.context_tokens == 0:
            self._group_probing.discard(task.group_id)  # the probe ended before its first turn
        self._set_state(task, TaskState.DONE)
        task.outcome, task.reason = outcome, reason
        self._set_generating(task, False)
        self._group_done[task.group_id] = self._group_done.get(task.group_id, 0) + 1
        self.counters[outcome.value] += 1
        if task.group_id in self._queued_by_group:
            self._ranked_groups = None  # its completion term of P(t) changed
        for paused in self._paused_by_group.get(task.group_id, {}).values():
            self._push_paused(paused)

    def count(self, state: TaskState) -> int:
        """Tasks in `state` now (QUEUED: waiting for admission, work the rollout has not started)."""
        return len(self._by_state[state])

    @property
    def kv_held_ranks(self) -> float:
        """The KV the resident tasks hold now, in ranks' worth of budget (each rank's usage over its base budget,
        summed): how many ranks the work in flight needs. ERS's trainer resize reads its peak over a step cycle:
        on fewer rollout ranks CTB pauses tasks and re-prefills them (the simulator's ALFWorld at 7 of 32 GPUs made
        a third of the sequences per GPU that 16 made, where a proportional model promised the same). Residents
        waiting for their environment count: where that wait is short, pausing them is thrash (only the KV of turns
        in flight or due: the resize from ALFWorld's even split went to 8 rollout GPUs, -5% over the run)."""
        return sum(rank.usage / rank.base for rank in self.budgets.ranks.values() if rank.base > 0)

    def set_admission_allowance(self, new_tasks: Optional[int]) -> None:
        """Staleness throttle: how many more new tasks may start before the trainer catches up (None = no limit)."""
        if new_tasks is not None and new_tasks < 0:
            raise ValueError(f"admission allowance = {new_tasks}: must be >= 0 or None")
        self._admission_allowance = new_tasks

    def state_dict(self) -> dict:
        """What survives a checkpoint: decision and outcome counters, and each GRPO group's prompt and
        first-turn footprint (verl re-issues in-flight groups under the same uid after a resume; with their
        probes known, CTB admits them without probing again). Tasks and ranks do not: engines restart empty."""
        return {"counters": dict(self.counters),
                "group_probe": {str(g): v for g, v in self._group_probe.items()},
                "group_prompt": {str(g): v for g, v in self._group_prompt.items()}}

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.get("counters", {}).items():
            if key not in self.counters:
                raise ValueError(f"CTB state: unknown counter {key!r}; known: {', '.join(self.counters)}")
            self.counters[key] = int(value)
        self._group_probe.update({g: int(v) for g, v in state.get("group_probe", {}).items()})
        for g, v in state.get("group_prompt", {}).items():
            self._group_prompt.setdefault(g, int(v))

    def set_budget_factor(self, factor: float) -> None:
        """Scale every rank's budget by `factor` (>= 1), from the step-boundary planner (`ctb/window.py`)."""
        self.budgets.set_factor(factor)

    @property
    def ranks(self) -> dict[RankId, RankBudget]:
        """Each rank's budget and what is charged to it (`budgets.py`)."""
        return self.budgets.ranks

    def add_rank(self, rank: RankId, kv_capacity_tokens: int) -> None:
        self.budgets.add(rank, kv_capacity_tokens)

    def remove_rank(self, rank: RankId) -> list[TaskId]:
        """Close a rank (ERS): its resident tasks become paused without affinity (their KV is gone)."""
        if rank not in self.ranks:
            raise KeyError(f"rank {rank!r} is not known")
        moved = []
        for task in list(self.ranks[rank].residents.values()):
            self._release(task)
            self._set_generating(task, False)
            self._set_state(task, TaskState.PAUSED)
            moved.append(task.task_id)
        for task in self._by_state[TaskState.PAUSED].values():
            if task.rank == rank:
                task.rank = None
        del self.ranks[rank]
        return moved

    # ---- the decision (Algorithm 1) --------------------------------------------------------
    def priority(self, task: Task) -> float:
        """P(t) = w1*eval + w2*group completion + w3*active + w4*context length."""
        w = self.config.priority
        # a fraction (capped: a group told too small a size must not outrank evaluation)
        completion = min(1.0, self._group_done.get(task.group_id, 0) / task.group_size)
        return (w.eval * task.is_eval + w.group_completion * completion + w.active * task.generating
                + w.context_length * self.footprint(task))

    def footprint(self, task: Task) -> int:
        """Tokens a task needs: its real context once known, else its group's probe, else its prompt."""
        if task.context_tokens:
            return task.context_tokens
        return max(self._group_probe.get(task.group_id, 0), task.prompt_tokens)

    def tick(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._pause_over_budget(out)
        self._fail_oversize(out)
        self._resume_paused(out)
        self.waiting_for_kv = bool(self._by_state[TaskState.PAUSED]) or self._admit_new(out)
        return out

    def _pause_over_budget(self, out: SchedulerOutput) -> None:
        for rank_id, rank in self.ranks.items():
            while self.budgets.used(rank) > rank.budget:
                residents = self._resident_on(rank_id)
                if self.config.budget_scope == "active":  # a waiting task's KV is not charged: pausing it frees none
                    residents = [t for t in residents if t.generating or t.due] or residents
                victim = min(residents, key=self._order)
                reason = f"rank over budget ({self.budgets.used(rank)} > {rank.budget}); lowest priority"
                self._release(victim)
                self._set_generating(victim, False)
                self._set_state(victim, TaskState.PAUSED)
                self.counters["pauses"] += 1
                out.pauses.append(Decision(victim.task_id, rank_id, reason))

    def _fail_oversize(self, out: SchedulerOutput) -> None:
        # A rank's KV capacity (x headroom), not its scaled budget: what no rank can ever hold, whatever the factor.
        largest = max((r.base for r in self.ranks.values()), default=0)
        # Footprints of waiting tasks change only when tasks arrive or pause, or group probes arrive:
        # those are checked; every waiting task is checked again when the largest budget shrinks.
        if largest < self._checked_largest:
            candidates = [*self._by_state[TaskState.PAUSED].values(), *self._by_state[TaskState.QUEUED].values()]
        else:
            candidates = [t for t in self._recheck.values() if t.state in (TaskState.QUEUED, TaskState.PAUSED)]
        self._recheck, self._checked_largest = {}, largest
        for task in candidates:
            if self.ranks and self.footprint(task) > largest:
                reason = f"context {self.footprint(task)} tokens exceeds the largest rank budget {largest}"
                self.task_finished(task.task_id, Outcome.DROPPED_FAILED, reason)
                out.failed.append(Decision(task.task_id, task.rank, reason))

    def _resume_paused(self, out: SchedulerOutput) -> None:
        """Highest priority first, on its affinity rank if it has headroom, else the best rank that fits."""
        while self._paused_heap:
            _, _, version, task_id = self._paused_heap[0]
            task = self.tasks[task_id]
            if task.state is not TaskState.PAUSED or self._heap_version.get(task_id) != version:
                heapq.heappop(self._paused_heap)  # stale entry
                continue
            need = self.footprint(task)
            affinity = task.rank if task.rank in self.ranks else None
            if affinity is not None and self.budgets.headroom(affinity, task) >= need:
                rank, why = affinity, "resume on the rank holding its prefix"
            else:
                rank = self.budgets.best_rank(task, need)
                why = "resume elsewhere: affinity rank has no headroom" if affinity is not None else "resume (no affinity)"
            if rank is None:
                return  # strict order: no lower-priority task resumes ahead of this one
            heapq.heappop(self._paused_heap)
            self._place(task, rank)
            self.counters["resumes"] += 1
            out.resumes.append(Decision(task.task_id, rank, why))

    def _admit_new(self, out: SchedulerOutput) -> bool:
        """Admit queued tasks by priority where they fit. Returns whether a queued task was left waiting for KV
        budget (not for the staleness allowance, the environment limit or its group's probe)."""
        resident = len(self._by_state[TaskState.RESIDENT])
        max_free = self.budgets.max_free()
        if not self._by_state[TaskState.QUEUED]:
            return False
        if max_free <= 0:
            return True
        blocked = False
        for group_id in self._admission_order():
            members = self._queued_by_group.get(group_id)
            if not members:
                continue
            if self.config.probe_first_turn and group_id in self._group_probing:
                continue  # wait for the group's probe to report its first-turn footprint
            first = next(iter(members.values()))
            if self.footprint(first) - self._shared_prompt(first) > max_free:
                blocked = True
                continue  # no rank can hold any member, even one where the group's prompt is cached
            for task in list(members.values()):
                if self._admission_allowance is not None and self._admission_allowance <= 0:
                    return False
                if self.config.env_concurrency and resident >= self.config.env_concurrency:
                    return False
                rank = self.budgets.best_rank(task, self.footprint(task))
                if rank is None:
                    blocked = True
                    break  # the group's queued members all need the same: none fits
                self._place(task, rank)
                resident += 1
                if self._admission_allowance is not None:
                    self._admission_allowance -= 1
                self.counters["admissions"] += 1
                out.admissions.append(Decision(task.task_id, rank, "admitted"))
                if task.group_id not in self._group_probe:
                    self._group_probing.add(task.group_id)
                    if self.config.probe_first_turn:
                        break  # the probe runs alone until it reports the group's first-turn footprint
            max_free = self.budgets.max_free()
            if max_free <= 0:
                return bool(self._by_state[TaskState.QUEUED])
        return blocked

    def _admission_order(self) -> list[Hashable]:
        """GRPO groups with queued tasks, highest priority first. The members of one group share the
        terms of P(t) that matter before they run (eval, group completion, footprint), so a group is
        ranked by its first queued member and its members follow in arrival order. The ranking is
        cached until a queued group's priority can change (new tasks, a probe, a completion)."""
        if self._ranked_groups is None:
            live = [g for g, members in self._queued_by_group.items() if members]
            self._ranked_groups = sorted(
                live, key=lambda g: self._order(next(iter(self._queued_by_group[g].values()))), reverse=True)
        return self._ranked_groups

    def _group_changed(self, group_id: Hashable) -> None:
        """The group's probe footprint arrived: its waiting members' footprints (and priorities) changed."""
        members = self._queued_by_group.get(group_id)
        if members:
            self._recheck.update(members)
            self._ranked_groups = None
        for paused in self._paused_by_group.get(group_id, {}).values():
            self._recheck[paused.task_id] = paused
            self._push_paused(paused)

    # ---- helpers ---------------------------------------------------------------------------
    def _place(self, task: Task, rank_id: RankId) -> None:
        self._set_state(task, TaskState.RESIDENT)
        self.budgets.place(task, rank_id, self.footprint(task))

    def _release(self, task: Task) -> None:
        self.budgets.release(task)

    def _order(self, task: Task) -> tuple:
        """Ascending = less important: priority, then later arrival."""
        return (self.priority(task), -task.seq)

    def _shared_prompt(self, task: Task) -> int:
        """Tokens of the group's common prompt (as reported by its first task)."""
        return self._group_prompt[task.group_id]

    def _resident_on(self, rank_id: RankId) -> Iterable[Task]:
        return list(self.ranks[rank_id].residents.values())

    def _in_state(self, state: TaskState) -> list[Task]:
        return list(self._by_state[state].values())

    def _push_paused(self, task: Task) -> None:
        version = self._heap_version.get(task.task_id, 0) + 1
        self._heap_version[task.task_id] = version
        heapq.heappush(self._paused_heap, (-self.priority(task), task.seq, version, task.task_id))

    def _set_state(self, task: Task, state: TaskState) -> None:
        self._by_state[task.state].pop(task.task_id, None)
        if task.state is TaskState.PAUSED:
            group = self._paused_by_group[task.group_id]
            group.pop(task.task_id, None)
            if not group:
                del self._paused_by_group[task.group_id]
            self._heap_version.pop(task.task_id, None)
        if task.state is TaskState.QUEUED:
            members = self._queued_by_group[task.group_id]
            members.pop(task.task_id, None)
            if not members:
                del self._queued_by_group[task.group_id]
        task.state = state
        self._by_state[state][task.task_id] = task
        if state is TaskState.PAUSED:
            self._paused_by_group.setdefault(task.group_id, {})[task.task_id] = task
            self._recheck[task.task_id] = task  # its footprint may exceed every budget
            self._push_paused(task)

    def _set_generating(self, task: Task, generating: bool) -> None:
        counted = task.context_tokens if generating else 0
        self.generating_tokens += counted - task.generating_counted
        task.generating, task.generating_counted = generating, counted
        self.budgets.count_active(task)

    def _live(self, task_id: TaskId) -> Task:
        task = self.tasks.get(task_id)
        if task is None:
            raise KeyError(f"task {task_id!r} is unknown")
        if task.state is TaskState.DONE:
            raise ValueError(f"task {task_id!r} already finished ({task.outcome.value})")
        return task

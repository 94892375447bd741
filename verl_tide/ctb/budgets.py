"""Each rollout rank's KV token budget and what is charged to it (CTB, paper Alg. 1).

A rank may hold `floor(kv_capacity_tokens * kv_headroom)` tokens. The tasks of one GRPO group share their
prompt, and the engine's prefix cache holds it once per rank, so a rank is charged a group's prompt once plus
each task's own tokens. Two tallies are kept for every rank, whichever `budget_scope` is chosen: `usage`
(every resident task) and `active_usage` (tasks with a turn in flight or due); `used` says which one the
budget bounds. Kept apart from the policy so the accounting is one small thing a property test can check.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Optional

from verl_tide.core.config import CTBConfig
from verl_tide.ctb.tasks import RankId, Task, TaskState


@dataclass
class RankBudget:
    base: int  # KV capacity x kv_headroom: Alg. 1's budget
    budget: int  # base x the budget factor in force (`set_factor`)
    usage: int = 0  # shared prompts of the groups resident here + every resident task's own tokens
    residents: dict[Hashable, Task] = field(default_factory=dict)
    group_residents: dict[Hashable, int] = field(default_factory=dict)
    type_counts: dict[str, int] = field(default_factory=dict)
    # shared prompts of groups with a turn in flight or due here + those tasks' own tokens (`budget_scope=active`)
    active_usage: int = 0
    group_active: dict[Hashable, int] = field(default_factory=dict)


class RankBudgets:
    """The ranks' budgets; `shared_prompt(task)` gives the tokens of the task's group prompt."""

    def __init__(self, config: CTBConfig, shared_prompt: Callable[[Task], int]):
        self.config = config
        self.shared_prompt = shared_prompt
        self.ranks: dict[RankId, RankBudget] = {}
        self.factor = 1.0

    def set_factor(self, factor: float) -> None:
        """Scale every rank's budget (`ctb/window.py` decides by how much); the policy's next tick pauses what no
        longer fits."""
        if factor < 1:
            raise ValueError(f"budget factor = {factor}: must be >= 1")
        self.factor = factor
        for rank in self.ranks.values():
            rank.budget = math.floor(rank.base * factor)

    def add(self, rank: RankId, kv_capacity_tokens: int) -> None:
        if rank in self.ranks:
            raise ValueError(f"rank {rank!r} is already known")
        if kv_capacity_tokens <= 0:
            raise ValueError(f"rank {rank!r}: kv_capacity_tokens = {kv_capacity_tokens}, must be > 0")
        base = math.floor(kv_capacity_tokens * self.config.kv_headroom)
        self.ranks[rank] = RankBudget(base=base, budget=math.floor(base * self.factor))

    def used(self, rank: RankBudget) -> int:
        """The tokens its budget bounds: every resident's (`resident`), or those of turns in flight or due."""
        return rank.active_usage if self.config.budget_scope == "active" else rank.usage

    def prompt_charged(self, rank: RankBudget, task: Task) -> bool:
        """The rank's budget already counts the task's group prompt (a member resident, or active, here)."""
        groups = rank.group_active if self.config.budget_scope == "active" else rank.group_residents
        return bool(groups.get(task.group_id))

    def max_free(self) -> int:
        return max((r.budget - self.used(r) for r in self.ranks.values()), default=0)

    def headroom(self, rank_id: RankId, task: Optional[Task] = None) -> int:
        rank = self.ranks[rank_id]
        credit = self.shared_prompt(task) if task is not None and self.prompt_charged(rank, task) else 0
        return rank.budget - self.used(rank) + credit

    def best_rank(self, task: Task, need: int) -> Optional[RankId]:
        """The rank with the most room left after `need`, less a diversity penalty per task of the same type,
        plus one if its group's prompt is cached there; None if none has room."""
        best, best_score = None, -math.inf
        for rank_id, rank in self.ranks.items():
            need_here = need - (self.shared_prompt(task) if self.prompt_charged(rank, task) else 0)
            free = rank.budget - self.used(rank)
            if free < need_here:
                continue
            score = (free - need_here) / rank.budget
            score -= self.config.diversity_penalty * rank.type_counts.get(task.task_type, 0)
            score += 1.0 if rank.group_residents.get(task.group_id) else 0.0  # its group's prompt is cached there
            if score > best_score:
                best, best_score = rank_id, score
        return best

    def place(self, task: Task, rank_id: RankId, footprint: int) -> None:
        """Charge a task made resident on `rank_id` with its estimated `footprint`; its first turn is due."""
        rank = self.ranks[rank_id]
        shared = self.shared_prompt(task)
        task.rank, task.charged = rank_id, max(footprint - shared, 0)
        rank.residents[task.task_id] = task
        if not rank.group_residents.get(task.group_id):
            rank.usage += shared  # the group's prompt is cached once per rank
        rank.group_residents[task.group_id] = rank.group_residents.get(task.group_id, 0) + 1
        rank.usage += task.charged
        rank.type_counts[task.task_type] = rank.type_counts.get(task.task_type, 0) + 1
        task.due = True
        self.count_active(task)

    def recharge(self, task: Task, context_tokens: int) -> None:
        """A turn started: the estimate is replaced by the real context."""
        own = max(context_tokens - self.shared_prompt(task), 0)
        self.ranks[task.rank].usage += own - task.charged
        task.charged = own

    def release(self, task: Task) -> None:
        rank = self.ranks[task.rank]
        rank.residents.pop(task.task_id, None)
        rank.usage -= task.charged
        rank.group_residents[task.group_id] -= 1
        if not rank.group_residents[task.group_id]:
            del rank.group_residents[task.group_id]
            rank.usage -= self.shared_prompt(task)
        rank.type_counts[task.task_type] -= 1
        task.charged, task.due = 0, False
        self.count_active(task, leaving=True)

    def count_active(self, task: Task, leaving: bool = False) -> None:
        """Keep `active_usage` in step with the task: counted while it is resident with a turn in flight or due
        (its group's shared prompt once per rank), recounted when its charge changes."""
        if task.active_on is not None and task.active_on in self.ranks:
            rank = self.ranks[task.active_on]
            rank.active_usage -= task.active_counted
            rank.group_active[task.group_id] -= 1
            if not rank.group_active[task.group_id]:
                del rank.group_active[task.group_id]
                rank.active_usage -= self.shared_prompt(task)
        task.active_on, task.active_counted = None, 0
        if not leaving and task.state is TaskState.RESIDENT and (task.generating or task.due):
            rank = self.ranks[task.rank]
            if not rank.group_active.get(task.group_id):
                rank.active_usage += self.shared_prompt(task)
            rank.group_active[task.group_id] = rank.group_active.get(task.group_id, 0) + 1
            rank.active_usage += task.charged
            task.active_on, task.active_counted = task.rank, task.charged

"""CTB's task record and decisions: what the policy (`policy.py`) and its rank budgets (`budgets.py`) share."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

# how a task ended: the goodput ledger's outcomes, one enum for CTB, the ledger and the simulator
from verl_tide.core.ledger import Outcome  # noqa: F401  (re-exported for CTB's modules)

TaskId = Hashable
RankId = Hashable


class TaskState(str, Enum):
    QUEUED = "queued"  # known, never admitted
    RESIDENT = "resident"  # admitted to a rank; its context is charged to that rank's budget
    PAUSED = "paused"  # taken off its rank at a turn boundary; holds no budget
    DONE = "done"  # finished (consumed, dropped stale or dropped failed)



@dataclass
class Task:
    task_id: TaskId
    group_id: Hashable
    group_size: int
    task_type: str
    is_eval: bool
    prompt_tokens: int
    state: TaskState = TaskState.QUEUED
    rank: Optional[RankId] = None  # resident rank, or the rank whose cache held it (affinity) when paused
    seq: int = 0  # arrival order: the deterministic tie-break
    context_tokens: int = 0  # last reported real context length; 0 before the first turn
    charged: int = 0  # own tokens (beyond the group's shared prompt) charged to `rank` while resident
    generating: bool = False
    generating_counted: int = 0  # its context in `CTBScheduler.generating_tokens` while generating
    due: bool = False  # placed (admitted or resumed) and its next turn has not started yet
    active_on: Optional[RankId] = None  # the rank whose `active_usage` counts it (a turn in flight or due there)
    active_counted: int = 0  # its own tokens in that `active_usage`
    outcome: Optional[Outcome] = None
    reason: str = ""


@dataclass(frozen=True)
class Decision:
    task_id: TaskId
    rank: RankId
    reason: str


@dataclass
class SchedulerOutput:
    pauses: list[Decision] = field(default_factory=list)
    resumes: list[Decision] = field(default_factory=list)
    admissions: list[Decision] = field(default_factory=list)
    failed: list[Decision] = field(default_factory=list)  # tasks no rank can ever hold

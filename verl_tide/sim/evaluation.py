"""verl's validation rounds in the simulation, and the sampler's poll that decides when a trainer sees data.

verl's V1 trainers read rollouts from a replay buffer that their sampler looks at every `poll_interval` (2 s
by default): the step's batch and a validation's results alike count from the first look after they are ready
(on the test bed verl `sync`'s `timing_s/gen` and `timing_s/testing` come in whole multiples of 2 s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

from verl_tide.sim.records import Group


def first_look(since: float, ready_at: float, poll_s: float) -> float:
    """When a sampler that looks every `poll_s` from `since` (0: continuously) first sees what was ready at
    `ready_at`."""
    if not poll_s or ready_at <= since:
        return max(since, ready_at)
    return since + math.ceil((ready_at - since) / poll_s - 1e-9) * poll_s


class Evaluation:
    """One validation round: released at `start` after `after` train steps; done once its groups have all
    finished and the trainer's sampler (looking every `poll_s` from `start`) has seen them."""

    def __init__(self, groups: Sequence[Group], start: float, after: int, poll_s: float) -> None:
        self.groups, self.start, self.after, self.poll_s = list(groups), start, after, poll_s
        self.finished_at: Optional[float] = None

    def done(self, t: float) -> bool:
        if self.finished_at is None:
            if any(g.done + g.failed < g.size for g in self.groups):
                return False
            self.finished_at = t
        return t >= first_look(self.start, self.finished_at, self.poll_s)

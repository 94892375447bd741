"""One step boundary as one round: decide from the snapshot, then apply through a port.

Why: trainer `tide` and the simulator decide at the same moment (after the Actor's update, before the weight
sync) and must act on the decision in the same order with the same rules (a plan on the last step is cancelled,
advice is not taken from a cycle that ran an evaluation, the budget factor is set before ranks move). Written in
each of them, those rules drifted. Here the round owns them; what differs between a verl job and the model is
the port: how signals are read, how a rank moves, how the Actor's GPUs are lent, where a report goes.

A round is replayable: `RoundRecord` keeps its inputs, the signals it read, what it did through the port and its
outcome; `ReplayedSignals` answers a replayed round's reads from the record, so a recorded round can be run again
through any port (tests/test_planner_replay.py runs them through the simulator's port and trainer `tide`'s).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from verl_tide.boundary.planner import BoundaryDecision, BoundaryInputs, BoundaryPlanner
from verl_tide.core.readiness import ReadinessSignals
from verl_tide.ctb.window import BudgetDecision
from verl_tide.ers.advice import SplitAdvice, SplitAdviceCycle
from verl_tide.ers.lending import LendDecision
from verl_tide.ers.policy import Phase, RankMove, Role
from verl_tide.ers.resize import ResizeDecision


class PlanOutcome(enum.Enum):
    """What became of ERS's plan at this boundary."""

    NOTHING_TO_MOVE = "nothing to move"
    CANCELLED_LAST_STEP = "not applied: last step"  # no step follows to use the moved ranks (no cooldown either)
    CANCELLED_RESIZE = "not applied: the Actor's group resizes"  # one move a boundary: the plan read the old split
    APPLIED = "applied"


@dataclass(frozen=True)
class AdviceInputs:
    """The split advice's view of the job at this boundary (`ers.advice.advise_split`)."""

    rollout_gpus: int  # GPUs rolling out now
    trainer_gpus: int  # the Actor's GPUs and every Ref GPU
    batch: int  # sequences a step trains (ERS's ideal batch)
    weight_kv_tokens: Optional[float]  # the model's weights in KV tokens (None: unknown, no decode-bound advice)
    kv_bound_min: float  # tide.ers.split_advice_kv_bound
    gpus_per_replica: int = 1


@dataclass(frozen=True)
class RoundContext:
    """What a boundary knows besides the planner's inputs."""

    phase: Phase = Phase.TRAIN  # EVAL: the next step's rollout also runs an evaluation
    roles: Optional[Mapping[int, Role]] = None  # the elastic ranks' roles; None: ERS plans nothing
    elastic_ref: bool = True  # ERS may move rollout ranks to Ref
    ref_floor: int = 0  # Ref ranks ERS must leave (the last one when nothing else computes Ref)
    last_step: bool = False
    advice: Optional[AdviceInputs] = None  # None: no split advice at this boundary


@dataclass(frozen=True)
class RoundResult:
    decision: BoundaryDecision
    plan_outcome: PlanOutcome
    moves: tuple[Any, ...]  # what the port applied (its own records of each move)
    advice_changed: bool  # the standing split advice changed to a new split (worth a log line)
    standing_advice: Optional[SplitAdvice] = None  # the split advice standing after this round


class BoundaryPort(Protocol):
    """What a round needs of the job it runs in. Each verb is called at most once a round, in this order:
    `signals` (any number of times, one per break-even RAS), `set_budget`, `lend`, `move_ranks`, `resize_trainer`
    (only where the inputs allowed a resize), `report`."""

    def signals(self, break_even: Optional[int]) -> ReadinessSignals:
        """The readiness signals of the step that just ended, with this decoupled break-even RAS."""

    def set_budget(self, decision: BudgetDecision) -> None:
        """CTB's budget factor for the next step (`ctb/window.py`)."""

    def lend(self, decision: LendDecision) -> None:
        """Whether the Actor's GPUs roll out after the weight sync, and until how many ready units."""

    def move_ranks(self, moves: Sequence[RankMove]) -> Sequence[Any]:
        """Move ranks between rollout and Ref before the weight sync; the moves applied."""

    def resize_trainer(self, decision: ResizeDecision) -> None:
        """Resize the Actor's training group to `decision.actor_gpus` GPUs, taken from or given to rollout."""

    def report(self, result: RoundResult) -> None:
        """Metrics, logs, traces of the round."""


@dataclass
class BoundaryRound:
    """The planner and the split advice's cycle, with the rules that turn a decision into effects."""

    planner: BoundaryPlanner
    advice: Optional[SplitAdviceCycle] = None  # None: no split advice (no elastic ranks)
    trace: Optional[list] = field(default=None, repr=False)  # set to a list to record each round (`RoundRecord`)

    def run(self, inputs: BoundaryInputs, context: RoundContext, port: BoundaryPort) -> RoundResult:
        recorder = _RecordingPort(port) if self.trace is not None else None
        port = recorder or port
        decision = self.planner.decide(inputs, port.signals, context.roles, context.phase, context.elastic_ref,
                                       context.ref_floor)
        if decision.budget is not None:
            port.set_budget(decision.budget)
        advice_changed = False
        if self.advice is not None and context.advice is not None and decision.signals is not None:
            a = context.advice
            advice_changed = self.advice.update(decision.signals, a.rollout_gpus, a.trainer_gpus, a.batch,
                                                a.weight_kv_tokens, a.kv_bound_min, context.phase is Phase.EVAL,
                                                gpus_per_replica=a.gpus_per_replica)
        if decision.lend is not None:
            port.lend(decision.lend)
        resize = decision.resize is not None and decision.resize.actor_gpus != inputs.resize.actor_gpus \
            and not context.last_step
        outcome, moves = self._move(decision, context.last_step, port, resize)
        if resize:
            port.resize_trainer(decision.resize)
        result = RoundResult(decision, outcome, moves, advice_changed,
                             self.advice.standing if self.advice is not None else None)
        port.report(result)
        if recorder is not None:
            standing = result.standing_advice
            self.trace.append(RoundRecord(inputs, context, dict(recorder.seen), recorder.effects, {
                "plan": outcome.value, "advice_changed": advice_changed,
                "advised_rollout_gpus": standing.rollout_gpus if standing is not None else None}))
        return result

    def _move(self, decision: BoundaryDecision, last_step: bool, port: BoundaryPort, resize: bool
              ) -> tuple[PlanOutcome, tuple[Any, ...]]:
        plan = decision.plan
        if plan is None or not plan.moves:
            return PlanOutcome.NOTHING_TO_MOVE, ()
        if last_step or resize:
            self.planner.ers.cancel(plan)
            return PlanOutcome.CANCELLED_LAST_STEP if last_step else PlanOutcome.CANCELLED_RESIZE, ()
        return PlanOutcome.APPLIED, tuple(port.move_ranks(plan.moves))


@dataclass(frozen=True)
class RoundRecord:
    """One round as it ran: its inputs and context, the signals it read (by break-even RAS), the calls it made
    through its port (verb, argument) in order, and its outcome."""

    inputs: BoundaryInputs
    context: RoundContext
    signals: dict
    effects: list
    outcome: dict  # what became of the plan, and the split advice standing after the round


class _RecordingPort:
    """A port in front of another, remembering what the round read and did through it."""

    def __init__(self, port: BoundaryPort):
        self.port, self.seen, self.effects = port, {}, []

    def signals(self, break_even: Optional[int]) -> ReadinessSignals:
        if break_even not in self.seen:
            self.seen[break_even] = self.port.signals(break_even)
        return self.seen[break_even]

    def set_budget(self, decision: BudgetDecision) -> None:
        self.effects.append(("set_budget", decision.factor))
        self.port.set_budget(decision)

    def lend(self, decision: LendDecision) -> None:
        self.effects.append(("lend", (decision.lend, decision.return_at_units)))
        self.port.lend(decision)

    def move_ranks(self, moves: Sequence[RankMove]) -> Sequence[Any]:
        self.effects.append(("move_ranks", tuple((m.rank, m.src.value, m.dst.value) for m in moves)))
        return self.port.move_ranks(moves)

    def resize_trainer(self, decision: ResizeDecision) -> None:
        self.effects.append(("resize_trainer", decision.actor_gpus))
        self.port.resize_trainer(decision)

    def report(self, result: RoundResult) -> None:
        self.port.report(result)


class ReplayedSignals:
    """A port's `signals` answered from a record: a round asking for signals the recording never computed
    (another break-even RAS) fails, since it did not decide as the recorded one did."""

    def __init__(self, record: RoundRecord):
        self.record = record

    def __call__(self, break_even: Optional[int]) -> ReadinessSignals:
        if break_even not in self.record.signals:
            raise KeyError(f"step {self.record.inputs.step}: break-even RAS {break_even} was never recorded "
                           f"(recorded: {sorted(self.record.signals, key=str)})")
        return self.record.signals[break_even]

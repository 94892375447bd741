"""ERS lends the Actor's GPUs to rollout: whether, after an update, and until how much is ready.

Why here: the paper's ERS moves GPUs to where the readiness signals say work waits. The Actor's GPUs (verl's
hybrid replica beside the Actor) are the one place it had not reached: they idle through the cold start, the
evaluations and the waits inside steps that start with too little ready data. The trainer and the simulator
ask this module through `BoundaryPlanner.decide` (one decision path); trainer `tide` hands the answer to
verl's hybrid switch (`trainer/lending.py`), the simulator to its modeled replicas.

- Cold start and evaluation: lend preemptively (generation dominates), as ERS's rank moves do, unless a
  mini-batch is ready: then the Actor has work, and an overlapped evaluation runs beside it (found in the
  simulator: over 100 WebShop steps, lending for every evaluation while data was ready cost 4% goodput).
- After an update: lend when the expected wait for the next step's first mini-batch (the units still missing
  times the measured time per ready unit, TPRM) exceeds the measured switch round trip (to rollout and back),
  and the rollout was saturated: work waited for KV budget at least `tide.ers.lend_kv_bound` of its working
  time (CTB's `kv_wait_s`), so more GPUs would have run it sooner. Found in the simulator: on OSWorld, whose
  rollout waits on its environments, lending on the wait alone cut the trainer's waits by two thirds and
  goodput by 8% (the Actor waited for ready mini-batches it could have streamed, and the extra replicas made
  trajectories no faster). Unknown rate, cost or saturation: lend (the first switch measures the cost;
  verl's own switch decides the same way).
- That test is a model of a GPU rollout, and the hardware decides whether it holds. With
  `tide.ers.lend_trials` = N > 0 the model decides only until each answer was tried N step cycles (lent,
  kept, alternating, the model's answer first); then the measured cycles decide: lend when those that followed
  a lend were shorter on average (the last four each way) than those that followed a keep. A cycle (update to
  update) holds everything lending changes: the switch both ways, the faster rollout, the Actor's wait. Off by
  default: on the CPU test bed's budgeted fake GPUs the trials measured lending after updates as a loss (the
  model's answer there, for another reason: the switch), and in the simulator they cost up to 1% (docs/ers.md).
- Whether at all (`tide.ers.lend_actor`, `resolve_lend_actor`): by default (`auto`) whenever the job allows it,
  as verl's own `separate_async` builds its hybrid replicas by default; with a Ref model only when asked
  (`true`, beside verl's Ref in its combined actor/rollout/ref worker; never beside tide's Ref replicas);
  never with `actor_rollout_ref.hybrid_engine=false` (the user asked for no replica on the trainer's GPUs).
- Return: once enough is ready that the rest of the step's mini-batches arrive while the ready ones train,
  k of M mini-batches with (M - k) x units x TPRM <= k x train time per mini-batch; one mini-batch when
  either rate is unknown (the trainer streams mini-batches).

Pure Python: no verl, ray or torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Union

from verl_tide.core.config import TideConfigError
from verl_tide.ers.policy import Phase


def resolve_lend_actor(setting: Union[bool, str], has_ref_model: bool, hybrid_engine: bool,
                       ref_replicas: bool = False, resize_trainer: bool = False) -> tuple[bool, str]:
    """`tide.ers.lend_actor` for one job: whether its Actor's GPUs get verl's hybrid replica, and why. An explicit
    `true` the job cannot honour is an error naming the keys; `auto` says which key kept lending off.

    With a Ref model on the trainer's GPUs only (verl's Ref; `ref_replicas` false), verl puts the Ref in its
    combined actor/rollout/ref worker beside the replica, as stock `separate_async` does: `true` runs that
    (with RA2P's hand-off), `auto` does not (on the CPU test bed it cost 9%; on GPUs it is not measured). With
    tide's Ref replicas (`tide.ra2p.ref_ranks`,
    elastic Ref ranks, split mode) it is not built."""
    blockers, opt_in = [], []
    if has_ref_model and ref_replicas:
        blockers.append("a Ref model on tide's Ref replicas (tide.ra2p.ref_ranks, tide.ers.min_ref_ranks / "
                        "max_ref_ranks, or tide.ra2p.mode = split): the lent replica beside them is not built yet")
    elif has_ref_model:
        opt_in.append("a Ref model (actor_rollout_ref.actor.use_kl_loss or algorithm.use_kl_in_reward): lending "
                      "beside verl's Ref is opt-in, tide.ers.lend_actor = true")
    if not hybrid_engine:
        blockers.append("actor_rollout_ref.hybrid_engine = false: no rollout replica on the trainer's GPUs")
    if resize_trainer:
        blockers.append("tide.ers.resize_trainer = true: a resize rebuilds the Actor's processes, where a lent "
                        "replica lives")
    if setting is True and blockers:
        raise TideConfigError([f"tide.ers.lend_actor = true with {b}; set tide.ers.lend_actor = auto or false"
                               for b in blockers])
    if setting is False:
        return False, "tide.ers.lend_actor = false"
    if setting == "auto" and (blockers or opt_in):
        return False, f"tide.ers.lend_actor = auto, off: the job has {(blockers or opt_in)[0]}"
    if has_ref_model:
        return True, "tide.ers.lend_actor = true, beside verl's Ref (its combined actor/rollout/ref worker)"
    return True, f"tide.ers.lend_actor = {'auto' if setting == 'auto' else 'true'}"


@dataclass(frozen=True)
class LendingInputs:
    """What the lending decision reads besides the phase and the rate of ready units."""

    ready_units: int  # units (GRPO groups) ready for the next step now
    units_per_mini_batch: int
    mini_batches: int  # per step (the weight-sync window)
    switch_cost_s: Optional[float]  # measured round trip, rollout and back (None before one was measured)
    train_s_per_mini_batch: Optional[float]  # the Actor's measured time to train one mini-batch
    last_step: bool = False

    def __post_init__(self) -> None:
        if self.units_per_mini_batch < 1 or self.mini_batches < 1:
            raise ValueError(f"LendingInputs: units_per_mini_batch = {self.units_per_mini_batch}, mini_batches = "
                             f"{self.mini_batches}: both must be >= 1")


@dataclass(frozen=True)
class LendDecision:
    lend: bool
    return_at_units: int  # the replica goes back to training once this many units are ready
    expected_wait_s: Optional[float]
    reason: str
    question: bool = False  # after an update with units missing: the cycle it starts is measured (LendingRecord)
    lent_cycle_s: Optional[float] = None  # measured mean step cycle after a lend (None: not yet tried enough)
    kept_cycle_s: Optional[float] = None  # the same after a keep


@dataclass
class LendingRecord:
    """The step cycles that followed each answer to a lending question, the measurement ERS prefers to its model
    once each answer was tried `trials` times (the last `window` cycles each way count)."""

    trials: int = 0  # tide.ers.lend_trials (0: the model alone)
    window: int = 4
    lent: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)
    _running: Optional[bool] = None  # the answer whose cycle runs now (None: not a question)

    def cycle_ended(self, cycle_s: Optional[float]) -> None:
        """The cycle the last answer started ended, `cycle_s` long (the readiness signals' `cycle_s`)."""
        if self._running is not None and cycle_s is not None and cycle_s > 0:
            side = self.lent if self._running else self.kept
            side.append(float(cycle_s))
            del side[:-self.window]
        self._running = None

    def answered(self, decision: LendDecision) -> None:
        self._running = decision.lend if decision.question else None

    def mean(self, lent: bool) -> Optional[float]:
        """Mean cycle after that answer; None until it was tried `trials` times."""
        side = self.lent if lent else self.kept
        return sum(side) / len(side) if self.trials > 0 and len(side) >= self.trials else None

    def untried(self, first: bool) -> Optional[bool]:
        """The answer to try next: the one tried fewer times (`first` on a tie), so the trials alternate and a
        trend over the run (a cold start settling) does not fall on one answer; None once both were tried
        `trials` times."""
        counts = {True: len(self.lent), False: len(self.kept)}
        if min(counts.values()) >= self.trials:
            return None
        return first if counts[first] <= counts[not first] else not first


def return_threshold(inputs: LendingInputs, seconds_per_unit: Optional[float]) -> int:
    """Units ready before the Actor takes its GPUs back: k whole mini-batches, the fewest whose training
    covers the arrival of the step's other M - k."""
    g, m, t = inputs.units_per_mini_batch, inputs.mini_batches, inputs.train_s_per_mini_batch
    if not seconds_per_unit or not t:
        return g
    k = math.ceil(m * g * seconds_per_unit / (g * seconds_per_unit + t) - 1e-9)
    return g * min(m, max(1, k))


def decide(inputs: LendingInputs, phase: Phase, seconds_per_unit: Optional[float],
           rollout_kv_bound: Optional[float] = None, kv_bound_min: float = 0.0,
           record: Optional[LendingRecord] = None) -> LendDecision:
    """Whether the Actor's replica rolls out from this boundary until `return_at_units` are ready.
    `rollout_kv_bound`: the readiness signal (None: not measured). `record`: the measured cycles after earlier
    answers (None: the model alone)."""
    back_at = return_threshold(inputs, seconds_per_unit)
    if inputs.last_step:
        return LendDecision(False, back_at, None, "the last step: nothing to train after it")
    missing = max(0, inputs.units_per_mini_batch - inputs.ready_units)
    if missing == 0:
        return LendDecision(False, back_at, 0.0, f"{inputs.ready_units} units ready: a mini-batch can train")
    if phase is not Phase.TRAIN:
        return LendDecision(True, back_at, None, f"{phase.value}: generation dominates, lend preemptively")
    model = _model(inputs, seconds_per_unit, rollout_kv_bound, kv_bound_min, missing, back_at)
    if not model.question or record is None or record.trials == 0:
        return model
    lent_s, kept_s = record.mean(True), record.mean(False)
    model = replace(model, lent_cycle_s=lent_s, kept_cycle_s=kept_s)
    if lent_s is not None and kept_s is not None:
        lend = lent_s < kept_s
        return replace(model, lend=lend, reason=f"measured step cycles {lent_s:.2f}s after a lend vs {kept_s:.2f}s "
                                                f"after a keep: {'lend' if lend else 'keep'}")
    todo = record.untried(first=model.lend)
    tried = len(record.lent if todo else record.kept)
    return replace(model, lend=todo, reason=f"trying {'a lend' if todo else 'a keep'} ({tried} of {record.trials} "
                                            f"cycles measured) before the measurement decides; the model: "
                                            f"{'lend' if model.lend else 'keep'}, {model.reason}")


def _model(inputs: LendingInputs, seconds_per_unit: Optional[float], rollout_kv_bound: Optional[float],
           kv_bound_min: float, missing: int, back_at: int) -> LendDecision:
    """The model's answer after an update. A wait the measured switch would not repay settles it (keep, not a
    question for the measurement); otherwise the answer is whether more GPUs would speed the rollout up."""
    if seconds_per_unit is None:
        return LendDecision(True, back_at, None, f"{missing} units missing, no arrival rate measured yet", True)
    wait = missing * seconds_per_unit
    if inputs.switch_cost_s is not None and wait <= inputs.switch_cost_s:
        return LendDecision(False, back_at, wait, f"expected wait {wait:.2f}s <= switch {inputs.switch_cost_s:.2f}s")
    if rollout_kv_bound is not None and rollout_kv_bound < kv_bound_min:
        return LendDecision(False, back_at, wait, f"expected wait {wait:.2f}s, but the rollout waited for KV "
                                                  f"{rollout_kv_bound:.0%} < {kv_bound_min:.0%} of its time: more "
                                                  "GPUs would not make it faster", True)
    if inputs.switch_cost_s is None:
        return LendDecision(True, back_at, wait, f"expected wait {wait:.2f}s, switch cost not measured yet", True)
    return LendDecision(True, back_at, wait, f"expected wait {wait:.2f}s > switch {inputs.switch_cost_s:.2f}s", True)

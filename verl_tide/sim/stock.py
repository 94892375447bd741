"""Stock verl 0.9.1's own schedulers, as the simulator's baselines run them.

The hybrid replicas (the trainer's GPUs rolling out while the trainer waits for data) are switched by a rule in
each asynchronous mode; a baseline is only as strong as the rule it runs, so these are verl's rules, constants
included, read from the 0.9.1 wheel:

- `SeparateAsyncSwitch`: `trainer.v1.trainer_mode=separate_async` with `hybrid_rollout.enable_switch`
  (`verl/trainer/ppo/v1/trainer_separate_async.py`: `_switch_threshold`, `_adapt_switch_threshold`, `on_step_end`).
- `FullyAsyncDefaultPolicy`: `verl/experimental/fully_async_policy` with `dynamic_schedule` policy `default`
  (`dynamic_schedule/default_policy.py`).

Both take the replicas back to training once a share of the step's batch is ready (the threshold), adapt that
share to whether the trainer had to wait, and lend the replicas again after a weight sync when the expected wait
pays for the switch. Pure Python: counts are sequences (verl counts prompts; the shares are the same).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Optional, Protocol

SWITCH_POLICIES = ("eager", "separate_async", "fully_async_default")


@dataclass(frozen=True)
class StepWaits:
    """What the trainer's sampler waited for in one step, as verl counts it."""

    seconds: float  # time spent waiting for ready data in the sampler
    sequences: int  # sequences that were not ready when the sampler asked for them (verl's wait_samples)


class HybridSwitch(Protocol):
    # whether lending after an update is part of the trainer's weight-sync phase (its next step waits for it)
    # and costs verl fully_async's activation (`Costs.activate_s`) rather than the switch one way
    activation_in_sync: bool

    def threshold(self) -> int:
        """Sequences ready before the hybrid replicas go back to training."""

    def step_ended(self, waits: StepWaits, ready_next: int, switch_cost_s: Optional[float]) -> bool:
        """After a step (before its weight sync): adapt, and whether to lend the replicas for the next step.
        `ready_next`: sequences already ready for it; `switch_cost_s`: the measured round trip, None before one."""

    def cycle_switched(self, seconds: float) -> None:
        """The step cycle that just ended spent `seconds` switching the replicas (taken back at its start, lent
        at its end), as the rule measures it."""


class SeparateAsyncSwitch:
    """verl separate_async's switch (defaults of `HybridRolloutSwitchConfig` in verl 0.9.1)."""

    activation_in_sync = False

    def __init__(self, batch: int, parameter_sync_step: int, total_gpus: int, rollout_gpus: int,
                 poll_s: float = 2.0, ratio: float = 0.4, step_up: float = 0.05, step_down: float = 0.03,
                 release_steps: int = 2, adaptive: bool = True):
        self.batch, self.psync, self.poll_s = batch, parameter_sync_step, poll_s
        self.ratio, self.step_up, self.step_down, self.release = ratio, step_up, step_down, release_steps
        self.adaptive = adaptive
        self.scaling = total_gpus / rollout_gpus  # verl's `_scaling_factor`
        self._idle = self._calm = 0
        self._wait_s, self._wait_samples = 0.0, 0

    def threshold(self) -> int:
        mini = self.batch // self.psync
        return min(max(round(self.ratio * self.batch), mini), self.batch)

    def cycle_switched(self, seconds: float) -> None:
        """verl measures each direction when it switches (`_to_rollout_costs`, `_to_trainer_costs`) and weighs a
        round trip only once both were measured: the caller passes that round trip to `step_ended`."""

    def step_ended(self, waits: StepWaits, ready_next: int, switch_cost_s: Optional[float]) -> bool:
        if waits.sequences > 0 and waits.seconds > 0:
            self._wait_s += waits.seconds
            self._wait_samples += waits.sequences
        if self.adaptive:
            self._adapt(waits.seconds > self.poll_s)
        remaining = max(0, self.threshold() - ready_next)
        per_sample = self._wait_s / self._wait_samples if self._wait_samples else None
        if per_sample is None or switch_cost_s is None:
            return remaining > 0
        return remaining > 0 and remaining * per_sample * (1.0 - 1.0 / self.scaling) > switch_cost_s

    def _adapt(self, had_idle: bool) -> None:
        if had_idle:
            self._calm = 0
            self._idle = min(self._idle + 1, self.release)
            if self._idle >= self.release:
                self.ratio = min(1.0, self.ratio + self.step_up)
            return
        self._idle = 0
        self._calm = min(self._calm + 1, self.release)
        if self._calm >= self.release:
            self.ratio = max(1.0 / self.psync, self.ratio - self.step_down)


class FullyAsyncDefaultPolicy:
    """verl fully_async's `default` dynamic-schedule policy (its module constants)."""

    DEFAULT_SWITCH_COST_S = 10.0
    INITIAL_PER_SAMPLE_TIME_S = 1000.0
    activation_in_sync = True  # `_fit_update_weights` activates the replicas before the trainer goes on

    def __init__(self, batch: int, ratio: float = 0.3):
        self.batch, self.ratio = batch, ratio
        self._switch_costs: deque = deque(maxlen=3)
        self._per_sample = self.INITIAL_PER_SAMPLE_TIME_S

    def threshold(self) -> int:
        return max(0, int(self.batch * self.ratio))

    def cycle_switched(self, seconds: float) -> None:
        """verl's `update_after_step` keeps the cycle's activate + deactivate seconds when above zero, after the
        cycle's decision: the cold start's deactivation counts, and a decision weighs the cycles before it."""
        if seconds > 0:
            self._switch_costs.append(seconds)

    def step_ended(self, waits: StepWaits, ready_next: int, switch_cost_s: Optional[float]) -> bool:
        """`switch_cost_s` is not read: verl's policy weighs the cycles' own switching (`cycle_switched`)."""
        if waits.sequences > 0:
            self.ratio = min(1.0, self.ratio + min(0.1, max(0.02, waits.sequences / self.batch)))
            if waits.seconds > 0:
                self._per_sample = waits.seconds / waits.sequences
        else:
            self.ratio -= 0.02
        gap = self.ratio * self.batch - ready_next
        if gap <= 0:
            return False
        cost = sum(self._switch_costs) / len(self._switch_costs) if self._switch_costs else self.DEFAULT_SWITCH_COST_S
        return gap * self._per_sample > cost


def hybrid_switch(policy: str, batch: int, parameter_sync_step: int, total_gpus: int, rollout_gpus: int,
                  poll_s: float) -> Optional[HybridSwitch]:
    """The switch a `SystemSpec.hybrid_switch` names; None for `eager` (lend whenever the trainer waits)."""
    if policy == "separate_async":
        return SeparateAsyncSwitch(batch, parameter_sync_step, total_gpus, rollout_gpus, poll_s=poll_s)
    if policy == "fully_async_default":
        return FullyAsyncDefaultPolicy(batch)
    if policy == "eager":
        return None
    raise ValueError(f"hybrid_switch = {policy!r}: must be one of {' | '.join(SWITCH_POLICIES)}")

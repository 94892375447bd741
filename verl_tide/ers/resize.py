"""ERS resizing the Actor's training group: GPUs move between rollout and the trainer at the weight-sync boundary,
driven by the readiness signals, so that goodput does not depend on the split the job started with.

Why: moving ranks between rollout and Ref and lending the Actor's GPUs to rollout leave the Actor's own group as
the job started; a job started rollout-heavy stays trainer-bound (the simulator's WebShop at 0.75 of the GPUs for
rollout kept 47% of tide's best). The model of a step cycle, from the last one: the trainer trains `batch`
sequences in its busy time (the cycle less TWT), data parallel over its GPUs (linear); the rollout made
`rollout_capacity_rate` sequences per second of its working time: fewer ranks do the same work while it fits
(`ReadinessSignals.rollout_rate_with`), more ranks make more only where the rollout was saturated
(`advice.rollout_rate_with`). The split where the slower side is fastest is the target; a move goes there in one
resize (bounded to halving or doubling the Actor's group), only if it stood for `confirm` of the last `window`
cycles, repays its cost over the steps left, and not within `cooldown` cycles of the last (those cycles ran at the
old split).

Pure Python. The move itself (the Actor's state to host memory and back, the worker group rebuilt over the new
GPU set) is the caller's: the simulator models it; trainer `tide` does not resize yet (docs/limits.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from verl_tide.core.readiness import ReadinessSignals
from verl_tide.ers.advice import rollout_rate_with


@dataclass(frozen=True)
class ResizeInputs:
    rollout_gpus: int  # GPUs rolling out now (Ref ranks and lent GPUs excluded)
    actor_gpus: int  # the Actor's data-parallel GPUs
    batch: int  # sequences a step trains
    move_s: float  # seconds one resize stops the trainer (state out and back in, groups rebuilt)
    steps_left: int
    weight_kv_tokens: Optional[float] = None  # the model's weights in KV tokens (decode-bound saturation)
    kv_bound_min: float = 0.5
    gpus_per_replica: int = 1


@dataclass(frozen=True)
class ResizeDecision:
    actor_gpus: int  # the Actor's GPUs after the move (== now: no move)
    predicted_gain: float  # sequences per second at the target split over now's, minus 1
    reason: str

    def delta(self, now: int) -> int:
        return self.actor_gpus - now


def target_split(signals: ReadinessSignals, inputs: ResizeInputs) -> Optional[tuple[int, float, str]]:
    """(Actor GPUs where the slower side is fastest, its predicted gain, why); None when the last cycle does not
    say (no cycle, nothing measured)."""
    cycle_s, twt, rate = signals.cycle_s, signals.trainer_wait_s, signals.rollout_capacity_rate
    r0, a0, g = inputs.rollout_gpus, inputs.actor_gpus, inputs.gpus_per_replica
    if not cycle_s or not rate or r0 < g or a0 < 1:
        return None
    trainer_rate = inputs.batch / max(cycle_s - twt, 0.05 * cycle_s)  # sequences per second on a0 GPUs
    of = r0 // g

    def rollout(replicas: int) -> float:
        if replicas <= of:
            return signals.rollout_rate_with(replicas, of) or 0.0
        more = rollout_rate_with(signals, replicas, of, inputs.weight_kv_tokens, inputs.kv_bound_min)
        return more[0] if more is not None else rate  # not saturated: more replicas make no more

    def rate_at(actor: int) -> float:
        return min(rollout((r0 + a0 - actor) // g), trainer_rate * actor / a0)

    now = rate_at(a0)
    candidates = [a for a in range(max(1, (a0 + 1) // 2), min(2 * a0, r0 + a0 - g) + 1) if (a - a0) % g == 0]
    best = max(candidates, key=lambda a: (rate_at(a), -abs(a - a0)))
    gain = rate_at(best) / now - 1 if now > 0 else 0.0
    side = "the trainer" if trainer_rate < rollout(of) else "rollout"
    return best, gain, (f"{side} bounds the cycle: rollout {rollout(of):.2f} seq/s on {r0} GPU(s), the trainer "
                        f"{trainer_rate:.2f} seq/s on {a0}")


@dataclass
class TrainerResizer:
    """The resize decision with the state it carries between boundaries (recent targets, the last move)."""

    min_gain: float = 0.05
    confirm: int = 2
    window: int = 3
    cooldown: int = 2  # cycles after a move before the next (they ran, at least partly, at the old split)
    _recent: list[Optional[int]] = field(default_factory=list)
    _since_move: int = 1 << 30

    def decide(self, signals: ReadinessSignals, inputs: ResizeInputs, eval_cycle: bool = False) -> ResizeDecision:
        a0 = inputs.actor_gpus
        self._since_move += 1
        target = None if eval_cycle else target_split(signals, inputs)  # an evaluation starves the trainer by design
        wanted = target[0] if target is not None and target[1] >= self.min_gain and target[0] != a0 else None
        self._recent = [*self._recent, wanted][-self.window:]
        if target is None:
            return ResizeDecision(a0, 0.0, "no move: the last cycle says nothing (evaluation, or nothing measured)")
        best, gain, why = target
        if wanted is None:
            return ResizeDecision(a0, gain, f"no move: {why}; best split within {self.min_gain:.0%}")
        same_way = [w for w in self._recent if w is not None and (w > a0) == (best > a0)]
        if len(same_way) < self.confirm:
            return ResizeDecision(a0, gain, f"not yet: {why}; Actor {a0} -> {best} GPU(s) stood {len(same_way)} of "
                                            f"{self.confirm} cycles")
        if self._since_move <= self.cooldown:
            return ResizeDecision(a0, gain, f"not yet: {self._since_move} cycle(s) since the last move")
        saved = signals.cycle_s * (1 - 1 / (1 + gain)) * inputs.steps_left  # a cycle shorter by the gain, each step
        if saved <= inputs.move_s:
            return ResizeDecision(a0, gain, f"no move: {why}; {saved:.1f}s saved over {inputs.steps_left} steps "
                                            f"does not repay a {inputs.move_s:.1f}s resize")
        self._since_move, self._recent = 0, []
        return ResizeDecision(best, gain, f"resize: Actor {a0} -> {best} GPU(s), {gain:+.0%} predicted ({why}; "
                                          f"{saved:.0f}s saved over {inputs.steps_left} steps, resize "
                                          f"{inputs.move_s:.1f}s)")

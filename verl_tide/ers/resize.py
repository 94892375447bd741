"""ERS resizing the Actor's training group: GPUs move between rollout and the trainer at the weight-sync boundary,
driven by the readiness signals, so that goodput does not depend on the split the job started with.

Why: moving ranks between rollout and Ref and lending the Actor's GPUs to rollout leave the Actor's own group as
the job started; a job started rollout-heavy stays trainer-bound (the simulator's WebShop at 0.75 of the GPUs for
rollout kept 47% of tide's best). The model of a step cycle, from the last one (the rollout's figures pooled over
the cycles run at this split, the run's cold start left out): the trainer trains `batch`
sequences in its busy time (the cycle less TWT), data parallel over its GPUs (linear); the rollout made
`rollout_capacity_rate` sequences per second of its working time: fewer ranks do the same work while it fits
(`ReadinessSignals.rollout_rate_with`), more ranks make more only where the rollout was saturated
(`advice.rollout_rate_with`), and never fewer than the KV its tasks held at once needs unless it already waited for
KV (`ReadinessSignals.kv_fits`: below that it pauses and re-prefills tasks; the simulator's ALFWorld from an even
split moved to 7 of 32 rollout GPUs, where a proportional model promised 20 seq/s and the rollout made 6). The
split where the slower side is fastest is the target; a move goes there in one
resize (bounded to halving or doubling the Actor's group), only if it stood for `confirm` of the last `window`
cycles, repays its cost over the steps left, and not within `cooldown` cycles of the last (those cycles ran at the
old split).

The model's prediction is one cycle's extrapolation and can be wrong by more than the gain it predicts; acted on
alone it walks back and forth (the simulator's WebShop from a rollout-starved start: ten resizes, half of them
reversals). So every split the Actor has run at keeps its measured rate (sequences per cycle second, cycles past
the cooldown), and a move stays inside the bracket those rates give: the goodput curve over the split has one
peak, so a measured split worse than the best measured one bounds the search on its side. A target that was
measured moves only if its measured rate beats the current one, and the best measured split wins over staying at
one measured worse.

Pure Python. The move itself (the Actor's state to host memory and back, the worker group rebuilt over the new
GPU set) is the caller's: the simulator models it; trainer `tide` applies it with `trainer/resize.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
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
    mini_batch: Optional[int] = None  # sequences in a PPO mini-batch: verl splits it evenly over the Actor's GPUs
    max_staleness: int = 0  # versions a trajectory may lag: the cold start rolls out 1 + this many steps' groups


@dataclass(frozen=True)
class ResizeDecision:
    actor_gpus: int  # the Actor's GPUs after the move (== now: no move)
    predicted_gain: float  # sequences per second at the target split over now's, minus 1
    reason: str

    def delta(self, now: int) -> int:
        return self.actor_gpus - now


def _trainer_rate(signals: ReadinessSignals, inputs: ResizeInputs) -> float:
    """Sequences per second on the Actor's GPUs now: the batch over the trainer's busy time (the cycle less TWT)."""
    return inputs.batch / max(signals.cycle_s - signals.trainer_wait_s, 0.05 * signals.cycle_s)


def target_split(signals: ReadinessSignals, inputs: ResizeInputs,
                 within: tuple[float, float] = (0, float("inf"))) -> Optional[tuple[int, float, str]]:
    """(Actor GPUs where the slower side is fastest, its predicted gain, why); None when the last cycle does not
    say (no cycle, nothing measured). `within`: the open interval of Actor GPU counts a target may take."""
    cycle_s, twt, rate = signals.cycle_s, signals.trainer_wait_s, signals.rollout_capacity_rate
    r0, a0, g = inputs.rollout_gpus, inputs.actor_gpus, inputs.gpus_per_replica
    if not cycle_s or not rate or r0 < g or a0 < 1:
        return None
    trainer_rate = _trainer_rate(signals, inputs)
    of = r0 // g

    def rollout(replicas: int) -> float:
        if replicas < of and not signals.kv_fits(replicas, inputs.kv_bound_min):
            return 0.0  # the work in flight would not fit: tasks pause and re-prefill, at a rate nothing measured
        if replicas <= of:
            return signals.rollout_rate_with(replicas, of) or 0.0
        more = rollout_rate_with(signals, replicas, of, inputs.weight_kv_tokens, inputs.kv_bound_min)
        return more[0] if more is not None else rate  # not saturated: more replicas make no more

    def rate_at(actor: int) -> float:
        return min(rollout((r0 + a0 - actor) // g), trainer_rate * actor / a0)

    now = rate_at(a0)
    candidates = [a for a in range(max(1, (a0 + 1) // 2), min(2 * a0, r0 + a0 - g) + 1)
                  if (a - a0) % g == 0 and (a == a0 or within[0] < a < within[1])
                  and (a == a0 or inputs.mini_batch is None or inputs.mini_batch % a == 0)]
    best = max(candidates, key=lambda a: (rate_at(a), -abs(a - a0)))
    gain = rate_at(best) / now - 1 if now > 0 else 0.0
    side = "the trainer" if trainer_rate < rollout(of) else "rollout"
    return best, gain, (f"{side} bounds the cycle: rollout {rollout(of):.2f} seq/s on {r0} GPU(s), the trainer "
                        f"{trainer_rate:.2f} seq/s on {a0}")


def probe_split(signals: ReadinessSignals, inputs: ResizeInputs, within: tuple[float, float] = (0, float("inf")),
                measured: frozenset[int] = frozenset(), trainer_wait_share: float = 0.25,
                trainer_bound_share: float = 0.05) -> Optional[tuple[int, float, str]]:
    """(Actor GPUs, gain, why) for a move the model cannot predict; None where there is none. The cycles measured
    after it decide whether it stays; a split that measured worse closes the bracket on its side, so each way is
    tried once.

    - **Toward rollout**: the model gives an unsaturated rollout nothing from more ranks, yet a trainer that waits a
      good share of the cycle for it says rollout bounds the cycle, and more engines may still help it (shorter
      decode steps on smaller batches, more trajectories at once beside a slow environment: the simulator's OSWorld
      from an even split gains 12% at 0.625). A quarter of the Actor's GPUs go to rollout; the gain assumes
      rollout scales with its GPUs (an upper bound).
    - **Toward the trainer**: a trainer that never waits bounds the cycle, and an unsaturated rollout (no work
      waiting for KV, the weights' read dominating its decode steps) makes what the trainer consumes, not what it
      could: its measured rate is the trainer's pace, and the model's work-conserving share gives fewer ranks
      proportionally less (the simulator's WebShop at 22 Actor GPUs read 40 seq/s on 10 rollout GPUs and predicted
      32 on 8; at 8 the rollout kept the 24 Actor GPUs fed, 7% faster a cycle). A quarter of the rollout's GPUs go
      to the Actor, never below the KV its work held at once; the gain assumes the trainer scales with its GPUs
      and the rollout keeps pace (an upper bound)."""
    cycle_s, twt, rate = signals.cycle_s, signals.trainer_wait_s, signals.rollout_capacity_rate
    r0, a0, g = inputs.rollout_gpus, inputs.actor_gpus, inputs.gpus_per_replica
    if not cycle_s or not rate or r0 < g:
        return None

    def allowed(a: int) -> bool:
        return within[0] < a < within[1] and a not in measured and (inputs.mini_batch is None
                                                                    or inputs.mini_batch % a == 0)

    if twt >= trainer_wait_share * cycle_s:
        sizes = [a for a in range(a0 - max(g, (a0 // 4) // g * g), 0, -g) if allowed(a)]
        if not sizes:
            return None
        to, trainer_rate = sizes[0], _trainer_rate(signals, inputs)
        rollout_now = signals.rollout_rate_with(r0 // g, r0 // g) or rate
        now = min(rollout_now, trainer_rate)
        at = min(rollout_now * (r0 + a0 - to) / r0, trainer_rate * to / a0)
        return to, at / now - 1 if now > 0 else 0.0, (f"rollout bounds the cycle (the trainer waited {twt:.0f} of "
                                                      f"{cycle_s:.0f} s) and was not saturated: {to} GPU(s) tried")
    saturated = rollout_rate_with(signals, r0 // g + 1, r0 // g, inputs.weight_kv_tokens, inputs.kv_bound_min)
    if twt > trainer_bound_share * cycle_s or saturated is not None:
        return None
    most = min(a0 + max(g, (r0 // 4) // g * g), r0 + a0 - g)  # a quarter of rollout, never its last replica
    sizes = [a for a in range(most, a0, -g)
             if allowed(a) and signals.kv_fits((r0 + a0 - a) // g, inputs.kv_bound_min)]
    if not sizes:
        return None
    return sizes[0], sizes[0] / a0 - 1, (f"the trainer bounds the cycle (it waited {twt:.1f} of {cycle_s:.0f} s) "
                                         f"and the rollout was not saturated: {sizes[0]} GPU(s) tried")


@dataclass
class TrainerResizer:
    """The resize decision with the state it carries between boundaries (recent targets, the last move)."""

    min_gain: float = 0.05
    confirm: int = 2
    window: int = 3
    cooldown: int = 2  # cycles after a move before the next (they ran, at least partly, at the old split)
    memory: int = 4  # measured cycles kept per split (the newest: a run's phases change what a split gives)
    _recent: list[Optional[int]] = field(default_factory=list)
    # the run's first cycles are its cold start (the rollout from empty, the trainer waiting for its first groups):
    # they do not say what the start split gives, and counted they made it look worse than the split a first move
    # reached (the simulator's WebShop from its best start: one move away and never back, -7%)
    warmup: int = 1
    # an evaluation skews the cycle that runs it and the next: the rollout serves it first, and the training
    # groups it held back arrive in the next cycle (the simulator's ALFWorld read a 151 s cycle there where its
    # split ran 56 s ones; counted, it moved 7 GPUs to rollout and back). Neither is measured or decided on.
    eval_wake: int = 2
    _eval_cycles_left: int = 0
    _since_move: int = 1 << 30
    _cycles_seen: int = 0
    _measured: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # Actor GPUs -> (batch, cycle s)
    _cycles: dict[int, list[ReadinessSignals]] = field(default_factory=dict)  # Actor GPUs -> the same cycles' signals

    def measured_rate(self, actor_gpus: int) -> Optional[float]:
        """Sequences over the summed cycle seconds at this split: a mean of per-cycle rates would favour the short
        cycles where long and short ones alternate (groups that arrive together, a slow environment)."""
        cycles = self._measured.get(actor_gpus)
        return sum(b for b, _ in cycles) / sum(s for _, s in cycles) if cycles else None

    def pooled_signals(self, signals: ReadinessSignals, actor_gpus: int) -> ReadinessSignals:
        """The last cycle's signals with the rollout's figures pooled over the cycles run at this split (the
        cooldown's included: the rollout had its new ranks from the boundary on): one cycle's rollout rate swings
        with the groups that happened to finish in it (the simulator's WebShop at 8 rollout GPUs read 56.8, 7.5 and
        121.5 seq/s in three cycles), and a move planned on a high one overshoots (there: to 4 rollout GPUs and a
        256 s cycle). Each cycle weighs by its working time, as in the rate itself. The trainer's figures stay the
        last cycle's (steady at a split; the cooldown's first cycle holds the resize's stall). The KV the rollout held
        at once is the peak of those cycles: a lumpy workload's quiet cycle says nothing about what its busy one
        needs."""
        cycles = self._cycles.get(actor_gpus, [])  # each with a cycle_s: `decide` stores no other
        if len(cycles) < 2:
            return signals
        working = [max(c.cycle_s - c.rollout_wait_s, 0.0) for c in cycles]

        def weighted(name: str) -> Optional[float]:
            pairs = [(getattr(c, name), w) for c, w in zip(cycles, working) if getattr(c, name) is not None]
            total = sum(w for _, w in pairs)
            return sum(v * w for v, w in pairs) / total if pairs and total > 0 else getattr(signals, name)

        return replace(signals, rollout_capacity_rate=weighted("rollout_capacity_rate"),
                       rollout_utilization=weighted("rollout_utilization"),
                       rollout_kv_bound=weighted("rollout_kv_bound"),
                       rollout_decode_context=weighted("rollout_decode_context"),
                       rollout_kv_held_peak=max((c.rollout_kv_held_peak for c in cycles
                                                 if c.rollout_kv_held_peak is not None),
                                                default=signals.rollout_kv_held_peak))

    def best_measured(self) -> Optional[int]:
        rates = {a: self.measured_rate(a) for a in self._measured}
        return max(rates, key=lambda a: rates[a]) if rates else None

    def bracket(self) -> tuple[float, float]:
        """The open interval of Actor GPU counts where the peak can be: between the measured neighbours of the best
        measured split (one peak: a split measured worse than the best bounds the search on its side)."""
        best = self.best_measured()
        if best is None:
            return 0, float("inf")
        rates = self._measured
        return max((a for a in rates if a < best), default=0), min((a for a in rates if a > best),
                                                                   default=float("inf"))

    def _overruled_by_the_run(self, target: tuple[int, float, str], a0: int) -> tuple[int, float, str]:
        """The model's (target, gain, why) where the measured splits say otherwise, once this split has a measured
        cycle (until then nothing says it is worse): stay at a split measured worse than the best -> the best; a
        move past the best -> stop at the best; a move to a split that ran -> its measured gain."""
        best_run, (to, gain, why) = self.best_measured(), target
        if best_run is not None and best_run != a0 and self.measured_rate(a0) is not None \
                and (to == a0 or min(a0, to) < best_run < max(a0, to)):
            to, why = best_run, f"{why}; {best_run} GPU(s) measured best" + ("" if to == a0 else f" on the way to {to}")
        if to != a0 and self.measured_rate(to) and self.measured_rate(a0):
            gain = self.measured_rate(to) / self.measured_rate(a0) - 1  # both ran: trust the run
            why = f"{why}; measured {gain:+.0%} at {to}"
        return to, gain, why

    def cold_start_move(self, signals: ReadinessSignals, inputs: ResizeInputs) -> Optional[tuple[int, float, str]]:
        """(target, gain, why) of a move the cold start's cycle settles alone, else None. The rollout starts the
        groups of 1 + `max_staleness` steps at once and the cycle counts only the first step's ready: its rate is
        a lower bound, up to 1 + `max_staleness` times low. Where the model moves the same way at both ends of
        that range, the smaller of the two moves goes now, without a second cycle to confirm it (the simulator's
        WebShop from 4 rollout GPUs of 32: a 434 s cold start, then a 196 s second cycle before the confirmed
        move; OSWorld from 12 of 32 read its second cycle as a reason to go back to the start split)."""
        rate = signals.rollout_capacity_rate
        if not rate or inputs.max_staleness < 1:
            return None
        ends = [target_split(replace(signals, rollout_capacity_rate=rate * k), inputs)
                for k in (1, 1 + inputs.max_staleness)]
        a0 = inputs.actor_gpus
        if any(t is None or t[0] == a0 or t[1] < self.min_gain for t in ends) \
                or (ends[0][0] > a0) != (ends[1][0] > a0):
            return None
        to, gain, why = min(ends, key=lambda t: abs(t[0] - a0))
        return to, gain, f"{why}; the cold start's rollout rate up to {1 + inputs.max_staleness}x as high moves too"

    def decide(self, signals: ReadinessSignals, inputs: ResizeInputs, eval_next: bool = False) -> ResizeDecision:
        """At a post-update boundary, from the cycle that just ended; `eval_next`: an evaluation runs in the next
        cycle (no move before it: the rollout serves it)."""
        a0 = inputs.actor_gpus
        self._since_move += 1
        self._cycles_seen += 1
        eval_cycle = self._eval_cycles_left > 0
        self._eval_cycles_left = self.eval_wake if eval_next else max(0, self._eval_cycles_left - 1)
        measured = not eval_cycle and signals.cycle_s and self._cycles_seen > self.warmup
        if measured and self._since_move > self.cooldown:
            self._measured[a0] = [*self._measured.get(a0, []), (inputs.batch, signals.cycle_s)][-self.memory:]
        if measured:  # the rollout ran at this split through the cooldown's cycles too
            self._cycles[a0] = [*self._cycles.get(a0, []), signals][-self.memory:]
            signals = self.pooled_signals(signals, a0)
        # an evaluation starves the trainer by design: its cycles say nothing, and no move goes before it
        target = None if eval_cycle or eval_next else target_split(signals, inputs, self.bracket())
        if target is not None:
            target = self._overruled_by_the_run(target, a0)
        if target is not None and (target[0] == a0 or target[1] < self.min_gain):
            target = probe_split(signals, inputs, self.bracket(), frozenset(self._measured)) or target
        cold = None if eval_cycle or eval_next or self._cycles_seen > self.warmup \
            else self.cold_start_move(signals, inputs)
        target = cold or target
        wanted = target[0] if target is not None and target[1] >= self.min_gain and target[0] != a0 else None
        self._recent = [*self._recent, wanted][-self.window:]
        if target is None:
            why = ("an evaluation follows" if eval_next else "the last cycle ran an evaluation or its wake" if eval_cycle
                   else "the last cycle says nothing (nothing measured)")
            return ResizeDecision(a0, 0.0, f"no move: {why}")
        best, gain, why = target
        if wanted is None:
            return ResizeDecision(a0, gain, f"no move: {why}; best split within {self.min_gain:.0%}")
        same_way = [w for w in self._recent if w is not None and (w > a0) == (best > a0)]
        if cold is None and len(same_way) < self.confirm:
            return ResizeDecision(a0, gain, f"not yet: {why}; Actor {a0} -> {best} GPU(s) stood {len(same_way)} of "
                                            f"{self.confirm} cycles")
        if self._since_move <= self.cooldown:
            return ResizeDecision(a0, gain, f"not yet: {self._since_move} cycle(s) since the last move")
        # a cycle shorter by the gain, each step; the cycle as this split measured it, else the last one
        rate_now = self.measured_rate(a0)
        cycle_s = inputs.batch / rate_now if rate_now else signals.cycle_s
        saved = cycle_s * (1 - 1 / (1 + gain)) * inputs.steps_left
        if saved <= inputs.move_s:
            return ResizeDecision(a0, gain, f"no move: {why}; {saved:.1f}s saved over {inputs.steps_left} steps "
                                            f"does not repay a {inputs.move_s:.1f}s resize")
        self._since_move, self._recent = 0, []
        return ResizeDecision(best, gain, f"resize: Actor {a0} -> {best} GPU(s), {gain:+.0%} predicted ({why}; "
                                          f"{saved:.0f}s saved over {inputs.steps_left} steps, resize "
                                          f"{inputs.move_s:.1f}s)")

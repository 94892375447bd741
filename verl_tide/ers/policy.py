"""ERS's scaling policy: one plan per step, after the actor update and before the weight sync.

Pure Python. It reads the shared `ReadinessSignals` and the current role of every elastic rank
and returns a `ScalingPlan` that says which ranks move, which RA2P mode the next step uses, the
elastic batch size, and why. Noise protection: a direction must be seen on `confirm_steps`
consecutive plans before a rank moves, a moved rank may not move back within
`cooldown_steps`, and at most `max_moves_per_step` ranks move per plan.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from verl_tide.core.config import ERSConfig
from verl_tide.core.readiness import ReadinessSignals
from verl_tide.ra2p.cost import RA2PMode


class Role(str, Enum):
    ROLLOUT = "rollout"
    REF = "ref"


class Phase(str, Enum):
    TRAIN = "train"
    COLD_START = "cold_start"  # buffer empty at job start: generation dominates
    EVAL = "eval"  # evaluation tasks running: generation dominates


# RA2P's cost model as ERS asks it: for at most this many Ref ranks, (the fewest with which a mode using them beats
# colocated or None, the step-time saving of the next move toward that count or None); `ra2p.cost.ref_rank_outlook`.
RefRankOutlook = Callable[[int], tuple[Optional[int], Optional[float]]]


@dataclass(frozen=True)
class RankMove:
    rank: int
    src: Role
    dst: Role


@dataclass(frozen=True)
class ScalingPlan:
    step: int
    moves: tuple[RankMove, ...]
    ra2p_mode: RA2PMode
    batch_size: int
    retain_ready_data: bool  # after a rollout scale-down, keep ready data instead of dropping it as stale
    reason: str


@dataclass
class ERSPolicy:
    config: ERSConfig
    ideal_batch: int  # resolved B_ideal (config value or data.train_batch_size)
    confirm_steps: int = 2
    _last_moved: dict[int, tuple[int, Role]] = field(default_factory=dict)  # rank -> (step, role it left)
    _streak: tuple[Optional[Role], int] = (None, 0)  # (direction's destination, consecutive plans)
    _borrowed: int = 0  # Ref ranks evaluation took back to rollout, owed to Ref once it is over
    _returned: tuple[int, int] = (-1, 0)  # (step, ranks) of the last plan that paid some of that back

    def __post_init__(self) -> None:
        if self.ideal_batch < 1:
            raise ValueError(f"ERSPolicy.ideal_batch = {self.ideal_batch}: must be >= 1")
        if self.confirm_steps < 1:
            raise ValueError(f"ERSPolicy.confirm_steps = {self.confirm_steps}: must be >= 1")

    @property
    def min_batch(self) -> int:
        return min(self.config.min_batch or self.ideal_batch, self.ideal_batch)

    @staticmethod
    def mini_batches(batch: int, per_mini_batch: int, most: int) -> int:
        """The elastic batch (sequences) in whole mini-batches of `per_mini_batch` sequences, 1 to `most` (the
        trainer's mini-batches per weight-sync window): rounded up, so at least `batch` sequences train."""
        if per_mini_batch < 1 or most < 1:
            raise ValueError(f"per_mini_batch = {per_mini_batch}, most = {most}: both must be >= 1")
        return max(1, min(most, -(-batch // per_mini_batch)))

    def elastic_batch(self, ready_volume: int) -> int:
        """Consume what is ready, within [B_min, B_ideal]."""
        return max(self.min_batch, min(ready_volume, self.ideal_batch))

    def plan(self, step: int, signals: ReadinessSignals, roles: Mapping[int, Role],
             phase: Phase = Phase.TRAIN, ref_outlook: Optional[RefRankOutlook] = None,
             elastic_ref: bool = True, ref_floor: int = 0) -> ScalingPlan:
        """`ref_outlook`: RA2P's cost model on the last step's arrivals, asked only when a move to Ref is on the
        table (a confirmed consumption deficit; most plans never ask, which keeps them far inside 1 ms), for as
        many Ref ranks as rollout can spare: it says with how many Ref ranks a mode using them (decoupled, or
        split) beats colocated, and the saving of the next move toward that count. Ranks move to Ref only while
        that count can be reached without making rollout the bottleneck, and not for a saving below
        `tide.ers.min_ref_gain`. None: unknown (no measured stage times yet); the signals alone decide.
        `elastic_ref`: whether a rank moved to Ref would have Ref work (a Ref model and a Ref pool that
        takes replicas); without it no rank moves to Ref. `ref_floor`: Ref ranks that never move back, in
        any phase (Ref has no ranks of its own)."""
        batch = self.elastic_batch(signals.ready_volume)
        if not self.config.enabled:
            return self._hold(step, roles, batch, "ERS disabled")
        if phase is not Phase.TRAIN:
            # Preemptive rollout allocation: do not wait for RAS/TPRM to show starvation; evaluation
            # borrows even the min_ref_ranks back.
            self._streak = (None, 0)
            moves = self._moves(step, roles, Role.REF, Role.ROLLOUT, keep_ref=ref_floor)
            if phase is Phase.EVAL:
                self._borrowed += len(moves)
            return self._finish(step, moves, RA2PMode.COLOCATED, batch, False,
                                f"{phase.value}: generation dominates, preemptively maximize rollout")
        returned = self._return_borrowed(step, signals, roles, batch, elastic_ref)
        if returned is not None:
            return returned
        n_ref = sum(1 for r in roles.values() if r is Role.REF)
        if elastic_ref and n_ref < self.config.min_ref_ranks:
            moves = self._moves(step, roles, Role.ROLLOUT, Role.REF)
            if moves:
                self._streak = (None, 0)
                return self._finish(step, moves, RA2PMode.DECOUPLED, batch, True,
                                    f"{n_ref} Ref rank(s) < tide.ers.min_ref_ranks {self.config.min_ref_ranks}; "
                                    f"move {len(moves)} rollout -> ref")
        if signals.generation_deficit and not signals.consumption_deficit:
            want, mode = Role.ROLLOUT, RA2PMode.COLOCATED
            why = f"generation deficit: {signals.ready_volume} ready < B_ideal {self.ideal_batch}"
        elif signals.consumption_deficit and not signals.generation_deficit:
            want, mode = Role.REF, RA2PMode.DECOUPLED
            why = (f"consumption deficit: HoL {signals.hol_latency:.2f}s, RAS {signals.ready_at_start}, "
                   f"{signals.ready_volume} ready")
        else:
            self._streak = (None, 0)
            state = "both deficits" if signals.generation_deficit else "balanced"
            return self._hold(step, roles, batch, f"{state}: no move")
        if want is Role.REF and not elastic_ref:
            self._streak = (None, 0)
            return self._finish(step, (), mode, batch, False,
                                f"{why}; no move: a Ref rank would have no Ref work (no Ref model, or "
                                "tide.ra2p.ref_ranks = 0)")
        dest, count = self._streak
        self._streak = (want, count + 1 if dest is want else 1)
        if self._streak[1] < self.confirm_steps:
            return self._finish(step, (), mode, batch, False,
                                f"{why}; waiting for confirmation ({self._streak[1]}/{self.confirm_steps})")
        src = Role.ROLLOUT if want is Role.REF else Role.REF
        if want is Role.REF:
            short = self._ref_move_would_not_pay(signals, roles, ref_outlook)
            if short:
                self._streak = (None, 0)
                return self._finish(step, (), mode, batch, False, f"{why}; no move: {short}")
        moves = self._moves(step, roles, src, want, keep_ref=max(self.config.min_ref_ranks, ref_floor))
        if not moves:
            return self._finish(step, (), mode, batch, False, f"{why}; no {src.value} rank may move (limits/cooldown)")
        return self._finish(step, moves, mode, batch, want is Role.REF, f"{why}; move {len(moves)} {src.value} -> {want.value}")

    def _return_borrowed(self, step: int, signals: ReadinessSignals, roles: Mapping[int, Role], batch: int,
                         elastic_ref: bool) -> Optional[ScalingPlan]:
        """After an evaluation, the Ref ranks it borrowed go back (one move a step, cooldown kept) without the
        confirmation and the capacity check a new move needs: the split before it was ERS's, checked then.
        Found in the simulator (WebShop, 8 GPUs x 100 steps): re-earning the move took 2 to 12 steps after each
        evaluation (the capacity check is work-conserving, so cautious), 39 of 100 steps at the slower split.
        A generation deficit now cancels the debt: the split has to be earned again."""
        if not self._borrowed:
            return None
        if signals.generation_deficit or not elastic_ref:
            self._borrowed = 0
            return None
        moves = self._moves(step, roles, Role.ROLLOUT, Role.REF)
        if not moves:
            return None  # a rank in cooldown: next step
        self._borrowed -= len(moves)
        self._returned = (step, len(moves))
        self._streak = (None, 0)
        return self._finish(step, moves, RA2PMode.DECOUPLED, batch, True,
                            f"evaluation over: {len(moves)} borrowed rank(s) back rollout -> ref")

    def _ref_move_would_not_pay(self, signals: ReadinessSignals, roles: Mapping[int, Role],
                                ref_outlook: Optional[RefRankOutlook]) -> str:
        """Why moving a rank from rollout to Ref would not pay ('' if it would).

        A backlog (HoL, RAS) says the trainer was behind, not that rollout can spare a rank: found in the
        simulator, where ERS drained the backlog by moving ranks to Ref and then starved the trainer. The
        remaining ranks must still produce a batch per step at the rate measured while rollout worked (the
        same rate while the ranks' busy time fits on fewer: `ReadinessSignals.rollout_rate_with`), and
        a Ref rank helps only once there are enough of them for a mode using them to beat colocated (until
        then it idles), so the move must lead there."""
        step_s = signals.mean_step_time
        n = sum(1 for r in roles.values() if r is Role.ROLLOUT)
        n_ref = len(roles) - n
        spare = None  # ranks rollout can give up and still make what the trainer consumes; None: unknown
        if signals.rollout_capacity_rate is not None and step_s and n > 1:
            need = self.ideal_batch / step_s
            spare = 0
            while spare + 1 < n and signals.rollout_rate_with(n - spare - 1, n) >= need:
                spare += 1
            if spare == 0:
                busy = signals.rollout_utilization
                return (f"{n - 1} rollout rank(s) would make {signals.rollout_rate_with(n - 1, n):.2f} seq/s, below "
                        f"the {need:.2f} seq/s the trainer consumes" + (f" (rollout busy {busy:.0%})"
                                                                        if busy is not None else ""))
        if ref_outlook is None:
            return ""
        reach = len(roles) if spare is None else n_ref + spare
        needed, saving = ref_outlook(reach)
        if needed is None:
            return (f"no count of Ref ranks up to {reach} beats colocated" +
                    ("" if spare is None else f" (rollout can spare {spare}, with {n_ref} already Ref)"))
        if spare is not None and n_ref + spare < needed:  # an outlook beyond `reach` (e.g. a fixed answer)
            return f"Ref ranks pay from {needed}, rollout can spare {spare} (with {n_ref} already Ref)"
        if saving is not None and saving < self.config.min_ref_gain:
            return (f"one more Ref rank saves {saving:.1%} of the step, below tide.ers.min_ref_gain "
                    f"{self.config.min_ref_gain:.1%}")
        return ""

    def state_dict(self) -> dict:
        """What a resumed job needs to keep ERS's cooldowns: each rank's last move (step, role it left)."""
        return {"last_moved": {str(r): [s, role.value] for r, (s, role) in self._last_moved.items()}}

    def load_state_dict(self, state: dict) -> None:
        self._last_moved = {int(r): (int(s), Role(role)) for r, (s, role) in state.get("last_moved", {}).items()}

    def cancel(self, plan: ScalingPlan) -> None:
        """The plan's moves were not carried out (the job ends, or no rank can host Ref): no cooldown from them."""
        for m in plan.moves:
            if self._last_moved.get(m.rank) == (plan.step, m.src):
                del self._last_moved[m.rank]
        if self._returned[0] == plan.step:  # still owed
            self._borrowed += self._returned[1]
            self._returned = (-1, 0)

    def _hold(self, step: int, roles: Mapping[int, Role], batch: int, reason: str) -> ScalingPlan:
        mode = RA2PMode.DECOUPLED if any(r is Role.REF for r in roles.values()) else RA2PMode.COLOCATED
        return ScalingPlan(step, (), mode, batch, False, reason)

    def _finish(self, step: int, moves: tuple[RankMove, ...], mode: RA2PMode, batch: int, retain: bool,
                reason: str) -> ScalingPlan:
        for m in moves:
            self._last_moved[m.rank] = (step, m.src)
        if moves:
            self._streak = (None, 0)
        return ScalingPlan(step, moves, mode, batch, retain, reason)

    def _moves(self, step: int, roles: Mapping[int, Role], src: Role, dst: Role,
               keep_ref: int = 0) -> tuple[RankMove, ...]:
        """Up to the per-step budget of `src` ranks not in cooldown; a Ref source keeps `keep_ref` Ref ranks."""
        n_rollout = sum(1 for r in roles.values() if r is Role.ROLLOUT)
        n_ref = len(roles) - n_rollout
        if src is Role.ROLLOUT:
            budget = n_rollout - self.config.min_rollout_ranks
            if self.config.max_ref_ranks is not None:
                budget = min(budget, self.config.max_ref_ranks - n_ref)
        else:
            budget = n_ref - keep_ref
        budget = min(budget, self.config.max_moves_per_step)
        moves: list[RankMove] = []
        for rank in sorted(roles, reverse=src is Role.ROLLOUT):  # highest rollout ranks leave first
            if len(moves) >= budget:
                break
            if roles[rank] is not src or self._in_cooldown(rank, step, dst):
                continue
            moves.append(RankMove(rank, src, dst))
        return tuple(moves)

    def _in_cooldown(self, rank: int, step: int, dst: Role) -> bool:
        last = self._last_moved.get(rank)
        return last is not None and last[1] is dst and step - last[0] < self.config.cooldown_steps

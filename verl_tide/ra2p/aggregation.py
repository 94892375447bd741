"""RA2P's ready-batch aggregation (colocated mode, paper Sec. 5.1): one Ref pass per burst of ready groups.

When Ref and Actor take turns on the same ranks, verl runs a Ref pass (a Ref<->Actor swap) for every
mini-batch it trains. With aggregation, the Ref pass for a mini-batch also scores every other GRPO
group that is already ready and will be trained in the same weight-sync window, so the next
mini-batches find their ref log-probs waiting and need no swap. Ref is frozen, so scoring a sample
early gives the same log-probs as scoring it late.

Pure Python: sample keys are opaque strings, groups are (uid, keys) in the order the replay buffer
will sample them. `RefAggregator` remembers which samples already carry ref log-probs, so a batch
never mixes samples with and without them (decoupled steps need none to carry them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class AggregationCounters:
    bursts: int = 0  # Ref passes run
    samples_scored: int = 0  # samples those passes scored
    samples_ahead: int = 0  # of them, scored before their mini-batch was sampled
    batches_without_ref_pass: int = 0  # mini-batches whose samples were all scored already (a swap saved)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class RefAggregator:
    """Which samples carry ref log-probs, and which samples the next Ref burst scores."""

    scored: set[str] = field(default_factory=set)  # carry ref log-probs, not trained yet
    counters: AggregationCounters = field(default_factory=AggregationCounters)

    def any_scored(self, keys: Iterable[str]) -> bool:
        return any(k in self.scored for k in keys)

    def burst(self, batch_keys: Sequence[str], ready_groups: Sequence[tuple[str, Sequence[str]]],
              max_groups: Optional[int]) -> tuple[list[str], list[str]]:
        """The samples one Ref pass scores now: the mini-batch's own samples that lack ref log-probs, then
        the samples of up to `max_groups` other ready groups (in sampling order) that lack them.
        Returns (the batch's samples, the samples ahead). Nothing to score -> ([], [])."""
        if max_groups is not None and max_groups < 0:
            raise ValueError(f"max_groups = {max_groups}: must be >= 0 or None")
        in_batch = set(batch_keys)
        own = [k for k in batch_keys if k not in self.scored]
        if not own:
            return [], []  # everything was scored by an earlier burst: no Ref pass for this mini-batch
        ahead: list[str] = []
        taken = 0
        for _uid, keys in ready_groups:
            if max_groups is not None and taken >= max_groups:
                break
            todo = [k for k in keys if k not in in_batch and k not in self.scored]
            if todo:
                ahead.extend(todo)
                taken += 1
        return own, ahead

    def record_burst(self, own: Sequence[str], ahead: Sequence[str]) -> None:
        """The Ref pass over `own + ahead` succeeded (ref log-probs written)."""
        self.counters.bursts += 1
        self.counters.samples_scored += len(own) + len(ahead)
        self.counters.samples_ahead += len(ahead)
        self.scored.update(own)
        self.scored.update(ahead)

    def trained(self, batch_keys: Sequence[str], ref_pass_ran: bool) -> None:
        """The mini-batch went to the Actor: its samples leave the buffer for good."""
        if not ref_pass_ran:
            self.counters.batches_without_ref_pass += 1
        self.scored.difference_update(batch_keys)

    def forget(self, keys: Iterable[str]) -> None:
        """Samples evicted from the buffer (stale, filtered, failed) will never be trained."""
        self.scored.difference_update(keys)

    def state_dict(self) -> dict[str, Any]:
        return {"scored": sorted(self.scored), "counters": self.counters.as_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scored = set(state.get("scored", []))
        self.counters = AggregationCounters(**state.get("counters", {}))


def trim_to_multiple(ahead: Sequence[str], multiple: int, base: int) -> list[str]:
    """The longest prefix of `ahead` with (base + its length) a multiple of `multiple` (verl's Ref worker
    group splits a pass evenly over its data-parallel ranks)."""
    if multiple < 1:
        raise ValueError(f"multiple = {multiple}: must be >= 1")
    keep = len(ahead) - (base + len(ahead)) % multiple
    return list(ahead[:max(keep, 0)])


def split_ref_pass(own: Sequence[str], ahead: Sequence[str], share: float,
                   multiple: int) -> tuple[list[str], list[str], list[str]]:
    """RA2P split mode: (verl's own part, verl's ahead part, the Ref replicas' part) of one Ref pass. The
    replicas take `share` of it from the end: samples scored ahead first, for which no backward waits yet.
    verl's Ref worker group splits its part evenly over its data-parallel ranks, so that part is a multiple
    of `multiple`, the one nearest to 1 - share (on a tie, the replicas take more)."""
    if not 0 <= share <= 1:
        raise ValueError(f"share = {share!r}: must be 0 <= x <= 1")
    if multiple < 1:
        raise ValueError(f"multiple = {multiple}: must be >= 1")
    keys = [*own, *ahead]
    n = len(keys)
    target = n - min(n, math.ceil(share * n))
    down = target // multiple * multiple
    up = min(down + multiple, n // multiple * multiple)
    n_verl = up if up - target < target - down else down
    verl = keys[:n_verl]
    return verl[:len(own)], verl[len(own):], keys[n_verl:]


def rank_aligned_order(own: Sequence[str], ahead: Sequence[str], ranks: int) -> list[str]:
    """A Ref pass's samples in the order that gives data-parallel rank r (an even, contiguous share of the pass)
    the r-th share of `own`, which the Actor's rank r in the same process trains next, plus the r-th share of
    `ahead`: with the colocated hand-off, the mini-batch's rows and inputs are then already in the process that
    trains them. Unchanged (`own + ahead`) when either does not split evenly."""
    if ranks < 1:
        raise ValueError(f"ranks = {ranks}: must be >= 1")
    if len(own) % ranks or len(ahead) % ranks:
        return [*own, *ahead]
    a, b = len(own) // ranks, len(ahead) // ranks
    return [k for r in range(ranks) for k in (*own[r * a:(r + 1) * a], *ahead[r * b:(r + 1) * b])]


def window_groups_left(parameter_sync_step: int, local_trigger_step: int, groups_per_mini_batch: int) -> int:
    """Ready groups the rest of this weight-sync window will train, beyond the current mini-batch."""
    return max(0, parameter_sync_step - local_trigger_step - 1) * groups_per_mini_batch

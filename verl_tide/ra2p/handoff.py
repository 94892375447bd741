"""RA2P colocated hand-off: ref log-probs go from Ref to the Actor's backward without TransferQueue.

verl's colocated path writes a Ref pass's log-probs to TransferQueue from the Ref workers, reads them
back into the driver, converts and writes them again as `ref_log_prob`, and the Actor workers read
them once more: four serializations for rows that were computed in the Actor's own process (verl
builds its Actor and Ref roles into one worker process per rank). With `tide.ra2p.zero_copy`, the
Ref pass (`TideRefWorker.compute_ref_log_prob_handoff`) leaves each sample's row in `PROCESS_HANDOFF`,
a store of the worker process, and the Actor's installed deferred-KL loss takes it from there by
sample id, as a reference to the same tensor. Rows an Actor rank did not score itself (several
data-parallel ranks) are in Ray's shared-memory object store through the Ref service (`SharedRows`).

Mechanism layer: torch only. `SampleIds` is the driver's bookkeeping (pure).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from verl_tide.ra2p.loss import RefLogProbStore


class ProcessHandoff(RefLogProbStore):
    """Rows a Ref pass left in this process, for the Actor's backward in the same process."""

    def __init__(self) -> None:
        super().__init__()
        self.counters = {"put": 0, "served_in_process": 0}

    def put_rows(self, sample_ids: Sequence[int], rows: Sequence[torch.Tensor]) -> None:
        if len(sample_ids) != len(rows):
            raise ValueError(f"{len(sample_ids)} sample ids for {len(rows)} ref log-prob rows")
        for i, row in zip(sample_ids, rows):
            self.put(int(i), row)
        with self._cond:
            self.counters["put"] += len(rows)

    def present(self, sample_ids: Sequence[int]) -> dict[int, torch.Tensor]:
        """The rows of these samples that this process holds (no wait): the rest come from the Ref service."""
        with self._cond:
            found = {int(i): self._data[int(i)] for i in sample_ids if int(i) in self._data}
            self.counters["served_in_process"] += len(found)
        return found

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {**self.counters, "held": len(self._data)}


PROCESS_HANDOFF = ProcessHandoff()  # one per worker process: the Ref role writes, the Actor role's loss reads


class SampleIds:
    """The driver's ids of samples whose ref log-probs travel outside TransferQueue (the Actor's data carries
    the id; its loss asks for the row by it). Ids are never reused within a run."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._next = 0

    def assign(self, keys: Sequence[str]) -> list[int]:
        """Fresh ids for these samples (a sample scored again gets a new id)."""
        ids = list(range(self._next, self._next + len(keys)))
        self._next += len(keys)
        self._ids.update(zip(keys, ids))
        return ids

    def release(self, keys: Iterable[str]) -> list[int]:
        """The ids of samples that were trained or evicted: their rows can go."""
        return [self._ids.pop(k) for k in keys if k in self._ids]

    def __len__(self) -> int:
        return len(self._ids)

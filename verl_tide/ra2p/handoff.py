"""RA2P colocated hand-off: ref log-probs go from Ref to the Actor's backward without TransferQueue.

verl's colocated path writes a Ref pass's log-probs to TransferQueue from the Ref workers, reads them
back into the driver, converts and writes them again as `ref_log_prob`, and the Actor workers read
them once more: four serializations for rows that were computed in the Actor's own process (verl
builds its Actor and Ref roles into one worker process per rank). With `tide.ra2p.zero_copy`, the
Ref pass (`TideRefWorker.compute_ref_log_prob_handoff`) leaves each sample's row in `PROCESS_HANDOFF`,
a store of the worker process, and the Actor's installed deferred-KL loss takes it from there by
sample id, as a reference to the same tensor. Rows an Actor rank did not score itself (several
data-parallel ranks) are in Ray's shared-memory object store through the Ref service (`SharedRows`).

The inputs go the same way (`PROCESS_INPUTS`): the Ref pass read each sample's sequence fields
(`INPUT_FIELDS`) from TransferQueue, and the Actor's update in the same process would read them
again. The Ref pass leaves them in the process; trainer `tide` asks TransferQueue for the update's
other fields only, and the Actor worker puts the held rows back into the batch (`assemble`), reading
from TransferQueue only the samples its process did not score.

Mechanism layer: torch only. `SampleIds` is the driver's bookkeeping (pure).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence

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

# The sequence fields a Ref pass reads and the Actor's update reads again (verl 0.9.1's no-padding layout).
INPUT_FIELDS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def split_rows(data: Mapping[str, torch.Tensor], fields: Sequence[str]) -> tuple[list[dict[str, torch.Tensor]], dict]:
    """Per-sample rows of these fields of a batch (nested or dense), and each field's layout to rebuild it."""
    present = [f for f in fields if f in data and isinstance(data[f], torch.Tensor)]
    n = len(data[present[0]]) if present else 0
    rows: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    layouts = {}
    for f in present:
        t = data[f]
        layouts[f] = t.layout if t.is_nested else None
        for i, row in enumerate(t.unbind(0)):
            rows[i][f] = row
    return rows, layouts


def assemble(rows: Sequence[Mapping[str, torch.Tensor]], field: str, layout) -> torch.Tensor:
    """One field of a batch from its per-sample rows, in the layout TransferQueue gave it (nested or dense)."""
    column = [r[field] for r in rows]
    if layout is None:
        return torch.stack(column)
    return torch.nested.as_nested_tensor(column, layout=layout)


class ProcessInputs:
    """Input rows a Ref pass left in this process, for the Actor's update in the same process."""

    def __init__(self) -> None:
        self._rows: dict[int, dict[str, torch.Tensor]] = {}
        self.layouts: dict[str, object] = {}
        self._lock = threading.Lock()
        self.counters = {"inputs_in_process": 0, "inputs_from_transfer_queue": 0}

    def put(self, sample_ids: Sequence[int], data: Mapping[str, torch.Tensor]) -> None:
        rows, layouts = split_rows(data, INPUT_FIELDS)
        if len(rows) != len(sample_ids):
            raise ValueError(f"{len(sample_ids)} sample ids for {len(rows)} input rows")
        with self._lock:
            self.layouts.update(layouts)
            self._rows.update((int(i), r) for i, r in zip(sample_ids, rows))

    def held(self, sample_ids: Sequence[int], fields: Sequence[str]) -> dict[int, dict[str, torch.Tensor]]:
        """The rows of these samples that this process holds with every one of these fields (no wait)."""
        with self._lock:
            return {int(i): self._rows[int(i)] for i in sample_ids
                    if int(i) in self._rows and all(f in self._rows[int(i)] for f in fields)}

    def count(self, in_process: int, from_transfer_queue: int) -> None:
        with self._lock:
            self.counters["inputs_in_process"] += in_process
            self.counters["inputs_from_transfer_queue"] += from_transfer_queue

    def discard(self, sample_ids: Iterable[int]) -> None:
        with self._lock:
            for i in sample_ids:
                self._rows.pop(int(i), None)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.counters, "inputs_held": len(self._rows)}


PROCESS_INPUTS = ProcessInputs()  # one per worker process: the Ref role writes, the Actor role's update reads


class SampleIds:
    """The driver's ids of samples whose ref log-probs travel outside TransferQueue (the Actor's data carries
    the id; its loss asks for the row by it). Ids are never reused within a run."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._replaced: list[int] = []  # ids of samples scored again: their rows are never asked for
        self._next = 0

    def assign(self, keys: Sequence[str]) -> list[int]:
        """Fresh ids for these samples (a sample scored again gets a new id; its old one goes at the next
        `release`)."""
        ids = list(range(self._next, self._next + len(keys)))
        self._next += len(keys)
        self._replaced.extend(self._ids[k] for k in keys if k in self._ids)
        self._ids.update(zip(keys, ids))
        return ids

    def ids_of(self, keys: Sequence[str]) -> list[int]:
        """The current ids of these samples (each must have been assigned)."""
        return [self._ids[k] for k in keys]

    def release(self, keys: Iterable[str]) -> list[int]:
        """The ids of samples that were trained or evicted, and the replaced ids of samples scored again: their
        rows can go."""
        released = [self._ids.pop(k) for k in keys if k in self._ids] + self._replaced
        self._replaced = []
        return released

    def __len__(self) -> int:
        return len(self._ids)

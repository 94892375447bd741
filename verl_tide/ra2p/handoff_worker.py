"""verl's Ref worker with RA2P's colocated hand-off (`tide.ra2p.zero_copy`): a subclass, installed by trainer
`tide` in place of separate_async's `DetachActorWorker` for the Ref role (`_init_resource_pool_mgr`), and for
verl's combined actor/rollout/ref role when the Actor's GPUs also roll out (lending beside verl's Ref).

verl builds the Actor and Ref roles of a rank into one worker process (`create_colocated_worker_cls`).
`compute_ref_log_prob_handoff` runs verl's own `compute_ref_log_prob` and leaves each sample's
response log-probs in that process (`PROCESS_HANDOFF`) instead of writing them to TransferQueue; the
Actor's deferred-KL loss takes them from there. With more than one Ref rank the rows are also put,
once, into Ray's shared-memory object store through the Ref service, for an Actor rank that trains a
sample another rank scored. The pass also leaves the samples' input rows in the process (`PROCESS_INPUTS`);
`TideActorWorker.update_actor` (installed for the Actor role) puts them back into the update's batch, which
trainer `tide` asked TransferQueue for without them. Thin verl adapter.
"""

from __future__ import annotations

import time
from typing import Any

import ray
from tensordict import TensorDict
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import response_from_nested

from verl_tide.ra2p.handoff import PROCESS_HANDOFF, PROCESS_INPUTS, assemble, split_rows
from verl_tide.ra2p.loss import SAMPLE_ID_KEY

SERVICE_KEY = "tide_ref_service"  # the Ref service's Ray name, passed in the batch's extra_info
# In the update's extra_info: {"fields": held input fields, "partition_id", "keys": {sample id: TransferQueue key}}
INPUTS_KEY = "tide_handoff_inputs"


class RefHandoff:
    """The Ref role's side of the hand-off; mixed into a `DetachActorWorker` subclass."""

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
    def compute_ref_log_prob_handoff(self, data: TensorDict) -> TensorDict:
        """verl's Ref pass; the rows stay in this process (and, with several ranks, in shared memory), keyed by
        each sample's `tide_sample_id`. Returns no batch: nothing goes to TransferQueue."""
        service_name = tu.pop(data, key=SERVICE_KEY, default=None)
        sample_ids = data[SAMPLE_ID_KEY].tolist()
        response_mask = data["response_mask"]
        PROCESS_INPUTS.put(sample_ids, data)  # every rank that read this share: its Actor role trains it next
        output = DetachActorWorker.compute_ref_log_prob(self, data)
        if output is not None:  # the rank that holds this data-parallel share's outputs
            rows = list(response_from_nested(output["log_probs"], response_mask).unbind())
            PROCESS_HANDOFF.put_rows(sample_ids, rows)
            if service_name and self.world_size > 1:
                from verl_tide.ra2p.ref_workers import SharedRows

                ray.get(ray.get_actor(service_name).put.remote(sample_ids, SharedRows.put(rows)))
        return TensorDict({}, batch_size=[])  # no batch dimension: verl's bridge writes nothing to TransferQueue

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def discard_ref_handoff(self, sample_ids: list[int]) -> dict[str, Any]:
        """Rows of trained (or evicted) samples leave the process; returns the process's hand-off counters."""
        PROCESS_HANDOFF.discard(sample_ids)
        PROCESS_INPUTS.discard(sample_ids)
        return {**PROCESS_HANDOFF.stats(), **PROCESS_INPUTS.stats()}


def swap_cycle_seconds(engine: Any, train: bool) -> float:
    """Seconds verl's engine takes to bring its offloaded state onto the device and offload it again: what its mode
    context (`BaseEngineCtx._context_switch`, verl 0.9.1) does around every pass when Ref and Actor share a GPU.
    0.0 when nothing is offloaded: the model stays resident and no pass swaps it."""
    from verl.utils.device import get_device_name, get_torch_device

    model = bool(engine.is_param_offload_enabled)
    optimizer = bool(train and engine.is_optimizer_offload_enabled)
    if not (model or optimizer):
        return 0.0
    device = get_torch_device()
    start = time.perf_counter()
    engine.to(device=get_device_name(), model=model, optimizer=optimizer, grad=False)
    if hasattr(device, "synchronize"):
        device.synchronize()
    engine.to(device="cpu", model=model, optimizer=optimizer, grad=False)
    if hasattr(device, "synchronize"):
        device.synchronize()
    return time.perf_counter() - start


class ActorInputs:
    """The Actor role's side of the hand-off (the inputs go back into its update); a mixin like `RefHandoff`."""

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: TensorDict) -> TensorDict:
        """verl's update; with the inputs hand-off, the input fields this process's Ref pass read go back into
        the batch from the process, those of samples another rank scored from TransferQueue."""
        spec = tu.pop(data, key=INPUTS_KEY, default=None)
        if spec is not None and SAMPLE_ID_KEY in data.keys():
            restore_inputs(data, spec)
        return DetachActorWorker.update_actor(self, data)


class TideRefWorker(RefHandoff, DetachActorWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def measure_swap(self) -> float:
        """One load + offload of the Ref model (RA2P's swap term, half of it): see `swap_cycle_seconds`."""
        return swap_cycle_seconds(self.ref.engine, train=False)


class TideActorWorker(ActorInputs, DetachActorWorker):
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def measure_swap(self) -> float:
        """One load + offload of the Actor's state (RA2P's swap term, half of it): see `swap_cycle_seconds`."""
        return swap_cycle_seconds(self.actor.engine, train=True)


class TideActorRolloutRefWorker(RefHandoff, ActorInputs, DetachActorWorker):
    """verl's combined actor/rollout/ref worker (the Actor's GPUs also roll out, beside verl's Ref) with both
    sides of the hand-off: Ref and Actor share the process, so every row stays in it."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def measure_swap(self) -> float:
        """Half of one Ref and one Actor load + offload: the trainer asks this group for both roles' and averages
        the two answers, so each answer is the swap itself."""
        ref = swap_cycle_seconds(self.ref.engine, train=False)
        return (ref + swap_cycle_seconds(self.actor.engine, train=True)) / 2


def restore_inputs(data: TensorDict, spec: dict) -> None:
    fields = list(spec["fields"])
    if not fields:
        return
    sample_ids = [int(i) for i in data[SAMPLE_ID_KEY].tolist()]
    rows = PROCESS_INPUTS.held(sample_ids, fields)
    in_process = len(rows)
    layouts = dict(PROCESS_INPUTS.layouts)
    missing = [i for i in sample_ids if i not in rows]
    if missing:
        import transfer_queue as tq

        keys = spec["keys"]
        fetched = tq.kv_batch_get(keys=[keys[i] for i in missing], partition_id=spec["partition_id"],
                                  select_fields=fields)
        fetched_rows, fetched_layouts = split_rows(fetched, fields)
        rows.update(zip(missing, fetched_rows))
        layouts.update(fetched_layouts)
    ordered = [rows[i] for i in sample_ids]
    for f in fields:
        data[f] = assemble(ordered, f, layouts[f])
    PROCESS_INPUTS.count(in_process, len(missing))

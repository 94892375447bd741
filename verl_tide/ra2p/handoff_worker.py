"""verl's Ref worker with RA2P's colocated hand-off (`tide.ra2p.zero_copy`): a subclass, installed by trainer
`tide` in place of separate_async's `DetachActorWorker` for the Ref role (`_init_resource_pool_mgr`).

verl builds the Actor and Ref roles of a rank into one worker process (`create_colocated_worker_cls`).
`compute_ref_log_prob_handoff` runs verl's own `compute_ref_log_prob` and leaves each sample's
response log-probs in that process (`PROCESS_HANDOFF`) instead of writing them to TransferQueue; the
Actor's deferred-KL loss takes them from there. With more than one Ref rank the rows are also put,
once, into Ray's shared-memory object store through the Ref service, for an Actor rank that trains a
sample another rank scored. Thin verl adapter.
"""

from __future__ import annotations

from typing import Any

import ray
from tensordict import TensorDict
from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.workers.utils.padding import response_from_nested

from verl_tide.ra2p.handoff import PROCESS_HANDOFF
from verl_tide.ra2p.loss import SAMPLE_ID_KEY

SERVICE_KEY = "tide_ref_service"  # the Ref service's Ray name, passed in the batch's extra_info


class TideRefWorker(DetachActorWorker):
    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
    def compute_ref_log_prob_handoff(self, data: TensorDict) -> TensorDict:
        """verl's Ref pass; the rows stay in this process (and, with several ranks, in shared memory), keyed by
        each sample's `tide_sample_id`. Returns no batch: nothing goes to TransferQueue."""
        service_name = tu.pop(data, key=SERVICE_KEY, default=None)
        sample_ids = data[SAMPLE_ID_KEY].tolist()
        response_mask = data["response_mask"]
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
        return PROCESS_HANDOFF.stats()

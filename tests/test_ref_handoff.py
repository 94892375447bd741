"""The decoupled hand-off of ref log-probs (ra2p/ref_workers.py): from a Ref replica, through the job's
`RefLogProbService`, to the Actor's deferred-KL backward. With `tide.ra2p.zero_copy` the rows travel as
one array in Ray's shared-memory object store (the service holds only a reference; the Actor maps the
array); without it they are serialized through the service. Real Ray actors; the whole path with verl's
FSDP Actor runs in test_tide_trainer_e2e.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.testbed


def _ref_rank(service_name, sample_ids, rows, zero_copy):
    """What RefReplica.compute does with its rows once scored (run as a Ray task: another process)."""
    import ray

    from verl_tide.ra2p.ref_workers import SharedRows

    handed = SharedRows.put(rows) if zero_copy else rows
    ray.get(ray.get_actor(service_name).put.remote(sample_ids, handed))
    return [type(h).__name__ for h in handed]


@pytest.mark.parametrize("zero_copy", [True, False])
def test_rows_reach_the_backward_unchanged_and_zero_copy_hands_over_shared_memory(ray_cpu_cluster, zero_copy):
    import sys

    import ray
    from ray import cloudpickle

    from verl_tide.ra2p.ref_workers import RefLogProbService, ServiceRefSource, SharedRows

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module
    name = f"test_ref_service_{zero_copy}"
    service = ray.remote(RefLogProbService).options(name=name).remote()
    rows = [torch.randn(n) for n in (3, 1, 5)]
    kinds = ray.get(ray.remote(_ref_rank).remote(name, [7, 8, 9], rows, zero_copy))
    assert kinds == (["tuple"] * 3 if zero_copy else ["Tensor"] * 3)

    source = ServiceRefSource(name)
    got = source.get([9, 7], timeout_s=30)
    torch.testing.assert_close(got[0], rows[2])
    torch.testing.assert_close(got[1], rows[0])
    if zero_copy:
        stored = ray.get(service.get.remote([8], 30))[0]
        shared, i = stored
        assert isinstance(shared, SharedRows) and shared.offsets == [0, 3, 4, 9] and i == 1
        assert not ray.get(shared.ref).flags.writeable  # mapped from the object store, not a private copy
    ray.get(service.discard.remote([7, 8, 9]))
    assert ray.get(service.stats.remote())["held"] == 0
    ray.kill(service)


def test_the_actors_source_takes_rows_its_own_process_holds_and_the_rest_from_the_service(ray_cpu_cluster):
    """Colocated hand-off: the Ref role of the Actor's process left some rows in it (PROCESS_HANDOFF); the
    backward takes those as they are (the same tensors) and only the others from the service (another Ref
    rank's, in shared memory)."""
    import sys

    import ray
    from ray import cloudpickle

    from verl_tide.ra2p.handoff import PROCESS_HANDOFF
    from verl_tide.ra2p.ref_workers import RefLogProbService, ServiceRefSource

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    name = "test_ref_service_colocated"
    service = ray.remote(RefLogProbService).options(name=name).remote()
    mine = [torch.randn(4), torch.randn(2)]
    other = [torch.randn(3)]
    PROCESS_HANDOFF.put_rows([100, 101], mine)
    ray.get(ray.remote(_ref_rank).remote(name, [102], other, True))
    before = PROCESS_HANDOFF.stats()["served_in_process"]
    got = ServiceRefSource(name).get([102, 100, 101], timeout_s=30)
    assert got[1] is PROCESS_HANDOFF.present([100])[100]  # no copy: the tensor the Ref pass left
    torch.testing.assert_close(got[0], other[0])
    torch.testing.assert_close(got[2], mine[1])
    assert ray.get(service.stats.remote())["served"] == 1  # only the other rank's row went through the service
    assert PROCESS_HANDOFF.stats()["served_in_process"] - before == 3  # 2 for the backward, 1 for the check
    PROCESS_HANDOFF.discard([100, 101])
    assert PROCESS_HANDOFF.stats()["held"] == 0
    ray.kill(service)

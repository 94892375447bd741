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


def _sequence_batch(lengths, seed=0):
    """A batch in verl 0.9.1's no-padding layout: jagged sequence fields, a dense per-sample field."""
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 100, (n,), generator=g) for n in lengths]
    jagged = lambda rows: torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    return TensorDict({
        "input_ids": jagged(ids),
        "position_ids": jagged([torch.arange(n) for n in lengths]),
        "response_mask": jagged([torch.ones(n - 2, dtype=torch.int64) for n in lengths]),
        "prompts": torch.randint(0, 100, (len(lengths), 2), generator=g),  # dense: same length each
        "advantages": jagged([torch.randn(n - 2, generator=g) for n in lengths]),  # not an input field
    }, batch_size=[len(lengths)])


def _assert_same_field(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.is_nested == b.is_nested and a.layout == b.layout and a.dtype == b.dtype
    for x, y in zip(a.unbind(0), b.unbind(0), strict=True):
        assert torch.equal(x, y)


def test_input_rows_a_ref_pass_leaves_rebuild_the_batch_in_its_layout_and_order():
    """The Ref pass leaves each sample's input rows (only INPUT_FIELDS); the Actor's share, in another order,
    is rebuilt field by field from them, nested fields as nested, dense as dense."""
    from verl_tide.ra2p.handoff import ProcessInputs, assemble

    batch = _sequence_batch([5, 3, 7, 4])
    store = ProcessInputs()
    store.put([10, 11, 12, 13], batch)
    fields = ["prompts", "input_ids", "position_ids", "response_mask"]
    held = store.held([12, 10, 99], fields)
    assert sorted(held) == [10, 12]  # 99 was scored elsewhere
    assert "advantages" not in held[10]  # computed after the Ref pass: still read from TransferQueue
    order = [2, 0]
    for f in fields:
        _assert_same_field(assemble([held[12], held[10]], f, store.layouts[f]), batch[f][order] if f == "prompts"
                           else torch.nested.as_nested_tensor([batch[f].unbind(0)[i] for i in order],
                                                              layout=torch.jagged))
    assert store.held([10], ["returns"]) == {}  # a field the pass did not read: not held
    store.discard([10, 11, 12, 13])
    assert store.stats()["inputs_held"] == 0


def test_the_actor_update_gets_the_same_batch_from_the_process_and_from_transfer_queue(ray_cpu_cluster):
    """Real TransferQueue on a real Ray cluster: the Actor's share, read without the input fields and rebuilt
    (two samples held by this process, two read back from TransferQueue), equals what verl's bridge reads."""
    import transfer_queue as tq

    from verl_tide.ra2p.handoff import INPUT_FIELDS, PROCESS_INPUTS
    from verl_tide.ra2p.handoff_worker import restore_inputs
    from verl_tide.ra2p.loss import SAMPLE_ID_KEY

    tq.init()
    try:
        keys = [f"uid{i}_0" for i in range(4)]
        ids = [40, 41, 42, 43]
        batch = _sequence_batch([6, 3, 8, 5], seed=1)
        batch[SAMPLE_ID_KEY] = torch.tensor(ids)
        tq.kv_batch_put(keys=keys, partition_id="train", fields=batch)
        full = tq.kv_batch_get(keys=keys, partition_id="train")  # what verl's update would read
        stored = tq.get_client().kv_retrieve_meta(keys=keys, partition_id="train").field_names
        held = [f for f in stored if f in INPUT_FIELDS]
        assert sorted(held) == ["input_ids", "position_ids", "prompts", "response_mask"]
        PROCESS_INPUTS.put(ids[:2], tq.kv_batch_get(keys=keys[:2], partition_id="train"))  # this rank's Ref pass
        before = PROCESS_INPUTS.stats()
        share = tq.kv_batch_get(keys=keys, partition_id="train",
                                select_fields=[f for f in stored if f not in INPUT_FIELDS])
        assert set(share.keys()) == {"advantages", SAMPLE_ID_KEY}
        restore_inputs(share, {"fields": held, "partition_id": "train", "keys": dict(zip(ids, keys))})
        for f in full.keys():
            if full[f].is_nested:
                _assert_same_field(share[f], full[f])
            else:
                torch.testing.assert_close(share[f], full[f])
        after = PROCESS_INPUTS.stats()
        assert after["inputs_in_process"] - before["inputs_in_process"] == 2
        assert after["inputs_from_transfer_queue"] - before["inputs_from_transfer_queue"] == 2
        PROCESS_INPUTS.discard(ids)
    finally:
        tq.close()


def test_the_combined_actor_rollout_ref_role_gets_both_sides_of_the_hand_off():
    """Lending beside verl's Ref: verl builds one actor/rollout/ref worker, so trainer tide installs the subclass
    with the Ref pass that keeps rows in the process and the update that takes the inputs back."""
    import ray
    from omegaconf import OmegaConf
    from verl.experimental.separation.engine_workers import DetachActorWorker
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.trainer.ppo.utils import Role

    from verl_tide.core.config import parse_tide_config
    from verl_tide.ra2p.handoff_worker import ActorInputs, RefHandoff, TideActorRolloutRefWorker
    from verl_tide.job_config import ref_layout_of
    from verl_tide.trainer.ref_path import RefPath

    config = OmegaConf.create({"actor_rollout_ref": {"actor": {"use_kl_loss": True, "strategy": "fsdp2"}},
                               "algorithm": {"use_kl_in_reward": False}})
    tide = parse_tide_config({})
    path = RefPath(config, tide, None, None, ref_layout_of(config, tide))
    roles = {Role.ActorRolloutRef: ray.remote(DetachActorWorker)}
    path.choose_worker_roles(roles, {})
    built = roles[Role.ActorRolloutRef].__ray_metadata__.modified_class
    assert issubclass(built, TideActorRolloutRefWorker) and path.layout.handoff and path.layout.inputs_handoff
    for method, owner in (("compute_ref_log_prob_handoff", RefHandoff), ("discard_ref_handoff", RefHandoff),
                          ("update_actor", ActorInputs)):
        assert getattr(built, method).__qualname__ == f"{owner.__name__}.{method}"  # the hand-off's, not verl's
        assert hasattr(getattr(built, method), MAGIC_ATTR)  # registered: the worker group binds it
    # the same job without the hand-off (zero_copy off) keeps verl's worker
    tide = parse_tide_config({"ra2p": {"zero_copy": False}})
    plain = RefPath(config, tide, None, None, ref_layout_of(config, tide))
    roles = {Role.ActorRolloutRef: ray.remote(DetachActorWorker)}
    plain.choose_worker_roles(roles, {})
    assert roles[Role.ActorRolloutRef].__ray_metadata__.modified_class.__mro__[1] is DetachActorWorker
    assert not plain.layout.handoff and not plain.layout.inputs_handoff

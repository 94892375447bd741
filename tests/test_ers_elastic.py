"""ERS's elastic ranks (ers/elastic.py) in isolation: the order of a switch and a Ref replica that cannot be
placed. Real Ray actors stand in for verl's load balancer and rollout servers (the whole path with verl, vLLM
and the Ref pool runs in test_tide_trainer_e2e.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from verl_tide.ers.policy import RankMove, Role

pytestmark = pytest.mark.testbed


class _Recorder:
    """A Ray actor standing in for verl's load balancer and a rollout server: records each call."""

    def __init__(self):
        self.calls: list = []

    def remove_servers(self, ids):
        self.calls.append(("remove_servers", tuple(ids)))

    def add_servers(self, servers):
        self.calls.append(("add_servers", tuple(servers)))

    def abort_all_requests(self, reject_request=False):
        self.calls.append(("abort_all_requests", reject_request))
        return {"aborted_count": 2, "request_ids": ["a", "b"]}

    def release_kv_cache(self):
        self.calls.append(("release_kv_cache",))

    def resume_kv_cache(self):
        self.calls.append(("resume_kv_cache",))

    def get_calls(self):
        return self.calls


class _Replica:
    def ready(self):
        return True


class _Pool:
    """The RefPool surface ElasticRanks uses; its replicas are real (tiny) Ray actors."""

    def __init__(self, placeable: bool):
        import ray

        self.placeable = placeable
        self.actors: dict = {}
        self._cls = ray.remote(_Replica)

    def add_replica(self, key, options):
        opts = {} if self.placeable else {"resources": {"no_such_device": 1}}  # never placed
        self.actors[key] = self._cls.options(**opts).remote()

    def get(self, key):
        return self.actors[key]

    def remove_replica(self, key):
        import ray

        ray.kill(self.actors.pop(key))


class _CheckpointManager:
    def __init__(self, replicas):
        self.replicas = list(replicas)

    def remove_replicas(self, replicas):
        self.replicas = [r for r in self.replicas if r not in replicas]

    def add_replicas(self, replicas):
        self.replicas.extend(replicas)


def _ranks(placeable: bool, timeout_s: float = 60.0):
    import sys

    import ray
    from ray import cloudpickle

    from verl_tide.ers.elastic import ElasticRanks

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test module

    recorder = ray.remote(_Recorder)
    balancer = recorder.remote()
    servers = [recorder.remote(), recorder.remote()]
    replicas = [SimpleNamespace(servers=[s], server_address=f"127.0.0.1:{9000 + i}", server_handle=s)
                for i, s in enumerate(servers)]
    manager = _CheckpointManager(replicas)
    elastic = ElasticRanks(replicas, balancer, manager, _Pool(placeable), lambda replica: {"num_gpus": 0.5},
                           timeout_s=60, ref_ready_timeout_s=timeout_s)
    return elastic, balancer, servers, manager


def test_a_rank_goes_to_ref_and_back_in_order(ray_cpu_cluster):
    import ray

    elastic, balancer, servers, manager = _ranks(placeable=True)
    [to_ref] = elastic.before_sync([RankMove(1, Role.ROLLOUT, Role.REF)])
    assert to_ref.requests_resent == 2 and to_ref.dst is Role.REF
    # out of routing first, then its requests aborted with the gate rejecting (clients re-send elsewhere)
    assert ray.get(balancer.get_calls.remote()) == [("remove_servers", ("127.0.0.1:9001",))]
    assert ray.get(servers[1].get_calls.remote()) == [("abort_all_requests", True), ("release_kv_cache",)]
    assert manager.replicas == [elastic.replicas[0]]  # no weight sync for a Ref-role rank
    assert elastic.after_sync() >= 0.0  # its Ref replica is placed and answers
    assert ray.get(servers[0].get_calls.remote()) == []  # the other rank is untouched

    elastic.before_sync([RankMove(1, Role.REF, Role.ROLLOUT)])
    assert elastic.ref_key(1) not in elastic.ref_pool.actors
    assert manager.replicas[-1] is elastic.replicas[1]  # the sync that follows gives it the current weights
    assert ray.get(balancer.get_calls.remote())[-1] == ("remove_servers", ("127.0.0.1:9001",))  # not routed yet
    elastic.after_sync()
    assert ray.get(balancer.get_calls.remote())[-1] == ("add_servers", ("127.0.0.1:9001",))
    assert ray.get(servers[1].get_calls.remote())[-1] == ("resume_kv_cache",)
    assert [(a.rank, a.dst) for a in elastic.applied] == [(1, Role.REF), (1, Role.ROLLOUT)]


def test_a_ref_replica_that_cannot_be_placed_stops_the_job_with_the_placement_in_the_message(ray_cpu_cluster):
    elastic, *_ = _ranks(placeable=False, timeout_s=3.0)
    elastic.before_sync([RankMove(0, Role.ROLLOUT, Role.REF)])
    with pytest.raises(RuntimeError, match=r"elastic rank 0 was not placed and loaded within 3 s.*num_gpus"):
        elastic.after_sync()

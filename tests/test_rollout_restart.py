"""Relaunch of quarantined rollout ranks (rollout_restart.py) in isolation: a replica whose `launch_servers`
starts a real Ray actor stands in for verl's vLLM replica (the kill-and-relaunch path with verl and vLLM
runs in test_tide_trainer_e2e.py)."""

from __future__ import annotations

import time

import pytest

pytestmark = pytest.mark.testbed


class _Server:
    def get_server_address(self):
        return "127.0.0.1", 9100


class _Balancer:
    def __init__(self):
        self.calls: list = []

    def add_servers(self, servers):
        self.calls.append(tuple(servers))

    def get_calls(self):
        return self.calls


class _Replica:
    """verl's RolloutReplica surface RankRestarts uses: `servers` and an async `launch_servers`."""

    def __init__(self, fail: bool = False):
        self.servers: list = []
        self.workers: list = []
        self.fail = fail
        self.launches = 0
        self.server_address = "127.0.0.1:9001"
        self.server_handle = None

    async def launch_servers(self):
        import ray

        self.launches += 1
        if self.fail:
            raise RuntimeError("engine start-up failed: out of memory")
        server = ray.remote(_Server).remote()
        host, port = await server.get_server_address.remote()
        self.servers.append(server)
        self.server_handle, self.server_address = server, f"{host}:{port}"


class _CheckpointManager:
    def __init__(self):
        self.replicas: list = []

    def add_replicas(self, replicas):
        self.replicas.extend(replicas)


def _wait(restarts, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while restarts.relaunching and time.monotonic() < end:
        time.sleep(0.1)
    assert not restarts.relaunching


def _setup(max_restarts):
    import sys

    import ray
    from ray import cloudpickle

    from verl_tide.rollout_restart import RankRestarts

    class Restarts(RankRestarts):
        def _new_workers(self, replica, job):  # verl's RayWorkerGroup in the replica's pool: run in the e2e test
            return [ray.remote(_Server).remote()]

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    balancer = ray.remote(_Balancer).remote()
    manager = _CheckpointManager()
    return Restarts(balancer, manager, max_restarts=max_restarts, timeout_s=60), balancer, manager


def test_a_relaunched_rank_gets_the_sync_first_then_tasks(ray_cpu_cluster):
    import ray

    restarts, balancer, manager = _setup(max_restarts=1)
    dead = ray.remote(_Server).remote()
    replica = _Replica()
    replica.servers.append(dead)  # the server that died
    old_worker = ray.remote(_Server).remote()
    replica.workers.append(old_worker)
    replicas = [_Replica(), replica]
    assert restarts.start(1, replica)
    assert not restarts.start(1, replica)  # already relaunching
    _wait(restarts)
    [(rank, seconds)] = restarts.before_sync()
    assert rank == 1 and seconds >= 0
    assert manager.replicas == [replica]  # the coming sync pushes the current weights to it
    assert ray.get(balancer.get_calls.remote()) == []  # no tasks before it has them
    assert replica.servers != [dead] and len(replica.servers) == 1  # the dead server was replaced
    assert replica.workers != [old_worker] and len(replica.workers) == 1  # and its workers (one may hang)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(old_worker.get_server_address.remote(), timeout=30)
    assert restarts.after_sync(replicas) == [1]
    assert ray.get(balancer.get_calls.remote()) == [(replica.server_address,)]
    assert restarts.after_sync(replicas) == []
    assert not restarts.start(1, replica)  # max_restarts = 1 used up


def test_a_failed_relaunch_leaves_the_rank_quarantined_with_the_reason(ray_cpu_cluster):
    restarts, _balancer, manager = _setup(max_restarts=2)
    replica = _Replica(fail=True)
    assert restarts.start(0, replica)
    _wait(restarts)
    assert restarts.before_sync() == []
    assert manager.replicas == []
    assert "RuntimeError: engine start-up failed: out of memory" in restarts.failures[0]
    assert restarts.start(0, replica) and replica.launches >= 1  # a second try is allowed
    _wait(restarts)
    assert replica.launches == 2 and not restarts.start(0, replica)


def test_zero_restarts_never_relaunches():
    from verl_tide.rollout_restart import RankRestarts

    restarts = RankRestarts(balancer=None, checkpoint_manager=None, max_restarts=0)
    assert not restarts.start(0, _Replica())
    with pytest.raises(ValueError, match="tide.max_rank_restarts = -1"):
        RankRestarts(None, None, max_restarts=-1)

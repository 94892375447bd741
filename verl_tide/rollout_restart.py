"""Restart of quarantined rollout ranks: a dead server is relaunched in the background and the rank rejoins
rollout at a weight-sync boundary.

A rollout rank whose server process died is quarantined by trainer `tide` (no tasks, no syncs). Its
replica's placement group (its GPUs) usually survives a crashed or OOM-killed engine, so the rank
need not stay lost. The relaunch does what verl's `RolloutReplica.init_standalone()` does, minus
creating a resource pool: it stops the replica's server and workers (a worker can hang in a weight
sync with a dead server, seen on the test bed), starts new workers in the replica's own resource pool
and calls verl's `launch_servers()`. The relaunch (model load, engine start-up: tens of seconds) runs
on a thread of its own while training goes on; at the next post-update boundary a relaunched rank
rejoins the checkpoint manager, so the sync pushes the current weights to it, and after the sync it
rejoins the load balancer (CTB admits tasks to it again). A relaunch that fails leaves the rank quarantined; each rank
is relaunched at most `max_restarts` times.

Mechanism layer: Ray and verl's replica/balancer/checkpoint-manager objects, through their methods.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ray


@dataclass
class _Relaunch:
    rank: int
    replica: Any
    started: float
    done: threading.Event = field(default_factory=threading.Event)
    error: Optional[str] = None
    seconds: float = 0.0


class RankRestarts:
    """Relaunches quarantined rollout ranks' servers; `before_sync` / `after_sync` bring them back."""

    def __init__(self, balancer: Any, checkpoint_manager: Any, max_restarts: int, timeout_s: float = 120.0):
        if max_restarts < 0:
            raise ValueError(f"tide.max_rank_restarts = {max_restarts}: must be >= 0")
        self.balancer = balancer
        self.checkpoint_manager = checkpoint_manager
        self.max_restarts = max_restarts
        self.timeout_s = timeout_s
        self.restarts: dict[int, int] = {}  # rank -> relaunches started
        self.failures: dict[int, str] = {}  # rank -> why its last relaunch failed
        self._running: dict[int, _Relaunch] = {}
        self._rejoin: list[int] = []

    def start(self, rank: int, replica: Any) -> bool:
        """Relaunch the rank's server in the background; False when it used up its restarts (or is running)."""
        if rank in self._running or self.restarts.get(rank, 0) >= self.max_restarts:
            return False
        self.restarts[rank] = self.restarts.get(rank, 0) + 1
        job = _Relaunch(rank, replica, time.perf_counter())
        self._running[rank] = job
        threading.Thread(target=self._relaunch, args=(job,), name=f"tide-relaunch-rank-{rank}", daemon=True).start()
        return True

    def _relaunch(self, job: _Relaunch) -> None:
        try:
            relaunch_replica(job.replica, lambda replica: self._new_workers(replica, job))
        except Exception as e:  # a relaunch that fails leaves the rank quarantined, training goes on
            job.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        job.seconds = time.perf_counter() - job.started
        job.done.set()
        if job.error is None:  # a failure is reported at the next weight sync, with the rank's other news
            print(f"verl-tide: rollout rank {job.rank}'s server is up again ({job.seconds:.1f} s after its "
                  "relaunch began); it rejoins at the next weight sync", flush=True)

    def _new_workers(self, replica: Any, job: _Relaunch) -> list:
        return new_rollout_workers(replica, f"rollout_standalone_{replica.replica_rank}_relaunch"
                                            f"{self.restarts[job.rank]}")

    @property
    def relaunching(self) -> list[int]:
        return sorted(r for r, job in self._running.items() if not job.done.is_set())

    def before_sync(self) -> list[tuple[int, float]]:
        """Ranks whose relaunch finished: they join the checkpoint manager, so the coming sync gives them the
        current weights. Returns (rank, relaunch seconds) of each; failed relaunches are recorded."""
        ready = []
        for rank, job in list(self._running.items()):
            if not job.done.is_set():
                continue
            del self._running[rank]
            if job.error is not None:
                self.failures[rank] = job.error
                continue
            self.checkpoint_manager.add_replicas([job.replica])
            self._rejoin.append(rank)
            ready.append((rank, job.seconds))
        return ready

    def after_sync(self, replicas: list[Any]) -> list[int]:
        """Relaunched ranks hold the new weights now: they take tasks again. Returns those ranks."""
        ranks, self._rejoin = self._rejoin, []
        if ranks:
            servers = {replicas[r].server_address: replicas[r].server_handle for r in ranks}
            ray.get(self.balancer.add_servers.remote(servers), timeout=self.timeout_s)
        return ranks


def stop_replica(replica: Any) -> None:
    """A replica's servers and workers killed (a dead one, its node-mates, its workers: a worker can hang in a
    weight sync with a dead server)."""
    for actor in [*replica.servers, *replica.workers]:
        try:
            ray.kill(actor)
        except Exception:  # already gone
            pass


def new_rollout_workers(replica: Any, name_prefix: str) -> list:
    """Rollout workers in the replica's own resource pool, as verl's `RolloutReplica.init_standalone()` builds
    them (verl 0.9.1); the pool makes its placement group again if it was removed."""
    from verl.single_controller.ray import RayWorkerGroup
    from verl.utils.device import get_device_name

    group = RayWorkerGroup(resource_pool=replica.resource_pool, ray_cls_with_init=replica.get_ray_class_with_init_args(),
                           bin_pack=False, name_prefix=name_prefix, use_gpu=True, device_name=get_device_name())
    return group.workers


def relaunch_replica(replica: Any, new_workers: Callable[[Any], list]) -> None:
    """`init_standalone()` minus the pool: the old processes stopped, new workers, then verl's `launch_servers()`.
    Runs its own event loop: call it where none runs (a thread)."""
    stop_replica(replica)
    replica.servers.clear()  # verl's launch_servers appends the new servers to this list
    replica.workers = new_workers(replica)
    asyncio.run(replica.launch_servers())

"""Rank health: quarantine of rollout ranks that die or stop answering, their relaunch, and a weight sync
that survives a rank dying under it.

Why apart from the trainer: it is the one part of trainer `tide` that handles failures, and it needs only
the rollout pool (replicas, CTB's router, the checkpoint engine), never the training state. Checked at each
step boundary, and by `tide_env_agent` the moment a turn fails (through CTB's `report_failure`).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any, Optional, Protocol

from verl_tide.ers.policy import Role
from verl_tide.trainer.verl_compat import load_balancer, server_handle


class RolloutPool(Protocol):
    """What rank health uses of verl's `LLMServerManager` (0.9.1)."""

    def get_replicas(self) -> list[Any]: ...


class CheckpointEngine(Protocol):
    """What rank health uses of verl's `CheckpointEngineManager` (0.9.1)."""

    def remove_replicas(self, replicas: list[Any]) -> None: ...


class RankHealth:
    def __init__(self, pool: RolloutPool, checkpoint_manager: CheckpointEngine, ctb_enabled: bool,
                 restarts: Optional[Any] = None, health_timeout_s: float = 30.0):
        self.pool, self.checkpoint_manager, self.ctb_enabled = pool, checkpoint_manager, ctb_enabled
        self.restarts = restarts  # rollout_restart.RankRestarts (tide.max_rank_restarts), or None
        self.health_timeout_s = health_timeout_s
        self.quarantined: dict[int, str] = {}  # rollout rank -> why
        self.training_ranks: set[int] = set()  # ranks whose GPUs ERS's trainer resize gave the Actor: no server

    def out_of_service(self) -> dict[int, str]:
        """Rollout ranks that take no tasks (rank -> why): quarantined, or their GPUs in the Actor's group."""
        return {**self.quarantined, **{r: "training (ERS's trainer resize)" for r in self.training_ranks}}

    def check(self, roles: MutableMapping[int, Role]) -> None:
        """Quarantine rollout ranks whose server died or stops answering: out of routing (their tasks go back to
        CTB and are re-admitted elsewhere) and out of every later weight sync. Training goes on with the
        remaining ranks; with none left the job stops with a clear error."""
        import ray

        replicas = self.pool.get_replicas()
        dead = []
        for rank, replica in enumerate(replicas):
            if rank in self.quarantined or rank in self.training_ranks:
                continue
            try:
                ray.get(server_handle(replica).get_server_address.remote(), timeout=self.health_timeout_s)
            except Exception as e:  # RayActorError (died), GetTimeoutError (stopped answering), ...
                dead.append((rank, replica, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"))
        if not dead:
            return
        if len(dead) + len(self.quarantined) + len(self.training_ranks) >= len(replicas):
            raise RuntimeError(f"verl-tide: every rollout rank is dead or unresponsive ({dead[0][2]}); "
                               "nothing left to generate with")
        lb = load_balancer(self.pool)
        for rank, replica, why in dead:
            address = replica.server_address
            if self.ctb_enabled:
                ray.get(lb.quarantine.remote([address], why), timeout=60)
            else:
                ray.get(lb.remove_servers.remote([address]), timeout=60)
            self.checkpoint_manager.remove_replicas([replica])
            self.quarantined[rank] = why
            roles.pop(rank, None)
            print(f"verl-tide: rollout rank {rank} ({address}) quarantined: {why}; it gets no new tasks and no "
                  f"weight syncs, its tasks are re-dispatched", flush=True)
            if self.restarts is not None and self.restarts.start(rank, replica):
                print(f"verl-tide: relaunching rollout rank {rank}'s server in the background (restart "
                      f"{self.restarts.restarts[rank]} of {self.restarts.max_restarts}); it rejoins at a weight sync",
                      flush=True)

    def sync_weights(self, verl_sync: Callable[[], None], roles: MutableMapping[int, Role]) -> None:
        """verl's weight sync to every rollout rank. A rank can die between the health check and the sync (seen
        in the fault test: the kill landed there); the sync then fails on it: quarantine it and sync the others
        once more, instead of losing the job."""
        import ray

        try:
            verl_sync()
        except ray.exceptions.RayActorError:
            before = set(self.quarantined)
            self.check(roles)
            if set(self.quarantined) == before:
                raise  # not a rollout rank that died
            print("verl-tide: a rollout rank died during the weight sync; syncing the others again", flush=True)
            verl_sync()

    def before_sync(self) -> list[tuple[int, float]]:
        """Relaunched ranks ready to rejoin at this sync: (rank, seconds their relaunch took)."""
        return self.restarts.before_sync() if self.restarts is not None else []

    def after_sync(self, relaunched: dict[int, float], roles: MutableMapping[int, Role]) -> dict[str, float]:
        """Relaunched ranks got this sync's weights: they leave quarantine and roll out again."""
        if self.restarts is None:
            return {}
        for rank in self.restarts.after_sync(self.pool.get_replicas()):
            self.quarantined.pop(rank, None)
            roles[rank] = Role.ROLLOUT
            print(f"verl-tide: rollout rank {rank} is back after a relaunch ({relaunched[rank]:.1f} s in the "
                  "background): current weights synced, it takes tasks again", flush=True)
        for rank, why in self.restarts.failures.items():
            print(f"verl-tide: rollout rank {rank}'s relaunch failed ({why}); it stays quarantined", flush=True)
        self.restarts.failures.clear()
        return {"tide/rollout/ranks_relaunching": float(len(self.restarts.relaunching)),
                "tide/rollout/relaunches": float(sum(self.restarts.restarts.values()))}

"""ERS's elastic ranks: a rollout rank lends its GPU to a Ref replica and takes it back, at the
weight-sync boundary (paper Sec. 5.2).

verl's rollout replicas are built once and only ever leave routing by verl's hybrid switch. An
elastic rank here is one standalone rollout replica's GPU, which hosts either that replica's
engine (role rollout) or a Ref replica of trainer `tide`'s Ref pool (role Ref), never both at work:

- Rollout -> Ref (before the sync): the rank leaves the load balancer (CTB hands its tasks back and
  re-admits them on other ranks), its in-flight requests are aborted with the gate rejecting
  (verl's partial-rollout client re-sends each one, prompt plus tokens so far, to another rank: a
  fresh prefill there, no task or token lost), it leaves the checkpoint manager (no more weight
  syncs, its weights go stale), its KV cache is released, and a Ref replica starts in the replica's
  own placement-group bundle, loading the Ref model while the sync runs.
- Ref -> Rollout (before the sync): the Ref replica is stopped (its memory freed), the engine's KV
  cache is restored and the replica rejoins the checkpoint manager, so the sync that follows pushes
  the current weights to it and reopens its gate; after the sync it rejoins the load balancer.

Mechanism layer: Ray only (verl objects are used through their documented methods).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import ray

from verl_tide.ers.policy import RankMove, Role


@dataclass(frozen=True)
class AppliedMove:
    rank: int
    dst: Role
    seconds: float  # driver-side time of the switch, before the sync (the Ref model loads during the sync)
    requests_resent: int = 0  # in-flight requests aborted on a rank leaving rollout, re-sent to other ranks


class ElasticRanks:
    """Applies ERS plans to the standalone rollout replicas (`replicas[rank]`) and a `RefPool`."""

    def __init__(self, replicas: Sequence[Any], balancer: Any, checkpoint_manager: Any, ref_pool: Any,
                 ref_options: Callable[[Any], dict[str, Any]], timeout_s: float = 120.0,
                 ref_ready_timeout_s: float = 600.0):
        self.replicas = list(replicas)
        self.balancer = balancer
        self.checkpoint_manager = checkpoint_manager
        self.ref_pool = ref_pool
        self.ref_options = ref_options
        self.timeout_s = timeout_s
        self.ref_ready_timeout_s = ref_ready_timeout_s
        self._rejoin: list[int] = []
        self._joining_ref: list[int] = []
        self.applied: list[AppliedMove] = []  # every switch so far, in order

    @staticmethod
    def ref_key(rank: int) -> tuple[str, int]:
        return ("elastic", rank)

    def before_sync(self, moves: Sequence[RankMove]) -> list[AppliedMove]:
        """Switch the moved ranks; returns what was done. Call after the actor update, before the weight sync."""
        done = []
        for move in moves:
            start = time.perf_counter()
            resent = 0
            if move.dst is Role.REF:
                resent = self._rollout_to_ref(move.rank)
            else:
                self._ref_to_rollout(move.rank)
            done.append(AppliedMove(move.rank, move.dst, time.perf_counter() - start, resent))
        self.applied.extend(done)
        return done

    def after_sync(self) -> float:
        """Ranks back from Ref hold the new weights now: they take tasks again. New Ref replicas must be placed
        and loaded before the next step needs them; returns how long that wait took past the sync."""
        if self._rejoin:
            servers = {self.replicas[r].server_address: self.replicas[r].server_handle for r in self._rejoin}
            ray.get(self.balancer.add_servers.remote(servers), timeout=self.timeout_s)
            self._rejoin = []
        start = time.perf_counter()
        joining, self._joining_ref = self._joining_ref, []
        for rank in joining:
            try:
                ray.get(self.ref_pool.get(self.ref_key(rank)).ready.remote(), timeout=self.ref_ready_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"verl-tide ERS: the Ref replica on elastic rank {rank} was not placed and loaded within "
                    f"{self.ref_ready_timeout_s:.0f} s; it runs in that rollout replica's placement-group bundle "
                    f"with {self.ref_options(self.replicas[rank])}: the bundle must have that much free") from None
        return time.perf_counter() - start

    def _rollout_to_ref(self, rank: int) -> int:
        replica = self.replicas[rank]
        resent = drain_replica(replica, self.balancer, self.checkpoint_manager, self.timeout_s)
        ray.get([s.release_kv_cache.remote() for s in replica.servers], timeout=self.timeout_s)
        self.ref_pool.add_replica(self.ref_key(rank), self.ref_options(replica))
        self._joining_ref.append(rank)
        return resent

    def _ref_to_rollout(self, rank: int) -> None:
        replica = self.replicas[rank]
        self.ref_pool.remove_replica(self.ref_key(rank))
        ray.get([s.resume_kv_cache.remote() for s in replica.servers], timeout=self.timeout_s)
        self.checkpoint_manager.add_replicas([replica])
        self._rejoin.append(rank)


def drain_replica(replica: Any, balancer: Any, checkpoint_manager: Any, timeout_s: float) -> int:
    """A rollout replica out of routing (CTB hands its tasks back), its in-flight requests aborted with the gate
    rejecting (verl's partial-rollout client re-sends each elsewhere) and out of the weight syncs; returns the
    requests aborted. Where a rank leaves rollout: to Ref here, to the Actor's group (`trainer/resize.py`)."""
    ray.get(balancer.remove_servers.remote([replica.server_address]), timeout=timeout_s)
    aborted = ray.get([s.abort_all_requests.remote(reject_request=True) for s in replica.servers], timeout=timeout_s)
    checkpoint_manager.remove_replicas([replica])
    return sum(int((a or {}).get("aborted_count", 0)) for a in aborted)

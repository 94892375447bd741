"""Where Ref runs at start-up: which roles trainer `tide` asks verl to build, and the elastic ranks that start as
Ref. Checked before verl builds any worker group, so a layout that cannot run fails with the keys to change.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from verl_tide.core.config import TideConfig, TideConfigError
from verl_tide.ers.policy import RankMove, Role


def initial_ref_moves(tide: TideConfig, roles: MutableMapping[int, Role]) -> list[RankMove]:
    """With no Ref ranks of its own (tide.ra2p.ref_ranks = 0), Ref runs on elastic ranks only: the highest
    tide.ers.min_ref_ranks rollout ranks start as Ref, so step 1 has a Ref replica."""
    ers = tide.ers
    missing = max(0, ers.min_ref_ranks - sum(r is Role.REF for r in roles.values()))
    rollout = [r for r in sorted(roles, reverse=True) if roles[r] is Role.ROLLOUT]
    if len(rollout) - missing < ers.min_rollout_ranks:
        raise TideConfigError([f"tide.ers.min_ref_ranks = {ers.min_ref_ranks}: with tide.ra2p.ref_ranks = 0 Ref "
                               f"runs on elastic ranks, and {len(roles)} rollout rank(s) cannot give that many while "
                               f"keeping tide.ers.min_rollout_ranks = {ers.min_rollout_ranks}"])
    return [RankMove(r, Role.ROLLOUT, Role.REF) for r in rollout[:missing]]


def switch_to_ref_at_start(elastic: Any, moves: list[RankMove], roles: MutableMapping[int, Role]) -> None:
    """Before the first sync: the ranks become Ref, and step 1 waits until their replicas answer."""
    for applied in elastic.before_sync(moves):
        roles[applied.rank] = Role.REF
    elastic.after_sync()


def start_elastic_ref_ranks(tide: TideConfig, elastic: Any, roles: MutableMapping[int, Role]) -> None:
    """Ref on elastic ranks only (tide.ra2p.ref_ranks = 0): the first ranks switch to Ref before step 1."""
    switch_to_ref_at_start(elastic, initial_ref_moves(tide, roles), roles)
    beside = " beside verl's Ref (split)" if tide.ra2p.mode == "split" else " only"
    print(f"verl-tide: Ref runs on elastic ranks{beside} (tide.ra2p.ref_ranks = 0): rank(s) "
          f"{sorted(r for r, role in roles.items() if role is Role.REF)} start as Ref", flush=True)


def elastic_ref_options(replica: Any) -> dict[str, Any]:
    """Where an elastic Ref replica runs: the rollout replica's first placement-group bundle (its GPU), taking
    the device share verl's rollout worker leaves free there (1 / max_colocate_count)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from verl.plugin.platform import get_platform

    pool = replica.resource_pool
    share = 1.0 / pool.max_colocate_count
    pg = pool.get_placement_groups()[0]
    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                    placement_group_bundle_index=0),
            "num_cpus": 0, **get_platform().ray_resource_options(share)}

"""Trainer `tide`'s standalone rollout pool, built once at start-up: verl's LLM server manager with CTB as its
load balancer, the checkpoint engine that pushes weights to it, rank health (quarantine, relaunch), the step
report, and ERS's elastic ranks when tide runs Ref replicas of its own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from verl_tide.ers.policy import Role
from verl_tide.trainer import elastic_setup, verl_compat
from verl_tide.trainer.rank_health import RankHealth
from verl_tide.trainer.reporting import RolloutReport


@dataclass
class RolloutPool:
    manager: Any  # verl's LLMServerManager (the trainer's `standalone_server_manager`)
    checkpoint_manager: Any  # verl's CheckpointEngineManager for it (`standalone_checkpoint_manager`)
    health: RankHealth
    report: RolloutReport
    roles: dict[int, Role]
    elastic: Any = None  # ers/elastic.py's ElasticRanks, with tide's Ref pool and ERS on


def ctb_balancer_cls(config: Any, tide_config: Any) -> Optional[type]:
    """CTB's router bound to the job's `tide.ctb` and GRPO group sizes (None: verl's stock routing)."""
    if not tide_config.ctb.enabled:
        return None
    from omegaconf import OmegaConf

    from verl_tide.ctb.router import CTBLoadBalancer

    rollout = config.actor_rollout_ref.rollout
    return CTBLoadBalancer.with_config({
        "ctb": OmegaConf.to_container(config.tide.ctb, resolve=True), "backend": rollout.name,
        "group_size": int(rollout.get("n", 1) or 1),
        "eval_group_size": int(rollout.get("val_kwargs", {}).get("n", 1) or 1)})


def build(config: Any, tide_config: Any, actor_wg: Any, start_rank: int, ref_pool: Any) -> RolloutPool:
    """The pool's replicas take ranks from `start_rank` on (after verl's hybrid replicas on the Actor's GPUs)."""
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.llm_server import LLMServerManager
    from verl.workers.rollout.utils import update_prometheus_config

    from verl_tide.ctb.agent_loops import warn_about_stock_agent_loop
    from verl_tide.rollout_restart import RankRestarts

    rollout_config = config.actor_rollout_ref.rollout
    manager = LLMServerManager.create(config=config, start_rank=start_rank,
                                      load_balancer_cls=ctb_balancer_cls(config, tide_config))
    if rollout_config.prometheus.enable:
        update_prometheus_config(rollout_config.prometheus, manager.server_addresses, rollout_config.name)
    checkpoints = CheckpointEngineManager(config=omega_conf_to_dataclass(rollout_config.checkpoint_engine),
                                          actor_wg=actor_wg, replicas=manager.get_replicas())
    balancer = verl_compat.load_balancer(manager)
    restarts = RankRestarts(balancer, checkpoints, tide_config.max_rank_restarts)
    pool = RolloutPool(manager, checkpoints, RankHealth(manager, checkpoints, tide_config.ctb.enabled, restarts),
                       RolloutReport(manager, str(rollout_config.name), tide_config.ctb.enabled),
                       {rank: Role.ROLLOUT for rank in range(len(manager.get_replicas()))})
    warn_about_stock_agent_loop(rollout_config.agent.get("default_agent_loop"), tide_config.ctb.enabled)
    if ref_pool is not None and tide_config.ers.enabled:
        from verl_tide.ers.elastic import ElasticRanks

        pool.elastic = ElasticRanks(manager.get_replicas(), balancer, checkpoints, ref_pool,
                                    elastic_setup.elastic_ref_options)
        if not rollout_config.free_cache_engine:
            print("verl-tide: elastic ranks on; actor_rollout_ref.rollout.free_cache_engine = false keeps a Ref-role "
                  "rank's KV cache allocated beside its Ref replica (set it true on GPUs)", flush=True)
    return pool


def ctb_state(manager: Any) -> dict:
    """CTB's router state (counters, group probes) for tide's checkpoint."""
    import ray

    return ray.get(verl_compat.load_balancer(manager).get_state.remote(), timeout=60)


def restore_ctb(manager: Any, state: dict) -> None:
    import ray

    ray.get(verl_compat.load_balancer(manager).load_state.remote(state), timeout=60)
    print(f"verl-tide: CTB state restored ({state['scheduler']['counters']['admissions']} admissions so far, "
          f"first-turn footprints of {len(state['scheduler']['group_probe'])} groups)", flush=True)

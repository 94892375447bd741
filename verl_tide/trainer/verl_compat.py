"""Every place trainer `tide` reaches into verl beyond its registry and hooks, one function each.

verl 0.9.1 offers no public way for these (private attributes, a grandparent's method called past the
parent, one method copied to change a count). Each function names the verl version it was written
against and, if verl changes under it, fails at once with a message that says what is missing, instead
of an AttributeError deep inside a training step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transfer_queue import KVBatchMeta

VERL_VERSION = "0.9.1"


class VerlChanged(RuntimeError):
    """verl no longer has something trainer `tide` relies on."""


def _installed_verl() -> str:
    try:
        import importlib.metadata as md

        return md.version("verl")
    except Exception:  # noqa: BLE001  (only for the message)
        return "unknown"


def reach(obj: Any, name: str, what: str) -> Any:
    """`obj.name`, or a `VerlChanged` naming it, what it is for, and the verl version it was written against."""
    try:
        return getattr(obj, name)
    except AttributeError:
        raise VerlChanged(
            f"verl-tide reads {type(obj).__name__}.{name} ({what}), which verl {VERL_VERSION} has and the "
            f"installed verl {_installed_verl()} does not: install verl=={VERL_VERSION} or update "
            "verl_tide/trainer/verl_compat.py") from None


def dispatch_layout(worker_group: Any, mesh: str) -> list[int]:
    """The data-parallel rank of each worker of `worker_group` on `mesh` (verl 0.9.1 caches it in
    `_dispatch_info`, filled by `_query_dispatch_info`): RA2P's hand-off gives each Ref rank the samples its
    own process trains."""
    info = reach(worker_group, "_dispatch_info", "data-parallel layout cache of a worker group")
    if mesh not in info:
        info[mesh] = reach(worker_group, "_query_dispatch_info", "data-parallel layout query")(mesh)
    return list(info[mesh])


def actor_pool_layout(trainer: Any) -> tuple[Any, Any]:
    """What verl's `PPOTrainer._setup` (0.9.1) built the Actor's pool from (`resource_pool_manager`,
    `resource_pool_to_cls`: role name -> `RayClassWithInitArgs`), to build it again at another size; and the pool.
    The pool may hold verl's Ref role beside the Actor (a Ref model, RA2P colocated): it is rebuilt with it."""
    from verl.trainer.ppo.utils import Role as VerlRole

    from verl_tide.trainer.actor_group import ActorGroupLayout

    manager = reach(trainer, "resource_pool_manager", "the job's resource pools")
    pool = manager.get_resource_pool(VerlRole.Actor)
    classes = dict(reach(trainer, "resource_pool_to_cls", "worker classes per resource pool")[pool])
    actor, ref = str(VerlRole.Actor), str(VerlRole.RefPolicy)
    if set(classes) not in ({actor}, {actor, ref}):
        raise RuntimeError(f"ERS's trainer resize rebuilds a pool holding the Actor and verl's Ref role alone; verl "
                           f"built {sorted(classes)} in it (tide.ers.resize_trainer: no critic or reward model on "
                           f"those GPUs)")
    if len(pool.store) != 1:
        raise RuntimeError(f"ERS's trainer resize is built for one node; the Actor's pool spans {pool.store}")
    layout = ActorGroupLayout(class_dict=classes, actor_role=actor, init_method={role: "init_model" for role in classes},
                              wg_kwargs={"device_name": trainer.config.trainer.device},
                              max_colocate_count=pool.max_colocate_count, ref_role=ref if ref in classes else None)
    return layout, pool


def rebind_actor_group(trainer: Any, views: dict[str, Any], layout: Any, pool: Any) -> None:
    """The trainer's references to the Actor's group, its Ref role and its pool (verl 0.9.1: `actor_rollout_wg`,
    `ref_policy_wg`, both checkpoint managers' `actor_wg`, the pool manager's and `resource_pool_to_cls`'s entries)
    moved to a rebuilt group."""
    from verl.trainer.ppo.utils import Role as VerlRole

    manager = reach(trainer, "resource_pool_manager", "the job's resource pools")
    name = manager.mapping[VerlRole.Actor]
    old = manager.resource_pool_dict[name]
    classes = reach(trainer, "resource_pool_to_cls", "worker classes per resource pool")
    classes[pool] = classes.pop(old)
    manager.resource_pool_dict[name] = pool
    old_actor, actor_wg = trainer.actor_rollout_wg, views[layout.actor_role]
    trainer.actor_rollout_wg = actor_wg
    if layout.ref_role is not None:
        trainer.ref_policy_wg = views[layout.ref_role]
    elif getattr(trainer, "ref_policy_wg", None) is old_actor:  # Ref inside the Actor (LoRA's adapter-off pass)
        trainer.ref_policy_wg = actor_wg
    for attr in ("checkpoint_manager", "standalone_checkpoint_manager"):
        reach(reach(trainer, attr, "weight sync to rollout"), "actor_wg", "the group weights are sent from")
        setattr(getattr(trainer, attr), "actor_wg", actor_wg)


def step_timing(trainer: Any) -> dict[str, float]:
    """The step's stage timers (`timing_raw`: old_log_prob, update_actor, ...), which verl fills per step."""
    return reach(trainer, "timing_raw", "the step's stage timers")


def pending_sync_metrics(trainer: Any) -> dict[str, Any]:
    """Metrics separate_async logs with the step after the weight sync (`_pending_sync_metrics`)."""
    return reach(trainer, "_pending_sync_metrics", "metrics logged after the weight sync")


def load_balancer(server_manager: Any) -> Any:
    """The rollout pool's load-balancer actor (`LLMServerManager.global_load_balancer`): CTB's router."""
    return reach(server_manager, "global_load_balancer", "the rollout pool's load balancer")


def server_handle(replica: Any) -> Any:
    """A rollout replica's server actor (`server_handle`), for health checks."""
    return reach(replica, "server_handle", "a rollout replica's server actor")


def launch_standalone_replica(manager: Any) -> tuple[int, Any]:
    """A new standalone rollout replica for the pool, as verl 0.9.1's `LLMServerManager._initialize_llm_servers`
    builds each (the manager's replica class and configs, the next replica rank, `init_standalone()`: a resource
    pool of its own on free GPUs, workers, servers), appended to the manager's lists (`rollout_replicas`,
    `server_handles`, `server_addresses`) so every reader of `get_replicas()` sees it. Returns its index there
    (trainer `tide`'s rollout rank) and the replica. verl offers no call that adds one; it runs an event loop of
    its own: call it where none runs (a thread)."""
    import asyncio

    replicas = reach(manager, "rollout_replicas", "the rollout pool's replicas")
    config = reach(manager, "rollout_config", "the rollout config replicas are built from")
    replica = reach(manager, "rollout_replica_class", "the rollout replica class")(
        replica_rank=int(reach(manager, "start_rank", "the pool's first replica rank")) + len(replicas), config=config,
        model_config=reach(manager, "model_config", "the model config replicas are built from"),
        gpus_per_node=config.n_gpus_per_node)
    asyncio.run(replica.init_standalone())
    replicas.append(replica)
    reach(manager, "server_handles", "the pool's server actors").append(server_handle(replica))
    reach(manager, "server_addresses", "the pool's server addresses").append(replica.server_address)
    return len(replicas) - 1, replica


def reward_workers(trainer: Any) -> Any:
    """The reward loop's worker handles (None when rewards run on the trainer's GPUs)."""
    manager = reach(trainer, "reward_loop_manager", "verl's reward loop")
    return reach(manager, "reward_loop_worker_handles", "the reward loop's workers")


def init_without_separate_async(trainer: Any, config: Any) -> None:
    """`PPOTrainer.__init__` past separate_async's own (which checks a config block tide replaces)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    PPOTrainer.__init__(trainer, config)


def setup_without_colocated_rollout(trainer: Any, without_ref: bool = False) -> None:
    """`PPOTrainer._setup` past separate_async's (which would build hybrid replicas on the trainer's GPUs):
    worker groups and the reward loop only; trainer tide builds its own rollout pool. `without_ref`: verl builds no
    Ref worker group (tide's replicas replace it); its flag goes back on after, so verl's step still asks for ref
    log-probs (answered by trainer tide's `_compute_ref_log_prob`)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    use_ref = trainer.use_reference_policy
    trainer.use_reference_policy = use_ref and not without_ref
    try:
        PPOTrainer._setup(trainer)
    finally:
        trainer.use_reference_policy = use_ref


def blocking_validate(view: Any) -> dict:
    """`PPOTrainer._validate` on a view of the trainer (the overlapped evaluation pins its weights' step)."""
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    return PPOTrainer._validate(view)


def train_mini_batches(trainer: Any, count: int, sample_batch_size: int, metrics: dict,
                       timing_raw: dict) -> KVBatchMeta:
    """`PPOTrainer.step` of verl 0.9.1 with `count` mini-batches instead of `parameter_sync_step` (ERS's elastic
    batch): verl derives the mini-batch size from the same count, so the loop is copied, not reused."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.utils import MetricsAggregator

    step_once = reach(trainer, "_step_once", "one PPO mini-batch update")
    aggregator = MetricsAggregator()
    prepare_metrics = trainer.prepare_step()
    if prepare_metrics:
        aggregator.add_step_metrics(prepare_metrics)
    keys, tags, partition_id = [], [], "train"
    for trigger_idx in range(count):
        trainer.local_trigger_step = trigger_idx
        iter_metrics: dict = {}
        batch = step_once(iter_metrics, timing_raw, sample_batch_size)
        aggregator.add_step_metrics(iter_metrics,
                                    sample_count=sum(not tag.get("is_padding", False) for tag in batch.tags))
        keys.extend(batch.keys)
        tags.extend(batch.tags)
        partition_id = batch.partition_id
    metrics.update(aggregator.get_aggregated_metrics())
    return KVBatchMeta(partition_id=partition_id, keys=keys, tags=tags)


def separate_async_step_end(trainer: Any, lend: bool) -> None:
    """`PPOTrainerSeparateAsync.on_step_end` of verl 0.9.1 with its hybrid-switch decision taken out: `lend`
    (ERS's, `verl_tide/ers/lending.py`) says whether the replica on the Actor's GPUs rolls out after the weight
    sync. The rest as verl does it: the weight sync, the replica registered with the balancer before the sync
    and woken after it (so it gets the new weights), the round trip's cost recorded where verl keeps it."""
    import time

    from verl.utils.profiler import marked_timer

    costs = reach(trainer, "_to_rollout_costs", "the hybrid switch's measured costs to rollout")
    if reach(trainer, "prev_step_profile", "whether the last step was profiled"):
        reach(trainer, "_stop_rollout_profiling", "stops the rollout profiler")()
    timing = step_timing(trainer)
    prepare_s = 0.0
    if lend:
        start = time.perf_counter()
        with marked_timer("switch_to_rollout", timing, color="cyan"):
            trainer.add_replicas_to_balancer()
            trainer.clear_sticky_cache()
        prepare_s = time.perf_counter() - start
    with marked_timer("update_weights", timing, color="red"):
        sync = reach(trainer, "standalone_checkpoint_manager", "the rollout pool's weight sync").update_weights(
            trainer.global_steps)
    trainer._pending_sync_metrics = dict(sync or {})
    if lend:
        start = time.perf_counter()
        with marked_timer("switch_to_rollout", timing, color="cyan"):
            trainer.switch_to_rollout(already_registered=True)
        costs.append(prepare_s + time.perf_counter() - start)


def switch_round_trip_s(trainer: Any) -> float | None:
    """The measured cost of lending the Actor's replica and taking it back (verl 0.9.1 keeps the recent
    switches' costs, both ways, and averages them in `_effective_switch_cost`); None before both were seen."""
    return reach(trainer, "_effective_switch_cost", "the hybrid switch's measured round-trip cost")()


def check_hybrid_switch_hooks(trainer_cls: type) -> None:
    """The hybrid-switch methods ERS's lending overrides or calls (verl 0.9.1's separate_async): fail at start-up,
    not at the first switch, if verl renamed them."""
    for name, what in (("_switch_threshold", "ready prompts before the hybrid replica returns to training"),
                       ("_effective_switch_cost", "the measured switch round trip"),
                       ("switch_to_rollout", "wakes the hybrid replica with the new weights"),
                       ("add_replicas_to_balancer", "routes rollout to the hybrid replica"),
                       ("_init_hybrid_rollout_state", "the hybrid switch's state")):
        reach(trainer_cls, name, what)


# verl 0.9.1's private methods trainer `tide` and its replay buffer override (an override of a method verl renamed
# would silently never run) or call, with what each is for. `check_private_hooks` fails at start-up on a verl
# that lacks one; tests/test_trainer_units.py runs it against the installed verl.
TRAINER_HOOKS = {
    "_build_replay_buffer": "builds the replay buffer (tide's, with readiness and the ledger)",
    "_init_dataloader": "the dataloaders (evaluation prompts marked for CTB)",
    "_init_resource_pool_mgr": "verl's worker roles (Ref replaced or its hand-off workers)",
    "_setup": "worker groups, reward loop, rollout (tide's own pool)",
    "_save_checkpoint": "verl's checkpoint (tide's state beside it)",
    "_load_checkpoint": "verl's resume (tide's state with it)",
    "_compute_old_log_prob": "the Actor's forward (RA2P's Ref path starts before it)",
    "_compute_ref_log_prob": "Ref log-probs (RA2P's mode for the step)",
    "_update_actor": "the Actor's update (deferred KL, hand-off inputs)",
    "_submit_batch_to_rollout": "prompts to rollout (the ledger counts them)",
    "_validate": "validation (overlapped with the next step's rollout)",
    "_add_prompts_to_generate": "the replay buffer's refill",
    "_resolve_filter_groups_metric": "DAPO's group filter metric, for the replay buffer",
    "_step_once": "one PPO mini-batch update (ERS's elastic batch)",
}
REPLAY_BUFFER_HOOKS = {
    "_sync_metadata_from_transfer_queue": "groups becoming ready (readiness arrivals, the ledger)",
    "_wait_for_next_poll": "the sampler's wait for data (CTB's budget window decides there)",
    "_evict_terminal_groups": "groups evicted stale, filtered or failed (the ledger)",
    "_materialize_batch": "groups sampled for an update (the ledger)",
    "_terminal_eviction_reasons": "which groups verl would evict now (ready groups for aggregation)",
    "_sampleable_terminal_keys": "which groups verl would sample next (ready groups for aggregation)",
}


def check_private_hooks(trainer_cls: type, buffer_cls: type) -> None:
    """Every private verl method in `TRAINER_HOOKS` and `REPLAY_BUFFER_HOOKS` exists on verl's classes: a
    `VerlChanged` at start-up, naming the method, instead of an override that never runs."""
    for cls, hooks in ((trainer_cls, TRAINER_HOOKS), (buffer_cls, REPLAY_BUFFER_HOOKS)):
        for name, what in hooks.items():
            reach(cls, name, what)


def verl_ref_pass_multiple(ref_config: Any, world_size: int) -> int:
    """Rows a Ref pass on verl's worker group must come in multiples of: verl splits the pass evenly over its
    ranks, and each rank's share must be whole micro-batches (verl 0.9.1 asserts it in
    `engine/utils.prepare_micro_batches` unless `log_prob_use_dynamic_bsz`). A pass of the mini-batch and one
    group scored ahead broke this on 2 ranks with 2-row micro-batches (a fresh-clone CI run, 2026-12-03)."""
    ranks = max(1, int(world_size))
    if ref_config.get("log_prob_use_dynamic_bsz", False):
        return ranks
    per_gpu = ref_config.get("log_prob_micro_batch_size_per_gpu")
    if per_gpu is None and ref_config.get("log_prob_micro_batch_size") is not None:  # verl's deprecated global key
        per_gpu = max(1, int(ref_config.get("log_prob_micro_batch_size")) // ranks)
    return ranks * max(1, int(per_gpu or 1))

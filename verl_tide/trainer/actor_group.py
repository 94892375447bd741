"""ERS's trainer resize, verl side: the Actor's worker group rebuilt over another number of GPUs, its training state
carried across (`ers/train_state.py`, through the worker methods of `ers/resize_worker.py`).

verl 0.9.1 builds a pool's roles into one process per GPU (`create_colocated_worker_cls`, `RayWorkerGroup.spawn`,
`PPOTrainer._setup`) and offers no way to change a group's size; it has no call that stops a group either. This
module does what `_setup` does over a new `RayResourcePool`, after the old group has written its state and been
stopped: the same classes and init arguments, the same role views, the same engine init, then the state loaded.
A failure leaves the state directory in place and names it. Thin verl adapter.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

STATE_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()  # host memory on one node


@dataclass(frozen=True)
class ActorGroupLayout:
    """What verl's `_setup` built the Actor's pool from, kept so the group can be built again at another size."""

    class_dict: dict[str, Any]  # role name -> verl `RayClassWithInitArgs` (as in `resource_pool_to_cls[pool]`)
    actor_role: str  # the role whose engine trains (verl's `str(Role.Actor)`), holding `TrainStateTransfer`
    init_method: dict[str, str]  # role -> the call that builds its engine ("init_model"; a bare TrainingWorker: "reset")
    wg_kwargs: dict[str, Any] = field(default_factory=dict)  # verl's `RayWorkerGroup` keyword arguments
    max_colocate_count: int = 3  # verl's `ResourcePoolManager` default: CPUs per bundle
    after_init: Optional[Callable[[dict[str, Any]], None]] = None  # the plugin's own post-init calls (loss functions)
    ref_role: Optional[str] = None  # verl's Ref role in the same processes (`str(Role.RefPolicy)`), built again too


@dataclass(frozen=True)
class ResizeTimes:
    """Seconds each part of one resize took: what ERS's `move_s` input is measured from."""

    world_from: int
    world_to: int
    export_s: float
    stop_s: float
    build_s: float  # placement, worker processes, engines built
    import_s: float

    @property
    def total_s(self) -> float:
        return self.export_s + self.stop_s + self.build_s + self.import_s

    def as_metrics(self, prefix: str = "tide/ers/resize_") -> dict[str, float]:
        return {f"{prefix}{k}": float(v) for k, v in (("from_gpus", self.world_from), ("to_gpus", self.world_to),
                                                       ("export_s", self.export_s), ("stop_s", self.stop_s),
                                                       ("build_s", self.build_s), ("import_s", self.import_s),
                                                       ("total_s", self.total_s))}


def build_actor_group(layout: ActorGroupLayout, world_size: int, gpu_wait_s: float = 300.0) -> tuple[dict[str, Any], Any]:
    """The pool's role views (role -> `RayWorkerGroup`) over `world_size` GPUs, engines built; and the new pool."""
    from verl.single_controller.ray import RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls

    _wait_for_gpus(world_size, gpu_wait_s)
    pool = RayResourcePool(process_on_nodes=[world_size], use_gpu=True, max_colocate_count=layout.max_colocate_count)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls(layout.class_dict),
                           **layout.wg_kwargs)
    views = group.spawn(prefix_set=layout.class_dict.keys())
    for role in layout.class_dict:  # the Actor first, as `_setup` does
        getattr(views[role], layout.init_method[role])()
    if layout.after_init is not None:
        layout.after_init(views)
    return views, pool


def stop_actor_group(views: dict[str, Any], pool: Any) -> None:
    """The group's processes killed and its placement groups removed: its GPUs free for the next group."""
    import ray
    from ray.util.placement_group import remove_placement_group

    handles = {id(h): h for view in views.values() for h in view.workers}.values()  # role views share processes
    for handle in handles:
        ray.kill(handle, no_restart=True)
    for pg in pool.pgs or []:
        remove_placement_group(pg)


def resize_actor_group(layout: ActorGroupLayout, views: dict[str, Any], pool: Any, world_size: int,
                       clock: Callable[[], float] = time.perf_counter, state_root: str = STATE_ROOT,
                       gpu_wait_s: float = 60.0) -> tuple[dict[str, Any], Any, ResizeTimes]:
    """The Actor's group at `world_size` GPUs with the state it holds now. Call it at the weight-sync boundary,
    after the update and before the sync, with no request in flight to the group. Refused before anything stops
    when the GPUs are not there (after `gpu_wait_s` for them); if building the new group fails, the old size is
    built again from the saved state (the times then say `world_to == world_from`); only if that fails too does
    the error propagate, naming where the state is kept."""
    actor = views[layout.actor_role]
    world_from = actor.world_size
    try:  # a rollout replica stopped just before frees its GPU a moment later
        if world_size < 1:
            raise TimeoutError
        _wait_for_gpus(world_size - world_from, gpu_wait_s)
    except TimeoutError:
        raise ValueError(f"ERS's trainer resize to {world_size} GPU(s): the Actor holds {world_from} and "
                         f"{_free_gpus():g} more are free; free a rollout replica's GPU first") from None
    state_dir = tempfile.mkdtemp(prefix="verl-tide-actor-state-", dir=state_root)
    try:
        t0 = clock()
        actor.export_train_state(state_dir)
        t1 = clock()
        stop_actor_group(views, pool)
        t2 = clock()
        try:
            views, pool = build_actor_group(layout, world_size)
            views[layout.actor_role].import_train_state(state_dir)
        except Exception as exc:  # the old size again, from the same state
            print(f"verl-tide: ERS's trainer resize {world_from} -> {world_size} GPU(s) failed ({exc!r}); "
                  f"rebuilding the Actor's group at {world_from}", flush=True)
            world_size = world_from
            views, pool = build_actor_group(layout, world_from)
            t3 = clock()
            views[layout.actor_role].import_train_state(state_dir)
        else:
            t3 = clock()
        t4 = clock()
    except BaseException as exc:
        raise RuntimeError(f"ERS's trainer resize {world_from} -> {world_size} GPU(s) failed; the Actor's training "
                           f"state saved before it is kept at {state_dir}") from exc
    shutil.rmtree(state_dir, ignore_errors=True)
    return views, pool, ResizeTimes(world_from, world_size, t1 - t0, t2 - t1, t3 - t2, t4 - t3)


def _wait_for_gpus(n: int, timeout_s: float) -> None:
    """verl's pool creation waits without end for its placement; a resize says what it waits for instead."""
    deadline = time.monotonic() + timeout_s
    while (free := _free_gpus()) < n - 1e-6:
        if time.monotonic() > deadline:
            raise TimeoutError(f"ERS's trainer resize needs {n} free GPU(s) for the Actor's group; {free:g} free "
                               f"after {timeout_s:.0f}s (a rollout replica still holds one?)")
        time.sleep(0.2)


def _free_gpus() -> float:
    import ray
    from verl.plugin.platform import get_platform

    return ray.available_resources().get(get_platform().ray_resource_name(), 0.0)

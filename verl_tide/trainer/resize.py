"""ERS's trainer resize in a running job (`tide.ers.resize_trainer`): at the weight-sync boundary the Actor's
training group takes a standalone rollout replica's GPUs (up) or gives them back (down), as `ers/resize.py`
decided in the boundary round.

Up: the replica leaves CTB's router, its in-flight requests are aborted with the gate rejecting (verl's
partial-rollout client re-sends each, prompt plus tokens so far, to another rank: nothing is lost), it leaves the
checkpoint engine, its processes stop and its placement group is removed; then the Actor's group is rebuilt over
one more replica's GPUs with its state carried (`trainer/actor_group.py`). Down: the Actor's group is rebuilt
smaller first, then the replica is launched again in its own pool (`rollout_restart.relaunch_replica`), joins the
checkpoint engine before the sync (which gives it the current weights) and the router after it.

The seconds the training stopped for, measured, become the next decision's `move_s`. Thin verl adapter; the
reach into verl's trainer attributes is `verl_compat.actor_pool_layout`. With a Ref model verl's Ref role lives in the
Actor's processes (RA2P colocated): it is rebuilt with them, and samples Ref scored ahead whose rows stayed in
those processes (the hand-off) are scored again by the pass that trains them (`RefPath.before_actor_rebuild`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ray

from verl_tide.ers.policy import Role
from verl_tide.ers.resize import ResizeDecision, ResizeInputs
from verl_tide.trainer import actor_group, verl_compat
from verl_tide.trainer.actor_group import ActorGroupLayout, ResizeTimes


@dataclass
class AppliedResize:
    step: int
    actor_from: int
    actor_to: int
    ranks: list[int]  # rollout ranks whose GPUs moved
    rollout_s: float  # replicas released (up) or launched again (down)
    times: ResizeTimes
    reason: str
    ref_rescored: int = 0  # samples scored ahead whose hand-off rows stopped with the old processes: scored again
    new_ranks: int = 0  # of `ranks` (down), those launched on GPUs rollout never had

    @property
    def total_s(self) -> float:
        return self.rollout_s + self.times.total_s

    def text(self) -> str:
        t = self.times
        verb = "released" if self.actor_to > self.actor_from else \
            f"launched ({self.new_ranks} new)" if self.new_ranks else "launched again"
        return (f"ERS resized the Actor's group {self.actor_from} -> {self.actor_to} GPU(s) after step {self.step} in "
                f"{self.total_s:.1f} s (state out {t.export_s:.1f}, old group stopped {t.stop_s:.1f}, new group built "
                f"{t.build_s:.1f}, state in {t.import_s:.1f}; rollout rank(s) {self.ranks} {verb} "
                f"{self.rollout_s:.1f}"
                + (f"; {self.ref_rescored} sample(s) scored ahead by Ref scored again" if self.ref_rescored else "")
                + f"): {self.reason}")


@dataclass
class TrainerResize:
    """The Actor's group as ERS resizes it, and the rollout ranks whose GPUs it holds."""

    layout: ActorGroupLayout
    pool: Any  # the Actor's current `RayResourcePool`
    move_s: float  # what the next decision assumes a resize costs (measured after the first)
    mini_batch: int  # sequences per PPO mini-batch: the Actor's GPU count must divide it
    start_gpus: int  # the Actor's GPUs at start-up (a checkpoint at another size carries a re-sharding copy)
    gpus_per_replica: int = 1  # a rollout replica's GPUs (verl's `RolloutReplica.world_size`): moves go in these
    training_ranks: list[int] = field(default_factory=list)  # rollout ranks now in the Actor's group, in order
    applied: list[AppliedResize] = field(default_factory=list)
    _rejoin: list[int] = field(default_factory=list)
    timeout_s: float = 120.0
    cycles: list[tuple[int, int, float]] = field(default_factory=list)  # (step, Actor GPUs, boundary to boundary s)
    _last_boundary: Optional[float] = None

    def inputs(self, actor_gpus: int, roles: dict[int, Role], batch: int, steps_left: int, *,
               weight_kv_tokens: Optional[float], kv_bound_min: float, max_staleness: int = 0) -> ResizeInputs:
        """The decision's inputs, the saturation tests' figures as the split advice reads them (the model's weights
        in KV tokens, `tide.ers.split_advice_kv_bound`), as the simulator gives them."""
        rollout = self.gpus_per_replica * sum(r is Role.ROLLOUT for r in roles.values())
        return ResizeInputs(rollout_gpus=rollout, actor_gpus=actor_gpus, batch=batch, move_s=self.move_s,
                            steps_left=steps_left, weight_kv_tokens=weight_kv_tokens, kv_bound_min=kv_bound_min,
                            mini_batch=self.mini_batch, gpus_per_replica=self.gpus_per_replica,
                            max_staleness=max_staleness)

    def apply(self, trainer: Any, decision: ResizeDecision, step: int) -> AppliedResize:
        """The move to `decision.actor_gpus`; call after the update, before `before_sync`."""
        actor = trainer.actor_rollout_wg
        a0, a1 = actor.world_size, decision.actor_gpus
        replicas = trainer.standalone_server_manager.get_replicas()
        begin = start = time.perf_counter()
        rescored = trainer.ref.before_actor_rebuild()  # hand-off rows live in the processes about to stop
        new_ranks: list[int] = []
        if a1 > a0:
            ranks = [r for r in sorted(trainer.rollout_roles, reverse=True)
                     if trainer.rollout_roles[r] is Role.ROLLOUT][: (a1 - a0) // self.gpus_per_replica]
            for rank in ranks:
                self._release(trainer, rank, replicas[rank])
            rollout_s = time.perf_counter() - start
            views, self.pool, times = actor_group.resize_actor_group(self.layout, self._views(trainer), self.pool, a1)
            if times.world_to == a0:  # the group could not grow and was rebuilt as it was: rollout gets them back
                for rank in ranks:
                    self._launch_again(trainer, rank, replicas[rank])
        else:  # GPUs taken from rollout go back first; past the start split, rollout gets replicas it never had
            views, self.pool, times = actor_group.resize_actor_group(self.layout, self._views(trainer), self.pool, a1)
            given_back = (a0 - times.world_to) // self.gpus_per_replica
            ranks = self.training_ranks[-given_back:] if given_back else []
            start = time.perf_counter()
            for rank in ranks:
                self._launch_again(trainer, rank, replicas[rank])
            new_ranks = [self._launch_new(trainer) for _ in range(given_back - len(ranks))]
            ranks = [*ranks, *new_ranks]
            rollout_s = time.perf_counter() - start
        verl_compat.rebind_actor_group(trainer, views, self.layout, self.pool)
        trainer.ref.after_actor_rebuild(trainer.actor_rollout_wg, getattr(trainer, "ref_policy_wg", None),
                                        bool(trainer.ref_in_actor))
        done = AppliedResize(step, a0, times.world_to, ranks, rollout_s, times, decision.reason, rescored,
                             len(new_ranks))
        self.applied.append(done)
        self.move_s = done.total_s
        verl_compat.step_timing(trainer)["tide_resize"] = time.perf_counter() - begin
        print(f"verl-tide: {done.text()}", flush=True)
        return done

    def after_sync(self, trainer: Any) -> None:
        """Ranks launched again hold this sync's weights: they take tasks again."""
        if not self._rejoin:
            return
        replicas = trainer.standalone_server_manager.get_replicas()
        servers = {replicas[r].server_address: verl_compat.server_handle(replicas[r]) for r in self._rejoin}
        ray.get(verl_compat.load_balancer(trainer.standalone_server_manager).add_servers.remote(servers),
                timeout=self.timeout_s)
        for rank in self._rejoin:
            trainer.rollout_roles[rank] = Role.ROLLOUT
        self._rejoin = []

    def metrics(self, step: int, actor_gpus: int, now: float) -> dict[str, float]:
        """The step's resize metrics, at its boundary (`now`: the trainer's clock); the step cycle (boundary to
        boundary) is logged beside the cycles before the last resize for three steps after it."""
        m = {"tide/ers/actor_gpus": float(actor_gpus), "tide/ers/resizes": float(len(self.applied)),
             "tide/ers/resize_move_s": float(self.move_s)}
        if self._last_boundary is not None:
            cycle = now - self._last_boundary
            self.cycles.append((step, actor_gpus, cycle))
            m["tide/ers/cycle_s"] = cycle
            self._report_cycle(step, actor_gpus, cycle)
        self._last_boundary = now
        if self.applied:
            last = self.applied[-1]
            m.update(last.times.as_metrics())
            m["tide/ers/resize_rollout_s"] = last.rollout_s
        return m

    def save_resharded(self, trainer: Any, step_folder: str) -> None:
        """Beside verl's checkpoint (written per rank at the Actor's current size), while the Actor holds rollout
        GPUs: a copy any size can load, so the job resumes at the split it started with."""
        import os

        from verl_tide.ers.resize_worker import RESHARDED_DIR

        if trainer.actor_rollout_wg.world_size != self.start_gpus:
            trainer.actor_rollout_wg.export_train_state(os.path.join(step_folder, "actor", RESHARDED_DIR))

    def _report_cycle(self, step: int, actor_gpus: int, cycle: float) -> None:
        if not self.applied or not 0 < step - self.applied[-1].step <= 3:
            return
        last = self.applied[-1]
        before = [c for s, _, c in self.cycles if last.step - 3 < s <= last.step]
        note = " (this cycle includes the resize)" if step == last.step + 1 else ""
        mean = f"{sum(before) / len(before):.2f} s" if before else "not measured"
        print(f"verl-tide step {step}: step cycle {cycle:.2f} s on {actor_gpus} Actor GPU(s){note}; before the resize "
              f"to {last.actor_to}, {mean} on {last.actor_from} (mean of the last {len(before)})", flush=True)

    def _views(self, trainer: Any) -> dict[str, Any]:
        views = {self.layout.actor_role: trainer.actor_rollout_wg}
        if self.layout.ref_role is not None:  # verl's Ref role in the same processes: rebuilt with the Actor
            views[self.layout.ref_role] = trainer.ref_policy_wg
        return views

    def _release(self, trainer: Any, rank: int, replica: Any) -> None:
        from ray.util.placement_group import remove_placement_group

        from verl_tide.ers.elastic import drain_replica
        from verl_tide.rollout_restart import stop_replica

        drain_replica(replica, verl_compat.load_balancer(trainer.standalone_server_manager),
                      trainer.standalone_checkpoint_manager, self.timeout_s)
        stop_replica(replica)
        for pg in replica.resource_pool.pgs or []:
            remove_placement_group(pg)
        replica.resource_pool.pgs = None  # verl's pool makes it again when the replica is launched again
        trainer.rollout_roles.pop(rank, None)
        trainer.health.training_ranks.add(rank)
        self.training_ranks.append(rank)

    def _launch_new(self, trainer: Any) -> int:
        """A rollout replica on GPUs the Actor gave up past its start: built as verl builds the pool's replicas
        (`verl_compat.launch_standalone_replica`), it joins the checkpoint engine before the sync and CTB's
        router after it, as a replica launched again does. Returns its rollout rank."""
        rank, replica = _off_this_thread(
            lambda: verl_compat.launch_standalone_replica(trainer.standalone_server_manager),
            "a new rollout replica on the GPUs the Actor gave up did not launch")
        trainer.standalone_checkpoint_manager.add_replicas([replica])  # the coming sync gives it the weights
        self._rejoin.append(rank)
        return rank

    def _launch_again(self, trainer: Any, rank: int, replica: Any) -> None:
        from verl_tide.rollout_restart import new_rollout_workers, relaunch_replica

        _off_this_thread(lambda: relaunch_replica(replica, lambda r: new_rollout_workers(
            r, f"rollout_standalone_{rank}_resize{len(self.applied)}")), f"rollout rank {rank} did not launch again")
        trainer.standalone_checkpoint_manager.add_replicas([replica])  # the coming sync gives it the weights
        trainer.health.training_ranks.discard(rank)
        self.training_ranks.remove(rank)
        self._rejoin.append(rank)


def _off_this_thread(launch: Callable[[], Any], failure: str) -> Any:
    """`launch()` on a thread of its own, waited for: verl's replica launches run an event loop of their own, not
    on this thread's. Its error is raised here, naming what failed."""
    out: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            out.append(launch())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run, name="tide-resize-launch")
    thread.start()
    thread.join()
    if error:
        raise RuntimeError(f"ERS's trainer resize: {failure}") from error[0]
    return out[0]


def check_job(config: Any, tide_config: Any) -> None:
    """With `tide.ers.resize_trainer`, a job ERS cannot resize stops before Ray starts work, naming the keys
    (`job_config.resize_blockers`)."""
    from verl_tide.core.config import TideConfigError
    from verl_tide.job_config import resize_blockers

    if tide_config.ers.resize_trainer and resize_blockers(config):
        raise TideConfigError(resize_blockers(config))


def install_actor_worker(role_worker_mapping: dict, tide_config: Any, inputs_handoff: bool) -> None:
    """With `tide.ers.resize_trainer`, the Actor role's worker with the state-transfer methods
    (`ers/resize_worker.py`), before verl builds it: the Actor's state can leave its group and enter a new one.
    `inputs_handoff`: the Ref path installed RA2P's hand-off worker for the Actor (`ref_path.choose_worker_roles`);
    the resizable one keeps its update."""
    if not tide_config.ers.resize_trainer:
        return
    from verl.trainer.ppo.utils import Role as VerlRole

    from verl_tide.core.config import TideConfigError
    from verl_tide.ers.resize_worker import ResizableActorWorker, ResizableHandoffActorWorker

    if VerlRole.Actor not in role_worker_mapping:
        raise TideConfigError([f"tide.ers.resize_trainer = true: verl built no separate Actor role "
                               f"({sorted(map(str, role_worker_mapping))})"])
    role_worker_mapping[VerlRole.Actor] = ray.remote(ResizableHandoffActorWorker if inputs_handoff
                                                     else ResizableActorWorker)


def build(trainer: Any, move_s: Optional[float], setup_s: float) -> TrainerResize:
    """The resize for a job whose verl `_setup` has run; `move_s` from `tide.ers.resize_move_s`, else the seconds
    the Actor's setup took (a rebuild does the same work plus the state's way out and in)."""
    layout, pool = verl_compat.actor_pool_layout(trainer)
    config = trainer.config
    mini_batch = int(config.actor_rollout_ref.actor.ppo_mini_batch_size) * int(config.actor_rollout_ref.rollout.n)
    assumed = float(setup_s if move_s is None else move_s)
    print(f"verl-tide: ERS may resize the Actor's group (tide.ers.resize_trainer); a move is assumed to stop "
          f"training {assumed:.1f} s until one is measured ("
          + ("tide.ers.resize_move_s" if move_s is not None else "the worker groups' set-up at start-up") + ")",
          flush=True)
    if layout.ref_role is not None:
        print("verl-tide: verl's Ref role shares the Actor's processes (RA2P colocated): a resize rebuilds it with "
              "them on the Actor's new GPUs", flush=True)
    replicas = trainer.standalone_server_manager.get_replicas()
    return TrainerResize(layout, pool, assumed, mini_batch, trainer.actor_rollout_wg.world_size,
                         int(replicas[0].world_size) if replicas else 1)


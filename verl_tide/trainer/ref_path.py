"""The Ref path of trainer `tide`: where each step's ref log-probs come from, in RA2P's mode for that step.

- decoupled: tide's Ref replicas (`ra2p/ref_workers.py`, ranks of their own or lent by ERS) score a
  mini-batch while the Actor runs its forward; the deferred-KL loss (`ra2p/loss.py`) picks the rows up in
  the Actor's backward through the Ref service;
- colocated: one Ref pass scores the mini-batch and the ready groups the rest of the weight-sync window
  trains (ready-batch aggregation, `ra2p/aggregation.py`), on verl's Ref role or on the replicas;
- split: verl's Ref role and the replicas each score a share of a pass (the cost model sizes it);
- the colocated hand-off (`tide.ra2p.zero_copy`, `ra2p/handoff.py`): rows (and inputs) reach the Actor's loss
  by sample id, in the same process, instead of through TransferQueue.

Why a module: one concern (which Ref runs where, what the Actor's loss reads); the trainer's verbs per mini-batch
are `before_old_log_prob`, `score`, `update_actor`."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any, Optional, Protocol

from verl_tide.core.config import TideConfig
from verl_tide.boundary.planner import BoundaryPlanner
from verl_tide.ra2p.aggregation import (RefAggregator, rank_aligned_order, split_ref_pass, trim_to_multiple,
                                        window_groups_left)
from verl_tide.ra2p.cost import RA2PMode, StageTimer, next_step_mode
from verl_tide.ra2p.handoff import SampleIds
from verl_tide.ra2p.layout import RefLayout
from verl_tide.trainer.boundary import observe_ref_replicas
from verl_tide.trainer.verl_compat import dispatch_layout, verl_ref_pass_multiple

SWAP_MEASURE_EVERY = 10  # steps between two measurements of the Ref<->Actor swap (each costs a swap pair)
VerlRefPass = Callable[[Any, dict], Any]  # verl's `_compute_ref_log_prob(batch, metrics)`
VerlUpdate = Callable[[Any, dict], Any]  # verl's `_update_actor(batch, metrics)`


class WorkerGroup(Protocol):
    """What the Ref path uses of a verl worker group (0.9.1)."""

    world_size: int


class ReadyGroups(Protocol):
    """What the Ref path uses of tide's replay buffer: the ready groups verl will sample next."""

    def ready_groups(self, global_steps: int, limit: int, exclude: set[str] = ...) -> list[tuple[str, dict]]: ...


class RefPath:
    def __init__(self, config: Any, tide_config: TideConfig, stage_timer: StageTimer, planner: BoundaryPlanner,
                 layout: RefLayout):
        self.config, self.tide_config = config, tide_config
        self.stage_timer, self.planner = stage_timer, planner
        self.aggregator = RefAggregator()  # colocated steps: ready-batch aggregation of Ref passes
        self.pool: Any = None  # tide's Ref replicas (ra2p/ref_workers.RefPool)
        self.service: Any = None  # decoupled/split: where the Actor's backward picks ref log-probs up
        self.service_name = ""
        self.in_flight: Optional[tuple] = None
        self.split_pending: list[list] = []  # split mode: the replicas' shares, collected after the update
        self.sample_ids = SampleIds()  # samples whose ref log-probs travel outside TransferQueue
        self.released_ids: list[int] = []  # of evicted samples scored ahead, discarded at the next update
        self.handoff_counters: dict[str, float] = {}  # cumulative; logged at the step boundary (not averaged)
        self.layout = layout  # where Ref runs and how its rows reach the Actor's loss (ra2p/layout.py)
        self.actor_wg: Any = None
        self.ref_wg: Any = None  # verl's Ref worker group, when it exists
        self.ref_in_actor = False
        self._swap_measured_at: Optional[int] = None
        self._swap_unmeasured_said = False

    def _verl_pass_multiple(self, wg: WorkerGroup) -> int:
        return verl_ref_pass_multiple(self.config.actor_rollout_ref.get("ref") or {}, wg.world_size)

    # ---- construction ------------------------------------------------------------------------
    def bind(self, actor_wg: WorkerGroup, ref_wg: Optional[WorkerGroup], ref_in_actor: bool) -> None:
        self.actor_wg, self.ref_wg, self.ref_in_actor = actor_wg, ref_wg, ref_in_actor

    def choose_worker_roles(self, role_worker_mapping: dict, mapping: dict) -> None:
        """Which Ref verl builds (before it builds any worker group). With tide's Ref replicas, none: verl's Ref
        would share the trainer's GPUs. With the hand-off, verl's own Ref and Actor roles (or its combined
        actor/rollout/ref role, when the Actor's GPUs also roll out) as tide's worker subclasses
        (`ra2p/handoff_worker.py`), so rows and inputs stay in the process. With Ref inside the Actor (LoRA),
        verl's path through TransferQueue."""
        from verl.trainer.ppo.utils import Role as VerlRole

        if self.layout.pool_wanted:
            role_worker_mapping.pop(VerlRole.RefPolicy, None)
            mapping.pop(VerlRole.RefPolicy, None)
        elif self.layout.handoff and VerlRole.RefPolicy in role_worker_mapping:
            import ray

            from verl_tide.ra2p.handoff_worker import TideActorWorker, TideRefWorker

            role_worker_mapping[VerlRole.RefPolicy] = ray.remote(TideRefWorker)
            if VerlRole.Actor in role_worker_mapping:  # and the inputs: the Actor's update takes them back
                role_worker_mapping[VerlRole.Actor] = ray.remote(TideActorWorker)
                self.layout = dataclasses.replace(self.layout, inputs_handoff=True)
        elif self.layout.handoff and VerlRole.ActorRolloutRef in role_worker_mapping:
            # The Actor's GPUs also roll out (lending beside verl's Ref): verl's one actor/rollout/ref worker
            import ray

            from verl_tide.ra2p.handoff_worker import TideActorRolloutRefWorker

            role_worker_mapping[VerlRole.ActorRolloutRef] = ray.remote(TideActorRolloutRefWorker)
            self.layout = dataclasses.replace(self.layout, inputs_handoff=True)
        else:
            self.layout = dataclasses.replace(self.layout, handoff=False)

    def start_pool(self) -> None:
        from verl_tide.ra2p.ref_workers import RefPool

        model = self.config.actor_rollout_ref.model
        ra2p = self.tide_config.ra2p
        dtype = str(self.config.actor_rollout_ref.ref.fsdp_config.get("model_dtype", "bfloat16") or "bfloat16")
        self.pool = RefPool(str(model.path), ra2p.ref_ranks, dtype=dtype,
                            trust_remote_code=bool(model.get("trust_remote_code", False)))
        how = "Actor waits for them"
        # With Ref on ranks of its own, deferring the KL term only removes a wait: auto takes it too (colocated asks
        # for the Actor to wait for the replicas; decoupled with a KL penalty in the reward is refused at start-up).
        kl_in_reward = bool(self.config.algorithm.get("use_kl_in_reward", False))
        if ra2p.mode == "decoupled" or (ra2p.mode == "auto" and not kl_in_reward):
            self.start_service()
            how = "deferred KL: the Actor's forward does not wait for Ref, its backward picks the log-probs up"
        if ra2p.mode == "split":
            print(f"verl-tide: RA2P split: verl's Ref on the trainer's GPUs and {ra2p.ref_ranks} Ref replica(s) of "
                  f"their own (ERS may lend rollout ranks as more) score shares of each Ref pass, sized by RA2P's "
                  f"cost model; the Actor's backward picks the replicas' log-probs up", flush=True)
            return
        if not self.layout.pool_wanted:
            print(f"verl-tide: verl's Ref on the trainer's GPUs (RA2P colocated, ready-batch aggregation); ERS may lend "
                  f"up to {self.tide_config.ers.max_ref_ranks} rollout rank(s) to Ref replicas (decoupled placement; "
                  f"{how})", flush=True)
            return
        where = (f"{ra2p.ref_ranks} Ref replica(s) on GPUs of their own" if ra2p.ref_ranks
                 else "Ref replicas on elastic ranks only")
        print(f"verl-tide: {where} (RA2P decoupled placement; {how}); verl's Ref worker is not built", flush=True)

    def start_service(self) -> None:
        """The Ref service (where ref log-probs wait by sample id) and the deferred-KL loss on the Actor, which
        takes them from the service, or from its own process after a colocated hand-off."""
        import ray

        from verl_tide.ra2p.ref_workers import RefLogProbService

        if self.service is not None:
            return
        self.service_name = f"tide_ref_service_{os.getpid()}_{int(time.time())}"
        self.service = ray.remote(RefLogProbService).options(name=self.service_name).remote()
        self._install_loss()
        if self.layout.handoff:
            print("verl-tide: RA2P colocated hand-off (tide.ra2p.zero_copy): ref log-probs reach the Actor's loss by "
                  "sample id, from the Ref role of its own process or Ray's shared memory, not TransferQueue",
                  flush=True)

    def _install_loss(self) -> None:
        """The deferred-KL loss on the Actor's group: it reads ref log-probs from the service or its own process."""
        from verl.utils.config import omega_conf_to_dataclass

        from verl_tide.ra2p.loss import DeferredKLLoss
        from verl_tide.ra2p.ref_workers import ServiceRefSource

        actor_cfg = omega_conf_to_dataclass(self.config.actor_rollout_ref.actor)
        self.actor_wg.set_loss_fn(DeferredKLLoss(actor_cfg, ServiceRefSource(self.service_name)))

    # ---- ERS's trainer resize: the Actor's processes (and verl's Ref role in them) built again ------------
    def before_actor_rebuild(self) -> int:
        """With the hand-off, the rows of samples scored ahead and not trained yet live in the Actor's processes
        (and in shared memory they own), which the resize stops: those samples are forgotten as scored, so the
        pass that trains them scores them again. Returns how many. Rows in TransferQueue outlive the processes."""
        if not self.layout.handoff or not self.aggregator.scored:
            return 0
        keys = sorted(self.aggregator.scored)
        self.forget_scored(keys)  # their ids go from the service at the next update
        return len(keys)

    def after_actor_rebuild(self, actor_wg: WorkerGroup, ref_wg: Optional[WorkerGroup], ref_in_actor: bool) -> None:
        """The rebuilt groups bound; the new Actor processes get the deferred-KL loss again (verl's own otherwise)."""
        self.bind(actor_wg, ref_wg, ref_in_actor)
        if self.service is not None:
            self._install_loss()

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown()

    # ---- which mode a step runs ------------------------------------------------------------
    def replicas_up(self) -> int:
        return len(self.pool.replicas) if self.pool is not None else 0

    def verls_ref_beside_replicas(self) -> bool:
        """verl's Ref worker group exists beside tide's Ref replicas, with the hand-off (the Actor's loss takes
        ref log-probs by sample id from either): what split mode needs, besides a replica."""
        return self.layout.handoff and not self.layout.pool_wanted and self.ref_wg is not None

    def can_split(self) -> bool:
        return self.verls_ref_beside_replicas() and self.replicas_up() > 0

    def step_mode(self) -> RA2PMode:
        """The mode this step's mini-batches run in; it can change at every step boundary (`tide.ra2p.mode=auto`
        follows the planner's choice). Decoupled needs tide's Ref replicas and the deferred-KL loss; split needs
        them beside verl's Ref worker group; everything else runs colocated: the Actor waits for Ref, one Ref
        pass per burst of ready groups."""
        # (with verl's Ref beside an elastic pool: colocated until ERS lends a rank to Ref)
        return next_step_mode(self.tide_config.ra2p.mode, self.planner.mode, self.replicas_up(), self.can_split(),
                              ref_service_ready=self.service is not None)

    def split_share(self) -> float:
        """The share of a Ref pass the replicas score: the planner's, once stage times are measured; before,
        their share of the ranks that run Ref (replicas and the Actor's)."""
        if self.planner.share is not None:
            return self.planner.share
        k = self.replicas_up()
        return k / (k + max(1, self.actor_wg.world_size))

    def swap_seconds(self, step: int) -> Optional[float]:
        """One Ref<->Actor swap on the trainer's GPUs, for RA2P's cost model: half of a Ref load+offload plus an
        Actor load+offload, measured by tide's worker subclasses (`ra2p/handoff_worker.py`) on the first step and
        every `SWAP_MEASURE_EVERY` steps (it costs one extra swap pair). 0.0 when neither model is offloaded (both
        stay resident: nothing swaps). None when it cannot be measured (verl's own workers run the Ref role);
        the cost model then keeps its last value."""
        actor_cfg, ref_cfg = self.config.actor_rollout_ref.actor, self.config.actor_rollout_ref.ref
        offloaded = any(bool(c.get("fsdp_config", {}).get("param_offload", False)) for c in (actor_cfg, ref_cfg)) or \
            bool(actor_cfg.get("fsdp_config", {}).get("optimizer_offload", False))
        if self.ref_wg is None or self.ref_in_actor or not offloaded:
            return 0.0  # no Ref on the Actor's GPUs, or both resident
        if not self.layout.inputs_handoff:
            if not self._swap_unmeasured_said:
                self._swap_unmeasured_said = True
                print("verl-tide WARNING: parameters are offloaded, so Ref and Actor swap on the trainer's GPUs, but "
                      "verl's own workers run the Ref role (tide.ra2p.zero_copy off?): the swap is not measured and "
                      "RA2P's cost model counts it as 0", flush=True)
            return None
        if self._swap_measured_at is not None and step - self._swap_measured_at < SWAP_MEASURE_EVERY:
            return None
        self._swap_measured_at = step
        ref, actor = self.ref_wg.measure_swap(), self.actor_wg.measure_swap()
        return (max(ref) + max(actor)) / 2

    def aggregate_limit(self, window_mini_batches: int, local_trigger_step: int, groups_per_mini_batch: int) -> int:
        """Ready groups a colocated Ref pass may score beyond the mini-batch (`tide.ra2p.max_aggregate`;
        null: the groups the rest of this weight-sync window trains)."""
        cap = self.tide_config.ra2p.max_aggregate
        if cap is not None:
            return cap
        return window_groups_left(window_mini_batches, local_trigger_step, groups_per_mini_batch)

    # ---- per mini-batch --------------------------------------------------------------------
    def before_old_log_prob(self, batch: Any, metrics: dict) -> None:
        """Decoupled mode: Ref starts on its own ranks before the Actor's old-log-prob pass, so they overlap.
        A batch with samples scored ahead by a colocated step's burst finishes colocated (never mixed)."""
        mode = self.step_mode()
        metrics["tide/ra2p/step_mode_decoupled"] = 0.0
        metrics["tide/ra2p/step_mode_split"] = float(mode is RA2PMode.SPLIT)
        if self.service is not None and mode is RA2PMode.DECOUPLED and not self.aggregator.any_scored(batch.keys):
            metrics["tide/ra2p/step_mode_decoupled"] = 1.0
            keys = list(batch.keys)
            ids = self._put_sample_ids(keys, batch.partition_id)
            pending = self.pool.start(keys, batch.partition_id, self._temperature(), sample_ids=ids,
                                      service_name=self.service_name, zero_copy=self.tide_config.ra2p.zero_copy)
            self.in_flight = (pending, time.perf_counter())

    def score(self, batch: Any, metrics: dict, ready: ReadyGroups, global_steps: int, aggregate_limit: int,
              verl_ref_pass: VerlRefPass) -> None:
        """The mini-batch's ref log-probs, unless decoupled mode already runs them (the Actor's backward waits).
        Colocated, ready-batch aggregation: one Ref pass scores this mini-batch and the ready groups the next
        mini-batches will take, so those find their ref log-probs waiting (no Ref<->Actor swap)."""
        if self.in_flight is not None:
            return
        uids = {key.split("_")[0] for key in batch.keys}
        groups = ready.ready_groups(global_steps, aggregate_limit, exclude=uids) if aggregate_limit else []
        own, ahead = self.aggregator.burst(list(batch.keys), [(u, list(t)) for u, t in groups], aggregate_limit)
        on_replicas: list[str] = []
        if own:
            tags = dict(zip(batch.keys, batch.tags))
            for _uid, group_tags in groups:
                tags.update(group_tags)
            split = self.step_mode() is RA2PMode.SPLIT
            if split:  # the replicas take a share (the samples scored ahead first), verl's workers the rest
                own = list(batch.keys)
                mine, mine_ahead, on_replicas = split_ref_pass(own, ahead, self.split_share(),
                                                               self._verl_pass_multiple(self.ref_wg))
                order = self._pass_order(mine, mine_ahead, on_verls_wg=True)
            else:
                if not self.replicas_up():  # verl's Ref worker group splits a pass evenly over its ranks
                    own = list(batch.keys)
                    wg = self.actor_wg if self.ref_in_actor else self.ref_wg
                    ahead = trim_to_multiple(ahead, self._verl_pass_multiple(wg), base=len(own))
                order = self._pass_order(own, ahead)
            self._run_pass(batch, order, [tags[k] for k in order], metrics, verl_ref_pass,
                           on_replicas if split else None)
            self.aggregator.record_burst(own, ahead)
        self.aggregator.trained(list(batch.keys), ref_pass_ran=bool(own))
        metrics["tide/ra2p/ref_pass_samples"] = float(len(own) + len(ahead))
        metrics["tide/ra2p/ref_pass_samples_ahead"] = float(len(ahead))
        metrics["tide/ra2p/ref_pass_samples_on_replicas"] = float(len(on_replicas))

    def update_actor(self, batch: Any, metrics: dict, verl_update: VerlUpdate) -> Any:
        """verl's update; with the inputs hand-off the update reads from TransferQueue all but the input fields,
        which the Actor worker puts back from its process (the Ref pass left them there) or, for samples another
        rank scored, from TransferQueue. Then what the update consumed leaves the Ref service."""
        if not self.layout.inputs_handoff:
            batch = verl_update(batch, metrics)
        else:
            import transfer_queue as tq

            from verl_tide.ra2p.handoff import INPUT_FIELDS
            from verl_tide.ra2p.handoff_worker import INPUTS_KEY

            stored = tq.get_client().kv_retrieve_meta(keys=batch.keys, partition_id=batch.partition_id).field_names
            held = [f for f in stored if f in INPUT_FIELDS]
            batch.fields = [f for f in stored if f not in INPUT_FIELDS]
            batch.extra_info[INPUTS_KEY] = {"fields": held, "partition_id": batch.partition_id,
                                            "keys": dict(zip(self.sample_ids.ids_of(batch.keys), batch.keys))}
            try:
                batch = verl_update(batch, metrics)
            finally:
                batch.fields = None
                batch.extra_info.pop(INPUTS_KEY, None)
        if self.service is not None:
            self._after_update(batch, metrics)
        return batch

    def forget_scored(self, keys: list[str]) -> None:
        """Samples scored ahead whose group verl evicted (stale, filtered, failed): never trained."""
        self.aggregator.forget(keys)
        self.released_ids.extend(self.sample_ids.release(keys))

    # ---- helpers -----------------------------------------------------------------------------
    def _temperature(self) -> float:
        return float(self.config.actor_rollout_ref.rollout.temperature)

    def _put_sample_ids(self, keys: list[str], partition_id: str) -> list[int]:
        """Fresh ids for these samples, written to TransferQueue: the Actor's loss reads each sample's id from
        its data, then asks for its ref log-probs by it."""
        import torch
        import transfer_queue as tq
        from tensordict import TensorDict

        from verl_tide.ra2p.loss import SAMPLE_ID_KEY

        ids = self.sample_ids.assign(keys)
        tq.kv_batch_put(keys=keys, partition_id=partition_id,
                        fields=TensorDict({SAMPLE_ID_KEY: torch.tensor(ids, dtype=torch.int64)}, batch_size=[len(ids)]))
        return ids

    def _pass_order(self, own: list[str], ahead: list[str], on_verls_wg: bool = False) -> list[str]:
        """With the hand-off to verl's Actor (same processes, same data-parallel layout), each Ref rank scores the
        share of the mini-batch its process trains; otherwise verl's order, the mini-batch first."""
        if not self.layout.inputs_handoff or (self.replicas_up() and not on_verls_wg):
            return own + ahead
        actor, ref = dispatch_layout(self.actor_wg, "actor"), dispatch_layout(self.ref_wg, "ref")
        if actor != ref:
            return own + ahead
        return rank_aligned_order(own, ahead, max(actor) + 1)

    def _run_pass(self, batch: Any, keys: list[str], tags: list[dict], metrics: dict, verl_ref_pass: VerlRefPass,
                  on_replicas: Optional[list[str]] = None) -> None:
        """One Ref pass over these samples (the mini-batch's and those scored ahead); when it returns their ref
        log-probs are in TransferQueue (`ref_log_prob`) or, with the hand-off, where the Actor's loss finds them.
        Split mode: `keys` on verl's Ref worker group, `on_replicas` on tide's replicas at the same time; the
        Actor's backward waits for theirs (deferred KL), and `update_actor` collects the replicas after it."""
        temperature = self._temperature()
        if on_replicas:
            ids = self._put_sample_ids(list(on_replicas), batch.partition_id)
            pending = self.pool.start(list(on_replicas), batch.partition_id, temperature, sample_ids=ids,
                                      service_name=self.service_name, zero_copy=self.tide_config.ra2p.zero_copy)
            self.split_pending.append(pending)
            if not keys:
                return
        ids = self._put_sample_ids(keys, batch.partition_id) if self.layout.handoff else None
        if self.replicas_up() and on_replicas is None:
            pending = self.pool.start(keys, batch.partition_id, temperature, sample_ids=ids,
                                      service_name=self.service_name if self.layout.handoff else None)
            self._finish_on_replicas(pending, metrics)
            return
        from transfer_queue import KVBatchMeta

        # verl's Ref worker group; timed here (RA2P's t_ref) because a pass may score samples ahead
        start = time.perf_counter()
        if self.layout.handoff:
            from verl_tide.ra2p.handoff_worker import SERVICE_KEY

            meta = KVBatchMeta(keys=keys, tags=tags, partition_id=batch.partition_id, extra_info={
                "calculate_entropy": False, "compute_loss": False, "temperature": temperature,
                SERVICE_KEY: self.service_name})
            self.ref_wg.compute_ref_log_prob_handoff(meta)
        else:
            meta = batch if keys == list(batch.keys) else KVBatchMeta(keys=keys, tags=tags,
                                                                       partition_id=batch.partition_id)
            verl_ref_pass(meta, metrics)
        tokens = sum(int(tag.get("seq_len", 0) or 0) for tag in tags)
        if tokens > 0:
            self.stage_timer.observe("ref", tokens, time.perf_counter() - start)

    def _finish_on_replicas(self, pending: Any, metrics: dict) -> None:
        observe_ref_replicas(self.stage_timer, self.pool.finish(pending), metrics, self.verls_ref_beside_replicas())

    def _after_update(self, batch: Any, metrics: dict) -> None:
        import ray

        if self.in_flight is not None:
            pending, started = self.in_flight
            self.in_flight = None
            self._finish_on_replicas(pending, metrics)
            metrics["tide/ra2p/ref_wall_s"] = time.perf_counter() - started
        for pending in self.split_pending:  # split mode: the replicas' shares of this update's passes
            self._finish_on_replicas(pending, metrics)
        self.split_pending = []
        # The trained samples' rows (and those of evicted samples scored ahead) leave the service and processes.
        released = self.sample_ids.release(batch.keys) + self.released_ids
        self.released_ids = []
        ray.get(self.service.discard.remote(released))
        # Cumulative counters go out with the step's own metrics: verl averages a step's mini-batch metrics.
        stats = ray.get(self.service.stats.remote())
        self.handoff_counters.update({f"tide/ra2p/ref_service_{k}": float(v) for k, v in stats.items()})
        # Samples scored and not yet trained or evicted: the rows that should be held, nothing more.
        self.handoff_counters["tide/ra2p/handoff_ids_live"] = float(len(self.sample_ids))
        if self.layout.handoff and self.ref_wg is not None:
            ranks = self.ref_wg.discard_ref_handoff(released)
            for k in (ranks[0] if ranks else {}):  # put/served_in_process/held (+ inputs_*), summed over processes
                self.handoff_counters[f"tide/ra2p/handoff_{k}"] = float(sum(r[k] for r in ranks))
        kl = ray.get(self.service.take_kl.remote())
        if kl is not None:  # verl's own metric, which its loss cannot report when the KL term is deferred
            metrics["actor/kl_loss"] = kl

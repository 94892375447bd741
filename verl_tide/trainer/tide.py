"""The V1 trainer `tide`, registered in verl's TRAINER_REGISTRY (`+tide=enabled` selects it).

Built on verl's `separate_async` trainer (subclass, no patching): rollout runs on its own ranks and never
waits for the trainer; the trainer takes one PPO mini-batch of ready GRPO groups at a time from
TransferQueue as soon as it is ready, and pushes weights to every rollout rank after
`data.train_batch_size` prompts. This class holds only verl's hooks; each delegates to a module:

- `ref_path.RefPath`: where ref log-probs come from in RA2P's mode for the step (decoupled, colocated with
  ready-batch aggregation, split; the zero-copy hand-off);
- `verl_tide.boundary.planner.BoundaryPlanner` through `boundary.py`: at the post-update boundary, RA2P's mode for
  the next step and ERS's plan, from the readiness signals and the measured stage times;
- `rank_health.RankHealth`: quarantine and relaunch of rollout ranks, a weight sync that survives a death;
- `rollout_pool.py`: the standalone rollout pool built at start-up (CTB's router, its checkpoint engine, rank
  health, elastic ranks); `lending.py`: the Actor's GPUs rolling out (`tide.ers.lend_actor`);
- `checkpoint.py`: tide's state beside verl's checkpoint; `reporting.py`: what each step logs;
- `verl_compat.py`: every reach into verl beyond its hooks, each naming the verl version.
CTB runs inside the rollout pool as its load balancer (`ctb/router.py`); evaluation overlaps the next step's
rollout (`evaluation.py`); the goodput ledger and readiness arrivals are kept by the replay buffer
(`buffer.py`).
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Optional

from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
from verl.trainer.ppo.v1.trainer_separate_async import HybridEngineMode, PPOTrainerSeparateAsync
from verl.utils.profiler import marked_timer

from verl_tide.buffer import TideReplayBuffer
from verl_tide.core.ledger import GoodputLedger, Outcome
from verl_tide.boundary.planner import BoundaryPlanner
from verl_tide.boundary.round import BoundaryRound, RoundContext
from verl_tide.core.readiness import ReadinessTracker
from verl_tide.ers.advice import SplitAdviceCycle
from verl_tide.ers.policy import Phase, Role
from verl_tide.evaluation import EvalMarkedLoader, OverlappedEvaluation, overlapped_evaluation, validation_buffer
from verl_tide.job_config import check_layout, lend_actor, ref_layout_of, tide_config_from_job
from verl_tide.ra2p.cost import RA2PMode, StageTimer
from verl_tide.trainer import boundary, checkpoint, elastic_setup, lending, resize, rollout_pool, verl_compat
from verl_tide.trainer.budget_window import BudgetWindowReader
from verl_tide.trainer.rank_health import RankHealth
from verl_tide.trainer.ref_path import RefPath
from verl_tide.trainer.reporting import RolloutReport, SplitAdviceReport, ledger_metrics, ledger_text, ra2p_text

if TYPE_CHECKING:
    from omegaconf import DictConfig


class TideNotBuiltError(NotImplementedError):
    """Raised when a job asks for a part of trainer `tide` that does not exist yet."""


def ideal_batch(tide_config: Any, config: DictConfig) -> int:
    """B_ideal in sequences, the unit of the readiness signals (ready volume, rollout rate): a step trains
    data.train_batch_size prompts x rollout.n samples each."""
    return tide_config.ers.ideal_batch or int(config.data.train_batch_size) * int(
        config.actor_rollout_ref.rollout.get("n", 1))


class TideTrainer(PPOTrainerSeparateAsync):
    ideal_batch = staticmethod(ideal_batch)

    def __init__(self, config: DictConfig):
        self.tide_config = tide_config_from_job(config)
        check_layout(config)  # the lending keys: `lend_actor` below (the driver's callback checks both at once)
        verl_compat.check_private_hooks(PPOTrainerSeparateAsync, ReplayBufferAsync)
        self.clock = time.monotonic
        self.readiness = ReadinessTracker(clock=self.clock)
        self.ledger = GoodputLedger(clock=self.clock)
        self.stage_timer = StageTimer()
        # rollout on its own ranks, and unless tide.ers.lend_actor says no, on the Actor's GPUs too (lending.py)
        self._enable_hybrid_replicas, why = lend_actor(config, self.tide_config)
        print(f"verl-tide: ERS {'may lend' if self._enable_hybrid_replicas else 'does not lend'} the Actor's GPUs "
              f"to rollout ({why})", flush=True)
        verl_compat.init_without_separate_async(self, config)
        self.parameter_sync_step = int(config.data.train_batch_size) // int(
            config.actor_rollout_ref.actor.ppo_mini_batch_size)
        self.hybrid_rollout_config = lending.switch_config(config, self._enable_hybrid_replicas)
        if self._enable_hybrid_replicas:
            verl_compat.check_hybrid_switch_hooks(PPOTrainerSeparateAsync)
            self._init_hybrid_rollout_state()
        self._lend = None  # ERS's last lending decision (tide.ers.lend_actor)
        self.planner = BoundaryPlanner.build(self.tide_config.ra2p, self.tide_config.ers,
                                             ideal_batch(self.tide_config, config), ctb=self.tide_config.ctb)
        self.round = BoundaryRound(self.planner, SplitAdviceCycle())  # one code path with the simulator's
        self.ref = RefPath(config, self.tide_config, self.stage_timer, self.planner, ref_layout_of(config, self.tide_config))
        self._elastic_batch = self.planner.ers.ideal_batch  # sequences the next step trains (ERS's plan)
        self._window_mini_batches = self.parameter_sync_step  # mini-batches of the current step
        self.advice = SplitAdviceReport(config, self.planner.ers.ideal_batch, self.tide_config.ers.split_advice_kv_bound,
                                        self.tide_config.ra2p.ref_ranks)
        self.exporter: Any = None  # Prometheus (tide.metrics)
        self.metrics_server: Any = None
        self.health: Optional[RankHealth] = None
        self.report: Optional[RolloutReport] = None
        self.budget_window: Optional[BudgetWindowReader] = None  # CTB's budget window's inputs, once rollout runs
        self.rollout_roles: dict[int, Role] = {}
        self._step_tokens_before = 0
        self._sample_started = 0.0
        self._training = False
        self._restored: Optional[dict] = None  # tide_state.json, applied once the rollout pool exists
        self.overlapped_eval: Optional[OverlappedEvaluation] = None
        self.elastic: Any = None  # ERS's elastic ranks (ers/elastic.py); with tide's Ref pool only
        self.resize: Optional[resize.TrainerResize] = None  # ERS's trainer resize (tide.ers.resize_trainer)
        self._resize_decision: Any = None  # the last round's, applied before the sync
        resize.check_job(config, self.tide_config)

    @property
    def _groups_per_mini_batch(self) -> int:
        """GRPO groups (prompts) in one PPO mini-batch: what verl's replay buffer hands out at once."""
        return int(self.config.data.train_batch_size) // self.parameter_sync_step

    @property
    def quarantined(self) -> dict[int, str]:
        return self.health.out_of_service() if self.health is not None else {}

    # ---- construction (verl's hooks) ---------------------------------------------------------
    def _build_replay_buffer(self) -> TideReplayBuffer:
        return TideReplayBuffer.for_trainer(self)

    def _init_dataloader(self):
        super()._init_dataloader()
        if getattr(self, "val_dataloader", None) is not None:
            self.val_dataloader = EvalMarkedLoader(self.val_dataloader)  # CTB ranks evaluation prompts first

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        self.ref.choose_worker_roles(self.role_worker_mapping, self.mapping)  # set by _setup before this runs
        resize.install_actor_worker(self.role_worker_mapping, self.tide_config,  # with tide.ers.resize_trainer
                                    self.ref.layout.inputs_handoff)

    def _setup(self):
        layout = self.ref.layout  # actor (and Ref, unless tide's replicas replace it) worker groups, reward loop
        setup_start = time.perf_counter()
        verl_compat.setup_without_colocated_rollout(self, without_ref=layout.pool_wanted)
        setup_s = time.perf_counter() - setup_start
        # With lending beside verl's Ref, verl builds one actor/rollout/ref worker: `ref_policy_wg` is the Actor's
        # group, whose Ref role answers `compute_ref_log_prob` (not Ref-in-Actor, which is LoRA's adapter-off pass).
        self.ref.bind(self.actor_rollout_wg, getattr(self, "ref_policy_wg", None), bool(self.ref_in_actor))
        if layout.pool_wanted or layout.beside_verl_ref:
            self.ref.start_pool()
        if layout.handoff:
            self.ref.start_service()
        self._start_rollout_pool()
        if self.tide_config.ers.resize_trainer:
            self.resize = resize.build(self, self.tide_config.ers.resize_move_s, setup_s)
        self._restore_ctb_and_roles()
        if self.elastic is not None and self.tide_config.ra2p.ref_ranks == 0:
            elastic_setup.start_elastic_ref_ranks(self.tide_config, self.elastic, self.rollout_roles)
        if self.tide_config.metrics.enabled:
            from verl_tide.metrics import TideMetrics

            self.exporter, self.metrics_server = TideMetrics.start(self.tide_config.metrics.host,
                                                                   self.tide_config.metrics.port)
            self.report.exporter = self.advice.exporter = self.exporter

    def _start_rollout_pool(self) -> None:
        pool = rollout_pool.build(self.config, self.tide_config, self.actor_rollout_wg,
                                  len(self.llm_server_manager.get_replicas()), self.ref.pool)
        # verl's separate_async reads the first two under these names (weight sync, hybrid switch)
        self.standalone_server_manager, self.standalone_checkpoint_manager = pool.manager, pool.checkpoint_manager
        self.health, self.report, self.rollout_roles, self.elastic = pool.health, pool.report, pool.roles, pool.elastic
        self.current_mode = HybridEngineMode.TRAINER
        if self._enable_hybrid_replicas:  # lent from the start: the cold start is the first wait
            self.current_mode = HybridEngineMode.ROLLOUT
            self.add_replicas_to_balancer()

    # ---- checkpoint and resume ---------------------------------------------------------------
    def _save_checkpoint(self):
        super()._save_checkpoint()  # actor, dataloader, TransferQueue (ready and in-flight groups)
        ctb = rollout_pool.ctb_state(self.standalone_server_manager) if self.tide_config.ctb.enabled else None
        folder = checkpoint.save_state(self.config.trainer, self.global_steps, checkpoint.tide_state(
            self.global_steps, self.ledger, ctb, self.planner.ers, self.rollout_roles, self.ref.aggregator))
        if self.resize is not None:  # the Actor's state at any size, while it holds rollout GPUs
            self.resize.save_resharded(self, os.path.dirname(folder))

    def _load_checkpoint(self):
        super()._load_checkpoint()
        if self.global_steps == 0:
            return
        state = checkpoint.load_state(checkpoint.step_folder(self.config.trainer, self.global_steps))
        if state is None:
            return
        checkpoint.restore(state, self.ledger, self.readiness, self.planner.ers, self.ref.aggregator,
                           rows_kept=not self.ref.layout.handoff)
        self._restored = state  # CTB's router and the ranks' roles are restored once the rollout pool exists
        print(f"verl-tide: resumed from step {state['global_steps']}: {ledger_text(self.ledger)}", flush=True)

    def _restore_ctb_and_roles(self) -> None:
        state = self._restored or {}
        if state.get("ctb") and self.tide_config.ctb.enabled:
            rollout_pool.restore_ctb(self.standalone_server_manager, state["ctb"])
        moves = checkpoint.moves_to_restore(checkpoint.roles_of(state), self.rollout_roles, self.elastic is not None)
        if moves:
            elastic_setup.switch_to_ref_at_start(self.elastic, moves, self.rollout_roles)
            print(f"verl-tide: ranks {[m.rank for m in moves]} resume in the Ref role", flush=True)

    # ---- a step ------------------------------------------------------------------------------
    def step(self, metrics: dict, timing_raw: dict):
        """verl's step, over the mini-batches of ERS's elastic batch: with tide.ers.min_batch < B_ideal and less
        ready at the last boundary, the step trains fewer mini-batches and the weight sync comes sooner."""
        n = int(self.config.actor_rollout_ref.rollout.get("n", 1))
        count = self.planner.ers.mini_batches(self._elastic_batch, self._groups_per_mini_batch * n,
                                              self.parameter_sync_step)
        self._window_mini_batches = count
        metrics["tide/ers/step_mini_batches"] = float(count)
        if count >= self.parameter_sync_step:
            return super().step(metrics, timing_raw)
        return verl_compat.train_mini_batches(self, count, self._groups_per_mini_batch, metrics, timing_raw)

    def _compute_old_log_prob(self, batch, metrics: dict):
        self.ref.before_old_log_prob(batch, metrics)
        return super()._compute_old_log_prob(batch, metrics)

    def _compute_ref_log_prob(self, batch, metrics: dict):
        limit = self.ref.aggregate_limit(self._window_mini_batches, self.local_trigger_step,
                                         self._groups_per_mini_batch)
        self.ref.score(batch, metrics, self.replay_buffer, self.global_steps, limit, super()._compute_ref_log_prob)
        return batch

    def _update_actor(self, batch, metrics: dict):
        return self.ref.update_actor(batch, metrics, super()._update_actor)

    def _submit_batch_to_rollout(self, batch) -> int:
        n = super()._submit_batch_to_rollout(batch)
        self.ledger.groups_submitted(n)
        return n

    def _while_waiting_for_data(self) -> None:
        """At each look for ready data that found too little: a batch whose dispatch failed never becomes ready
        (`trainer/dispatch.py`), and CTB's budget window decides while the trainer waits."""
        raise_dispatch_errors = getattr(getattr(self, "agent_loop_manager", None), "raise_dispatch_errors", None)
        if raise_dispatch_errors is not None:
            raise_dispatch_errors()
        if getattr(self, "budget_window", None) is not None:
            self.budget_window.while_waiting(self.global_steps, self.quarantined)

    # ---- evaluation --------------------------------------------------------------------------
    def _validate(self):
        """Before training and after the last step: verl's blocking validation. In between (trainer.test_freq),
        with tide.overlap_eval: started now on this step's weights, collected before the next weight sync."""
        if not self._overlaps_evaluation():
            return super()._validate()
        self.overlapped_eval.start(self, self.global_steps)
        print(f"verl-tide step {self.global_steps}: evaluation runs during step {self.global_steps + 1}'s rollout "
              f"(step-{self.global_steps} weights); its metrics come with step {self.global_steps + 1}", flush=True)
        return {}

    def _overlaps_evaluation(self) -> bool:
        return self.overlapped_eval is not None and self._training and self.global_steps < self.total_training_steps

    def on_validate_begin(self):
        """verl lends the Actor's replica to every validation; an overlapped one runs beside training, and ERS
        decided at the boundary whether the replica rolls out (`tide.ers.lend_actor`)."""
        if not self._overlaps_evaluation():
            super().on_validate_begin()

    # ---- the loop's hooks --------------------------------------------------------------------
    def on_train_begin(self):
        super().on_train_begin()
        self._training = True
        clocks = self.report.feed_rollout_clocks(self.readiness, report=False)  # the first cycle counts from here
        self.report.engine_hit_rates(self.quarantined)  # the engines' counters now: step 1 has a hit rate too
        self.readiness.rollout_started()
        if self.tide_config.ctb.enabled and self.planner.window is not None:
            self.budget_window = BudgetWindowReader(self.report, self.planner, self.clock)
            self.budget_window.mark(clocks, self.report.engine_scrapes)
        wanted = self.tide_config.overlap_eval and self.config.trainer.test_freq > 0
        self.overlapped_eval = overlapped_evaluation(
            wanted, lambda: verl_compat.reward_workers(self), verl_compat.blocking_validate, self.clock,
            lambda: validation_buffer(self.config, self.trainer_mode))

    def on_step_begin(self):
        self.health.check(self.rollout_roles)
        self.readiness.step_started()
        self._step_tokens_before = self.ledger.tokens[Outcome.CONSUMED]
        super().on_step_begin()

    def on_sample_begin(self):
        super().on_sample_begin()
        self._sample_started = self.clock()

    def on_sample_end(self):
        super().on_sample_end()
        self.readiness.trainer_waited(self.clock() - self._sample_started)

    def on_step_end(self):
        """The post-update boundary: the step's readiness is final, RA2P and ERS decide, ranks move, then the sync."""
        self.health.check(self.rollout_roles)  # a dead rank must not stall the weight sync
        # The previous step's evaluation ran on the weights this sync replaces: it finishes first.
        with marked_timer("tide_eval_collect", self.timing_raw):
            eval_metrics = self.overlapped_eval.collect() if self.overlapped_eval is not None else {}
        with marked_timer("tide_boundary", self.timing_raw):  # readiness, RA2P and ERS decide, ranks move
            clocks = self.report.feed_rollout_clocks(self.readiness)
            self.readiness.step_finished()
            step_metrics, plan = self._boundary_round(clocks)
        mode = self.ref.step_mode() if self.use_reference_policy else None
        step_metrics["tide/ra2p/next_ref_share"] = share = self.ref.split_share() if mode is RA2PMode.SPLIT else 0.0
        if self.exporter is not None and mode is not None:
            self.exporter.update_from_ra2p(mode.value, share, step_metrics)
        self._elastic_batch = plan.batch_size
        if self._resize_decision is not None:  # the Actor's group takes or gives back rollout GPUs, then the sync
            self.resize.apply(self, self._resize_decision, self.global_steps)
            self._resize_decision = None
        relaunched = self.health.before_sync()
        sync_start = self.clock()
        self.health.sync_weights(self._sync_weights_and_lend, self.rollout_roles)
        # Rollout waits while weights move; counted toward the next step's RWT (this step's signals are final).
        self.readiness.rollout_waited(self.clock() - sync_start)
        clocks = self.report.feed_rollout_clocks(self.readiness, report=False)
        if self.budget_window is not None:
            self.budget_window.mark(clocks)
        if self.elastic is not None:
            step_metrics["tide/ers/ref_ready_wait_s"] = self.elastic.after_sync()
        if self.resize is not None:
            self.resize.after_sync(self)
        step_metrics.update(self.health.after_sync(dict(relaunched), self.rollout_roles))
        pending = verl_compat.pending_sync_metrics(self)
        pending.update(step_metrics)
        pending.update(eval_metrics)
        if eval_metrics and self.exporter is not None:
            self.exporter.update_from_eval(eval_metrics)

    def _sync_weights_and_lend(self) -> None:
        """verl's weight sync at the step's end; with the Actor's replica, ERS's lending decision in place of verl's
        hybrid switch decision."""
        if self._lend is None:
            return super().on_step_end()
        verl_compat.separate_async_step_end(self, self._lend.lend)

    def _switch_threshold(self) -> int:
        """verl's hook, read as a step begins while the Actor's replica is lent: ERS's count of ready groups that
        brings it back to training (one mini-batch before any rate was measured)."""
        return self._lend.return_at_units if self._lend is not None else self._groups_per_mini_batch

    def on_train_end(self):
        super().on_train_end()
        self.ref.shutdown()
        if self.overlapped_eval is not None:
            self.overlapped_eval.close()
        if self.metrics_server is not None:
            self.metrics_server.shutdown()

    # ---- the step boundary -------------------------------------------------------------------
    def _phase(self):
        return boundary.ers_phase(self.global_steps, self.total_training_steps, int(self.config.trainer.test_freq),
                                  self.overlapped_eval is not None)

    def _boundary_round(self, clocks: Optional[dict]) -> tuple[dict[str, Any], Any]:
        """The boundary round (one code path with the simulator's): the planner decides RA2P's next mode, ERS's
        plan, lending and CTB's budget; the round applies them through this job's port. `clocks`: CTB's router's,
        as just read for the readiness signals. Returns the step's metrics and ERS's plan."""
        tide = self.tide_config
        step_tokens = self.ledger.tokens[Outcome.CONSUMED] - self._step_tokens_before
        boundary.observe_stage_times(self.stage_timer, verl_compat.step_timing(self), step_tokens,
                                     self.ref.swap_seconds(self.global_steps))
        m: dict[str, Any] = ledger_metrics(self.ledger, self.replay_buffer, self.global_steps, tide.ledger_tolerance)
        m.update(self.report.ctb_metrics(self.llm_server_manager.server_addresses))
        m.update(self.report.engine_hit_rates(self.quarantined))
        advice = self.advice.inputs(self.rollout_roles, self.quarantined)
        inputs = boundary.boundary_inputs(
            self.global_steps, self.readiness.last_ready_times, self._groups_per_mini_batch, step_tokens,
            self.stage_timer, max(1, self.actor_rollout_wg.world_size), tide.ra2p.ref_ranks,
            self.rollout_roles, self.ref.replicas_up(), self.ref.verls_ref_beside_replicas(),
            bool(self.use_reference_policy),
            lending.inputs_after_update(self) if self._enable_hybrid_replicas else None,
            self.budget_window.inputs(self.quarantined, clocks, self.report.engine_scrapes)
            if self.budget_window is not None and clocks is not None else None,
            self.resize.inputs(self.actor_rollout_wg.world_size, self.rollout_roles, self.planner.ers.ideal_batch,
                               self.total_training_steps - self.global_steps,
                               weight_kv_tokens=advice.weight_kv_tokens, kv_bound_min=advice.kv_bound_min,
                               max_staleness=tide.max_staleness)
            if self.resize is not None else None)
        context = RoundContext(
            self._phase(), self.rollout_roles, elastic_ref=self.elastic is not None,
            # Without Ref ranks of its own, the last elastic Ref rank must stay: nothing else would compute Ref.
            ref_floor=1 if self.ref.layout.pool_wanted and tide.ra2p.ref_ranks == 0 else 0,
            last_step=self.global_steps >= self.total_training_steps,
            advice=advice)
        port = boundary.TrainerBoundaryPort(
            self.global_steps, lambda be: self.readiness.signals(ideal_batch=self.planner.ers.ideal_batch,
                                                                 tau=tide.ers.tau, ras_break_even=be),
            self.rollout_roles, self.quarantined, self.elastic, self.budget_window, self.advice, self.exporter,
            step_tokens, self.stage_timer)
        result = self.round.run(inputs, context, port)
        self._lend = port.lend_decision
        m.update(port.metrics)
        m["tide/rollout/ranks_quarantined"] = float(len(self.health.quarantined))
        self._resize_decision = port.resize_decision
        if self.resize is not None:
            m.update(self.resize.metrics(self.global_steps, self.actor_rollout_wg.world_size, self.clock()))
        m["tide/ra2p/uses_ref"] = float(self.use_reference_policy)
        # cumulative, since the job started: Ref passes, samples scored (ahead), mini-batches without a Ref pass
        m.update({f"tide/ra2p/aggregation_{k}": float(v) for k, v in self.ref.aggregator.counters.as_dict().items()})
        m.update(self.ref.handoff_counters)
        if self.ref.pool is not None:
            m["tide/ra2p/ref_replicas"] = float(self.ref.replicas_up())
        plan = result.decision.plan
        print(f"verl-tide step {self.global_steps}: ERS plan: {plan.reason} ({port.plan_note(result)}); RA2P: "
              f"{ra2p_text(self.ref, self.use_reference_policy)}; ledger: {ledger_text(self.ledger)}", flush=True)
        if self.exporter is not None:
            self.exporter.update_from_ledger(self.ledger)
        return m, plan

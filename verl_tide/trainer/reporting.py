"""Step reporting: what trainer `tide` reads from the rollout pool at each step boundary (CTB's counters and
clocks, each engine's prefix-cache hit rate), the split advice, and the one-line texts of its log.

Why apart: none of it changes a decision except through the readiness signals (the rollout clocks), and all
of it must fail soft (observability never stops training). Prometheus export is `verl_tide.metrics`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

from verl_tide.core.ledger import GoodputLedger, LedgerImbalanceError, Outcome
from verl_tide.core.readiness import ReadinessSignals, ReadinessTracker
from verl_tide.boundary.round import AdviceInputs
from verl_tide.ers.advice import SplitAdvice, weight_kv_tokens
from verl_tide.ers.policy import Role
from verl_tide.ra2p.cost import RA2PMode
from verl_tide.trainer.lending import lent_metrics
from verl_tide.trainer.verl_compat import load_balancer

if TYPE_CHECKING:
    from verl_tide.buffer import TideReplayBuffer
    from verl_tide.trainer.ref_path import RefPath

logger = logging.getLogger(__name__)


class RolloutReport:
    """Reads CTB's router and the engines' `/metrics` once per step boundary (and hands CTB the planner's budget
    factor)."""

    def __init__(self, pool: Any, backend: str, ctb_enabled: bool, exporter: Optional[Any] = None):
        self.pool, self.backend, self.ctb_enabled, self.exporter = pool, backend, ctb_enabled, exporter
        self._engine_scrapes: dict[str, Any] = {}

    def _router(self) -> Any:
        return load_balancer(self.pool)

    def group_finish_times(self, uids: list[str], clock: Callable[[], float]) -> dict[str, float]:
        """When each group's last trajectory finished, from CTB's router (wall clock there), on `clock`: the
        replay buffer stamps a group ready then, not when verl's sampler polls."""
        import ray

        from verl_tide.core.request_ids import SEP

        by_group = {uid.replace(SEP, "_"): uid for uid in uids}  # the router's group ids (core/request_ids.py)
        try:
            wall = ray.get(self._router().group_finish_times.remote(list(by_group)), timeout=30)
        except Exception as e:  # readiness falls back to the poll time; training goes on
            logger.warning("verl-tide: could not read group finish times from CTB's router: %s", e)
            return {}
        now_wall, now = time.time(), clock()
        return {by_group[g]: now - max(0.0, now_wall - t) for g, t in wall.items()}

    def rollout_time(self, take_peak: bool = False) -> Optional[dict[str, Any]]:
        """CTB's router's rollout clocks (`CTBLoadBalancer.rollout_time`); None without CTB or when unreadable."""
        if not self.ctb_enabled:
            return None
        import ray

        try:
            return ray.get(self._router().rollout_time.remote(take_peak=take_peak), timeout=30)
        except Exception as e:  # observability must not stop training
            logger.warning("verl-tide: could not read the rollout ranks' busy and idle time: %s", e)
            return None

    def feed_rollout_clocks(self, readiness: ReadinessTracker, report: bool = True) -> Optional[dict[str, Any]]:
        """This cycle's rollout time for the readiness signals, from CTB's router's clocks: its busy seconds, its
        idle rank-seconds with no task waiting (RWT beside the weight sync, as the simulator counts it), its
        seconds with work waiting for KV budget, and the decode load. Without CTB nothing is reported: RWT is the
        sync alone and ERS assumes saturated ranks. `report=False` starts the next cycle's clocks here. Returns the
        clocks read (CTB's budget window reads the same, `budget_window.py`)."""
        now = self.rollout_time(take_peak=True)
        if now is not None:
            readiness.rollout_clocks(now["busy_s"], float(now["idle_rank_s"]), report=report,
                                     kv_wait_s=float(now["kv_wait_s"]),
                                     generating_token_s=float(now["generating_token_s"]),
                                     kv_held_peak=float(now["kv_held_peak"]))
        return now

    def ctb_metrics(self, actor_servers: Sequence[str] = ()) -> dict[str, float]:
        """CTB's counters and per-rank token usage, read from the rollout pool's load balancer actor; with
        `actor_servers` (the replicas on the Actor's GPUs, when lent), the turns CTB routed to them and
        the seconds they were in CTB's pool."""
        if not self.ctb_enabled:
            return {}
        import ray

        try:
            status = ray.get(self._router().get_status.remote(), timeout=30)
        except Exception as e:  # observability must not stop training
            logger.warning("verl-tide: could not read CTB status: %s", e)
            return {}
        ctb = status["ctb"]
        if self.exporter is not None:
            self.exporter.update_from_ctb_status(ctb["ranks"], ctb["tasks"], ctb)
        m = {f"tide/ctb/{k}": float(v) for k, v in ctb.items() if isinstance(v, (int, float))}
        m.update({f"tide/ctb/tasks_{state}": float(n) for state, n in ctb["tasks"].items()})
        m["tide/ctb/ranks"] = float(len(ctb["ranks"]))
        m["tide/ctb/tokens_used"] = float(sum(r["usage"] for r in ctb["ranks"].values()))
        m["tide/ctb/tokens_budget"] = float(sum(r["budget"] for r in ctb["ranks"].values()))
        m["tide/ctb/tokens_base"] = float(sum(r["base"] for r in ctb["ranks"].values()))  # at budget factor 1
        served = status.get("turns_served", {})  # per server since it (re)started: a relaunch has a new address
        for rank, replica in enumerate(self.pool.get_replicas()):
            m[f"tide/ctb/turns_served_rank{rank}"] = float(served.get(replica.server_address, 0))
        if actor_servers:
            m.update(lent_metrics(status, actor_servers))
        return m

    def set_budget_factor(self, factor: float) -> None:
        """The planner's budget factor for the next step, to CTB's router (`ctb/window.py`)."""
        import ray

        try:
            ray.get(self._router().set_budget_factor.remote(factor), timeout=30)
        except Exception as e:  # the budgets stay as they were; training goes on
            logger.warning("verl-tide: could not set CTB's budget factor: %s", e)

    def scrape_engines(self, quarantined: Mapping[int, str]) -> dict[str, tuple[int, Any]]:
        """{address: (rank, its `/metrics` now)} of every live engine that answers (none without vLLM/SGLang)."""
        from verl_tide.engine_metrics import EngineMetrics

        if self.backend not in ("vllm", "sglang"):
            return {}
        current: dict[str, tuple[int, Any]] = {}
        for rank, replica in enumerate(self.pool.get_replicas()):
            address = replica.server_address  # current: a relaunched rank has a new one
            if rank in quarantined:
                continue
            try:
                current[address] = (rank, EngineMetrics.scrape(f"http://{address}", self.backend, timeout_s=5.0))
            except (OSError, ValueError):
                continue  # no /metrics (stats logging off): nothing to report
        return current

    def engine_hit_rates(self, quarantined: Mapping[int, str]) -> dict[str, float]:
        """Each rollout engine's prefix-cache hit rate over the last step, from its own `/metrics`."""
        from verl_tide.engine_metrics import prefix_hit_rate

        current = self.scrape_engines(quarantined)
        rates = {str(rank): prefix_hit_rate(self._engine_scrapes[address], now)
                 for address, (rank, now) in current.items() if address in self._engine_scrapes}
        self._engine_scrapes = {address: now for address, (_, now) in current.items()}
        if self.exporter is not None:
            self.exporter.update_hit_rates(rates)
        return {f"tide/engine/prefix_hit_rate/{rank}": rate for rank, rate in rates.items()}

    @property
    def engine_scrapes(self) -> dict[str, Any]:
        """{address: `/metrics`} as `engine_hit_rates` last read them."""
        return dict(self._engine_scrapes)


def pooled_hit_rate(since: Mapping[str, Any], current: Mapping[str, Any]) -> Optional[float]:
    """The engines' prefix-cache hit rate between two reads ({address: `/metrics`}), prompt tokens pooled over
    engines (an engine missing from `since` counts from its next read); None when no prompt token was queried."""
    hit = queried = 0.0
    for address, now in current.items():
        if address in since:
            hit += now.prefix_hit_tokens - since[address].prefix_hit_tokens
            queried += now.prefix_queried_tokens - since[address].prefix_queried_tokens
    return hit / queried if queried > 0 else None


class SplitAdviceReport:
    """ERS cannot move the Actor's GPUs: where the trainer starves behind a saturated rollout, say which split to
    start the job with (`ers.advice`; the boundary round keeps the advice's cycle, as the simulator's does). This
    is the job's view for it (GPUs per role from verl's config and the ranks' roles) and what a step logs of it."""

    def __init__(self, config: Any, ideal_batch: int, kv_bound: float, fixed_ref_ranks: int,
                 exporter: Optional[Any] = None):
        self.config, self.ideal_batch, self.kv_bound = config, ideal_batch, kv_bound
        self.fixed_ref_ranks, self.exporter = fixed_ref_ranks, exporter
        self.weight_kv_tokens: Optional[float] = None  # the rollout model's weights in KV tokens (read once)

    def _gpus(self, roles: Mapping[int, Role], quarantined: Mapping[int, str]) -> tuple[int, int, int]:
        """(GPUs per rollout replica, GPUs rolling out now, trainer GPUs: the Actor's and every Ref GPU)."""
        rollout = self.config.actor_rollout_ref.rollout
        rollout_gpus = int(rollout.nnodes) * int(rollout.n_gpus_per_node)
        per_replica = max(1, rollout_gpus // max(1, len(roles) + len(quarantined)))
        now_rollout = per_replica * sum(r is Role.ROLLOUT for r in roles.values())
        trainer_gpus = (int(self.config.trainer.nnodes) * int(self.config.trainer.n_gpus_per_node)
                        + self.fixed_ref_ranks + per_replica * sum(r is Role.REF for r in roles.values()))
        return per_replica, now_rollout, trainer_gpus

    def inputs(self, roles: Mapping[int, Role], quarantined: Mapping[int, str]) -> AdviceInputs:
        per_replica, now_rollout, trainer_gpus = self._gpus(roles, quarantined)
        if self.weight_kv_tokens is None and now_rollout >= 1:
            self.weight_kv_tokens = self._model_weight_kv_tokens()
        return AdviceInputs(now_rollout, trainer_gpus, self.ideal_batch, self.weight_kv_tokens or None, self.kv_bound,
                            gpus_per_replica=per_replica)

    def metrics(self, signals: ReadinessSignals, roles: Mapping[int, Role], quarantined: Mapping[int, str], step: int,
                standing: Optional[SplitAdvice], changed: bool) -> dict[str, float]:
        """The advice standing after this boundary's round, and the rollout's KV signals it read."""
        _, now_rollout, _ = self._gpus(roles, quarantined)
        m = {}
        if signals.rollout_kv_bound is not None:
            m["tide/rollout/kv_bound"] = float(signals.rollout_kv_bound)
        if signals.rollout_decode_context is not None:
            m["tide/rollout/decode_context_tokens"] = float(signals.rollout_decode_context)
        if signals.rollout_kv_held_peak is not None:
            m["tide/rollout/kv_held_peak_ranks"] = float(signals.rollout_kv_held_peak)
        if changed and standing is not None:
            print(f"verl-tide step {step}: ERS split advice: {standing.reason}", flush=True)
        m["tide/ers/advised_rollout_gpus"] = float(standing.rollout_gpus if standing else now_rollout)
        if self.exporter is not None:
            self.exporter.update_split_advice(now_rollout, standing)
        return m

    def _model_weight_kv_tokens(self) -> float:
        """`ers.advice.weight_kv_tokens` of the job's model; 0.0 (no decode-bound advice) if its config is unreadable."""
        model = self.config.actor_rollout_ref.model
        try:
            from transformers import AutoConfig

            hf = AutoConfig.from_pretrained(str(model.path),
                                            trust_remote_code=bool(model.get("trust_remote_code", False)))
            return weight_kv_tokens(hf.to_dict()) or 0.0
        except Exception as e:  # advice must not stop training
            logger.warning("verl-tide: could not read the model config for the split advice: %s", e)
            return 0.0


def ledger_metrics(ledger: GoodputLedger, buffer: TideReplayBuffer, step: int,
                   tolerance: int = 0) -> dict[str, float]:
    """The ledger at a boundary, checked against the groups TransferQueue holds (counted there, not derived from
    the ledger), and where the replay buffer's ready times came from. The imbalance is a metric
    (`tide/ledger/imbalance`, what a dashboard alerts on); past `tolerance` groups it stops the job with the counts."""
    held = buffer.groups_held()
    m: dict[str, float] = {**ledger.snapshot(), "tide/ledger/groups_held": float(held),
                           "tide/ledger/imbalance": float(ledger.imbalance(held))}
    m.update({f"tide/readiness/groups_stamped_{k}": float(v) for k, v in buffer.stamped.items()})
    problem = ledger.check(held)
    if problem:
        print(f"verl-tide step {step} WARNING: {problem}", flush=True)
        if abs(ledger.imbalance(held)) > tolerance or held < 0:
            raise LedgerImbalanceError(f"step {step}: {problem}; more than tide.ledger_tolerance = {tolerance} "
                                       "group(s): tokens would go unaccounted, so the job stops")
    return m


def ledger_text(ledger: GoodputLedger) -> str:
    return (f"{ledger.groups[Outcome.CONSUMED]} consumed, {ledger.groups[Outcome.DROPPED_STALE]} stale, "
            f"{ledger.groups[Outcome.DROPPED_FILTERED]} filtered, {ledger.groups[Outcome.DROPPED_FAILED]} failed, "
            f"{ledger.in_flight_groups} in flight (groups); goodput {ledger.goodput():.1f} tok/s")


def ra2p_text(ref: RefPath, uses_ref: bool) -> str:
    """RA2P's part of the step's log line: the mode chosen, the next step's, and the aggregation counters."""
    if not uses_ref:
        return "off (no Ref model: use_kl_loss and use_kl_in_reward are false)"
    c = ref.aggregator.counters
    passes = (f"{c.bursts} Ref passes, {c.samples_ahead} samples scored ahead, "
              f"{c.batches_without_ref_pass} mini-batches needed none")
    mode = ref.tide_config.ra2p.mode
    if mode != "auto":
        chosen = f"{mode} (tide.ra2p.mode)"
    else:
        chosen = "measuring stage times" if ref.planner.mode is None else f"{ref.planner.mode.value} chosen"
    if ref.step_mode() is RA2PMode.SPLIT:
        chosen += f", replicas' share {ref.split_share():.0%}"
    if ref.pool is None:
        return f"{chosen}; colocated with verl's Ref ({passes})"
    return f"{chosen}; next step runs {ref.step_mode().value} ({ref.replicas_up()} Ref replica(s); {passes})"

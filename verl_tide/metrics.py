"""verl-tide's Prometheus exporter: CTB state per rank, task outcomes, engine hit rates, readiness, RA2P, ERS
and the goodput ledger. Started in one place, `TideMetrics.start` (trainer `tide` and CTB's router plugin
each call it once); reading the engines' own `/metrics` is `verl_tide.engine_metrics`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge

if TYPE_CHECKING:
    from verl_tide.core.ledger import GoodputLedger
    from verl_tide.core.readiness import ReadinessSignals
    from verl_tide.ctb.policy import CTBScheduler
    from verl_tide.ers.advice import SplitAdvice
    from verl_tide.ers.policy import Role, ScalingPlan


class TideMetrics:
    """verl-tide's Prometheus exporter: CTB state per rank, task outcomes, engine hit rates."""

    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rank_tokens = Gauge("tide_ctb_rank_tokens", "Tokens charged to a rollout rank", ["rank"], registry=r)
        self.rank_budget = Gauge("tide_ctb_rank_budget_tokens", "Token budget of a rollout rank", ["rank"], registry=r)
        self.tasks = Gauge("tide_ctb_tasks", "Tasks by CTB state", ["state"], registry=r)
        self.decisions = Counter("tide_ctb_decisions", "CTB pauses, resumes and admissions", ["kind"], registry=r)
        self.outcomes = Counter("tide_tasks_finished", "Finished tasks by outcome", ["outcome"], registry=r)
        self.hit_rate = Gauge("tide_engine_prefix_cache_hit_rate", "Engine prefix-cache hit rate", ["rank"],
                              registry=r)
        self._seen: dict[str, float] = {}
        self.ers_ranks = Gauge("tide_ers_ranks", "Elastic ranks per role", ["role"], registry=r)
        self.ers_moves = Counter("tide_ers_rank_moves", "Ranks moved between roles", ["src", "dst"], registry=r)
        self.ers_plan = Gauge("tide_ers_last_plan_info", "The last ERS plan (value 1) and its reason",
                              ["step", "ra2p_mode", "reason"], registry=r)
        self.readiness = Gauge("tide_readiness", "Readiness signals after the last step", ["signal"], registry=r)
        self.evaluation = Gauge("tide_eval", "The last overlapped evaluation: model_step, overlapped_s, "
                                "trainer_wait_s", ["quantity"], registry=r)
        self.ra2p = Gauge("tide_ra2p", "RA2P for the next step: the replicas' share of a Ref pass (split mode) and "
                          "the cost model's predicted step times per mode", ["quantity"], registry=r)
        self.ra2p_mode = Gauge("tide_ra2p_mode_info", "The mode the next step runs in (value 1)", ["mode"], registry=r)
        self.split_advice = Gauge("tide_ers_split_advice", "ERS's split advice: rollout GPUs now and advised (the same "
                                  "when none stands), and the predicted gain in sequences per second", ["quantity"],
                                  registry=r)
        self.ledger = Gauge("tide_goodput_ledger", "Goodput ledger: groups, samples and tokens by outcome; "
                            "goodput_tok_s", ["quantity"], registry=r)

    def update_from_ctb(self, scheduler: CTBScheduler) -> None:
        from verl_tide.ctb.policy import TaskState

        counts = {s.value: 0 for s in TaskState}
        for task in scheduler.tasks.values():
            counts[task.state.value] += 1
        ranks = {rank: {"usage": r.usage, "budget": r.budget} for rank, r in scheduler.ranks.items()}
        self.update_from_ctb_status(ranks, counts, scheduler.counters)

    def update_from_ctb_status(self, ranks: Mapping[str, Mapping[str, float]], task_counts: Mapping[str, int],
                               counters: Mapping[str, float]) -> None:
        """CTB state as the router's `get_status()` reports it (the trainer reads it from the router actor)."""
        for rank, usage in ranks.items():
            self.rank_tokens.labels(rank=str(rank)).set(usage["usage"])
            self.rank_budget.labels(rank=str(rank)).set(usage["budget"])
        for state, n in task_counts.items():
            self.tasks.labels(state=state).set(n)
        for key, value in counters.items():  # counters only grow: export the increments
            if not isinstance(value, (int, float)) or key in ("eval_tasks", "budget_factor"):  # not outcomes
                continue
            delta = value - self._seen.get(key, 0)
            if delta > 0:
                metric = self.decisions if key in ("pauses", "resumes", "admissions") else self.outcomes
                metric.labels(**({"kind": key} if metric is self.decisions else {"outcome": key})).inc(delta)
            self._seen[key] = value

    def update_from_eval(self, metrics: Mapping[str, float]) -> None:
        """An overlapped evaluation's timing (`tide/eval/*` of `evaluation.OverlappedEvaluation.collect`)."""
        for key, value in metrics.items():
            if key.startswith("tide/eval/"):
                self.evaluation.labels(quantity=key[len("tide/eval/"):]).set(float(value))

    def update_from_ers(self, plan: ScalingPlan, signals: ReadinessSignals, roles: Mapping[int, Role]) -> None:
        """One step of ERS: ranks per role after the plan, the plan and its reason, RWT, TWT, RAS, TPRM, HoL, and
        the rollout ranks' utilization, KV-bound share and decode context (when CTB's router reported them)."""
        counts: dict[str, int] = {}
        for role in roles.values():
            counts[role.value] = counts.get(role.value, 0) + 1
        for move in plan.moves:
            counts[move.src.value] = counts.get(move.src.value, 0) - 1
            counts[move.dst.value] = counts.get(move.dst.value, 0) + 1
            self.ers_moves.labels(src=move.src.value, dst=move.dst.value).inc()
        for role, n in counts.items():
            self.ers_ranks.labels(role=role).set(n)
        self.ers_plan.clear()  # only the latest plan is exported
        self.ers_plan.labels(step=str(plan.step), ra2p_mode=plan.ra2p_mode.value, reason=plan.reason).set(1)
        for name, value in (("rollout_wait_s", signals.rollout_wait_s), ("trainer_wait_s", signals.trainer_wait_s),
                            ("ready_at_start", signals.ready_at_start), ("hol_latency_s", signals.hol_latency),
                            ("time_per_ready_microbatch_s", signals.tprm_smoothed),
                            ("ready_volume", signals.ready_volume), ("batch_size", plan.batch_size),
                            ("rollout_utilization", signals.rollout_utilization),
                            ("rollout_kv_bound", signals.rollout_kv_bound),
                            ("rollout_decode_context_tokens", signals.rollout_decode_context),
                            ("rollout_kv_held_peak_ranks", signals.rollout_kv_held_peak)):
            if value is not None:
                self.readiness.labels(signal=name).set(value)

    def update_split_advice(self, rollout_gpus: int, advice: Optional[SplitAdvice]) -> None:
        """The standing split advice (`ers.advice.SplitAdvisor.standing`), or none: advised = now, gain 0."""
        self.split_advice.labels(quantity="rollout_gpus").set(rollout_gpus)
        self.split_advice.labels(quantity="advised_rollout_gpus").set(advice.rollout_gpus if advice else rollout_gpus)
        self.split_advice.labels(quantity="predicted_gain").set(advice.predicted_gain if advice else 0.0)

    def update_from_ra2p(self, mode: str, ref_share: float, step_metrics: Mapping[str, float]) -> None:
        """The next step's RA2P mode, split mode's share, and the predictions (`tide/ra2p/predicted_*_s`)."""
        self.ra2p_mode.clear()
        self.ra2p_mode.labels(mode=mode).set(1)
        self.ra2p.labels(quantity="ref_share").set(ref_share)
        for key, value in step_metrics.items():
            if key.startswith("tide/ra2p/predicted_"):
                self.ra2p.labels(quantity=key[len("tide/ra2p/"):]).set(float(value))

    def update_from_ledger(self, ledger: GoodputLedger) -> None:
        """Where every group and token went so far, and goodput."""
        for key, value in ledger.snapshot(prefix="").items():
            self.ledger.labels(quantity=key.lstrip("/")).set(value)

    def update_hit_rates(self, rates: Mapping[str, float]) -> None:
        for rank, rate in rates.items():
            self.hit_rate.labels(rank=str(rank)).set(rate)

    @classmethod
    def start(cls, host: str = "127.0.0.1", port: int = 0, who: str = "verl-tide") -> tuple[TideMetrics, Any]:
        """A new exporter, served on host:port (0: any free port); (exporter, HTTP server). The one place an
        exporter starts: trainer `tide` and CTB's router plugin both call it, and it says where it listens."""
        exporter = cls()
        server, _thread = exporter.serve(host, port)
        print(f"{who}: Prometheus metrics at http://{host}:{server.server_port}/metrics", flush=True)
        return exporter, server

    def serve(self, host: str = "127.0.0.1", port: int = 0):
        """Serve `/metrics` in a background thread; returns (server, thread). Call server.shutdown() to stop."""
        from prometheus_client import start_http_server

        return start_http_server(port, addr=host, registry=self.registry)

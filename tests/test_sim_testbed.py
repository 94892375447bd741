"""The simulator on the test bed's measured profile: loading it, the host-time terms it adds, the environment probe
through a real environment service, and the validation benchmark's systems matching the head-to-head's."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
from dataclasses import replace
from pathlib import Path

import pytest

from verl_tide.sim.bench import STOCK_SYSTEMS, VERL_SYNC
from verl_tide.sim.cluster import Simulation, SystemSpec
from verl_tide.sim.evaluation import first_look
from verl_tide.sim.env_probe import fit, probe_environment
from verl_tide.sim.hardware import Costs, Hardware, fit_decode_iteration, load_profile, profile_names
from verl_tide.sim.plan import PlanError, hardware_named
from verl_tide.sim.workload import ModelSpec, load_workload, parse_workload
from verl_tide.testing.testbed import spawn_env_service

ROOT = Path(__file__).resolve().parents[1]


def test_the_measured_profile_gives_its_rates_for_its_model_only():
    hw = load_profile("testbed-cpu")
    assert "testbed-cpu" in profile_names() and hardware_named("testbed-cpu") == hw
    w = load_workload("testbed_demo")
    c = Costs.of(w.model, hw)
    rates = dict(hw.measured.rates)
    assert c.prefill_tok_s == rates["prefill_tok_s"] and c.act_b_s_per_token == rates["act_b_s_per_token"]
    assert c.kv_capacity_tokens == rates["kv_capacity_tokens"] > 0
    with pytest.raises(ValueError, match="measured on"):
        Costs.of(ModelSpec(7.6, 57344), hw)  # a 7B model on the tiny model's rates
    with pytest.raises(PlanError, match="h100 | h200 | testbed-cpu"):
        hardware_named("a100")


def test_a_bad_profile_names_every_key(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("name: x\nmodel: {params_b: 1.0}\nrates: {prefill_tok_s: -1, warp_speed: 3}\n")
    with pytest.raises(ValueError) as e:
        load_profile(str(bad))
    msg = str(e.value)
    for key in ("rates.decode_weight_s: missing", "rates.warp_speed: unknown", "rates.prefill_tok_s = -1",
                "kv_bytes_per_token"):
        assert key in msg


def _profile(step_overhead_s: float = 0.0, request_overhead_s: float = 0.0, **more: float) -> Hardware:
    hw = load_profile("testbed-cpu")
    rates = {**dict(hw.measured.rates), "step_overhead_s": step_overhead_s, "request_overhead_s": request_overhead_s,
             **more}
    return replace(hw, measured=replace(hw.measured, rates=tuple(rates.items())))


def test_host_overheads_lengthen_steps_and_turns_as_measured():
    w = replace(load_workload("testbed_demo"), steps=3)
    spec = SystemSpec("verl_sync", sync=True)
    base = Simulation(w, 2, spec, _profile(), dt=0.05).run()
    slow_step = Simulation(w, 2, spec, _profile(step_overhead_s=2.0), dt=0.05).run()
    # verl sync trains after the whole batch: each step's train phase is 2 s longer, nothing else changes
    for a, b in zip(base.steps, slow_step.steps):
        assert (b["end_s"] - b["start_s"]) - (a["end_s"] - a["start_s"]) == pytest.approx(2.0, abs=0.06)
    slow_turn = Simulation(w, 2, spec, _profile(request_overhead_s=0.5), dt=0.05).run()
    turns = w.turns.mean
    # every turn (and the start) waits 0.5 s more: a step's rollout is at least turns x 0.5 s longer
    assert slow_turn.steps[0]["end_s"] - base.steps[0]["end_s"] >= 0.5 * turns - 0.1


def test_verls_sampler_poll_rounds_a_sync_steps_rollout_up_to_its_next_look():
    w = replace(load_workload("testbed_demo"), steps=4)
    continuous = Simulation(w, 2, SystemSpec("verl_sync", sync=True), _profile(), dt=0.05).run()
    polled = Simulation(w, 2, SystemSpec("verl_sync", **VERL_SYNC), _profile(), dt=0.05).run()
    # the same trajectories (one seed), each batch seen at the sampler's first look after it is ready: a step
    # is longer by less than one poll, and by some of one at least once
    longer = [(b["end_s"] - b["start_s"]) - (a["end_s"] - a["start_s"]) for a, b in zip(continuous.steps, polled.steps)]
    assert all(-0.06 < d < VERL_SYNC["poll_s"] + 0.06 for d in longer) and max(longer) > 0.5
    assert first_look(10.0, 14.1, 2.0) == 16.0 and first_look(10.0, 14.0, 2.0) == 14.0
    assert first_look(10.0, 9.0, 2.0) == 10.0 and first_look(10.0, 14.1, 0.0) == 14.1


@pytest.mark.parametrize("spec", [SystemSpec("verl_sync", **VERL_SYNC),
                                  SystemSpec("separate_async", rollout_ratio=0.5, **STOCK_SYSTEMS["verl_separate_async"]),
                                  SystemSpec("tide", rollout_ratio=0.5, routing="ctb", consume="ra2p",
                                             eval_blocks_trainer=False, elastic=True)], ids=lambda s: s.name)
def test_a_validation_after_the_last_step_runs_and_ends_the_clock(spec):
    w = replace(load_workload("testbed_every_part"), steps=4)
    assert w.eval.at_end and w.eval_after(3) and w.eval_after(4) and not w.eval_after(2) and not w.eval_after(5)
    without = replace(w, eval=replace(w.eval, at_end=False))
    r, r0 = (Simulation(x, 3, spec, load_profile("testbed-cpu-0.5-every-part"), dt=0.05).run() for x in (w, without))
    # one more validation round (2 groups of one) after the last update, and the run lasts until it is seen
    assert r.ledger["eval_tokens"] > r0.ledger["eval_tokens"]
    assert r.makespan_s > r.steps[-1]["end_s"] + 1.0 and r.consumed_tokens == r0.consumed_tokens
    # nothing before it changed (the last step's boundary now plans for the validation after it)
    assert [(s["start_s"], s["end_s"]) for s in r.steps] == [(s["start_s"], s["end_s"]) for s in r0.steps]


def test_a_sync_to_standalone_replicas_delays_async_steps_only():
    w = replace(load_workload("testbed_demo"), steps=4)
    sep = SystemSpec("separate_async", rollout_ratio=0.5, consume="mini_batch", parameter_sync_step=1)
    for spec, slower in ((sep, True), (SystemSpec("verl_sync", sync=True), False)):
        base = Simulation(w, 2, spec, _profile(), dt=0.05).run()
        slow = Simulation(w, 2, spec, _profile(standalone_sync_s=3.0), dt=0.05).run()
        # the async trainer's next step waits for the 3 s sync; verl sync's colocated sync is `sync_s`
        assert (slow.makespan_s > base.makespan_s + 2.0) is slower
        assert (slow.makespan_s == base.makespan_s) is not slower


def test_the_decode_fit_tells_a_sequences_own_cost_from_its_contexts():
    """One prompt length makes context proportional to the batch, and a per-sequence cost (vLLM-CPU's sampling and
    server output path) then fits as a per-context-token one, tens of times too large at the job's contexts. With
    long prompts at some batches the fit recovers both terms."""
    w, seq, kv = 0.07, 0.003, 2e-6
    pts = [(b, b * (n + 32), w + seq * b + kv * b * (n + 32)) for b, n in [(1, 16), (4, 16), (8, 16), (16, 16),
                                                                          (1, 168), (8, 168)]]
    assert fit_decode_iteration(pts) == pytest.approx((w, seq, kv), rel=1e-6)
    # a term that fits below zero is dropped and the other refitted
    no_kv = [(b, c, w + seq * b - (0.005 if c > b * 48 else 0.0)) for b, c, _ in pts]  # longer ran faster
    assert fit_decode_iteration(no_kv)[2] == 0.0 and fit_decode_iteration(no_kv)[1] > 0
    with pytest.raises(ValueError, match="do not determine"):
        fit_decode_iteration([(1, 48, 1.0)] * 3)


def test_a_sequences_own_decode_cost_slows_an_iteration_by_the_batch():
    w = replace(load_workload("testbed_demo"), steps=2)
    spec = SystemSpec("verl_sync", sync=True)
    rates = dict(load_profile("testbed-cpu").measured.rates)
    hw = lambda seq: replace(load_profile("testbed-cpu"), measured=replace(  # noqa: E731
        load_profile("testbed-cpu").measured, rates=tuple({**rates, "decode_seq_s": seq}.items())))
    base, slow = (Simulation(w, 2, spec, hw(x), dt=0.05).run() for x in (0.0, 0.01))
    # 8 tokens a turn, each iteration 10 ms longer per sequence decoding beside it (1 to 8 of them, as the
    # environments stagger the turns): a step's rollout is at least 2 turns x 8 x 2 x 10 ms = 0.32 s longer
    for a, b in zip(base.steps, slow.steps):
        assert b["end_s"] - a["end_s"] >= w.turns.mean * 8 * 2 * 0.01


def test_fit_keeps_the_mean_and_the_range():
    d = fit([0.1, 0.2, 0.4, 0.8, 1.6])
    assert d["dist"] == "lognormal" and d["mean"] == pytest.approx(0.62) and (d["min"], d["max"]) == (0.1, 1.6)
    assert d["sigma"] > 0.5
    assert fit([6, 6, 6], integer=True) == {"dist": "fixed", "mean": 6}
    w = parse_workload({"name": "t", "description": "", "model": {"params_b": 1.0, "kv_bytes_per_token": 8},
                        "prompt_tokens": {"dist": "fixed", "mean": 10}, "turns": fit([2, 3, 5], integer=True),
                        "action_tokens": {"dist": "fixed", "mean": 8}, "observation_tokens": fit([4, 9]),
                        "env_latency_s": d, "env_start_s": {"dist": "fixed", "mean": 0.0},
                        "context_window": None, "group_size": 2, "groups_per_step": 1, "reference_gpus": 2,
                        "steps": 1, "max_staleness": 1,
                        "eval": {"every_steps": 0, "at_start": False, "groups": 0, "group_size": 1}}, "fit")
    assert w.turns.min == 2 and w.turns.max == 5


def test_the_environment_probe_measures_a_real_service():
    import urllib.request

    proc, url = spawn_env_service("--session-timeout", "60", latency_scale=0.0)
    try:
        s = asyncio.run(probe_environment(url, episodes=4, env="tiny_slow"))
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            health = json.load(r)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    # tiny_slow: an answer without a number never finds the target, so every episode plays its 6 turns; each turn
    # but the last returns an observation of the preset's filler words and a sentence
    assert s.turns == [6, 6, 6, 6] and len(s.step_s) == 24 and len(s.observation_tokens) == 20
    assert min(s.observation_tokens) > 8 and len(s.start_s) == 4
    # the service timed the agent's side of every action (here: the probe's own turnaround)
    assert health["agent_turns"] == 24 and 0 < health["agent_turn_s"] < 24 * 1.0
    w = s.workload("probe", "", {"params_b": 1.0, "kv_bytes_per_token": 8}, prompt_tokens=30, action_tokens=8,
                   group_size=2, groups_per_step=4, gpus=2, steps=3, max_staleness=1)
    assert parse_workload(w, "probe").turns.mean == 6


@pytest.mark.parametrize("measured_json, validation_json", [
    ("e2e_compare_budgeted_cpu.json", "sim_validation_testbed_cpu.json"),
    ("e2e_compare_budgeted_0.5_cpu.json", "sim_validation_testbed_0.5_cpu.json"),
    ("e2e_every_part_budgeted_0.5_cpu.json", "sim_validation_testbed_every_part_0.5_cpu.json")])
def test_the_validation_runs_the_head_to_heads_systems_and_reports_each(measured_json, validation_json):
    mod = _sim_validation()
    measured = json.loads((ROOT / "benchmarks/results" / measured_json).read_text())
    report = json.loads((ROOT / "benchmarks/results" / validation_json).read_text())
    systems = mod.specs(*mod.JOBS[report["job"].split()[0]])
    ran = [n for n in measured if isinstance(measured[n], dict) and "goodput_tok_s" in measured[n]]
    assert ran and all(n in systems for n in ran), "a measured system the validation does not know"
    assert report["measured"]["file"] == f"benchmarks/results/{measured_json}"
    assert set(report["systems"]) == set(ran)
    for name, r in report["systems"].items():
        assert r["measured_tok_s"] > 0 and (r["predicted_tok_s"] is None) == (systems[name] is None)


@pytest.mark.parametrize("job, gpus, ref_model", [("demo", 2, False), ("every_part", 3, True)])
def test_the_validation_knows_every_system_the_head_to_head_runs(job, gpus, ref_model):
    from verl_tide.testing.compare import systems
    from verl_tide.testing.testbed import GRPOJob

    mod = _sim_validation()
    assert mod.JOBS[job][:1] == (gpus,) and mod.JOBS[job][2] is ref_model
    grpo = GRPOJob(model_path="m", train_file="t", val_file="v", n_gpus=gpus, use_kl_loss=ref_model)
    specs = mod.specs(*mod.JOBS[job])
    names = [s.name for s in systems(grpo, tide_rollout_gpus=mod.JOBS[job][1])]
    assert [n for n in names if n not in specs] == []
    # trainer tide's rule: the Actor's GPUs are lent without a Ref model only, unless the user asks
    lend_key = "tide, tide.ers.lend_actor=true" if ref_model else "tide, tide.ers.lend_actor=false"
    assert specs["tide"].lend_actor is not ref_model and specs[lend_key].lend_actor is ref_model


def _sim_validation():
    spec = importlib.util.spec_from_file_location("sim_validation", ROOT / "benchmarks" / "sim_validation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_calibration_maps_verls_passes_onto_the_simulators_stages():
    spec = importlib.util.spec_from_file_location("testbed_calibrate", ROOT / "benchmarks" / "testbed_calibrate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    f, fb, ref = 2e-4, 4.5e-4, 1.8e-4
    for r, verl_step in ((0.0, f + fb), (ref, ref + f + fb)):  # without and with a Ref model
        rates = mod.trainer_rates(f, fb, r)
        simulated = rates["ref_s_per_token"] + rates["act_f_s_per_token"] + rates["act_b_s_per_token"]
        assert simulated == pytest.approx(verl_step)
        assert rates["act_f_s_per_token"] == f
    # a steady step is a gap between step lines without the validation verl ran in it (every third step here)
    wall = {1: 17.0, 2: 24.5, 3: 36.1, 4: 43.6}
    assert mod.steady_step_s(wall, {3: 4.1}) == pytest.approx(7.5)
    assert mod.steady_step_s(wall, {}) == pytest.approx(7.5)  # the median of 7.5, 11.6, 7.5
    assert mod.steady_step_s({1: 17.0, 2: 24.5, 3: 36.1}, {3: 4.1}) == pytest.approx(7.5)


def test_the_trainer_fit_recovers_fixed_and_per_token_parts_from_two_trainer_sizes(tmp_path):
    spec = importlib.util.spec_from_file_location("trainer_fit", ROOT / "benchmarks" / "trainer_fit.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    tokens, fixed, rate = 2400.0, {"ref": 0.2, "act_f": 0.25, "act_fb": 0.3}, {"ref": 8e-5, "act_f": 1e-4, "act_fb": 2.4e-4}

    def point(ranks: int) -> dict:
        return {**{k: fixed[k] + tokens * rate[k] / ranks for k in fixed}, "tokens": tokens}

    f = mod.fit({3: point(3), 2: point(2)})
    for k in ("ref", "act_fb"):
        assert f[f"{k}_fixed_s"] == pytest.approx(fixed[k]) and f[f"{k}_s_per_token"] == pytest.approx(rate[k])
    # the Actor's forward is split as the Ref forward is at the larger size: its sum is kept exactly
    assert f["act_f_fixed_s"] + tokens * f["act_f_s_per_token"] / 3 == pytest.approx(point(3)["act_f"])
    one = mod.fit({2: point(2)})  # one size: no fixed part, GPU-seconds per token
    assert one["ref_fixed_s"] == 0 and one["ref_s_per_token"] * tokens / 2 == pytest.approx(point(2)["ref"])
    # the profile's step overhead carries the fixed parts once, however often the fit is rerun
    prof = tmp_path / "p.yaml"
    prof.write_text("name: t\nmodel: {params_b: 0.1, kv_bytes_per_token: 8}\nrates: {step_overhead_s: 0.05}\n")
    log = tmp_path / "sync.log"
    log.write_text("\n".join(f"step:{n} - timing_s/ref:0.3 - timing_s/old_log_prob:0.3 - timing_s/update_actor:0.5 - "
                             "perf/total_num_tokens:2400" for n in (1, 2, 3)))
    for _ in range(2):
        mod.main(["--point", f"3={log}", "--point", f"2={log}", "--profile", str(prof)])
    import yaml
    assert yaml.safe_load(prof.read_text())["rates"]["step_overhead_s"] == pytest.approx(0.05 + 0.3 + 0.3 + 0.5)


def test_plan_takes_the_environment_from_a_probe_of_its_service(tmp_path, capsys):
    from verl_tide.cli import main as cli_main

    out = tmp_path / "plan.json"
    proc, url = spawn_env_service("--session-timeout", "60", latency_scale=0.0)
    try:
        assert cli_main(["plan", "--hardware", "testbed-cpu", "--workload", "testbed_demo", "--gpus", "4", "--steps",
                         "2", "--env-url", url, "--env-name", "tiny_slow", "--probe-episodes", "4",
                         "--json", str(out)]) == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    p = json.loads(out.read_text())
    # the workload says 2 turns (the demo job's response length ends its episodes); the environment plays 6
    assert load_workload("testbed_demo").turns.mean == 2 and p["environment"]["turns_mean"] == 6
    assert p["environment"]["from"].startswith(f"probe of {url}") and p["predicted_tok_s"]["tide"] > 0
    assert "environment (probe of" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["plan", "--hardware", "testbed-cpu", "--workload", "testbed_demo", "--gpus", "4",
                  "--env-url", "http://127.0.0.1:9", "--probe-episodes", "1"])
    assert "--env-url http://127.0.0.1:9: the environment probe failed" in capsys.readouterr().err


def test_a_steps_readiness_counts_from_when_the_trainer_was_free_as_trainer_tides_step_does():
    """Trainer tide's step begins (its tracker's `step_started`, verl's `on_step_begin`) before its sampler waits,
    so a step whose one micro-batch arrives during the wait has none ready at its start and a measured TPRM, which
    ERS's lending reads after the update. Counted from when the data was there (as the simulator did), every step
    of the demo job had its micro-batch ready at its start, TPRM was never measured, and the simulated tide lent
    the Actor's GPU after every other update, where trainer tide's measured runs lent it through the cold start
    only (the rollout never waits for KV there)."""
    w = replace(load_workload("testbed_demo"), steps=8)
    spec = SystemSpec("tide", rollout_ratio=0.5, routing="ctb", consume="ra2p", eval_blocks_trainer=False,
                      elastic=True, lend_actor=True)
    sim = Simulation(w, 2, spec, load_profile("testbed-cpu-0.5"), dt=0.05)
    r = sim.run()
    reasons = [why for _, _, why in sim.lend_decisions]
    assert len(reasons) == w.steps - 1
    assert not any("no arrival rate" in why for why in reasons), reasons
    waited = [why for why in reasons if "expected wait" in why]
    assert waited and all("waited for KV 0%" in why for why in waited), reasons
    assert not any(lent for _, lent, _ in sim.lend_decisions)
    assert sim.tracker.signals(1, 1.0).tprm_smoothed > 0 and r.consumed_tokens > 0


def test_fully_async_lending_after_an_update_holds_its_trainer_for_the_activation():
    """verl fully_async activates its hybrid replicas inside its weight-sync phase (`_fit_update_weights`), so the
    step after a lend starts only once the activation is done; its request rebalance then waits (up to 30 s) for
    the turns it aborted to drain, which on the budgeted test bed timed out both times (`hybrid_activate_s`,
    31.1 s). With no turn in flight the activation costs the switch one way (the policy's weighing of each
    cycle's switching: test_sim_stock)."""
    w = load_workload("testbed_demo")
    spec = SystemSpec("fully_async_dynamic", rollout_ratio=0.5,
                      **{**STOCK_SYSTEMS["verl_fully_async_dynamic"], "parameter_sync_step": 1})
    rates = {"step_overhead_s": 0.0358, "request_overhead_s": 0.2651, "hybrid_switch_s": 0.2713}
    runs = {}
    for name, activate in (("cheap", 0.2713), ("slow", 31.1)):
        sim = Simulation(w, 2, spec, _profile(**rates, hybrid_activate_s=activate), seed=0, dt=0.05)
        lends: list[tuple[int, bool]] = []
        step_ended = sim.hybrid.switch.step_ended

        def record(waits, ready, cost, sim=sim, lends=lends, step_ended=step_ended):
            lend = step_ended(waits, ready, cost)
            if lend:
                busy = any(t.in_engine is not None for t in sim.rollout.trajs.values() if not t.done)
                lends.append((sim.consumed_steps, busy))
            return lend

        sim.hybrid.switch.step_ended = record
        runs[name] = (sim.run(), lends)
    r, lends = runs["slow"]
    assert any(busy for _, busy in lends), lends
    for step, busy in lends:
        gap = r.steps[step]["start_s"] - r.steps[step - 1]["end_s"]
        assert (gap >= 31.1) is busy, (step, busy, gap)
    assert r.goodput_tok_s < runs["cheap"][0].goodput_tok_s

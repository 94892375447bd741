"""One decision path: the step-boundary decision (RA2P's mode and split share, the break-even RAS, ERS's plan) is
`verl_tide.boundary.planner`, called by trainer `tide` (through trainer/boundary.py) and by the simulator. A trace the
simulator records replays through the planner as trainer `tide` builds it, from inputs built by the trainer's
own adapter, to the same decisions."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from verl_tide.core.config import parse_tide_config
from verl_tide.boundary.planner import BoundaryPlanner, BudgetRecord, TraceRecord, replay
from verl_tide.ers.policy import Role
from verl_tide.ra2p.cost import StageTimer
from verl_tide.sim.cluster import Simulation, SystemSpec
from verl_tide.sim.workload import load_workload
from verl_tide.engine_metrics import EngineMetrics
from verl_tide.trainer.boundary import boundary_inputs
from verl_tide.trainer.budget_window import BudgetWindowReader
from verl_tide.trainer.reporting import RolloutReport

TIDE = SystemSpec("tide", rollout_ratio=0.5, routing="ctb", consume="ra2p", eval_blocks_trainer=False, elastic=True)


@pytest.fixture(scope="module")
def recorded():
    """WebShop on 8 GPUs, 12 steps: ERS lends and returns ranks, RA2P runs colocated and split."""
    sim = Simulation(dataclasses.replace(load_workload("webshop"), steps=12), 8, TIDE)
    sim.planner.trace = []
    sim.boundary.round.trace = []  # each round: its inputs, context, signals, and the calls through the port
    sim.run()
    return sim, sim.planner.trace


def _as_trainer_builds_it(sim: Simulation) -> BoundaryPlanner:
    """TideTrainer.__init__'s construction, for a job with the simulated system's settings."""
    tide = parse_tide_config({"ra2p": {"max_aggregate": TIDE.max_aggregate}})
    return BoundaryPlanner.build(tide.ra2p, tide.ers, ideal_batch=sim.B, ctb=tide.ctb)


def test_the_trace_exercises_every_decision(recorded):
    _, trace = recorded
    trace = _boundaries(trace)
    assert len(trace) == 11  # one boundary after every step but the last
    modes = {rec.decision["mode"] for rec in trace}
    assert {"colocated", "split"} <= modes
    assert any(rec.decision["plan"][0] for rec in trace)  # ERS moved ranks
    assert any(rec.decision["break_even"] is not None for rec in trace)


def test_the_trainers_adapter_builds_the_inputs_the_simulator_decided_on(recorded):
    """The trainer's adapter, fed what a running job measures (ready times, stage rates observed by its
    StageTimer, the ranks' roles), gives exactly the simulator's inputs."""
    sim, trace = recorded
    rates = _boundaries(trace)[0].inputs.rates
    timer = StageTimer()
    for stage, seconds in (("ref", rates.ref), ("act_f", rates.act_f), ("act_b", rates.act_b),
                           ("ref_rank", rates.ref_rank)):
        timer.observe(stage, 1, seconds)  # one token: the rate is the seconds, exactly
    timer.observe("swap", 0, rates.swap_s)
    for rec in trace:
        if isinstance(rec, BudgetRecord):
            continue
        roles = rec.roles
        ref_ranks = sum(r is Role.REF for r in roles.values())
        built = boundary_inputs(rec.inputs.step, rec.inputs.ready_times, 1, rec.inputs.step_tokens, timer,
                                sim.actor_ranks, 0, roles, ref_ranks, ref_beside_actor=True, uses_ref=True,
                                ctb=rec.inputs.ctb)
        assert built == rec.inputs
    assert _budget_as_the_trainer_reads_it(sim, trace) == [c for c in _budget_inputs(trace) if c is not None]


class _RecordedRollout(RolloutReport):
    """CTB's router's clocks and one engine's `/metrics` as the simulator recorded them at each window decision:
    trainer `tide`'s budget-window reader (`trainer/budget_window.py`) reads them through its own code."""

    def __init__(self, reads):
        super().__init__(pool=None, backend="vllm", ctb_enabled=True)
        self.reads, self.now = iter(reads), None

    def rollout_time(self):
        self.now = next(self.reads)
        return {k: self.now[k] for k in ("busy_s", "idle_rank_s", "kv_wait_s")}

    def scrape_engines(self, quarantined):
        return {"engine": (0, EngineMetrics("vllm", self.now["prompt_tokens"], self.now["hit_tokens"], None, None,
                                            None))}


def _budget_as_the_trainer_reads_it(sim, trace):
    """The BudgetInputs trainer `tide`'s reader builds from the same clocks, read in the simulator's order (its reads
    at the rollout's start and at each sync's end only mark, as the reader's `start`), the factor in force as the
    planner set it."""
    report = _RecordedRollout(sim.boundary.window_reads)
    reader = BudgetWindowReader(report, _as_trainer_builds_it(sim), clock=lambda: report.now["t"])
    decided = iter(c for c in _budget_inputs(trace) if c is not None)
    built = []
    for i, read in enumerate(sim.boundary.window_reads):
        if read["mark_only"]:  # the trainer's clocks just read; the engines' counters too at the rollout's start
            clocks = report.rollout_time()
            reader.mark(clocks, {a: m for a, (_, m) in report.scrape_engines({}).items()} if i == 0 else None)
            continue
        reader.factor = next(decided).factor
        built.append(reader.inputs({}))
    return built


def _budget_inputs(trace):
    """Each decision's BudgetInputs (None at a boundary CTB's router was not read at)."""
    return [rec.inputs if isinstance(rec, BudgetRecord) else rec.inputs.ctb for rec in trace]


def _boundaries(trace):
    return [rec for rec in trace if isinstance(rec, TraceRecord)]


def test_ctbs_budget_factor_replays_through_the_trainers_planner_from_the_trainers_inputs():
    """Environment-bound with tight KV: work waits for CTB's budget while the engines have nothing in flight, so
    the planner doubles the budgets (ctb/window.py); the trainer's planner, from inputs its adapter builds,
    decides the same at every boundary."""
    w0 = load_workload(str(Path(__file__).parent / "data" / "sim_tiny.yaml"))
    w = dataclasses.replace(w0, groups_per_step=48, eval=dataclasses.replace(w0.eval, groups=0),
                            env_latency_s=dataclasses.replace(w0.env_latency_s, mean=10.0, max=40.0),
                            model=dataclasses.replace(w0.model, kv_bytes_per_token=3_000_000))
    sim = Simulation(w, 8, TIDE)
    sim.planner.trace = []
    sim.run()
    trace = sim.planner.trace
    factors = [rec.decision["budget"][0] for rec in trace if isinstance(rec, TraceRecord)]
    assert max(factors) >= 2.0 and sim.budget_factors == factors
    assert sim.rollout.ctb.budgets.factor == [rec.decision["budget"][0] for rec in trace][-1]
    assert _budget_as_the_trainer_reads_it(sim, trace) == [c for c in _budget_inputs(trace) if c is not None]
    assert replay(_as_trainer_builds_it(sim), trace) == [rec.decision for rec in trace]


def test_the_trace_replays_to_the_same_decisions_through_the_trainers_planner(recorded):
    sim, trace = recorded
    assert replay(_as_trainer_builds_it(sim), trace) == [rec.decision for rec in trace]


def test_a_planner_that_decides_differently_does_not_replay(recorded):
    """The comparison can fail: a trainer built with other RA2P settings (a higher hysteresis; verl-tide's default
    aggregation cap instead of the simulated system's) decides differently on the same trace."""
    sim, trace = recorded
    for change in ({"hysteresis": 0.5}, {"max_aggregate": None}):
        other = _as_trainer_builds_it(sim)
        other.ra2p = dataclasses.replace(other.ra2p, **change)
        try:
            decisions = replay(other, trace)
        except KeyError:  # it asked for readiness signals the recorded run never computed
            continue
        assert decisions != [rec.decision for rec in trace], change


@pytest.fixture(scope="module")
def recorded_lend():
    """tide.ers.lend_actor on the tiny workload (evaluations every 3 steps): at every boundary ERS also decides
    whether the Actor's GPUs roll out until the next step."""
    from pathlib import Path

    spec = dataclasses.replace(TIDE, lend_actor=True)
    sim = Simulation(load_workload(str(Path(__file__).parent / "data" / "sim_tiny.yaml")), 8, spec, seed=3)
    sim.planner.trace = []
    sim.boundary.round.trace = []
    sim.run()
    return sim, sim.planner.trace


def test_lending_decisions_replay_through_the_trainers_planner_from_the_trainers_inputs(recorded_lend):
    """One decision path for the Actor's GPUs too: the simulator's lending decisions (lent and kept, with their
    return thresholds) replay to the same through the trainer's planner, and the trainer's adapter builds the
    same lending inputs from what a job measures (verl's sampleable count, its switch costs, its update_actor
    timer over the mini-batches trained)."""
    from verl_tide.trainer.lending import lending_inputs

    sim, trace = recorded_lend
    lends = [rec.decision["lend"] for rec in _boundaries(trace)]
    assert all(lend is not None for lend in lends) and {lend[0] for lend in lends} == {True, False}, lends
    assert replay(_as_trainer_builds_it(sim), trace) == [rec.decision for rec in trace]
    for rec in _boundaries(trace):
        sim_in = rec.inputs.lending
        trained = sim_in.mini_batches
        built = lending_inputs(sim_in.ready_units, 1, sim_in.mini_batches, sim_in.switch_cost_s,
                               {"update_actor": sim_in.train_s_per_mini_batch * trained}, trained, last_step=False)
        assert built == dataclasses.replace(sim_in, train_s_per_mini_batch=pytest.approx(sim_in.train_s_per_mini_batch))


class _ElasticRanks:
    """ERS's elastic ranks as trainer `tide`'s port drives them (`ers.elastic.ElasticRanks.before_sync`): every
    move applied, timed."""

    def before_sync(self, moves):
        return [dataclasses.make_dataclass("Applied", ["rank", "dst", "seconds", "requests_resent"])(
            m.rank, m.dst, 0.5, 0) for m in moves]


class _BudgetWindow:
    def __init__(self):
        self.factors = []

    def at_boundary(self, decision, step):
        self.factors.append(decision.factor)
        return {"tide/ctb/next_budget_factor": decision.factor}


def _rounds_through_the_trainers_port(sim, trace):
    """Every round the simulator ran through its own port, run again by a round built as trainer `tide` builds it
    (its planner, a fresh advice cycle) through trainer `tide`'s port, with CTB's budget decisions between
    boundaries in their recorded order. Returns the replayed rounds' records and the port's last roles."""
    from verl_tide.boundary.round import BoundaryRound, ReplayedSignals
    from verl_tide.ers.advice import SplitAdviceCycle
    from verl_tide.trainer.boundary import TrainerBoundaryPort

    replay_round = BoundaryRound(_as_trainer_builds_it(sim), SplitAdviceCycle(sim.w.is_eval_step(0)), trace=[])
    rounds, roles, window = iter(sim.boundary.round.trace), None, _BudgetWindow()
    for rec in trace:
        if isinstance(rec, BudgetRecord):
            replay_round.planner.decide_budget(rec.inputs)
            continue
        recorded_round = next(rounds)
        roles = dict(recorded_round.context.roles)
        port = TrainerBoundaryPort(recorded_round.inputs.step, ReplayedSignals(recorded_round), roles,
                                   elastic=_ElasticRanks(), budget_window=window)
        result = replay_round.run(recorded_round.inputs, recorded_round.context, port)
        assert result.decision.summary() == rec.decision
        assert port.metrics["tide/ers/moves_applied"] == len(port.applied)
    return replay_round.trace, roles, window.factors


def test_a_recorded_round_replays_through_the_trainers_port_to_the_same_effects(recorded):
    """The whole round, not the planner alone: the calls the simulator's round made through its port (budget
    factor, lending, ERS's moves, in order) are the calls the trainer's round makes through trainer `tide`'s port
    on the same inputs, and the trainer's roles follow the moves."""
    sim, trace = recorded
    replayed, roles, factors = _rounds_through_the_trainers_port(sim, trace)
    recorded_rounds = sim.boundary.round.trace
    assert len(replayed) == len(recorded_rounds) == 11
    assert [r.effects for r in replayed] == [r.effects for r in recorded_rounds]
    assert [r.outcome for r in replayed] == [r.outcome for r in recorded_rounds]  # plan outcome, split advice
    moves = [e for r in recorded_rounds for e in r.effects if e[0] == "move_ranks"]
    assert moves and factors == sim.budget_factors  # ERS moved ranks; CTB's factor went through the port
    last_moves = {rank: dst for e in moves for rank, _, dst in e[1]}
    assert {r: roles[r].value for r in last_moves} == last_moves


def test_lending_rounds_replay_through_the_trainers_port(recorded_lend):
    sim, trace = recorded_lend
    replayed, _, _ = _rounds_through_the_trainers_port(sim, trace)
    lends = [e[1] for r in sim.boundary.round.trace for e in r.effects if e[0] == "lend"]
    assert {lent for lent, _ in lends} == {True, False}
    assert [r.effects for r in replayed] == [r.effects for r in sim.boundary.round.trace]


def test_a_round_that_acts_differently_does_not_replay(recorded):
    """The comparison can fail: a round that cancels every plan (as on a job's last step) makes no moves where the
    recorded one moved ranks."""
    from verl_tide.boundary.round import BoundaryRound, ReplayedSignals
    from verl_tide.trainer.boundary import TrainerBoundaryPort

    sim, trace = recorded
    replay_round = BoundaryRound(_as_trainer_builds_it(sim), trace=[])
    rounds = iter(sim.boundary.round.trace)
    for rec in trace:
        if isinstance(rec, BudgetRecord):
            replay_round.planner.decide_budget(rec.inputs)
            continue
        r = next(rounds)
        context = dataclasses.replace(r.context, last_step=True)
        replay_round.run(r.inputs, context, TrainerBoundaryPort(r.inputs.step, ReplayedSignals(r), dict(r.context.roles),
                                                                elastic=_ElasticRanks(), budget_window=_BudgetWindow()))
    assert [r.effects for r in replay_round.trace] != [r.effects for r in sim.boundary.round.trace]


def test_a_recorded_round_drives_the_simulators_port_as_it_drives_the_trainers(recorded):
    """The first recorded round that moved ranks, replayed through a fresh simulation's port (the model at its
    start) and through trainer `tide`'s port, each by a round whose planner decided the recorded rounds before it:
    the same calls, and each port applies ERS's moves to its own job."""
    from verl_tide.boundary.round import BoundaryRound, ReplayedSignals
    from verl_tide.trainer.boundary import TrainerBoundaryPort

    sim, trace = recorded
    first = next(r for r in sim.boundary.round.trace if any(e[0] == "move_ranks" for e in r.effects))
    boundaries = _boundaries(trace)
    before = trace[:trace.index(next(rec for rec in boundaries if rec.inputs == first.inputs))]

    def round_as_before():
        replay_round = BoundaryRound(_as_trainer_builds_it(sim), trace=[])
        replay(replay_round.planner, before)  # the planner's state then (RA2P's last mode, ERS's cooldowns)
        return replay_round

    fresh = Simulation(dataclasses.replace(load_workload("webshop"), steps=12), 8, TIDE)
    fresh.step_records.append(dataclasses.replace(sim.step_records[0], moves=[]))
    fresh.boundary.signals = ReplayedSignals(first)
    on_sim = round_as_before()
    on_sim.run(first.inputs, first.context, fresh.boundary)
    roles = dict(first.context.roles)
    on_trainer = round_as_before()
    on_trainer.run(first.inputs, first.context, TrainerBoundaryPort(first.inputs.step, ReplayedSignals(first), roles,
                                                                    elastic=_ElasticRanks(),
                                                                    budget_window=_BudgetWindow()))
    assert on_sim.trace[0].effects == on_trainer.trace[0].effects == first.effects
    moved = [m for e in first.effects if e[0] == "move_ranks" for m in e[1]]
    for rank, _, dst in moved:
        assert roles[rank].value == dst
        assert (rank in fresh.ref_ranks) == (dst == "ref") and (rank in fresh.rollout.ranks) == (dst == "rollout")

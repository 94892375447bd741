"""ERS resizing the Actor's training group (`ers/resize.py`): the target split from one cycle's readiness signals,
confirmation, cooldown and the move's cost; in the simulator, a job started at a bad split moves toward a good
one and trains faster than without the resize, with nothing lost."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from verl_tide.core.readiness import ReadinessSignals
from verl_tide.ers.resize import ResizeInputs, TrainerResizer, probe_split, target_split

TINY = str(Path(__file__).parent / "data" / "sim_tiny.yaml")


def _signals(**kw) -> ReadinessSignals:
    base = dict(ready_at_start=0, time_per_ready_microbatch=None, tprm_smoothed=None, hol_latency=0.0,
                ready_volume=0, mean_step_time=None, generation_deficit=False, consumption_deficit=False,
                rollout_wait_s=0.0, trainer_wait_s=0.0, rollout_capacity_rate=4.0, rollout_utilization=1.0,
                rollout_kv_bound=0.8, rollout_decode_context=None, cycle_s=100.0)
    return ReadinessSignals(**{**base, **kw})


def _inputs(**kw) -> ResizeInputs:
    return ResizeInputs(**{**dict(rollout_gpus=24, actor_gpus=8, batch=200, move_s=20.0, steps_left=50), **kw})


def test_a_trainer_bound_cycle_moves_rollout_gpus_into_the_actor_group():
    """Rollout made 4 seq/s on 24 GPUs with half of them idle at the staleness bound (utilization 0.5); the trainer
    took the whole 100 s cycle for 200 sequences on 8 GPUs (2 seq/s): more Actor GPUs, at most twice as many."""
    best, gain, why = target_split(_signals(rollout_utilization=0.5, rollout_wait_s=50.0), _inputs())
    assert best == 16 and gain > 0.5 and why.startswith("the trainer bounds")


def test_a_saturated_rollout_that_starves_the_trainer_gets_gpus_from_the_actor_group():
    """KV-bound rollout on 4 GPUs, the trainer idle 80 of 100 s: fewer Actor GPUs, at most half as many."""
    best, gain, why = target_split(_signals(trainer_wait_s=80.0, rollout_capacity_rate=1.0),
                                   _inputs(rollout_gpus=4, actor_gpus=28))
    assert 14 <= best < 28 and gain > 0.5 and why.startswith("rollout bounds")


def test_a_balanced_cycle_or_an_unmeasured_one_does_not_move():
    balanced = _signals(rollout_capacity_rate=2.0, rollout_utilization=1.0, rollout_kv_bound=0.0)
    best, gain, _ = target_split(balanced, _inputs())
    assert gain < 0.05 or best == 8
    assert target_split(_signals(cycle_s=None), _inputs()) is None
    assert target_split(_signals(rollout_capacity_rate=None), _inputs()) is None


def test_a_move_needs_two_cycles_a_cooldown_and_to_repay_its_cost():
    resizer = TrainerResizer()
    trainer_bound = _signals(rollout_utilization=0.5, rollout_wait_s=50.0)
    first = resizer.decide(trainer_bound, _inputs())
    assert first.actor_gpus == 8 and first.reason.startswith("not yet")  # one cycle does not decide
    second = resizer.decide(trainer_bound, _inputs())
    assert second.actor_gpus == 16 and second.delta(8) == 8 and second.reason.startswith("resize")
    after = resizer.decide(trainer_bound, _inputs(actor_gpus=16))
    assert after.actor_gpus == 16  # the cycles right after a move ran at the old split
    # an evaluation cycle says nothing; a move that the steps left cannot repay is not made
    assert TrainerResizer().decide(trainer_bound, _inputs(), eval_next=True).reason.startswith("no move")
    late = TrainerResizer()
    late.decide(trainer_bound, _inputs(steps_left=1, move_s=500.0))
    assert late.decide(trainer_bound, _inputs(steps_left=1, move_s=500.0)).actor_gpus == 8


def test_a_split_the_run_measured_worse_bounds_the_search_and_stops_the_walk_back():
    """The model keeps predicting more Actor GPUs (its one-cycle extrapolation); the run measured 8 GPUs at 2.0
    seq/s and 16 at 1.6: the peak lies below 16, so no move reaches 16 again; the next move goes to a split between
    the measured ones, and a move back to a measured split happens only on its measured gain."""
    resizer = TrainerResizer()
    trainer_bound = _signals(rollout_utilization=0.5, rollout_wait_s=50.0)  # cycle 100 s, batch 200: 2.0 seq/s at 8
    for _ in range(2):
        d = resizer.decide(trainer_bound, _inputs())
    assert d.actor_gpus == 16
    slower = _signals(rollout_utilization=0.5, rollout_wait_s=50.0, cycle_s=125.0)  # 1.6 seq/s at 16
    for _ in range(3):  # the cooldown's cycles are not measured (they ran partly at 8)
        assert resizer.decide(slower, _inputs(rollout_gpus=16, actor_gpus=16)).actor_gpus == 16
    assert resizer.measured_rate(8) == 2.0 and resizer.measured_rate(16) == 1.6
    assert resizer.bracket() == (0, 16)  # the peak is below 16
    back = resizer.decide(slower, _inputs(rollout_gpus=16, actor_gpus=16))  # the second cycle that says so
    assert back.actor_gpus == 8 and "8 GPU(s) measured best" in back.reason and back.predicted_gain == 0.25
    # from 8 the model asks for more again: only a split the run has not measured worse (below 16)
    for _ in range(5):
        d = resizer.decide(trainer_bound, _inputs())
        assert d.actor_gpus < 16
    # without the run's memory the same signals ask for 32 GPUs: the walk the bracket stops
    assert target_split(slower, _inputs(rollout_gpus=16, actor_gpus=16))[0] > 16


def test_a_target_beyond_the_best_measured_split_stops_there_first():
    resizer = TrainerResizer()
    resizer._measured = {20: [(300, 100.0)], 24: [(200, 100.0)]}  # 20 measured best, 24 worse: the peak is below 24
    starved = _signals(trainer_wait_s=80.0, rollout_capacity_rate=1.0)  # the model says: far fewer Actor GPUs
    assert target_split(starved, _inputs(rollout_gpus=8, actor_gpus=24))[0] < 20
    d = [resizer.decide(starved, _inputs(rollout_gpus=8, actor_gpus=24)) for _ in range(2)][-1]
    assert d.actor_gpus == 20 and "measured best on the way" in d.reason


def test_a_split_s_measured_rate_is_its_sequences_over_its_seconds_when_cycles_alternate():
    """Groups that arrive together make cycles alternate long and short at one split (200 sequences in 20 s, then
    in 380 s: 1.0 seq/s over the clock); another split runs even 160 s cycles (1.25 seq/s). A mean of per-cycle
    rates (10 and 0.53 -> 5.3) would rank the alternating split first and keep the job there."""
    resizer = TrainerResizer(cooldown=0, warmup=0)
    for cycle_s in (20.0, 380.0, 20.0, 380.0):
        resizer.decide(_signals(cycle_s=cycle_s), _inputs())
    for _ in range(4):
        resizer.decide(_signals(cycle_s=160.0), _inputs(rollout_gpus=16, actor_gpus=16))
    assert resizer.measured_rate(8) == 1.0 and resizer.measured_rate(16) == 1.25
    assert resizer.best_measured() == 16


def test_the_rollout_rate_a_move_plans_on_is_pooled_over_the_cycles_at_the_split():
    """Three cycles at 8 rollout / 24 Actor GPUs read 56.8, 7.5 and 121.5 seq/s of rollout (groups finishing
    together), the trainer 2048 sequences in 48.7 s each. Planned on the last cycle alone, 4 more Actor GPUs look
    +17% (4 rollout GPUs making half of 121.5); over the three cycles' working seconds the rollout makes ~60 seq/s
    on 8 GPUs, and 4 of them could not feed 28 Actor GPUs."""
    inputs = _inputs(rollout_gpus=8, actor_gpus=24, batch=2048, steps_left=80)
    cycles = [_signals(rollout_capacity_rate=r, cycle_s=c, rollout_kv_bound=0.0)
              for r, c in ((56.8, 79.0), (7.5, 54.1), (121.5, 48.7))]
    assert target_split(cycles[-1], inputs)[0] == 28  # the last cycle alone
    resizer = TrainerResizer(cooldown=0)
    for c in cycles:
        d = resizer.decide(c, inputs)
    pooled = resizer.pooled_signals(cycles[-1], 24)
    assert 55 < pooled.rollout_capacity_rate < 65 and pooled.cycle_s == 48.7  # the trainer's: the last cycle's
    assert d.actor_gpus < 28 and target_split(pooled, inputs)[0] < 28
    assert resizer.pooled_signals(cycles[-1], 16) is cycles[-1]  # nothing run at 16: the cycle as it came


def test_a_move_leaves_rollout_at_least_the_ranks_its_kv_held_at_once():
    """The simulator's ALFWorld from an even split (16/16 of 32 GPUs): the trainer took 77.8 s for 1024 sequences
    without waiting, the rollout made 46.4 seq/s and was never short of KV. Proportionally, 7 rollout GPUs make 20
    seq/s and 25 Actor GPUs look best; but its tasks held 8.2 ranks' worth of KV at once, and on 7 they paused and
    re-prefilled (it made 6 seq/s there). The target keeps 9 rollout GPUs; once the rollout waits for KV anyway,
    the proportional model stands."""
    cycle = _signals(cycle_s=77.8, trainer_wait_s=0.3, rollout_wait_s=33.7, rollout_capacity_rate=46.42,
                     rollout_utilization=1.0, rollout_kv_bound=0.0)
    even = _inputs(rollout_gpus=16, actor_gpus=16, batch=1024, steps_left=98)
    assert target_split(cycle, even)[0] == 25  # the peak not reported: the proportional model alone
    held = dataclasses.replace(cycle, rollout_kv_held_peak=8.2)
    assert not held.kv_fits(8) and held.kv_fits(9) and held.kv_fits(16)
    assert target_split(held, even)[0] == 23
    kv_bound = dataclasses.replace(held, rollout_kv_bound=0.6)
    assert kv_bound.kv_fits(1) and target_split(kv_bound, even)[0] == 25
    # a lumpy workload's quiet cycle does not lift the bound: the peak is pooled over the split's cycles as a max
    resizer = TrainerResizer(cooldown=0, warmup=0)
    for peak in (8.2, 3.0):
        resizer.decide(dataclasses.replace(held, rollout_kv_held_peak=peak), even)
    assert resizer.pooled_signals(dataclasses.replace(held, rollout_kv_held_peak=3.0), 16).rollout_kv_held_peak == 8.2


def test_an_evaluation_s_cycle_and_its_wake_are_neither_measured_nor_moved_on():
    """The boundary before an evaluation: its cycle counts, no move goes before the evaluation. The evaluation's
    own cycle and the next (the training groups it held back: the simulator's ALFWorld read 151 s where its
    split ran 56 s) are not measured and decide nothing; the cycle after them does both."""
    resizer = TrainerResizer(cooldown=0, warmup=0)
    steady = _signals(cycle_s=56.0, rollout_kv_bound=0.0, rollout_capacity_rate=2.0)
    at_8 = _inputs()
    before = resizer.decide(steady, at_8, eval_next=True)
    assert before.actor_gpus == 8 and "an evaluation follows" in before.reason
    assert [c for _, c in resizer._measured[8]] == [56.0]
    wake = _signals(cycle_s=151.0, trainer_wait_s=93.0, rollout_kv_bound=0.0, rollout_capacity_rate=0.5)
    for _ in range(2):
        d = resizer.decide(wake, at_8)
        assert d.actor_gpus == 8 and "evaluation or its wake" in d.reason
    assert [c for _, c in resizer._measured[8]] == [56.0] and len(resizer._cycles[8]) == 1
    resizer.decide(steady, at_8)
    assert [c for _, c in resizer._measured[8]] == [56.0, 56.0]


def test_the_cold_start_cycle_is_not_what_the_start_split_measures():
    """The run's first cycle holds the rollout starting from empty: a 300 s cycle where the split then runs 100 s
    ones. Counted, the start split (200 sequences a cycle: 1.2 seq/s over the three) would measure worse than a
    split reached by one move that runs 160 s cycles (1.25 seq/s), and the run would stay there."""
    resizer = TrainerResizer(cooldown=0)
    for cycle_s in (300.0, 100.0, 100.0):
        d = resizer.decide(_signals(cycle_s=cycle_s, rollout_kv_bound=0.0, rollout_capacity_rate=2.0), _inputs())
    assert resizer.measured_rate(8) == 2.0 and [c.cycle_s for c in resizer._cycles[8]] == [100.0, 100.0]
    for _ in range(2):
        resizer.decide(_signals(cycle_s=160.0, rollout_kv_bound=0.0, rollout_capacity_rate=2.0),
                       _inputs(rollout_gpus=16, actor_gpus=16))
    assert resizer.best_measured() == 8


def test_a_trainer_waiting_on_an_unsaturated_rollout_tries_a_quarter_of_its_gpus_there_once():
    """The model gives an unsaturated rollout nothing from more ranks; the trainer waited 60 of 100 s for it.
    ERS tries 12 of the Actor's 16 GPUs (two cycles that ask, as for any move), and the cycles measured there
    decide: measured worse, the run goes back to 16 and does not try 12 again."""
    waited = _signals(trainer_wait_s=60.0, rollout_capacity_rate=2.0, rollout_kv_bound=0.0)
    even = _inputs(rollout_gpus=16, actor_gpus=16)
    assert target_split(waited, even)[0] == 16  # the model alone stays
    to, gain, why = probe_split(waited, even)
    assert to == 12 and gain > 0.05 and "tried" in why
    assert probe_split(_signals(trainer_wait_s=10.0, rollout_capacity_rate=2.0, rollout_kv_bound=0.0), even) is None
    assert probe_split(waited, even, measured=frozenset({12, 16}))[0] == 11  # the next size nobody measured

    resizer = TrainerResizer(cooldown=0)
    assert resizer.decide(waited, even).actor_gpus == 16  # the first cycle that asks
    tried = resizer.decide(waited, even)
    assert tried.actor_gpus == 12 and "12 GPU(s) tried" in tried.reason
    worse = _signals(trainer_wait_s=60.0, rollout_capacity_rate=2.0, rollout_kv_bound=0.0, cycle_s=130.0)
    at_12 = _inputs(rollout_gpus=20, actor_gpus=12)
    back = [resizer.decide(worse, at_12) for _ in range(2)][-1]
    assert back.actor_gpus == 16 and "16 GPU(s) measured best" in back.reason
    for _ in range(4):  # 12 measured worse: below 16 the bracket is closed, no second try
        assert resizer.decide(waited, even).actor_gpus == 16


def test_a_trainer_that_never_waits_on_an_unsaturated_rollout_tries_a_quarter_of_the_rollout_gpus_once():
    """The simulator's WebShop at 22 Actor GPUs: the trainer waited 0.2 of 55 s, the rollout made 40 seq/s on 10
    GPUs with no work waiting for KV and its decode steps reading more weights than context. That rate is the
    trainer's pace, not the rollout's capacity, so the model (fewer ranks, proportionally less) stays; ERS tries
    two of the rollout's GPUs on the Actor, never below the KV the rollout's work held at once, and not where the
    rollout was saturated or the trainer waited. Measured worse there, the run goes back and does not try 24
    again; the next size up promises less than the 5% a move needs."""
    steady = _signals(cycle_s=55.0, trainer_wait_s=0.2, rollout_capacity_rate=40.0, rollout_kv_bound=0.0,
                      rollout_decode_context=90_000.0, rollout_kv_held_peak=3.0)
    at_22 = _inputs(rollout_gpus=10, actor_gpus=22, batch=2048, weight_kv_tokens=265_000.0, steps_left=90)
    assert target_split(steady, at_22)[0] == 22  # the model alone stays
    to, gain, why = probe_split(steady, at_22)
    assert to == 24 and abs(gain - 24 / 22 + 1) < 1e-9 and "the trainer bounds the cycle" in why
    assert probe_split(dataclasses.replace(steady, rollout_kv_held_peak=9.0), at_22)[0] == 23  # 8 would not hold it
    assert probe_split(dataclasses.replace(steady, rollout_kv_held_peak=9.5), at_22) is None
    assert probe_split(dataclasses.replace(steady, rollout_kv_bound=0.8), at_22) is None  # KV-bound: the model's
    assert probe_split(dataclasses.replace(steady, rollout_decode_context=300_000.0), at_22) is None  # decode-bound
    assert probe_split(dataclasses.replace(steady, trainer_wait_s=5.5), at_22) is None  # 10%: neither way
    one_left = dataclasses.replace(at_22, rollout_gpus=1, actor_gpus=2)  # never the rollout's last replica
    assert probe_split(dataclasses.replace(steady, rollout_kv_held_peak=None), one_left) is None
    assert probe_split(steady, dataclasses.replace(at_22, mini_batch=2016))[0] == 24  # 84 a GPU
    assert probe_split(steady, dataclasses.replace(at_22, mini_batch=2048)) is None  # neither 24 nor 23 splits it

    resizer = TrainerResizer(cooldown=0)
    assert resizer.decide(steady, at_22).actor_gpus == 22  # the first cycle that asks
    tried = resizer.decide(steady, at_22)
    assert tried.actor_gpus == 24 and "24 GPU(s) tried" in tried.reason
    worse = dataclasses.replace(steady, cycle_s=60.0)
    at_24 = dataclasses.replace(at_22, rollout_gpus=8, actor_gpus=24)
    back = [resizer.decide(worse, at_24) for _ in range(2)][-1]
    assert back.actor_gpus == 22 and "22 GPU(s) measured best" in back.reason
    for _ in range(4):  # 24 measured worse: the bracket is closed above it; 23 promises under 5%
        assert resizer.decide(steady, at_22).actor_gpus == 22


def test_the_simulator_resizes_a_rollout_heavy_start_toward_the_trainer_and_trains_faster():
    """The same decision through the boundary round: from 3 of 4 GPUs rolling out (6 of 8), ERS gives the Actor
    more (each resize logged with its stall), every sequence is accounted for, and the run is faster than without.
    8 GPUs: a run whose queue of ready micro-batches drains after a move (on 16 the trainer stays the bottleneck,
    the queue never drains, and the micro-batches keep the size they had)."""
    from verl_tide.sim.cluster import Simulation, SystemSpec
    from verl_tide.sim.workload import load_workload

    w = dataclasses.replace(load_workload("webshop"), steps=20)
    spec = SystemSpec("tide", rollout_ratio=0.75, routing="ctb", consume="ra2p", eval_blocks_trainer=False,
                      elastic=True)
    fixed = Simulation(w, 8, spec).run()
    sim = Simulation(w, 8, dataclasses.replace(spec, resize_trainer=True))
    sim.planner.trace = []
    resized = sim.run()
    assert sim.resizes and sim.resizes[0][2] > sim.resizes[0][1] == 2  # (step, from, to, stall, why)
    assert all(stall > 0 for *_, stall, _ in sim.resizes)
    assert resized.goodput_tok_s > 1.2 * fixed.goodput_tok_s
    # every step trained its batch (less what rounds to micro-batches), counted in the ledger; micro-batches are
    # sized again for the resized group once none of the old size waits
    assert resized.ledger["consumed_sequences"] == sim.consumed_sequences >= 0.99 * w.steps * sim.B
    assert len({r.micro_batches for r in sim.step_records}) > 1
    assert sim.ledger.check(sim.sequences_held()) is None  # the ledger balances across the resizes
    decided = [rec.decision["resize"] for rec in sim.planner.trace if "resize" in getattr(rec, "decision", {})]
    assert decided and any(reason.startswith("resize") for _, reason in decided)


def test_the_actor_takes_only_sizes_that_split_a_mini_batch():
    """verl splits each PPO mini-batch evenly over the Actor's GPUs."""
    trainer_bound = _signals(rollout_utilization=0.5, rollout_wait_s=50.0)
    assert target_split(trainer_bound, _inputs(mini_batch=40))[0] == 10  # 16 does not divide 40; 10 does


def test_trainer_resize_refuses_what_it_cannot_rebuild_naming_the_keys():
    import pytest

    from verl_tide.core.config import TideConfigError, parse_tide_config
    from verl_tide.ers.lending import resolve_lend_actor

    with pytest.raises(TideConfigError) as err:
        parse_tide_config({"ers": {"resize_trainer": True, "lend_actor": True}, "ra2p": {"ref_ranks": 1}})
    text = str(err.value)
    assert "tide.ers.resize_trainer = true with tide.ers.lend_actor = true" in text
    assert "tide.ra2p.ref_ranks" in text
    with pytest.raises(TideConfigError, match="resize_move_s.*>= 0"):
        parse_tide_config({"ers": {"resize_move_s": -1}})
    lend, why = resolve_lend_actor("auto", has_ref_model=False, hybrid_engine=True, resize_trainer=True)
    assert not lend and "tide.ers.resize_trainer" in why


def test_a_verl_job_with_a_critic_or_two_nodes_is_refused_for_a_resize_and_one_with_a_ref_model_is_not():
    """verl's Ref role is rebuilt with the Actor's processes; a critic shares them and is not, nor a second node."""
    from omegaconf import OmegaConf

    from verl_tide.job_config import resize_blockers

    def job(kl=False, critic=None, nodes=1):
        return OmegaConf.create({
            "actor_rollout_ref": {"actor": {"use_kl_loss": kl}, "rollout": {"nnodes": 1}},
            "algorithm": {"use_kl_in_reward": False, "adv_estimator": "grpo"}, "critic": {"enable": critic},
            "trainer": {"nnodes": nodes}})

    assert resize_blockers(job()) == [] and resize_blockers(job(kl=True)) == []
    problems = resize_blockers(job(kl=True, critic=True, nodes=2))
    assert len(problems) == 2 and all(p.startswith("tide.ers.resize_trainer = true with") for p in problems)
    assert "critic.enable" in problems[0] and "trainer.nnodes = 2" in problems[1]


def test_a_resize_scores_again_what_ref_scored_ahead_into_the_processes_it_stops():
    """With the hand-off, rows of samples scored ahead live in the Actor's processes: a rebuild loses them, so
    the samples count as unscored (the pass that trains them scores them again) and their ids are released; rows
    in TransferQueue (no hand-off) outlive the processes and stay scored. The rebuilt Actor gets tide's loss again."""
    from types import SimpleNamespace

    from verl_tide.ra2p.layout import RefLayout
    from verl_tide.trainer.ref_path import RefPath

    def path(handoff):
        p = RefPath.__new__(RefPath)
        RefPath.__init__(p, None, None, None, None, RefLayout(pool_wanted=False, handoff=handoff,
                                                              beside_verl_ref=False))
        p.sample_ids.assign(["a_0", "a_1", "b_0"])
        p.aggregator.record_burst(["a_0", "a_1"], ["b_0"])
        p.aggregator.trained(["a_0", "a_1"], ref_pass_ran=True)
        p.sample_ids.release(["a_0", "a_1"])
        return p

    kept = path(handoff=False)
    assert kept.before_actor_rebuild() == 0 and kept.aggregator.scored == {"b_0"}
    lost = path(handoff=True)
    assert lost.before_actor_rebuild() == 1
    assert lost.aggregator.scored == set() and lost.released_ids == [2] and len(lost.sample_ids) == 0
    _own, ahead = lost.aggregator.burst(["b_0"], [], 0)
    assert _own == ["b_0"] and ahead == []  # its mini-batch runs a Ref pass for it

    installed = []
    lost.service = object()
    lost._install_loss = lambda: installed.append(lost.actor_wg)
    new_actor, new_ref = SimpleNamespace(world_size=2), SimpleNamespace(world_size=2)
    lost.after_actor_rebuild(new_actor, new_ref, False)
    assert (lost.actor_wg, lost.ref_wg, installed) == (new_actor, new_ref, [new_actor])


def test_a_boundary_that_resizes_the_actor_group_moves_no_rank_to_ref():
    """One move a boundary: ERS's plan read the split before the resize, so its rank moves are cancelled (no
    cooldown charged) and only the resize is applied."""
    from types import SimpleNamespace

    from verl_tide.boundary.planner import BoundaryDecision
    from verl_tide.boundary.round import BoundaryRound, PlanOutcome, RoundContext
    from verl_tide.ers.policy import RankMove, Role, ScalingPlan
    from verl_tide.ers.resize import ResizeDecision
    from verl_tide.ra2p.cost import RA2PMode

    plan = ScalingPlan(5, (RankMove(3, Role.ROLLOUT, Role.REF),), RA2PMode.DECOUPLED, 200, False, "consumption")
    cancelled = []

    class Planner:
        ers = SimpleNamespace(cancel=cancelled.append)

        def __init__(self, resize_to: int):
            self.resize_to = resize_to

        def decide(self, *args):
            return BoundaryDecision(None, None, None, None, None, plan,
                                    resize=ResizeDecision(self.resize_to, 0.2, "resize"))

    class Port:
        def __init__(self):
            self.calls = []

        def signals(self, break_even):
            return None

        def move_ranks(self, moves):
            self.calls.append(("move_ranks", moves))
            return moves

        def resize_trainer(self, decision):
            self.calls.append(("resize_trainer", decision.actor_gpus))

        def report(self, result):
            self.calls.append(("report", result.plan_outcome))

    inputs = SimpleNamespace(resize=_inputs())  # the Actor on 8 GPUs
    port = Port()
    BoundaryRound(Planner(16)).run(inputs, RoundContext(), port)
    assert port.calls == [("resize_trainer", 16), ("report", PlanOutcome.CANCELLED_RESIZE)] and cancelled == [plan]
    port = Port()
    BoundaryRound(Planner(8)).run(inputs, RoundContext(), port)  # no resize: the plan's moves apply
    assert port.calls == [("move_ranks", plan.moves), ("report", PlanOutcome.APPLIED)]


def test_the_cold_start_moves_alone_where_every_rollout_rate_it_allows_moves_the_same_way():
    """The cold start rolls out the groups of 1 + max_staleness steps and its cycle counts the first step's: the
    rollout's rate there is up to that many times low. The simulator's WebShop from 4 rollout GPUs of 32 read 5.2
    seq/s (10.5 the next cycle) with the trainer idle 382 of 434 s: at either rate rollout bounds the cycle, so the
    smaller move goes after the first cycle. From 8 of 32 it read 17.9 seq/s against a trainer making 36.4: at twice
    the rate the two sides balance, and the move waits for the cycles that confirm it (there none did)."""
    starved = _signals(cycle_s=434.0, trainer_wait_s=382.0, rollout_capacity_rate=5.2, rollout_kv_bound=0.8)
    at_28 = _inputs(rollout_gpus=4, actor_gpus=28, batch=2048, steps_left=99, max_staleness=1)
    low, high = (target_split(dataclasses.replace(starved, rollout_capacity_rate=r), at_28)[0] for r in (5.2, 10.4))
    assert low < high < 28  # the higher rate asks for fewer rollout GPUs
    moved = TrainerResizer().decide(starved, at_28)
    assert moved.actor_gpus == high and moved.reason.startswith("resize") and "cold start" in moved.reason
    # without a staleness bound the cold start rolled out one step's groups: nothing to bound, the rule as usual
    assert TrainerResizer().decide(starved, dataclasses.replace(at_28, max_staleness=0)).reason.startswith("not yet")
    # an evaluation next: no move before it
    assert TrainerResizer().decide(starved, at_28, eval_next=True).actor_gpus == 28
    # only the run's first cycle is its cold start
    later = TrainerResizer()
    later.decide(_signals(cycle_s=100.0, rollout_kv_bound=0.0, rollout_capacity_rate=30.0), at_28)
    assert later.decide(starved, at_28).reason.startswith("not yet")

    balanced_at_twice = _signals(cycle_s=153.0, trainer_wait_s=96.0, rollout_capacity_rate=17.9, rollout_kv_bound=0.8)
    at_24 = _inputs(rollout_gpus=8, actor_gpus=24, batch=2048, steps_left=99, max_staleness=1)
    assert target_split(balanced_at_twice, at_24)[0] < 24  # the cold start's rate alone says: to rollout
    assert TrainerResizer().cold_start_move(balanced_at_twice, at_24) is None
    assert TrainerResizer().decide(balanced_at_twice, at_24).actor_gpus == 24

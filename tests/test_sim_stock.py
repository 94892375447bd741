"""Stock verl's own rules as the simulator's baselines run them (`sim/stock.py`) and verl V1's mini-batch trainer
(`ra2p.cost.mini_batch_cost`): each rule's threshold, adaptation and cost gate, read from verl 0.9.1."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_tide.ra2p.cost import StageTimes
from verl_tide.ra2p.stock_cost import global_batch_cost, mini_batch_cost
from verl_tide.sim.cluster import Simulation, SystemSpec
from verl_tide.sim.stock import FullyAsyncDefaultPolicy, SeparateAsyncSwitch, StepWaits, hybrid_switch
from verl_tide.sim.workload import load_workload


TINY = str(Path(__file__).parent / "data" / "sim_tiny.yaml")
T = StageTimes(1.0, 1.0, 1.0, 0.0)


def test_mini_batches_train_as_each_is_whole_and_the_sampler_sees_them_at_its_polls():
    # two mini-batches of two micro-batches: the second is ready before the first is trained, no wait
    assert mini_batch_cost([0, 0, 5, 5], T, 2) == 12
    waits: list[float] = []
    # ready at 7 while the trainer is free at 6: seen at the next 2 s look (8), not at 7
    assert mini_batch_cost([0, 0, 7, 7], T, 2, poll_s=2.0, waits=waits) == 14 and waits == [2.0]
    assert mini_batch_cost([0, 0, 7, 7], T, 2, poll_s=0.0) == 13  # fully_async's queue: no poll
    # one mini-batch per sync is verl's global batch: the same cost
    assert mini_batch_cost([0, 0, 0, 0], StageTimes(1, 1, 1, 0.5), 4) == global_batch_cost([0] * 4,
                                                                                          StageTimes(1, 1, 1, 0.5))
    with pytest.raises(ValueError, match="per_mini_batch = 0"):
        mini_batch_cost([0], T, 0)


def test_separate_async_switch_follows_verls_threshold_adaptation_and_cost_gate():
    sw = SeparateAsyncSwitch(batch=64, parameter_sync_step=4, total_gpus=8, rollout_gpus=4)
    assert sw.threshold() == round(0.4 * 64)  # switch_threshold_ratio 0.4, floored at one mini-batch (16)
    idle = StepWaits(seconds=5.0, sequences=16)  # waited longer than the 2 s poll
    sw.step_ended(idle, ready_next=0, switch_cost_s=None)
    assert sw.ratio == pytest.approx(0.4)  # release_steps 2: one idle step does not move it
    sw.step_ended(idle, ready_next=0, switch_cost_s=None)
    assert sw.ratio == pytest.approx(0.45)
    calm = StepWaits(0.0, 0)
    for _ in range(30):
        sw.step_ended(calm, ready_next=64, switch_cost_s=None)
    assert sw.ratio == pytest.approx(0.25)  # stepped down by 0.03 a calm step, floored at 1 / parameter_sync_step
    # the gate: remaining x per-sample time x (1 - 1/scaling) against the measured switch
    fresh = SeparateAsyncSwitch(batch=64, parameter_sync_step=4, total_gpus=8, rollout_gpus=4, adaptive=False)
    assert fresh.step_ended(StepWaits(32.0, 32), ready_next=0, switch_cost_s=None)  # nothing measured: lend
    # 1 s a sample: 25.6 remaining x 1 x 0.5 = 12.8 s of benefit
    assert fresh.step_ended(StepWaits(0.0, 0), ready_next=0, switch_cost_s=12.0)
    assert not fresh.step_ended(StepWaits(0.0, 0), ready_next=0, switch_cost_s=13.0)
    assert not fresh.step_ended(StepWaits(0.0, 0), ready_next=64, switch_cost_s=None)  # enough ready: no lend


def test_fully_async_default_policy_follows_verls_ratio_and_benefit_rules():
    p = FullyAsyncDefaultPolicy(batch=100)
    assert p.threshold() == 30  # deactivate_ratio 0.3
    # before any measured wait, the pessimistic 1000 s a sample makes any gap worth the default 10 s switch
    assert p.step_ended(StepWaits(0.0, 0), ready_next=0, switch_cost_s=None)
    assert p.ratio == pytest.approx(0.28)  # no wait: -0.02
    p.step_ended(StepWaits(50.0, 50), ready_next=100, switch_cost_s=None)  # waited for half the batch
    assert p.ratio == pytest.approx(0.38)  # + clip(50/100, 0.02, 0.1)
    p.step_ended(StepWaits(1.0, 1), ready_next=100, switch_cost_s=None)
    assert p.ratio == pytest.approx(0.40)  # + the 0.02 floor
    # 1 s / sample measured now: a gap of 42 samples pays 42 s, more than the default 10 s switch
    assert p.step_ended(StepWaits(1.0, 1), ready_next=0, switch_cost_s=None)
    # the cycle's own switching (activate + deactivate) is kept after its decision, as verl's update_after_step
    p.cycle_switched(50.0)
    assert not p.step_ended(StepWaits(1.0, 1), ready_next=0, switch_cost_s=None)  # 44 s against 50 s
    assert not p.step_ended(StepWaits(1.0, 1), ready_next=0, switch_cost_s=0.1)  # a round trip passed is not read
    p.cycle_switched(0.0)  # a cycle that did not switch is not kept
    p.cycle_switched(1.0)
    p.cycle_switched(1.0)  # the mean of the last three: 17.3 s
    assert p.step_ended(StepWaits(1.0, 1), ready_next=0, switch_cost_s=None)  # 48 s against it
    with pytest.raises(ValueError, match="hybrid_switch = 'nope'"):
        hybrid_switch("nope", 10, 1, 2, 1, 0.0)


@pytest.mark.parametrize("rule", ["separate_async", "fully_async_default"])
def test_verls_rule_takes_the_replicas_back_at_its_threshold_and_lends_them_after_syncs(rule):
    w = load_workload(TINY)
    spec = SystemSpec(rule, rollout_ratio=0.25, consume="mini_batch", poll_s=2.0 if rule == "separate_async" else 0.0,
                      partial_rollout=True, hybrid=True, hybrid_switch=rule)
    sim = Simulation(w, 4, spec, seed=3)
    starts: list[tuple[int, int]] = []
    hybrid_set = sim.hybrid.set

    def switch(s, wake: bool, switch_s=None) -> None:  # the replicas taken back: what was ready, what the rule asked
        if not wake:
            starts.append((len(sim.rollout.micro_batches) * sim.mb_size, sim.hybrid.switch.threshold()))
        hybrid_set(s, wake, switch_s)

    sim.hybrid.set = switch
    r = sim.run()
    assert len(r.steps) == w.steps and all(s["mode"] == "mini_batch" for s in r.steps)
    assert starts, "the replicas were never lent into a step"
    for ready, threshold in starts:  # taken back only once the rule's share of the batch was ready
        assert ready >= min(threshold, sim.B) - sim.mb_size + 1
    if rule == "separate_async":  # nothing measured of the switch yet: verl lends whenever the threshold is short
        assert sim.hybrid.round_trips >= 1
    else:  # the trainer waited (the ratio rose) but a few cheap samples never pay the default 10 s switch
        assert sim.hybrid.switch.ratio > 0.3 and sim.hybrid.round_trips == 0

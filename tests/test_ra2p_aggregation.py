"""RA2P's ready-batch aggregation (pure policy) and trainer `tide`'s use of it, without a running job
(the e2e tests run it through verl's trainer and tide's Ref replicas)."""

from __future__ import annotations

import pytest

from verl_tide.ra2p.aggregation import RefAggregator, trim_to_multiple, window_groups_left


def _group(uid, n=2):
    return uid, [f"{uid}_{i}" for i in range(n)]


def test_a_burst_scores_the_mini_batch_then_ready_groups_in_sampling_order_up_to_the_cap():
    agg = RefAggregator()
    own, ahead = agg.burst(["a_0", "a_1"], [_group("b"), _group("c"), _group("d")], max_groups=2)
    assert own == ["a_0", "a_1"] and ahead == ["b_0", "b_1", "c_0", "c_1"]
    agg.record_burst(own, ahead)
    agg.trained(["a_0", "a_1"], ref_pass_ran=True)
    # The next mini-batch (b, c) was scored ahead: no Ref pass at all.
    assert agg.burst(["b_0", "b_1", "c_0", "c_1"], [_group("d")], max_groups=2) == ([], [])
    agg.trained(["b_0", "b_1", "c_0", "c_1"], ref_pass_ran=False)
    assert agg.scored == set()
    assert agg.counters.as_dict() == {"bursts": 1, "samples_scored": 6, "samples_ahead": 4,
                                      "batches_without_ref_pass": 1}


def test_only_unscored_samples_are_scored_and_partly_scored_groups_are_finished():
    agg = RefAggregator()
    agg.record_burst(["a_0"], ["b_0"])  # b_1 arrived after that burst
    own, ahead = agg.burst(["a_0", "a_1"], [_group("b"), _group("c")], max_groups=None)
    assert own == ["a_1"] and ahead == ["b_1", "c_0", "c_1"]
    assert agg.any_scored(["x", "b_0"]) and not agg.any_scored(["x", "c_0"])


def test_zero_cap_is_verls_order_and_evicted_samples_are_forgotten():
    agg = RefAggregator()
    assert agg.burst(["a_0"], [_group("b")], max_groups=0) == (["a_0"], [])
    agg.record_burst(["a_0"], ["b_0", "b_1"])
    agg.forget(["b_0", "b_1"])  # b went stale before it was trained
    assert agg.scored == {"a_0"}
    with pytest.raises(ValueError, match="max_groups = -1"):
        agg.burst(["a_0"], [], max_groups=-1)


def test_state_round_trips_for_checkpoints():
    agg = RefAggregator()
    agg.record_burst(["a_0"], ["b_0"])
    again = RefAggregator()
    again.load_state_dict(agg.state_dict())
    assert again.scored == {"a_0", "b_0"} and again.counters == agg.counters


@pytest.mark.parametrize("ahead,multiple,base,kept", [(5, 4, 4, 4), (3, 4, 4, 0), (7, 2, 3, 7), (1, 1, 0, 1), (6, 3, 2, 4),
                                                      (0, 4, 4, 0)])
def test_trim_to_multiple(ahead, multiple, base, kept):
    keys = [str(i) for i in range(ahead)]
    out = trim_to_multiple(keys, multiple, base)
    assert out == keys[:kept]
    assert (base + len(out)) % multiple == 0


def test_window_groups_left():
    assert window_groups_left(parameter_sync_step=4, local_trigger_step=0, groups_per_mini_batch=2) == 6
    assert window_groups_left(parameter_sync_step=4, local_trigger_step=3, groups_per_mini_batch=2) == 0
    assert window_groups_left(parameter_sync_step=1, local_trigger_step=0, groups_per_mini_batch=8) == 0


# ---- trainer `tide`: the colocated path and the per-step mode --------------------------------

class _Buffer:
    """Stands in for TideReplayBuffer.ready_groups (run against TransferQueue in the e2e tests)."""

    def __init__(self, groups):
        self.groups = groups
        self.calls = []

    def ready_groups(self, global_steps, limit, exclude=frozenset()):
        self.calls.append((limit, set(exclude)))
        return [(u, t) for u, t in self.groups if u not in exclude][:limit]


class _Pool:
    def __init__(self, replicas=1):
        self.passes = []
        self.replicas = [object()] * replicas

    def compute(self, keys, partition_id, temperature):
        self.passes.append(list(keys))
        return {"tokens": 10.0 * len(keys), "seconds": 0.1, "replicas": 1.0}


def _trainer(mode="auto", max_aggregate=None, ref_service=None, chosen=None):
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from verl_tide.config import parse_tide_config
    from verl_tide.ra2p.cost import StageTimer
    from verl_tide.trainer import TideTrainer

    t = TideTrainer.__new__(TideTrainer)
    t.tide_config = parse_tide_config({"ra2p": {"mode": mode, "max_aggregate": max_aggregate}})
    t.config = OmegaConf.create({"data": {"train_batch_size": 4},
                                 "actor_rollout_ref": {"rollout": {"temperature": 1.0}}})
    t.parameter_sync_step, t.local_trigger_step, t.global_steps = 2, 0, 1
    t.ref_aggregator = RefAggregator()
    t.ref_pool, t.ref_service, t.ra2p_mode = _Pool(), ref_service, chosen
    t._ref_pool_wanted = True
    t._ref_in_flight = None
    t.stage_timer = StageTimer()
    t.replay_buffer = _Buffer([(u, {f"{u}_0": {"seq_len": 5}, f"{u}_1": {"seq_len": 5}}) for u in "cdef"])
    return t, SimpleNamespace


def _batch(ns, uids):
    keys = [f"{u}_{i}" for u in uids for i in range(2)]
    return ns(keys=keys, tags=[{"seq_len": 5}] * len(keys), partition_id="train")


def test_colocated_steps_score_the_rest_of_the_window_in_the_first_ref_pass():
    t, ns = _trainer(mode="colocated")
    metrics = {}
    t._compute_ref_log_prob(_batch(ns, "ab"), metrics)
    # 4 groups per step, 2 per mini-batch: the first pass also scores the 2 groups the second mini-batch takes
    assert t.replay_buffer.calls == [(2, {"a", "b"})]
    assert t.ref_pool.passes == [["a_0", "a_1", "b_0", "b_1", "c_0", "c_1", "d_0", "d_1"]]
    assert metrics["tide/ra2p/ref_pass_samples_ahead"] == 4.0
    t.local_trigger_step = 1
    t._compute_ref_log_prob(_batch(ns, "cd"), metrics)
    assert len(t.ref_pool.passes) == 1  # the second mini-batch needed no Ref pass
    assert t.ref_aggregator.counters.batches_without_ref_pass == 1 and metrics["tide/ra2p/ref_pass_samples"] == 0
    assert t.ref_aggregator.scored == set()


def test_max_aggregate_zero_gives_a_ref_pass_per_mini_batch():
    t, ns = _trainer(mode="colocated", max_aggregate=0)
    t._compute_ref_log_prob(_batch(ns, "ab"), {})
    t.local_trigger_step = 1
    t._compute_ref_log_prob(_batch(ns, "cd"), {})
    assert t.ref_pool.passes == [["a_0", "a_1", "b_0", "b_1"], ["c_0", "c_1", "d_0", "d_1"]]
    assert t.replay_buffer.calls == []


def test_the_step_mode_follows_the_cost_models_choice_and_a_scored_batch_never_runs_deferred(monkeypatch):
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from verl_tide.ra2p.cost import RA2PMode

    monkeypatch.setattr(PPOTrainerSeparateAsync, "_compute_old_log_prob", lambda self, b, m: b)  # unit only
    t, ns = _trainer(mode="auto", ref_service=object(), chosen=None)
    started = []
    t._start_deferred_ref = lambda batch: started.append(list(batch.keys))
    assert t._step_ra2p_mode() is RA2PMode.DECOUPLED  # before the first measurement
    t.ra2p_mode = RA2PMode.COLOCATED  # the cost model's choice at the last step boundary
    assert t._step_ra2p_mode() is RA2PMode.COLOCATED
    t._compute_old_log_prob(_batch(ns, "ab"), {})
    t._compute_ref_log_prob(_batch(ns, "ab"), {})  # scores c, d ahead
    assert started == []
    t.ra2p_mode = RA2PMode.DECOUPLED  # the next step switches back
    m = {}
    t._compute_old_log_prob(_batch(ns, "cd"), m)  # c, d already carry ref log-probs: finishes colocated
    assert started == [] and m["tide/ra2p/step_mode_decoupled"] == 0.0
    t._compute_ref_log_prob(_batch(ns, "cd"), {})
    t._compute_old_log_prob(_batch(ns, "ef"), m)
    assert started == [["e_0", "e_1", "f_0", "f_1"]] and m["tide/ra2p/step_mode_decoupled"] == 1.0


def test_without_the_deferred_loss_every_step_is_colocated():
    from verl_tide.ra2p.cost import RA2PMode

    t, _ = _trainer(mode="decoupled", ref_service=None)
    assert t._step_ra2p_mode() is RA2PMode.COLOCATED
    t.ref_service = object()
    assert t._step_ra2p_mode() is RA2PMode.DECOUPLED


def test_with_verls_own_ref_a_burst_is_one_ref_worker_group_pass_of_whole_ranks(monkeypatch):
    """verl's Ref on the trainer's GPUs (no tide Ref replicas): the burst is handed to verl's own
    `_compute_ref_log_prob` as one batch, a multiple of the Ref worker group's size."""
    from types import SimpleNamespace

    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    passes = []
    monkeypatch.setattr(PPOTrainerSeparateAsync, "_compute_ref_log_prob",
                        lambda self, batch, metrics: passes.append((list(batch.keys), list(batch.tags))) or batch)
    t, ns = _trainer(mode="auto", max_aggregate=3)
    t.ref_pool = None
    t.ref_in_actor = False
    t.ref_policy_wg = SimpleNamespace(world_size=4)
    t.replay_buffer.groups[0][1]["c_0"] = {"seq_len": 9}
    t._compute_ref_log_prob(_batch(ns, "ab"), {})
    (keys, tags), = passes
    assert keys == ["a_0", "a_1", "b_0", "b_1", "c_0", "c_1", "d_0", "d_1"]  # 3 groups ahead trimmed to 2: 8 = 2x4
    assert tags[4] == {"seq_len": 9}
    assert t.ref_aggregator.scored == {"c_0", "c_1", "d_0", "d_1"}


def test_verls_ref_beside_an_empty_elastic_pool_runs_colocated_until_a_rank_is_lent(monkeypatch):
    """tide.ers.max_ref_ranks >= 1 with verl's Ref: the pool starts empty, so steps run colocated on verl's Ref
    worker group (aggregated, timed for the cost model); once ERS lends a rank, the pool scores and a decoupled
    step can run."""
    from types import SimpleNamespace

    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from verl_tide.ra2p.cost import RA2PMode

    verl_passes = []
    monkeypatch.setattr(PPOTrainerSeparateAsync, "_compute_ref_log_prob",
                        lambda self, batch, metrics: verl_passes.append(list(batch.keys)) or batch)
    t, ns = _trainer(mode="auto", ref_service=object(), chosen=RA2PMode.DECOUPLED)
    t.ref_pool = _Pool(replicas=0)
    t._ref_pool_wanted = False
    t.ref_in_actor = False
    t.ref_policy_wg = SimpleNamespace(world_size=1)
    assert t._step_ra2p_mode() is RA2PMode.COLOCATED  # decoupled was chosen, but no Ref replica is up
    t._compute_ref_log_prob(_batch(ns, "ab"), {})
    assert verl_passes == [["a_0", "a_1", "b_0", "b_1", "c_0", "c_1", "d_0", "d_1"]] and t.ref_pool.passes == []
    assert t.stage_timer._rate["ref"] > 0  # measured on verl's pass: 40 tokens
    t.ref_pool.replicas.append(object())  # ERS lent a rollout rank to Ref
    assert t._step_ra2p_mode() is RA2PMode.DECOUPLED
    t.local_trigger_step = 1
    t._compute_ref_log_prob(_batch(ns, "ef"), {})
    assert t.ref_pool.passes == [["e_0", "e_1", "f_0", "f_1"]] and len(verl_passes) == 1

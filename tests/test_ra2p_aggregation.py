"""RA2P's ready-batch aggregation (pure policy) and trainer `tide`'s use of it, without a running job
(the e2e tests run it through verl's trainer and tide's Ref replicas)."""

from __future__ import annotations

import pytest

from verl_tide.ra2p.aggregation import RefAggregator, rank_aligned_order, trim_to_multiple, window_groups_left
from verl_tide.ra2p.handoff import SampleIds


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


def test_rank_aligned_order_gives_each_ref_rank_the_share_its_actor_rank_trains():
    own = ["o0", "o1", "o2", "o3"]  # the Actor's rank 0 trains o0, o1; rank 1 trains o2, o3 (even contiguous shares)
    ahead = ["a0", "a1", "a2", "a3", "a4", "a5"]
    order = rank_aligned_order(own, ahead, 2)
    assert sorted(order) == sorted(own + ahead)
    share = len(order) // 2
    assert order[:share] == ["o0", "o1", "a0", "a1", "a2"]  # Ref rank 0: what Actor rank 0 trains, and ahead
    assert order[share:] == ["o2", "o3", "a3", "a4", "a5"]
    assert rank_aligned_order(own, ahead, 1) == own + ahead
    assert rank_aligned_order(own, ["a0"], 2) == own + ["a0"]  # an uneven pass: verl's order
    with pytest.raises(ValueError, match="ranks"):
        rank_aligned_order(own, ahead, 0)


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
        self.passes, self.handed = [], []
        self.replicas = [object()] * replicas

    def start(self, keys, partition_id, temperature, sample_ids=None, service_name=None):
        self.passes.append(list(keys))
        self.handed.append((sample_ids, service_name))
        return [{"tokens": 10.0 * len(keys), "seconds": 0.1}]

    @staticmethod
    def finish(pending):
        return {**pending[0], "replicas": 1.0}


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
    t._window_mini_batches = 2
    t.ref_aggregator = RefAggregator()
    t.ref_pool, t.ref_service, t.ra2p_mode = _Pool(), ref_service, chosen
    t._ref_pool_wanted = True
    t._ref_in_flight = None
    t._handoff, t.sample_ids, t._released_ids, t._handoff_counters = False, SampleIds(), [], {}
    t._inputs_handoff = False
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


def _handoff_trainer(monkeypatch, **kwargs):
    t, ns = _trainer(**kwargs)
    t._handoff, t._ref_service_name = True, "svc"
    written = []

    def put_ids(keys, partition_id):  # unit only: TransferQueue is not running here
        ids = t.sample_ids.assign(keys)
        written.append(dict(zip(keys, ids)))
        return ids

    monkeypatch.setattr(t, "_put_sample_ids", put_ids)
    return t, ns, written


def test_with_the_handoff_a_colocated_pass_on_ref_replicas_sends_rows_by_sample_id(monkeypatch):
    """tide.ra2p.zero_copy: the burst's rows go to the Ref service under fresh sample ids (written to the
    samples' data), not to TransferQueue; a sample scored ahead keeps its id until its mini-batch trains."""
    t, ns, written = _handoff_trainer(monkeypatch, mode="colocated")
    t._compute_ref_log_prob(_batch(ns, "ab"), {})
    (ids, service), = t.ref_pool.handed
    assert service == "svc" and ids == list(range(8))
    assert written == [{k: i for i, k in enumerate(["a_0", "a_1", "b_0", "b_1", "c_0", "c_1", "d_0", "d_1"])}]
    assert t.sample_ids.release(["c_1", "zz"]) == [5]  # ahead, not trained yet: still known


def test_with_the_handoff_verls_ref_worker_group_runs_the_handoff_pass_with_the_service_name(monkeypatch):
    from types import SimpleNamespace

    from verl_tide.ra2p.handoff_worker import SERVICE_KEY

    calls = []
    t, ns, written = _handoff_trainer(monkeypatch, mode="auto", max_aggregate=1)
    t.ref_pool = None
    t.ref_in_actor = False
    t.ref_policy_wg = SimpleNamespace(world_size=2, compute_ref_log_prob_handoff=calls.append)
    t._compute_ref_log_prob(_batch(ns, "ab"), {})
    (meta,), = [calls]
    assert list(meta.keys) == ["a_0", "a_1", "b_0", "b_1", "c_0", "c_1"]
    assert meta.extra_info[SERVICE_KEY] == "svc" and meta.extra_info["compute_loss"] is False
    assert meta.extra_info["temperature"] == 1.0
    assert list(written[0]) == list(meta.keys)


def test_with_the_inputs_handoff_each_ref_rank_scores_the_share_its_actor_rank_trains(monkeypatch):
    """verl's Ref and Actor roles in the same processes, the same data-parallel layout: the pass is ordered so
    that Ref rank r's share holds the mini-batch samples Actor rank r trains (their rows and inputs stay
    there); with another layout, verl's order."""
    from types import SimpleNamespace

    calls = []
    t, ns, written = _handoff_trainer(monkeypatch, mode="auto", max_aggregate=2)
    t.ref_pool = None
    t.ref_in_actor = False
    t._inputs_handoff = True
    t.ref_policy_wg = SimpleNamespace(world_size=2, compute_ref_log_prob_handoff=calls.append,
                                      _dispatch_info={"ref": [0, 1]})
    t.actor_rollout_wg = SimpleNamespace(_dispatch_info={"actor": [0, 1]})
    t._compute_ref_log_prob(_batch(ns, "ab"), {})
    assert list(calls[0].keys) == ["a_0", "a_1", "c_0", "c_1", "b_0", "b_1", "d_0", "d_1"]
    assert list(written[0]) == list(calls[0].keys)
    t.local_trigger_step = 1
    t.actor_rollout_wg._dispatch_info["actor"] = [1, 0]  # another layout: nothing to align with
    t.ref_aggregator = RefAggregator()
    t._compute_ref_log_prob(_batch(ns, "ab"), {})
    assert list(calls[1].keys)[:4] == ["a_0", "a_1", "b_0", "b_1"]


def test_after_an_update_the_trained_and_evicted_samples_rows_are_discarded(monkeypatch):
    """Rows leave the service and every Ref rank's process once their samples trained or verl evicted them."""
    from types import SimpleNamespace

    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    monkeypatch.setattr(PPOTrainerSeparateAsync, "_update_actor", lambda self, b, m: b)  # unit only
    t, ns, _ = _handoff_trainer(monkeypatch, mode="colocated")
    discarded = []

    class _Remote:
        def __init__(self, fn):
            self.remote = fn

    t.ref_service = SimpleNamespace(discard=_Remote(lambda ids: discarded.append(list(ids))),
                                    stats=_Remote(lambda: {"put": 8, "served": 2, "held": 0}),
                                    take_kl=_Remote(lambda: 0.25))
    ranks_told = []
    t.ref_policy_wg = SimpleNamespace(discard_ref_handoff=lambda ids: ranks_told.append(list(ids)) or [
        {"put": 4, "served_in_process": 3, "held": 1}, {"put": 4, "served_in_process": 3, "held": 0}])
    monkeypatch.setattr("ray.get", lambda x: x)
    t._compute_ref_log_prob(_batch(ns, "ab"), {})  # ids 0-3 own, 4-7 ahead (c, d)
    t._forget_scored(["d_0", "d_1"])  # verl evicts group d before it trains
    metrics = {}
    t._update_actor(_batch(ns, "ab"), metrics)
    assert discarded == [[0, 1, 2, 3, 6, 7]] and ranks_told == discarded
    counters = t._handoff_counters  # logged at the step boundary: verl averages a step's mini-batch metrics
    assert counters["tide/ra2p/handoff_served_in_process"] == 6.0 and counters["tide/ra2p/handoff_held"] == 1.0
    assert counters["tide/ra2p/handoff_ids_live"] == 2.0  # c_0, c_1: scored ahead, not trained yet
    assert metrics["actor/kl_loss"] == 0.25 and counters["tide/ra2p/ref_service_served"] == 2.0
    assert t.ref_aggregator.scored == {"c_0", "c_1"}


def test_sample_ids_are_fresh_per_pass_and_released_once():
    ids = SampleIds()
    assert ids.assign(["a", "b"]) == [0, 1]
    assert ids.assign(["b", "c"]) == [2, 3]  # scored again: a new id (its old row is never asked for)
    assert ids.release(["b", "x"]) == [2, 1]  # b's row, and b's replaced row (it would be held forever)
    assert ids.release(["b"]) == []
    assert len(ids) == 2


def test_the_process_handoff_refuses_rows_without_ids():
    import torch

    from verl_tide.ra2p.handoff import ProcessHandoff

    store = ProcessHandoff()
    with pytest.raises(ValueError, match="2 sample ids for 1 ref log-prob rows"):
        store.put_rows([1, 2], [torch.zeros(3)])
    store.put_rows([1], [torch.ones(3)])
    assert list(store.present([1, 5])) == [1] and store.stats() == {"put": 1, "served_in_process": 1, "held": 1}

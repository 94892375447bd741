"""RA2P's ready-batch aggregation (pure policy) and trainer `tide`'s use of it, without a running job
(the e2e tests run it through verl's trainer and tide's Ref replicas)."""

from __future__ import annotations

import dataclasses

import pytest

from verl_tide.ra2p.aggregation import (RefAggregator, rank_aligned_order, split_ref_pass, trim_to_multiple,
                                        window_groups_left)
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

    def start(self, keys, partition_id, temperature, sample_ids=None, service_name=None, zero_copy=True):
        self.passes.append(list(keys))
        self.handed.append((sample_ids, service_name))
        return [{"tokens": 10.0 * len(keys), "seconds": 0.1}]

    @staticmethod
    def finish(pending):
        return {**pending[0], "replicas": 1.0}


def _path(mode="auto", max_aggregate=None, ref_service=None, chosen=None):
    """trainer `tide`'s Ref path (trainer/ref_path.py) with stand-ins for the Ref pool and the replay buffer."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from verl_tide.core.config import parse_tide_config
    from verl_tide.boundary.planner import BoundaryPlanner
    from verl_tide.ra2p.cost import StageTimer
    from verl_tide.ra2p.layout import RefLayout
    from verl_tide.trainer.ref_path import RefPath

    tide = parse_tide_config({"ra2p": {"mode": mode, "max_aggregate": max_aggregate}})
    config = OmegaConf.create({"data": {"train_batch_size": 4}, "algorithm": {},
                               "actor_rollout_ref": {"rollout": {"temperature": 1.0}, "actor": {}}})
    planner = BoundaryPlanner.build(tide.ra2p, tide.ers, ideal_batch=8)
    planner.mode = chosen
    p = RefPath(config, tide, StageTimer(), planner, RefLayout(pool_wanted=True, beside_verl_ref=False))
    p.pool, p.service = _Pool(), ref_service
    p.actor_wg = SimpleNamespace(world_size=1)
    buffer = _Buffer([(u, {f"{u}_0": {"seq_len": 5}, f"{u}_1": {"seq_len": 5}}) for u in "cdef"])
    return p, buffer, SimpleNamespace


def _score(p, buffer, batch, metrics, trigger=0, verl_ref_pass=None):
    """What trainer `tide`'s `_compute_ref_log_prob` does: 2 mini-batches of 2 groups a step."""
    limit = p.aggregate_limit(2, trigger, 2)
    p.score(batch, metrics, buffer, 1, limit, verl_ref_pass or (lambda b, m: b))


def _batch(ns, uids):
    keys = [f"{u}_{i}" for u in uids for i in range(2)]
    return ns(keys=keys, tags=[{"seq_len": 5}] * len(keys), partition_id="train")


def test_colocated_steps_score_the_rest_of_the_window_in_the_first_ref_pass():
    p, buffer, ns = _path(mode="colocated")
    metrics = {}
    _score(p, buffer, _batch(ns, "ab"), metrics)
    # 4 groups per step, 2 per mini-batch: the first pass also scores the 2 groups the second mini-batch takes
    assert buffer.calls == [(2, {"a", "b"})]
    assert p.pool.passes == [["a_0", "a_1", "b_0", "b_1", "c_0", "c_1", "d_0", "d_1"]]
    assert metrics["tide/ra2p/ref_pass_samples_ahead"] == 4.0
    _score(p, buffer, _batch(ns, "cd"), metrics, trigger=1)
    assert len(p.pool.passes) == 1  # the second mini-batch needed no Ref pass
    assert p.aggregator.counters.batches_without_ref_pass == 1 and metrics["tide/ra2p/ref_pass_samples"] == 0
    assert p.aggregator.scored == set()


def test_max_aggregate_zero_gives_a_ref_pass_per_mini_batch():
    p, buffer, ns = _path(mode="colocated", max_aggregate=0)
    _score(p, buffer, _batch(ns, "ab"), {})
    _score(p, buffer, _batch(ns, "cd"), {}, trigger=1)
    assert p.pool.passes == [["a_0", "a_1", "b_0", "b_1"], ["c_0", "c_1", "d_0", "d_1"]]
    assert buffer.calls == []


def _no_transfer_queue(p):
    """Unit only: TransferQueue is not running here; sample ids are assigned and recorded."""
    written = []

    def put_ids(keys, partition_id):
        ids = p.sample_ids.assign(keys)
        written.append(dict(zip(keys, ids)))
        return ids

    p._put_sample_ids = put_ids
    return written


def test_the_step_mode_follows_the_cost_models_choice_and_a_scored_batch_never_runs_deferred():
    from verl_tide.ra2p.cost import RA2PMode

    p, buffer, ns = _path(mode="auto", ref_service=object(), chosen=None)
    _no_transfer_queue(p)
    assert p.step_mode() is RA2PMode.DECOUPLED  # before the first measurement
    p.planner.mode = RA2PMode.COLOCATED  # the planner's choice at the last step boundary
    assert p.step_mode() is RA2PMode.COLOCATED
    p.before_old_log_prob(_batch(ns, "ab"), {})
    _score(p, buffer, _batch(ns, "ab"), {})  # scores c, d ahead
    assert p.in_flight is None and len(p.pool.passes) == 1
    p.planner.mode = RA2PMode.DECOUPLED  # the next step switches back
    m = {}
    p.before_old_log_prob(_batch(ns, "cd"), m)  # c, d already carry ref log-probs: finishes colocated
    assert p.in_flight is None and m["tide/ra2p/step_mode_decoupled"] == 0.0
    _score(p, buffer, _batch(ns, "cd"), {}, trigger=1)
    p.before_old_log_prob(_batch(ns, "ef"), m)
    assert p.pool.passes[-1] == ["e_0", "e_1", "f_0", "f_1"] and m["tide/ra2p/step_mode_decoupled"] == 1.0
    assert p.in_flight is not None  # the Actor's backward picks them up; no colocated pass for e, f
    _score(p, buffer, _batch(ns, "ef"), {})
    assert len(p.pool.passes) == 2


def test_without_the_deferred_loss_every_step_is_colocated():
    from verl_tide.ra2p.cost import RA2PMode

    p, _, _ = _path(mode="decoupled", ref_service=None)
    assert p.step_mode() is RA2PMode.COLOCATED
    p.service = object()
    assert p.step_mode() is RA2PMode.DECOUPLED


def test_with_verls_own_ref_a_burst_is_one_ref_worker_group_pass_of_whole_ranks():
    """verl's Ref on the trainer's GPUs (no tide Ref replicas): the burst is handed to verl's own
    `_compute_ref_log_prob` as one batch, a multiple of the Ref worker group's size."""
    from types import SimpleNamespace

    passes = []
    p, buffer, ns = _path(mode="auto", max_aggregate=3)
    p.pool = None
    p.ref_wg = SimpleNamespace(world_size=4)
    buffer.groups[0][1]["c_0"] = {"seq_len": 9}
    _score(p, buffer, _batch(ns, "ab"), {},
           verl_ref_pass=lambda batch, metrics: passes.append((list(batch.keys), list(batch.tags))) or batch)
    (keys, tags), = passes
    assert keys == ["a_0", "a_1", "b_0", "b_1", "c_0", "c_1", "d_0", "d_1"]  # 3 groups ahead trimmed to 2: 8 = 2x4
    assert tags[4] == {"seq_len": 9}
    assert p.aggregator.scored == {"c_0", "c_1", "d_0", "d_1"}


def test_verls_ref_beside_an_empty_elastic_pool_runs_colocated_until_a_rank_is_lent():
    """tide.ers.max_ref_ranks >= 1 with verl's Ref: the pool starts empty, so steps run colocated on verl's Ref
    worker group (aggregated, timed for the cost model); once ERS lends a rank, the pool scores and a decoupled
    step can run."""
    from types import SimpleNamespace

    from verl_tide.ra2p.cost import RA2PMode

    verl_passes = []
    p, buffer, ns = _path(mode="auto", ref_service=object(), chosen=RA2PMode.DECOUPLED)
    p.pool = _Pool(replicas=0)
    p.layout = dataclasses.replace(p.layout, pool_wanted=False)
    p.ref_wg = SimpleNamespace(world_size=1)
    verl_pass = lambda batch, metrics: verl_passes.append(list(batch.keys)) or batch  # noqa: E731
    assert p.step_mode() is RA2PMode.COLOCATED  # decoupled was chosen, but no Ref replica is up
    _score(p, buffer, _batch(ns, "ab"), {}, verl_ref_pass=verl_pass)
    assert verl_passes == [["a_0", "a_1", "b_0", "b_1", "c_0", "c_1", "d_0", "d_1"]] and p.pool.passes == []
    assert p.stage_timer.rate("ref") > 0  # measured on verl's pass: 40 tokens
    p.pool.replicas.append(object())  # ERS lent a rollout rank to Ref
    assert p.step_mode() is RA2PMode.DECOUPLED
    _score(p, buffer, _batch(ns, "ef"), {}, trigger=1, verl_ref_pass=verl_pass)
    assert p.pool.passes == [["e_0", "e_1", "f_0", "f_1"]] and len(verl_passes) == 1


def _handoff_path(**kwargs):
    p, buffer, ns = _path(**kwargs)
    p.layout, p.service_name = dataclasses.replace(p.layout, handoff=True), "svc"
    return p, buffer, ns, _no_transfer_queue(p)


def test_with_the_handoff_a_colocated_pass_on_ref_replicas_sends_rows_by_sample_id():
    """tide.ra2p.zero_copy: the burst's rows go to the Ref service under fresh sample ids (written to the
    samples' data), not to TransferQueue; a sample scored ahead keeps its id until its mini-batch trains."""
    p, buffer, ns, written = _handoff_path(mode="colocated")
    _score(p, buffer, _batch(ns, "ab"), {})
    (ids, service), = p.pool.handed
    assert service == "svc" and ids == list(range(8))
    assert written == [{k: i for i, k in enumerate(["a_0", "a_1", "b_0", "b_1", "c_0", "c_1", "d_0", "d_1"])}]
    assert p.sample_ids.release(["c_1", "zz"]) == [5]  # ahead, not trained yet: still known


def test_with_the_handoff_verls_ref_worker_group_runs_the_handoff_pass_with_the_service_name():
    from types import SimpleNamespace

    from verl_tide.ra2p.handoff_worker import SERVICE_KEY

    calls = []
    p, buffer, ns, written = _handoff_path(mode="auto", max_aggregate=1)
    p.pool = None
    p.ref_wg = SimpleNamespace(world_size=2, compute_ref_log_prob_handoff=calls.append)
    _score(p, buffer, _batch(ns, "ab"), {})
    (meta,), = [calls]
    assert list(meta.keys) == ["a_0", "a_1", "b_0", "b_1", "c_0", "c_1"]
    assert meta.extra_info[SERVICE_KEY] == "svc" and meta.extra_info["compute_loss"] is False
    assert meta.extra_info["temperature"] == 1.0
    assert list(written[0]) == list(meta.keys)


def test_with_the_inputs_handoff_each_ref_rank_scores_the_share_its_actor_rank_trains():
    """verl's Ref and Actor roles in the same processes, the same data-parallel layout: the pass is ordered so
    that Ref rank r's share holds the mini-batch samples Actor rank r trains (their rows and inputs stay
    there); with another layout, verl's order."""
    from types import SimpleNamespace

    calls = []
    p, buffer, ns, written = _handoff_path(mode="auto", max_aggregate=2)
    p.pool = None
    p.layout = dataclasses.replace(p.layout, inputs_handoff=True)
    p.ref_wg = SimpleNamespace(world_size=2, compute_ref_log_prob_handoff=calls.append,
                               _dispatch_info={"ref": [0, 1]})
    p.actor_wg = SimpleNamespace(world_size=2, _dispatch_info={"actor": [0, 1]})
    _score(p, buffer, _batch(ns, "ab"), {})
    assert list(calls[0].keys) == ["a_0", "a_1", "c_0", "c_1", "b_0", "b_1", "d_0", "d_1"]
    assert list(written[0]) == list(calls[0].keys)
    p.actor_wg._dispatch_info["actor"] = [1, 0]  # another layout: nothing to align with
    p.aggregator = RefAggregator()
    _score(p, buffer, _batch(ns, "ab"), {}, trigger=1)
    assert list(calls[1].keys)[:4] == ["a_0", "a_1", "b_0", "b_1"]


def test_a_worker_group_without_verls_dispatch_cache_fails_naming_the_verl_version():
    from types import SimpleNamespace

    from verl_tide.trainer.verl_compat import VerlChanged, dispatch_layout

    with pytest.raises(VerlChanged, match=r"_dispatch_info .*verl 0\.9\.1"):
        dispatch_layout(SimpleNamespace(world_size=2), "ref")


class _Remote:
    def __init__(self, fn):
        self.remote = fn


def test_after_an_update_the_trained_and_evicted_samples_rows_are_discarded(monkeypatch):
    """Rows leave the service and every Ref rank's process once their samples trained or verl evicted them."""
    from types import SimpleNamespace

    p, buffer, ns, _ = _handoff_path(mode="colocated")
    discarded = []
    p.service = SimpleNamespace(discard=_Remote(lambda ids: discarded.append(list(ids))),
                                stats=_Remote(lambda: {"put": 8, "served": 2, "held": 0}),
                                take_kl=_Remote(lambda: 0.25))
    ranks_told = []
    p.ref_wg = SimpleNamespace(discard_ref_handoff=lambda ids: ranks_told.append(list(ids)) or [
        {"put": 4, "served_in_process": 3, "held": 1}, {"put": 4, "served_in_process": 3, "held": 0}])
    monkeypatch.setattr("ray.get", lambda x: x)  # unit only: the service is a stand-in, not a Ray actor
    _score(p, buffer, _batch(ns, "ab"), {})  # ids 0-3 own, 4-7 ahead (c, d)
    p.forget_scored(["d_0", "d_1"])  # verl evicts group d before it trains
    metrics = {}
    p.update_actor(_batch(ns, "ab"), metrics, verl_update=lambda b, m: b)
    assert discarded == [[0, 1, 2, 3, 6, 7]] and ranks_told == discarded
    counters = p.handoff_counters  # logged at the step boundary: verl averages a step's mini-batch metrics
    assert counters["tide/ra2p/handoff_served_in_process"] == 6.0 and counters["tide/ra2p/handoff_held"] == 1.0
    assert counters["tide/ra2p/handoff_ids_live"] == 2.0  # c_0, c_1: scored ahead, not trained yet
    assert metrics["actor/kl_loss"] == 0.25 and counters["tide/ra2p/ref_service_served"] == 2.0
    assert p.aggregator.scored == {"c_0", "c_1"}


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


def test_split_ref_pass_gives_the_replicas_the_samples_scored_ahead_first():
    own, ahead = ["a0", "a1", "a2", "a3"], ["b0", "b1", "b2", "b3"]
    # half of 8: the 4 samples scored ahead go to the replicas, verl's workers score the mini-batch
    assert split_ref_pass(own, ahead, 0.5, 1) == (own, [], ahead)
    # a quarter: 2 of the ahead samples, from the end
    assert split_ref_pass(own, ahead, 0.25, 1) == (own, ["b0", "b1"], ["b2", "b3"])
    # more than the ahead samples: the end of the mini-batch too
    assert split_ref_pass(own, ahead, 0.75, 1) == (["a0", "a1"], [], ["a2", "a3", *ahead])
    # any share above 0 gives the replicas a sample (ceil), share 0 none, share 1 all
    assert split_ref_pass(own, ahead, 0.01, 1)[2] == ["b3"]
    assert split_ref_pass(own, ahead, 0.0, 1) == (own, ahead, [])
    assert split_ref_pass(own, ahead, 1.0, 1) == ([], [], [*own, *ahead])


def test_split_ref_pass_keeps_verls_part_a_multiple_of_its_ranks():
    own, ahead = [f"a{i}" for i in range(4)], [f"b{i}" for i in range(6)]
    for share in (0.05, 0.2, 0.3, 0.5, 0.7, 0.95):
        mine, mine_ahead, replicas = split_ref_pass(own, ahead, share, 4)
        assert (len(mine) + len(mine_ahead)) % 4 == 0, share
        assert [*mine, *mine_ahead, *replicas] == [*own, *ahead]
    # 0.3 of 10 = 3 to the replicas, verl's 7 -> 8 (nearest multiple of 4): replicas take 2
    assert len(split_ref_pass(own, ahead, 0.3, 4)[2]) == 2
    # 0.05 -> 1 to the replicas, verl's 9 -> 8: replicas take 2; 0.5 -> verl's 5 -> 4: replicas take 6
    assert len(split_ref_pass(own, ahead, 0.05, 4)[2]) == 2
    assert len(split_ref_pass(own, ahead, 0.5, 4)[2]) == 6
    with pytest.raises(ValueError, match="share"):
        split_ref_pass(own, ahead, 1.5, 1)
    with pytest.raises(ValueError, match="multiple"):
        split_ref_pass(own, ahead, 0.5, 0)


def _split_path(replicas=1):
    """verl's Ref worker group (one rank) beside tide's Ref replicas, tide.ra2p.mode=split, the hand-off on."""
    from types import SimpleNamespace

    calls = []
    p, buffer, ns, written = _handoff_path(mode="split", ref_service=object())
    p.pool = _Pool(replicas=replicas)
    p.layout = dataclasses.replace(p.layout, pool_wanted=False)
    p.ref_wg = SimpleNamespace(world_size=1, compute_ref_log_prob_handoff=calls.append)
    return p, buffer, ns, written, calls


def test_split_mode_gives_the_replicas_the_samples_scored_ahead_and_verl_the_mini_batch():
    """Before any measurement the replicas' share is their share of the ranks that run Ref (1 of 2): the 4
    samples scored ahead go to the replica (started, not waited for), the mini-batch to verl's Ref worker
    group; each sample gets one id, written once."""
    from verl_tide.ra2p.cost import RA2PMode

    p, buffer, ns, written, calls = _split_path()
    assert p.step_mode() is RA2PMode.SPLIT
    m = {}
    _score(p, buffer, _batch(ns, "ab"), m)
    assert [list(c.keys) for c in calls] == [["a_0", "a_1", "b_0", "b_1"]]
    assert p.pool.passes == [["c_0", "c_1", "d_0", "d_1"]]
    assert m["tide/ra2p/ref_pass_samples_on_replicas"] == 4.0 and m["tide/ra2p/ref_pass_samples_ahead"] == 4.0
    assert len(p.split_pending) == 1  # collected after the Actor's update
    ids = {k: i for d in written for k, i in d.items()}
    assert sorted(ids.values()) == list(range(8)) and len(ids) == 8
    assert p.aggregator.scored == {"c_0", "c_1", "d_0", "d_1"}  # the next mini-batch needs no pass
    # the planner's share: 3/4 of the next pass goes to the replica, the end of the mini-batch too
    p2, buffer2, ns2, _, calls2 = _split_path()
    p2.planner.share = 0.75
    _score(p2, buffer2, _batch(ns2, "ab"), {})
    assert [list(c.keys) for c in calls2] == [["a_0", "a_1"]]
    assert p2.pool.passes == [["b_0", "b_1", "c_0", "c_1", "d_0", "d_1"]]


def test_split_mode_without_a_replica_runs_colocated_on_verls_ref():
    from verl_tide.ra2p.cost import RA2PMode

    p, buffer, ns, _, calls = _split_path(replicas=0)
    assert p.step_mode() is RA2PMode.COLOCATED  # ERS took the last replica back for rollout
    m = {}
    _score(p, buffer, _batch(ns, "ab"), m)
    assert len(calls) == 1 and len(calls[0].keys) == 8 and p.pool.passes == []
    assert m["tide/ra2p/ref_pass_samples_on_replicas"] == 0.0
    p.pool.replicas.append(object())
    p.layout = dataclasses.replace(p.layout, handoff=False)  # without the hand-off the Actor's loss could not take the replicas' rows
    assert p.step_mode() is RA2PMode.COLOCATED


def test_split_mode_collects_the_replicas_after_the_update_and_learns_their_rate(monkeypatch):
    from types import SimpleNamespace

    p, buffer, ns, _, _ = _split_path()
    p.service = SimpleNamespace(discard=_Remote(lambda ids: None), stats=_Remote(lambda: {}),
                                take_kl=_Remote(lambda: None))
    p.ref_wg.discard_ref_handoff = lambda ids: []
    monkeypatch.setattr("ray.get", lambda x: x)  # unit only: the service is a stand-in, not a Ray actor
    _score(p, buffer, _batch(ns, "ab"), {})
    metrics = {}
    p.update_actor(_batch(ns, "ab"), metrics, verl_update=lambda b, m: b)
    assert p.split_pending == []
    # the replica's rate (40 tokens in 0.1 s) is its own stage; verl's Ref pass keeps RA2P's t_ref
    assert p.stage_timer.rate("ref_rank") == pytest.approx(0.1 / 40) and p.stage_timer.rate("ref") != 0.1 / 40
    assert metrics["tide/ra2p/ref_worker_s"] == pytest.approx(0.1) and metrics["tide/ra2p/ref_replicas_used"] == 1.0


def test_the_mode_choice_weighs_the_replicas_measured_speed_for_split_and_decoupled():
    """verl's Ref on 4 Actor ranks (0.1 s a micro-batch), one replica measured at 4x that per token (0.4 s):
    colocated 0.05 + 8 x 0.1 + 0.05 + 8 x 0.3 = 3.3 s; decoupled on the replica 0.4 x 8 + 0.2 = 3.4 s (not
    Appendix A's grouping at verl's speed); split balances 3.3 - 0.8 s against 3.2 s + 0.2 at s = 0.775."""
    from types import SimpleNamespace

    from verl_tide.core.config import parse_tide_config
    from verl_tide.boundary.planner import BoundaryPlanner
    from verl_tide.ers.policy import Role
    from verl_tide.ra2p.cost import RA2PMode, StageTimer
    from verl_tide.trainer.boundary import boundary_inputs

    timer = StageTimer()
    for stage, seconds in (("ref", 1.0), ("act_f", 1.0), ("act_b", 2.0), ("ref_rank", 4.0)):
        timer.observe(stage, 1000, seconds)
    timer.observe("swap", 0, 0.05)
    tide = parse_tide_config({})
    planner = BoundaryPlanner.build(tide.ra2p, tide.ers, ideal_batch=16)
    no_tprm = lambda be: SimpleNamespace(tprm_smoothed=None)  # noqa: E731
    roles = {0: Role.ROLLOUT, 1: Role.REF}
    inputs = boundary_inputs(1, [0.0] * 8, 1, 800, timer, actor_ranks=4, fixed_ref_ranks=0, roles=roles,
                             replicas_up=1, ref_beside_actor=True, uses_ref=True)  # 8 micro-batches of 100 tokens
    decision = planner.decide(inputs, no_tprm)
    assert planner.mode is RA2PMode.SPLIT and planner.share == pytest.approx(0.775)
    assert decision.choice.colocated_s == pytest.approx(3.3)
    assert decision.choice.decoupled_s == pytest.approx(3.4)
    assert decision.choice.split_s == pytest.approx(3.3 - 0.8 * 0.775)
    assert decision.break_even is None
    from verl_tide.boundary.planner import _StepCosts

    _, outlook = planner._for_ers(_StepCosts.of(inputs, None), inputs, no_tprm)
    needed, saving = outlook(2)  # what ERS asks when it weighs a move to Ref: up to both ranks
    assert needed == 1  # split pays from the first Ref rank
    assert 0.0 < saving < 0.2  # a second replica: decoupled at 2.5 s against split's 2.68 s
    # without verl's Ref beside the replicas there is nothing to split with: no split candidate
    planner.mode = None
    alone = boundary_inputs(1, [0.0] * 8, 1, 800, timer, 4, 0, roles, 1, False, True)
    assert planner.decide(alone, no_tprm).choice.split_s is None and planner.mode is not RA2PMode.SPLIT

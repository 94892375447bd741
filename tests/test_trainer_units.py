"""Trainer `tide`'s modules that need no running job (the job runs in test_tide_trainer_e2e.py)."""

from __future__ import annotations

import pytest


def _health(quarantine_on_check: bool):
    """Rank health over a pool whose ranks all answer; `check` records and, when asked, quarantines rank 1
    (what it does when the rank's server is dead)."""
    from types import SimpleNamespace

    from verl_tide.trainer.rank_health import RankHealth

    health = RankHealth(SimpleNamespace(get_replicas=list), SimpleNamespace(remove_replicas=list), ctb_enabled=True)
    checks = []

    def check(roles):
        checks.append(dict(health.quarantined))
        if quarantine_on_check:
            health.quarantined[1] = "ActorDiedError"

    health.check = check  # this unit: the health check itself runs against real servers in the fault test
    return health, checks


def _verl_sync(health, fail_first: bool):
    import ray

    calls: list[int] = []

    def sync():
        calls.append(len(health.quarantined))
        if fail_first and len(calls) == 1:
            raise ray.exceptions.ActorDiedError()
    return sync, calls


def test_a_rank_dying_during_the_weight_sync_is_quarantined_and_the_others_synced():
    health, checks = _health(quarantine_on_check=True)
    sync, calls = _verl_sync(health, fail_first=True)
    health.sync_weights(sync, {})
    assert calls == [0, 1]  # failed with the dead rank, then synced the rest once it was quarantined
    assert checks == [{}]


def test_an_actor_error_that_is_not_a_dead_rollout_rank_is_not_swallowed():
    import ray

    health, _ = _health(quarantine_on_check=False)  # every rollout rank answers
    sync, calls = _verl_sync(health, fail_first=True)
    with pytest.raises(ray.exceptions.ActorDiedError):
        health.sync_weights(sync, {})
    assert calls == [0]


class _RecordingElastic:
    """Stands in for ERS's elastic ranks (ers/elastic.py, run for real in the e2e test): records moves."""

    def __init__(self):
        self.moves = []

    def before_sync(self, moves):
        from verl_tide.ers.elastic import AppliedMove

        self.moves.extend(moves)
        return [AppliedMove(m.rank, m.dst, 0.0) for m in moves]

    def after_sync(self):
        self.moves.append("after_sync")
        return 0.0


def test_ranks_that_were_ref_at_the_checkpoint_switch_to_ref_again_on_resume():
    from verl_tide.ers.policy import Role
    from verl_tide.trainer.checkpoint import moves_to_restore, roles_of
    from verl_tide.trainer.elastic_setup import switch_to_ref_at_start

    elastic = _RecordingElastic()
    roles = {0: Role.ROLLOUT, 1: Role.ROLLOUT, 2: Role.ROLLOUT}
    state = {"rollout_roles": {"0": "rollout", "2": "ref", "7": "ref"}}  # rank 7 no longer exists
    moves = moves_to_restore(roles_of(state), roles, have_elastic=True)
    switch_to_ref_at_start(elastic, moves, roles)
    assert [(m.rank, m.src, m.dst) for m in elastic.moves[:-1]] == [(2, Role.ROLLOUT, Role.REF)]
    assert elastic.moves[-1] == "after_sync"  # step 1 waits until the replica is placed and loaded
    assert roles == {0: Role.ROLLOUT, 1: Role.ROLLOUT, 2: Role.REF}


def test_without_a_ref_pool_restored_ref_roles_start_as_rollout_with_a_warning(capsys):
    from verl_tide.ers.policy import Role
    from verl_tide.trainer.checkpoint import moves_to_restore

    roles = {0: Role.ROLLOUT, 1: Role.ROLLOUT}
    assert moves_to_restore({1: Role.REF}, roles, have_elastic=False) == []
    assert all(r is Role.ROLLOUT for r in roles.values())
    assert "every rank starts as rollout" in capsys.readouterr().out


def test_ers_cooldowns_survive_a_checkpoint_in_the_new_and_the_old_format():
    from verl_tide.core.config import parse_tide_config
    from verl_tide.ers.policy import ERSPolicy, Role

    ers = ERSPolicy(parse_tide_config({}).ers, ideal_batch=8)
    ers._last_moved = {3: (5, Role.ROLLOUT)}
    again = ERSPolicy(parse_tide_config({}).ers, ideal_batch=8)
    again.load_state_dict(ers.state_dict())
    assert again._last_moved == {3: (5, Role.ROLLOUT)}
    again.load_state_dict({"last_moved": {"1": [2, "ref"]}})  # what tide_state.json held as "ers_last_moved"
    assert again._last_moved == {1: (2, Role.REF)}


def test_ers_ideal_batch_is_counted_in_sequences_like_the_ready_volume():
    """The readiness signals count sequences (a GRPO group of n is n); B_ideal must too, or a step's worth of
    ready data (prompts x n sequences) would look like n steps' worth and hide every generation deficit."""
    from omegaconf import OmegaConf

    from verl_tide.core.config import parse_tide_config
    from verl_tide.trainer.tide import ideal_batch

    job = OmegaConf.create({"data": {"train_batch_size": 16}, "actor_rollout_ref": {"rollout": {"n": 8}}})
    assert ideal_batch(parse_tide_config({}), job) == 128
    assert ideal_batch(parse_tide_config({"ers": {"ideal_batch": 40}}), job) == 40


def test_ra2p_sees_each_group_ready_when_its_ppo_mini_batch_is_complete():
    """verl's replay buffer hands out whole PPO mini-batches: a group ready early still waits for the rest of its
    mini-batch, so RA2P's cost model must not stream it from its own ready time (it would under-state colocated
    mode's wait and flatter decoupled mode's pipelining)."""
    from types import SimpleNamespace

    from verl_tide.core.config import parse_tide_config
    from verl_tide.boundary.planner import BoundaryPlanner
    from verl_tide.ra2p.cost import StageTimer, colocated_cost, decoupled_cost
    from verl_tide.trainer.boundary import boundary_inputs

    timer = StageTimer()
    for stage, seconds in (("ref", 1.0), ("act_f", 1.0), ("act_b", 2.0), ("swap", 0.5)):
        timer.observe(stage, 100, seconds)
    per_group = [0.0, 1.0, 2.0, 10.0, 11.0, 12.0, 13.0, 30.0]
    # trainer tide's adapter: 8 groups a step in mini-batches of 4, one Actor rank, Ref on 1 replica of its own
    inputs = boundary_inputs(1, per_group, 4, 800, timer, actor_ranks=1, fixed_ref_ranks=1, roles={},
                             replicas_up=1, ref_beside_actor=False, uses_ref=True)
    tide = parse_tide_config({})
    decision = BoundaryPlanner.build(tide.ra2p, tide.ers, 16).decide(inputs, lambda be: SimpleNamespace(
        tprm_smoothed=None))
    times = timer.stage_times(100)
    as_trained = [10.0] * 4 + [30.0] * 4  # each mini-batch when its last group was ready
    assert decision.choice.colocated_s == pytest.approx(colocated_cost(as_trained, times, 8))
    assert decision.choice.decoupled_s == pytest.approx(decoupled_cost(as_trained, times, 1))
    assert colocated_cost(per_group, times, 8) != pytest.approx(colocated_cost(as_trained, times, 8))


def test_a_measured_swap_reaches_the_cost_model_and_can_change_the_chosen_mode():
    """RA2P's swap term: colocated mode swaps Ref and Actor around each aggregated Ref pass, decoupled never. The
    trainer feeds the swap its workers measured (trainer/boundary.py); with the swap it used to log (always 0)
    the Ref on the Actor's GPUs wins here, with a measured 2 s swap decoupled mode does."""
    from types import SimpleNamespace

    from verl_tide.core.config import parse_tide_config
    from verl_tide.boundary.planner import BoundaryPlanner
    from verl_tide.ra2p.cost import RA2PMode, StageTimer
    from verl_tide.trainer.boundary import boundary_inputs, observe_stage_times

    tide = parse_tide_config({})

    def mode_with(swap_s):
        # 4 micro-batches of 100 tokens ready at the start; verl's Ref on the Actor's rank 0.1 s each, the one
        # Ref replica 2 s each (slow): decoupled ~9 s; colocated (or split) 6.4 s plus two swaps
        timer = StageTimer()
        timer.observe("ref", 100, 0.1)
        timer.observe("ref_rank", 100, 2.0)
        observe_stage_times(timer, {"old_log_prob": 0.5, "update_actor": 1.5}, 100, swap_s)
        planner = BoundaryPlanner.build(tide.ra2p, tide.ers, 16)
        inputs = boundary_inputs(1, [0.0] * 4, 1, 400, timer, 1, 0, {}, 1, True, True)
        planner.decide(inputs, lambda be: SimpleNamespace(tprm_smoothed=None))
        return planner.mode, timer.rate("swap")

    zero, measured = mode_with(0.0), mode_with(2.0)
    assert zero[0] is not RA2PMode.DECOUPLED and zero[1] == 0.0
    assert measured == (RA2PMode.DECOUPLED, 2.0)
    # not measured this step: the last measurement stands (0 only before any)
    timer = StageTimer()
    observe_stage_times(timer, {}, 100, None)
    assert timer.rate("swap") == 0.0
    observe_stage_times(timer, {}, 100, 0.4)
    observe_stage_times(timer, {}, 100, None)
    assert timer.rate("swap") == pytest.approx(0.2 * 0.4)


def test_split_advice_reads_the_job_layout_and_the_model_config(tmp_path, capsys):
    """Trainer `tide` counts rollout GPUs in whole replicas, the trainer's (and Ref ranks') GPUs beside them, reads
    the model's weights-to-KV ratio from its Hugging Face config, and says the standing advice once (the advice's
    cycle driven as the boundary round drives it)."""
    import dataclasses
    import json

    from omegaconf import OmegaConf
    from prometheus_client import generate_latest

    from verl_tide.core.readiness import ReadinessSignals
    from verl_tide.ers.advice import SplitAdviceCycle
    from verl_tide.ers.policy import Role
    from verl_tide.metrics import TideMetrics
    from verl_tide.trainer.reporting import SplitAdviceReport

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}))
    config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"nnodes": 1, "n_gpus_per_node": 4}, "model": {"path": str(tmp_path)}},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 12, "test_freq": 0}})
    exporter = TideMetrics()
    report = SplitAdviceReport(config, ideal_batch=400, kv_bound=0.5, fixed_ref_ranks=0, exporter=exporter)
    roles = {0: Role.ROLLOUT, 1: Role.ROLLOUT}  # 2 replicas of 2 GPUs
    cycle = SplitAdviceCycle()

    def update(signals):
        a = report.inputs(roles, {})
        changed = cycle.update(signals, a.rollout_gpus, a.trainer_gpus, a.batch, a.weight_kv_tokens, a.kv_bound_min,
                               False, gpus_per_replica=a.gpus_per_replica)
        return report.metrics(signals, roles, {}, 3, cycle.standing, changed)

    # decode-bound (no work waited for KV; 400k tokens of context in flight per replica, the weights ~266k)
    signals = ReadinessSignals(0, None, None, 0.0, 0, 40.0, True, False, 0.0, 60.0, rollout_capacity_rate=4.0,
                               rollout_kv_bound=0.0, rollout_decode_context=400_000.0, cycle_s=100.0,
                               rollout_kv_held_peak=3.2)
    first = update(signals)
    assert first["tide/ers/advised_rollout_gpus"] == 4.0  # one cycle does not stand
    assert first["tide/rollout/kv_bound"] == 0.0 and first["tide/rollout/decode_context_tokens"] == 400_000.0
    assert first["tide/rollout/kv_held_peak_ranks"] == 3.2
    assert report.weight_kv_tokens == pytest.approx(265_600.0)
    second = update(signals)
    # 1 seq/s per rollout GPU, 400 / 40 s / 12 = 0.833 per trainer GPU: 7 of 16 balance, 8 in whole replicas
    assert second["tide/ers/advised_rollout_gpus"] == 8.0
    update(signals)
    assert capsys.readouterr().out.count("ERS split advice") == 1  # said when it changes
    body = generate_latest(exporter.registry).decode()
    assert 'tide_ers_split_advice{quantity="advised_rollout_gpus"} 8.0' in body
    assert 'tide_ers_split_advice{quantity="rollout_gpus"} 4.0' in body
    light = dataclasses.replace(signals, rollout_decode_context=100_000.0)  # the weights dominate: no estimate
    for _ in range(3):
        last = update(light)
    assert last["tide/ers/advised_rollout_gpus"] == 4.0


@pytest.mark.parametrize("ref,world,multiple", [
    ({"log_prob_micro_batch_size_per_gpu": 2, "log_prob_use_dynamic_bsz": False}, 2, 4),
    ({"log_prob_micro_batch_size_per_gpu": 2, "log_prob_use_dynamic_bsz": True}, 2, 2),  # token-packed: ranks only
    ({"log_prob_micro_batch_size_per_gpu": None, "log_prob_micro_batch_size": 4}, 2, 4),  # verl's deprecated key
    ({"log_prob_micro_batch_size_per_gpu": None}, 3, 3),
])
def test_a_ref_pass_on_verls_workers_comes_in_whole_micro_batches_per_rank(ref, world, multiple):
    """The CI failure of 2026-12-03: a mini-batch of 4 rows and one GRPO group of 2 scored ahead on 2 Ref ranks
    with 2-row micro-batches gave each rank 3 rows, and verl's prepare_micro_batches asserted."""
    from omegaconf import OmegaConf

    from verl_tide.ra2p.aggregation import trim_to_multiple
    from verl_tide.trainer.verl_compat import verl_ref_pass_multiple

    m = verl_ref_pass_multiple(OmegaConf.create(ref), world)
    assert m == multiple
    own, ahead = ["o0", "o1", "o2", "o3"], ["a0", "a1"]
    kept = trim_to_multiple(ahead, m, base=len(own))
    assert (len(own) + len(kept)) % m == 0
    if multiple == 4:
        assert kept == []  # the lone group waits for its own mini-batch's pass


def test_every_private_verl_method_tide_overrides_or_calls_exists_and_a_missing_one_fails_at_start_up():
    """Overrides of verl's private methods (trainer and replay buffer) are declared in verl_compat and checked when
    trainer `tide` is built: against the installed verl 0.9.1 all exist, each one tide's classes override is
    declared, and a verl without one fails naming it."""
    import inspect

    import pytest
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from verl_tide.buffer import TideReplayBuffer
    from verl_tide.trainer import verl_compat
    from verl_tide.trainer.tide import TideTrainer

    verl_compat.check_private_hooks(PPOTrainerSeparateAsync, ReplayBufferAsync)
    for ours, verls, declared in ((TideTrainer, PPOTrainerSeparateAsync, verl_compat.TRAINER_HOOKS),
                                  (TideReplayBuffer, ReplayBufferAsync, verl_compat.REPLAY_BUFFER_HOOKS)):
        overridden = {n for n, v in vars(ours).items() if n.startswith("_") and not n.startswith("__")
                      and inspect.isfunction(v) and hasattr(verls, n)}
        hybrid = {"_switch_threshold", "_init_hybrid_rollout_state"}  # checked with the lending hooks
        assert overridden - hybrid <= set(declared), overridden - set(declared)

    class OlderBuffer:  # a verl whose replay buffer renamed one of them
        pass

    for name in verl_compat.REPLAY_BUFFER_HOOKS:
        setattr(OlderBuffer, name, lambda self: None)
    delattr(OlderBuffer, "_materialize_batch")
    with pytest.raises(verl_compat.VerlChanged, match="OlderBuffer._materialize_batch|_materialize_batch"):
        verl_compat.check_private_hooks(PPOTrainerSeparateAsync, OlderBuffer)


def test_the_trainer_s_resize_inputs_carry_the_saturation_figures_the_simulator_gives():
    """The resize decision reads the model's weights in KV tokens (decode-bound rollout) and the KV-bound share that
    makes it saturated, as the split advice does; without them trainer `tide` would decide on fewer inputs than the
    simulator's runs of the same code."""
    from verl_tide.ers.policy import Role
    from verl_tide.trainer.actor_group import ActorGroupLayout
    from verl_tide.trainer.resize import TrainerResize

    resize = TrainerResize(ActorGroupLayout({}, "actor", {}), pool=None, move_s=30.0, mini_batch=64, start_gpus=2,
                           gpus_per_replica=2)
    roles = {0: Role.ROLLOUT, 1: Role.ROLLOUT, 2: Role.REF}
    inputs = resize.inputs(2, roles, batch=256, steps_left=10, weight_kv_tokens=265_600.0, kv_bound_min=0.3)
    assert (inputs.rollout_gpus, inputs.actor_gpus, inputs.gpus_per_replica) == (4, 2, 2)
    assert inputs.weight_kv_tokens == 265_600.0 and inputs.kv_bound_min == 0.3 and inputs.move_s == 30.0


def test_a_new_rollout_replica_is_built_as_verls_manager_builds_its_own_and_joins_its_lists():
    """Past the start split the Actor's GPUs go to a replica the pool never had: the manager's class and configs,
    the next replica rank after the pool's first, `init_standalone()`; then every reader of the manager's lists
    (health checks, reports, the weight sync) sees it. A verl without those attributes fails naming one."""
    from types import SimpleNamespace

    from verl_tide.trainer.verl_compat import VerlChanged, launch_standalone_replica

    class Replica:
        def __init__(self, replica_rank, config, model_config, gpus_per_node):
            self.replica_rank, self.gpus_per_node, self.started = replica_rank, gpus_per_node, False
            self.server_handle = f"handle{replica_rank}"
            self.server_address = f"addr{replica_rank}"

        async def init_standalone(self):
            self.started = True

    old = Replica(2, None, None, 1)
    manager = SimpleNamespace(rollout_replicas=[old], rollout_replica_class=Replica, start_rank=2,
                              rollout_config=SimpleNamespace(n_gpus_per_node=1), model_config=None,
                              server_handles=["handle2"], server_addresses=["addr2"])
    rank, replica = launch_standalone_replica(manager)
    assert rank == 1 and replica.replica_rank == 3 and replica.started
    assert manager.rollout_replicas == [old, replica]
    assert manager.server_handles == ["handle2", "handle3"] and manager.server_addresses == ["addr2", "addr3"]
    del manager.rollout_replica_class
    with pytest.raises(VerlChanged, match="rollout_replica_class"):
        launch_standalone_replica(manager)

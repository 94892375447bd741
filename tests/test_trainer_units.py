"""Trainer `tide`'s decisions that need no running job (the job runs in test_tide_trainer_e2e.py)."""

from __future__ import annotations

import pytest


def _trainer_with_sync(monkeypatch, fail_first: bool):
    """A TideTrainer shell whose parent weight sync (verl's separate_async `on_step_end`) is a stub that
    fails once the way a dead rollout server fails it."""
    import ray
    from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync

    from verl_tide.trainer import TideTrainer

    calls: list[int] = []

    def parent_sync(self):
        calls.append(len(self.quarantined))
        if fail_first and len(calls) == 1:
            raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(PPOTrainerSeparateAsync, "on_step_end", parent_sync)  # a stub for this unit only
    trainer = TideTrainer.__new__(TideTrainer)
    trainer.quarantined = {}
    return trainer, calls


def test_a_rank_dying_during_the_weight_sync_is_quarantined_and_the_others_synced(monkeypatch):
    trainer, calls = _trainer_with_sync(monkeypatch, fail_first=True)
    trainer._check_rollout_ranks = lambda: trainer.quarantined.update({1: "ActorDiedError"})
    trainer._sync_weights()
    assert calls == [0, 1]  # failed with the dead rank, then synced the rest once it was quarantined


def test_an_actor_error_that_is_not_a_dead_rollout_rank_is_not_swallowed(monkeypatch):
    import ray

    trainer, calls = _trainer_with_sync(monkeypatch, fail_first=True)
    trainer._check_rollout_ranks = lambda: None  # every rollout rank answers
    with pytest.raises(ray.exceptions.ActorDiedError):
        trainer._sync_weights()
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


def _resumed_trainer(restored: dict, elastic):
    from types import SimpleNamespace

    from verl_tide.ers.policy import Role
    from verl_tide.trainer import TideTrainer

    trainer = TideTrainer.__new__(TideTrainer)
    trainer.tide_config = SimpleNamespace(ctb=SimpleNamespace(enabled=False))
    trainer._restored_ctb_state = None
    trainer._restored_roles = restored
    trainer.rollout_roles = {0: Role.ROLLOUT, 1: Role.ROLLOUT, 2: Role.ROLLOUT}
    trainer.elastic = elastic
    return trainer


def test_ranks_that_were_ref_at_the_checkpoint_switch_to_ref_again_on_resume():
    from verl_tide.ers.policy import Role

    elastic = _RecordingElastic()
    trainer = _resumed_trainer({0: Role.ROLLOUT, 2: Role.REF, 7: Role.REF}, elastic)  # rank 7 no longer exists
    trainer._restore_ctb_and_roles()
    assert [(m.rank, m.src, m.dst) for m in elastic.moves[:-1]] == [(2, Role.ROLLOUT, Role.REF)]
    assert elastic.moves[-1] == "after_sync"  # step 1 waits until the replica is placed and loaded
    assert trainer.rollout_roles == {0: Role.ROLLOUT, 1: Role.ROLLOUT, 2: Role.REF}


def test_without_a_ref_pool_restored_ref_roles_start_as_rollout_with_a_warning(capsys):
    from verl_tide.ers.policy import Role

    trainer = _resumed_trainer({1: Role.REF}, None)
    trainer._restore_ctb_and_roles()
    assert all(r is Role.ROLLOUT for r in trainer.rollout_roles.values())
    assert "every rank starts as rollout" in capsys.readouterr().out


def test_ers_ideal_batch_is_counted_in_sequences_like_the_ready_volume():
    """The readiness signals count sequences (a GRPO group of n is n); B_ideal must too, or a step's worth of
    ready data (prompts x n sequences) would look like n steps' worth and hide every generation deficit."""
    from omegaconf import OmegaConf

    from verl_tide.config import parse_tide_config
    from verl_tide.trainer import TideTrainer

    job = OmegaConf.create({"data": {"train_batch_size": 16}, "actor_rollout_ref": {"rollout": {"n": 8}}})
    assert TideTrainer.ideal_batch(parse_tide_config({}), job) == 128
    assert TideTrainer.ideal_batch(parse_tide_config({"ers": {"ideal_batch": 40}}), job) == 40


def test_ra2p_sees_each_group_ready_when_its_ppo_mini_batch_is_complete():
    """verl's replay buffer hands out whole PPO mini-batches: a group ready early still waits for the rest of its
    mini-batch, so RA2P's cost model must not stream it from its own ready time (it would under-state colocated
    mode's wait and flatter decoupled mode's pipelining)."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from verl_tide.ra2p.cost import RA2PMode, StageTimer, colocated_cost, decoupled_cost
    from verl_tide.readiness import ReadinessTracker
    from verl_tide.trainer import TideTrainer

    trainer = TideTrainer.__new__(TideTrainer)
    trainer.config = OmegaConf.create({"data": {"train_batch_size": 8}})
    trainer.parameter_sync_step = 2  # mini-batches of 4 groups
    trainer.readiness = ReadinessTracker(clock=lambda: 0.0)
    trainer.readiness.last_ready_times = [0.0, 1.0, 2.0, 10.0, 11.0, 12.0, 13.0, 30.0]
    trainer.use_reference_policy = True
    trainer.stage_timer = StageTimer()
    for stage, seconds in (("ref", 1.0), ("act_f", 1.0), ("act_b", 2.0), ("swap", 0.5)):
        trainer.stage_timer.observe(stage, 100, seconds)
    trainer.actor_rollout_wg = SimpleNamespace(world_size=1)
    trainer.ref_pool = None
    trainer._handoff, trainer._ref_pool_wanted = False, False
    trainer.ra2p_mode, trainer.ra2p_share = RA2PMode.COLOCATED, None
    trainer.tide_config = SimpleNamespace(ra2p=SimpleNamespace(mode="auto", hysteresis=0.1, ref_ranks=0),
                                          ers=SimpleNamespace(tau=1.0))
    trainer.ers = SimpleNamespace(ideal_batch=16)
    trainer.rollout_roles = {}
    metrics: dict = {}
    trainer._ra2p_decision(step_tokens=800, m=metrics)

    times = trainer.stage_timer.stage_times(100)
    as_trained = [10.0] * 4 + [30.0] * 4  # each mini-batch when its last group was ready
    assert metrics["tide/ra2p/predicted_colocated_s"] == pytest.approx(colocated_cost(as_trained, times, 8))
    assert metrics["tide/ra2p/predicted_decoupled_s"] == pytest.approx(decoupled_cost(as_trained, times, 1))
    per_group = trainer.readiness.last_ready_times
    assert colocated_cost(per_group, times, 8) != pytest.approx(colocated_cost(as_trained, times, 8))


def test_split_advice_reads_the_job_layout_and_the_model_config(tmp_path, capsys):
    """Trainer `tide` counts rollout GPUs in whole replicas, the trainer's (and Ref ranks') GPUs beside them, reads
    the model's weights-to-KV ratio from its Hugging Face config, and says the standing advice once."""
    import dataclasses
    import json
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from prometheus_client import generate_latest

    from verl_tide.ers.advice import SplitAdvisor
    from verl_tide.ers.policy import Role
    from verl_tide.metrics import TideMetrics
    from verl_tide.readiness import ReadinessSignals
    from verl_tide.trainer import TideTrainer

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False}))
    trainer = TideTrainer.__new__(TideTrainer)
    trainer.config = OmegaConf.create({
        "actor_rollout_ref": {"rollout": {"nnodes": 1, "n_gpus_per_node": 4}, "model": {"path": str(tmp_path)}},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 12, "test_freq": 0}})
    trainer.rollout_roles = {0: Role.ROLLOUT, 1: Role.ROLLOUT}  # 2 replicas of 2 GPUs
    trainer.quarantined = {}
    trainer.tide_config = SimpleNamespace(ra2p=SimpleNamespace(ref_ranks=0),
                                          ers=SimpleNamespace(split_advice_kv_bound=0.5))
    trainer.ers = SimpleNamespace(ideal_batch=400)
    trainer.split_advisor, trainer._eval_in_cycle, trainer._weight_kv_tokens = SplitAdvisor(), False, None
    trainer.overlapped_eval, trainer.global_steps, trainer.total_training_steps = None, 3, 10
    trainer.tide_metrics = TideMetrics()
    # decode-bound (no work waited for KV; 400k tokens of context in flight per replica, the weights ~266k)
    signals = ReadinessSignals(0, None, None, 0.0, 0, 40.0, True, False, 0.0, 60.0, rollout_capacity_rate=4.0,
                               rollout_kv_bound=0.0, rollout_decode_context=400_000.0, cycle_s=100.0)
    first = trainer._split_advice(signals)
    assert first["tide/ers/advised_rollout_gpus"] == 4.0  # one cycle does not stand
    assert first["tide/rollout/kv_bound"] == 0.0 and first["tide/rollout/decode_context_tokens"] == 400_000.0
    assert trainer._weight_kv_tokens == pytest.approx(265_600.0)
    second = trainer._split_advice(signals)
    # 1 seq/s per rollout GPU, 400 / 40 s / 12 = 0.833 per trainer GPU: 7 of 16 balance, 8 in whole replicas
    assert second["tide/ers/advised_rollout_gpus"] == 8.0
    trainer._split_advice(signals)
    assert capsys.readouterr().out.count("ERS split advice") == 1  # said when it changes
    body = generate_latest(trainer.tide_metrics.registry).decode()
    assert 'tide_ers_split_advice{quantity="advised_rollout_gpus"} 8.0' in body
    assert 'tide_ers_split_advice{quantity="rollout_gpus"} 4.0' in body
    light = dataclasses.replace(signals, rollout_decode_context=100_000.0)  # the weights dominate: no estimate
    for _ in range(3):
        last = trainer._split_advice(light)
    assert last["tide/ers/advised_rollout_gpus"] == 4.0

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

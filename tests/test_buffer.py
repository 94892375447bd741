"""Trainer `tide`'s replay buffer (verl's async buffer, subclassed): when a group counts as ready, and what it
holds. TransferQueue's listing is stood in for (`tq.kv_list`, the one call verl's metadata sync makes); the
buffer against a running TransferQueue is in tests/test_tide_trainer_e2e.py."""

from __future__ import annotations

import pytest


def _listing():
    """What `tq.kv_list()` returns: prompt keys with their status, trajectories `{uid}_{session}_{index}`."""
    def prompt(status):
        return {"is_prompt": True, "status": status, "global_steps": 1}
    return {"train": {"a": prompt("finished"), "a_0_0": {"seq_len": 10}, "a_1_0": {"seq_len": 12},
                      "b": prompt("running"), "b_0_0": {"seq_len": 7},
                      "c": prompt("pending"), "d": prompt("failure")}}


@pytest.fixture
def buffer(monkeypatch):
    import verl.trainer.ppo.v1.replay_buffer as verl_buffer

    from verl_tide.buffer import TideReplayBuffer
    from verl_tide.core.ledger import GoodputLedger
    from verl_tide.core.readiness import ReadinessTracker

    monkeypatch.setattr(verl_buffer.tq, "kv_list", _listing)  # unit only: no TransferQueue running here
    clock = lambda: 100.0  # noqa: E731  (the poll happens at t = 100)
    return TideReplayBuffer(readiness=ReadinessTracker(clock=clock), ledger=GoodputLedger(clock=clock), clock=clock,
                            trainer_mode="separate_async", trainer_config={}, max_off_policy_threshold=2,
                            max_off_policy_strategy="drop", sampler_kwargs={}, train_batch_size=4)


def test_a_group_is_ready_when_its_last_trajectory_finished_not_when_verl_polls(buffer):
    asked = []
    buffer.finish_times = lambda uids: asked.append(list(uids)) or {"a": 93.5}  # CTB's router, on this clock
    buffer._sync_metadata_from_transfer_queue()
    assert asked == [["a"]]  # only the newly finished group
    assert buffer.readiness._ready["a"].at == 93.5 and buffer.readiness._ready["a"].sequences == 2
    assert buffer.ledger.ready() == {"a": (2, 22)}
    buffer._sync_metadata_from_transfer_queue()
    assert asked == [["a"]]  # known groups are not asked again
    assert buffer.stamped == {"at_finish": 1, "at_poll": 0}


def test_without_a_finish_time_a_group_is_stamped_at_the_poll_and_never_in_the_future(buffer):
    buffer.finish_times = lambda uids: {"a": 250.0}  # a clock mismatch must not put readiness after the poll
    buffer._sync_metadata_from_transfer_queue()
    assert buffer.readiness._ready["a"].at == 100.0


def test_the_buffer_counts_every_group_transfer_queue_holds_for_training(buffer):
    """Pending (submitted, not started), running, finished and failed groups: what the ledger calls in flight."""
    from verl_tide.core.ledger import Outcome

    buffer.ledger.groups_submitted(5)
    buffer.ledger.settle("e", Outcome.CONSUMED, 2, 20)  # trained earlier: no longer in TransferQueue
    assert buffer.groups_held() == 4
    assert buffer.ledger.check(buffer.groups_held()) is None
    buffer.ledger.groups_submitted(1)  # a group the buffer never saw: the check says so
    assert buffer.ledger.check(buffer.groups_held()) is not None


def test_the_trainer_looks_for_ready_groups_every_sample_poll_s_not_verls_two_seconds(monkeypatch):
    """verl's buffer sleeps `poll_interval` (2 s by default) between looks at TransferQueue: a mini-batch ready
    just after a look waited up to 2 s. Trainer tide passes `tide.sample_poll_s`; group "b" finishes at the third
    look and the sampler returns at that look."""
    import verl.trainer.ppo.v1.replay_buffer as verl_buffer

    from verl_tide.buffer import TideReplayBuffer
    from verl_tide.core.config import TideConfig
    from verl_tide.core.ledger import GoodputLedger
    from verl_tide.core.readiness import ReadinessTracker

    looks, sleeps = [], []

    def listing():
        looks.append(1)
        data = _listing()
        del data["train"]["d"]  # a failed group would be evicted (a TransferQueue call this test has no server for)
        if len(looks) >= 3:
            data["train"]["b"]["status"] = "finished"
        return data

    monkeypatch.setattr(verl_buffer.tq, "kv_list", listing)
    monkeypatch.setattr(verl_buffer.time, "sleep", sleeps.append)
    clock = lambda: 100.0  # noqa: E731
    poll = TideConfig().sample_poll_s
    buffer = TideReplayBuffer(readiness=ReadinessTracker(clock=clock), ledger=GoodputLedger(clock=clock),
                              clock=clock, trainer_mode="separate_async", trainer_config={},
                              max_off_policy_threshold=2, max_off_policy_strategy="drop", sampler_kwargs={},
                              train_batch_size=4, poll_interval=poll)
    ready, _ = buffer.wait_for_sampleable(1, "train", 2)
    assert ready == {"a", "b"} and len(looks) == 3
    assert sleeps == [poll, poll] and poll < 2.0 / 4


@pytest.mark.parametrize("max_staleness, trained_at, dropped", [
    (1, 1, False), (1, 2, False), (1, 3, True),  # a lag of one version is kept, two are dropped
    (0, 1, False), (0, 2, True),  # no lag: a group submitted a batch ahead is generated, then dropped
])
def test_one_staleness_bound_means_the_same_to_verls_buffer_for_tide_and_stock(monkeypatch, max_staleness, trained_at,
                                                                                dropped):
    """verl's own stale check (`_stale_terminal_keys`) on a finished group submitted at step 1, with the threshold
    trainer `tide` and the head-to-head's stock systems both take from `off_policy_threshold`."""
    import verl.trainer.ppo.v1.replay_buffer as verl_buffer

    from verl_tide.job_config import off_policy_threshold
    from verl_tide.testing.compare import systems
    from verl_tide.testing.testbed import GRPOJob

    monkeypatch.setattr(verl_buffer.tq, "kv_list", _listing)
    threshold = off_policy_threshold(max_staleness)
    stock = verl_buffer.ReplayBufferAsync(trainer_mode="separate_async", trainer_config={},
                                          max_off_policy_threshold=threshold, max_off_policy_strategy="drop",
                                          sampler_kwargs={})
    stock._sync_metadata_from_transfer_queue()
    assert ("a" in stock._stale_terminal_keys(trained_at, "train")) == dropped
    job = GRPOJob(model_path="/m", train_file="/t", val_file="/v", n_gpus=2)
    for system in systems(job, max_staleness=max_staleness):
        if "fully_async" in system.name:  # its own entry point and key, the same bound (job_config)
            assert f"async_training.staleness_threshold={float(threshold - 1)}" in system.overrides, system.name
        elif system.name.startswith("verl ") and system.name != "verl sync":
            assert f"trainer.v1.sampler.max_off_policy_threshold={threshold}" in system.overrides, system.name
    with pytest.raises(ValueError, match="max_staleness = -1"):
        off_policy_threshold(-1)

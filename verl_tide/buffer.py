"""verl's async replay buffer with TideRL's bookkeeping: readiness arrivals and the goodput ledger.

Why here: the replay buffer is the one place in verl's V1 loop that sees every GRPO group become
ready (status `finished` in TransferQueue), be sampled for an update, or be evicted (stale,
DAPO-filtered, failed). Recording those moments here computes the readiness signals once, from
real arrival times, and settles every group in the ledger exactly once. Sampling and eviction
themselves stay verl's (subclass, no patching).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

from verl_tide.core.ledger import GoodputLedger, Outcome
from verl_tide.core.readiness import ReadinessTracker

TRAIN = "train"


class RolloutFailing(RuntimeError):
    """Every group so far failed: a broken rollout path, not bad luck."""


class TideReplayBuffer(ReplayBufferAsync):
    def __init__(self, *args, readiness: ReadinessTracker, ledger: GoodputLedger, clock: Callable[[], float],
                 **kwargs):
        self.readiness = readiness
        self.ledger = ledger
        self.clock = clock
        self.on_evicted: Optional[Callable[[list[str]], None]] = None  # sample keys of groups verl evicts
        # {uid: time on `clock`} of the groups asked: when each group's last trajectory finished (CTB's router
        # knows); a group it does not know is stamped when this buffer first sees it finished (verl's poll)
        self.finish_times: Optional[Callable[[list[str]], dict[str, float]]] = None
        self.stamped = {"at_finish": 0, "at_poll": 0}  # groups made ready, by where their ready time came from
        self.while_waiting: Optional[Callable[[], None]] = None  # at each look while training waits for data
        super().__init__(*args, **kwargs)  # (the verl methods overridden here: verl_compat.REPLAY_BUFFER_HOOKS)
        batch = int(self.train_batch_size or 0) or 8
        self.max_failed_without_success = max(8, 4 * batch)

    @classmethod
    def for_trainer(cls, trainer: Any) -> "TideReplayBuffer":
        """The buffer trainer `tide` builds in place of verl's (its `_build_replay_buffer` hook), wired to the
        trainer's readiness tracker, ledger, Ref path and CTB's router."""
        from verl_tide.job_config import off_policy_threshold

        config, tide = trainer.config, trainer.tide_config
        sampler = config.trainer.v1.sampler
        buffer = cls(
            readiness=trainer.readiness, ledger=trainer.ledger, clock=trainer.clock,
            trainer_mode=trainer.trainer_mode, trainer_config=config.trainer.v1.get("separate_async", {}),
            max_off_policy_threshold=off_policy_threshold(tide.max_staleness),
            max_off_policy_strategy=tide.staleness_strategy, sampler_kwargs=sampler.sampler_kwargs,
            refill_fn=trainer._add_prompts_to_generate,
            filter_groups_metric=trainer._resolve_filter_groups_metric(),
            sync_refill_failed_groups=bool(sampler.get("sync_refill_failed_groups", False)),
            train_batch_size=int(config.data.train_batch_size),
            # a mini-batch trains as soon as it is ready: verl's 2 s poll would delay each by up to that long
            poll_interval=tide.sample_poll_s,
        )
        buffer.on_evicted = lambda keys: trainer.ref.forget_scored(keys)  # built in verl's __init__, before .ref
        buffer.while_waiting = trainer._while_waiting_for_data
        if tide.ctb.enabled:
            # when each group's last trajectory finished (CTB's router is told), once the rollout pool exists
            buffer.finish_times = lambda uids: (trainer.report.group_finish_times(uids, trainer.clock)
                                                if getattr(trainer, "report", None) else {})
        return buffer

    def _group_tags(self, partition_id: str, uid: str) -> dict[str, dict]:
        """{sample key: TransferQueue tag} of a group's trajectories (verl keys them `{uid}_{index}`)."""
        prefix = f"{uid}_"
        return {key: tag for key, tag in self.partitions[partition_id].items() if key.startswith(prefix)}

    def _group_size(self, partition_id: str, uid: str) -> tuple[int, int]:
        """(samples, tokens) of a group from its trajectories' TransferQueue tags."""
        tags = self._group_tags(partition_id, uid).values()
        return len(tags), sum(int(tag.get("seq_len", 0) or 0) for tag in tags)

    def _sync_metadata_from_transfer_queue(self):
        super()._sync_metadata_from_transfer_queue()
        now = self.clock()
        new = [uid for uid in sorted(self.finished_keys[TRAIN]) if not self.ledger.is_known(uid)]
        finished = self.finish_times(new) if new and self.finish_times is not None else {}
        for uid in new:
            samples, tokens = self._group_size(TRAIN, uid)
            self.ledger.group_ready(uid, samples, tokens)
            # ready when its last trajectory finished, not when verl's sampler polled (never in the future)
            self.readiness.micro_batch_ready(uid, max(samples, 1), t=min(now, finished.get(uid, now)))
            self.stamped["at_finish" if uid in finished else "at_poll"] += 1

    def _wait_for_next_poll(self, partition_id: str, last_debug_time: float) -> float:
        """verl 0.9.1's sampler calls this when it found too little ready and is about to sleep a poll: the trainer
        waits for data now (CTB's budget window decides then too, `trainer/budget_window.py`)."""
        if partition_id == TRAIN and self.while_waiting is not None:
            self.while_waiting()
        return super()._wait_for_next_poll(partition_id, last_debug_time)

    def groups_held(self) -> int:
        """GRPO groups TransferQueue holds for training now: submitted (verl writes a `pending` prompt key before
        it dispatches), running, finished or failed, and not yet consumed or evicted. Counted from what exists,
        not derived from the ledger's own counters: `settled + held == submitted` is the ledger's check."""
        self._sync_metadata_from_transfer_queue()
        return len(self.pending_keys[TRAIN] | self.running_keys[TRAIN] | self.finished_keys[TRAIN]
                   | self.failure_keys[TRAIN])

    def _evict_terminal_groups(self, global_steps, partition_id, eviction_reasons):
        if partition_id == TRAIN:
            stale, filtered, failed, _counts = eviction_reasons
            self._stop_if_nothing_succeeds(failed)
            for uid in failed | stale | filtered:
                outcome = (Outcome.DROPPED_FAILED if uid in failed
                           else Outcome.DROPPED_STALE if uid in stale else Outcome.DROPPED_FILTERED)
                samples, tokens = self._group_size(TRAIN, uid)
                self.ledger.settle(uid, outcome, samples, tokens)
                if self.on_evicted is not None:
                    self.on_evicted(list(self._group_tags(TRAIN, uid)))
                self.readiness.micro_batch_dropped(uid)
        return super()._evict_terminal_groups(global_steps, partition_id, eviction_reasons)

    def ready_groups(self, global_steps: int, limit: int, exclude: set[str] = frozenset()) -> list[tuple[str, dict]]:
        """Up to `limit` ready GRPO groups that verl will sample next (its order: oldest prompt first), as
        (uid, {sample key: tag}); stale, filtered and failed groups are left to verl's eviction.
        RA2P's ready-batch aggregation scores their Ref log-probs ahead of their mini-batch."""
        if limit <= 0:
            return []
        self._sync_metadata_from_transfer_queue()
        reasons = self._terminal_eviction_reasons(global_steps, TRAIN)
        sampleable = self._sampleable_terminal_keys(TRAIN, reasons) - set(exclude)
        steps = self.prompt_global_steps[TRAIN]
        chosen = sorted(sampleable, key=lambda uid: steps.get(uid, 0))[:limit]
        return [(uid, self._group_tags(TRAIN, uid)) for uid in chosen]

    def _stop_if_nothing_succeeds(self, failed: set[str]) -> None:
        """verl refills failed groups forever; when every group fails (a dead router or engine), stop."""
        total_failed = self.ledger.groups[Outcome.DROPPED_FAILED] + len(failed)
        if failed and total_failed >= self.max_failed_without_success and self.ledger.settled_groups == \
                self.ledger.groups[Outcome.DROPPED_FAILED]:
            raise RolloutFailing(
                f"verl-tide: {total_failed} GRPO groups failed and none was trained on; stopping instead of "
                "refilling forever. The rollout workers' log (AgentLoopWorker) has the first error.")

    def _materialize_batch(self, partition_id, selected_prompt_uids, partition_snapshot):
        if partition_id == TRAIN:
            now = self.clock()
            for uid in selected_prompt_uids:
                self.ledger.settle(uid, Outcome.CONSUMED)
                self.readiness.micro_batch_consumed(uid, t=now)
        return super()._materialize_batch(partition_id, selected_prompt_uids, partition_snapshot)

"""Evaluation overlapped with training (paper Sec. 3.2), for trainer `tide`.

verl runs `_validate()` between steps: the trainer blocks until every evaluation trajectory is back.
Here the step-i evaluation is submitted right after step i's weight sync and runs during step i+1's
rollout, on step-i weights: its results are collected before step i+1's sync (the trainer waits
there if evaluation is slower than a step), so no evaluation turn ever sees newer weights. Its
metrics are logged with step i+1's, tagged `tide/eval/model_step = i`.

verl's own `_validate` does the work, unchanged, on a thread: it is called on a view of the trainer
whose replay buffer is a separate instance for the `val` partition (verl's buffer keeps per-partition
state that two threads must not share) and whose `global_steps` stays i. TransferQueue's client runs
every call on its own event loop, so two threads may use it. Validation prompts carry the column
`ids.EVAL_FIELD`, which verl-tide's agent loops turn into evaluation request ids: CTB admits them
first (priority weight w1).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

import numpy as np

from verl_tide.core.request_ids import EVAL_FIELD


class EvalMarkedLoader:
    """verl's validation dataloader, each batch with a column saying its prompts are evaluation."""

    def __init__(self, loader: Any):
        self.loader = loader

    def __iter__(self) -> Iterator[dict]:
        for batch in self.loader:
            n = len(batch["raw_prompt"])
            batch[EVAL_FIELD] = np.array([True] * n, dtype=object)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


class _PinnedView:
    """The trainer as verl's `_validate` sees it: its own replay buffer and the step it evaluates."""

    def __init__(self, trainer: Any, replay_buffer: Any, step: int):
        self.__dict__.update(_trainer=trainer, replay_buffer=replay_buffer, global_steps=step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._trainer, name)


class OverlappedEvaluation:
    """Runs `validate(view)` in the background and hands its metrics back before the next weight sync."""

    def __init__(self, validate: Callable[[Any], dict], make_buffer: Callable[[], Any],
                 clock: Callable[[], float] = time.monotonic):
        self._validate, self._make_buffer, self._clock = validate, make_buffer, clock
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tide-eval")
        self._buffer: Any = None
        self._pending: Optional[tuple[concurrent.futures.Future, int, float]] = None

    @property
    def pending_step(self) -> Optional[int]:
        return None if self._pending is None else self._pending[1]

    def start(self, trainer: Any, step: int) -> None:
        if self._pending is not None:
            raise RuntimeError(f"evaluation of step {self._pending[1]} is still running; collect() it first")
        if self._buffer is None:
            self._buffer = self._make_buffer()
        view = _PinnedView(trainer, self._buffer, step)
        self._pending = (self._pool.submit(self._validate, view), step, self._clock())

    def collect(self) -> dict[str, Any]:
        """Wait for the running evaluation (if any); its metrics plus when and how long it ran."""
        if self._pending is None:
            return {}
        future, step, started = self._pending
        waited_from = self._clock()
        try:
            metrics = dict(future.result())
        finally:
            self._pending = None
        done = self._clock()
        metrics.update({"tide/eval/model_step": float(step), "tide/eval/overlapped_s": waited_from - started,
                        "tide/eval/trainer_wait_s": done - waited_from})
        return metrics

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def overlapped_evaluation(wanted: bool, reward_workers: Callable[[], Any], validate: Callable[[Any], dict],
                          clock: Callable[[], float], make_buffer: Callable[[], Any]) -> Optional[OverlappedEvaluation]:
    """The evaluation to overlap with training, or None: not `wanted` (`tide.overlap_eval` off or no
    `trainer.test_freq`), or no reward workers (said why: verl's validation puts the trainer's GPUs to sleep, and
    rewards computed there with them)."""
    if not wanted:
        return None
    if reward_workers() is None:
        print("verl-tide: evaluation is not overlapped: rewards are computed on the trainer's GPUs "
              "(reward.num_workers = 0), which verl's validation puts to sleep; set reward workers to overlap",
              flush=True)
        return None
    return OverlappedEvaluation(validate=validate, make_buffer=make_buffer, clock=clock)


def validation_buffer(config: Any, trainer_mode: str) -> Any:
    """A verl replay buffer for the `val` partition only (evaluation never evicts; no refills)."""
    from verl.trainer.ppo.v1.replay_buffer import ReplayBufferAsync

    return ReplayBufferAsync(
        trainer_mode=trainer_mode, trainer_config=config.trainer.v1.get("separate_async", {}),
        max_off_policy_threshold=None, max_off_policy_strategy="wait",
        sampler_kwargs=config.trainer.v1.sampler.sampler_kwargs)

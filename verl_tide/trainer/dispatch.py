"""verl's TransferQueue agent-loop manager, dispatching a batch without waiting on the agent-loop workers.

verl 0.9.1's `AgentLoopManagerTQ.generate_sequences` says it dispatches "without blocking", yet it `ray.get`s each
worker's `generate_sequences`, and a worker answers only when its event loop, busy running the agent loops already
in flight, gets to the call. On the every-part job (2026-12-04, py-spy on the trainer) that held trainer `tide` in
verl's `prepare_step` for ~3 s of step 1 while the rollout ran: CTB's budget window, which decides while the trainer
waits for data (`ctb/window.py`), could not decide then, and the engines sat idle 71% of that stretch at Alg. 1's
budget. This manager sends the batch and keeps the calls' refs; a dispatch that failed raises at the trainer's next
dispatch or its next look for data (`raise_dispatch_errors`), as verl's `ray.get` would have raised it sooner.

Selected by `+tide=enabled` through verl's own key, `actor_rollout_ref.rollout.agent.agent_loop_manager_class`.
"""

from __future__ import annotations

import threading
from typing import Any

import ray
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ

from verl_tide.trainer.verl_compat import reach


class TideAgentLoopManager(AgentLoopManagerTQ):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._dispatched: list[Any] = []  # refs of the workers' `generate_sequences` calls not yet seen to return
        self._lock = threading.Lock()  # tide's overlapped evaluation dispatches from a thread of its own

    def generate_sequences(self, prompts: Any) -> None:
        """verl's dispatch (the batch split over the agent-loop workers), without the wait for their answers."""
        self.raise_dispatch_errors()
        workers = reach(self, "agent_loop_workers", "the agent-loop worker handles verl dispatches batches to")
        refs = [worker.generate_sequences.remote(chunk) for worker, chunk in zip(workers, prompts.chunk(len(workers)),
                                                                                  strict=False)]
        with self._lock:
            self._dispatched += refs

    def raise_dispatch_errors(self) -> None:
        """Raise the error of a dispatch that failed (its batch never runs); forget those that returned."""
        with self._lock:
            if not self._dispatched:
                return
            done, self._dispatched = ray.wait(self._dispatched, num_returns=len(self._dispatched), timeout=0)
        ray.get(done)

    def pending_dispatches(self) -> int:
        return len(self._dispatched)

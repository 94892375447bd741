"""Trainer `tide`'s agent-loop manager (trainer/dispatch.py): verl's dispatch without the wait on the workers,
with a failed dispatch still raised. Real Ray actors stand in for verl's agent-loop workers (their
`generate_sequences` is what verl's manager calls); the manager runs in every trainer e2e job."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytestmark = pytest.mark.testbed


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _manager(workers):
    from verl_tide.trainer.dispatch import TideAgentLoopManager

    manager = TideAgentLoopManager.__new__(TideAgentLoopManager)  # verl's __init__ builds real workers
    manager._dispatched, manager._lock, manager.agent_loop_workers = [], threading.Lock(), workers
    return manager


def _worker_cls(ray):
    @ray.remote
    class Worker:
        """An agent-loop worker whose event loop answers a dispatch only once `release` is called."""

        def __init__(self):
            import tensordict  # noqa: F401  # verl's worker has these loaded; a cold import under load takes seconds
            import torch  # noqa: F401

            self.released = False
            self.batches = []

        async def generate_sequences(self, chunk):
            while not self.released:
                await asyncio.sleep(0.01)
            if bool(chunk["bad"].any()):
                raise RuntimeError("agent loop worker could not start the batch")
            self.batches.append(chunk["x"].tolist())

        async def release(self):
            self.released = True

        async def seen(self):
            return self.batches

    return Worker


def _batch(xs, bad=False):
    import torch
    from tensordict import TensorDict

    return TensorDict({"x": torch.tensor(xs), "bad": torch.tensor([bad] * len(xs))}, batch_size=[len(xs)])


def _until(condition, timeout_s=120.0):
    """Poll as the trainer does; the bound is generous because the suite runs verl jobs beside this on 2 cores."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"condition still false after {timeout_s:.0f} s"
        time.sleep(0.02)


def _started(ray, workers):
    """Wait for the actors' constructors, so the test times the dispatch, not a worker's start-up."""
    ray.get([w.seen.remote() for w in workers])
    return workers


def test_dispatch_returns_before_the_workers_answer_and_splits_the_batch(ray_local):
    ray = ray_local
    workers = _started(ray, [_worker_cls(ray).remote() for _ in range(2)])
    manager = _manager(workers)
    manager.generate_sequences(_batch([1, 2, 3, 4]))
    assert manager.pending_dispatches() == 2  # verl's manager would still be waiting on both workers here
    manager.raise_dispatch_errors()  # nothing answered yet: nothing to raise, both still pending
    assert manager.pending_dispatches() == 2
    ray.get([w.release.remote() for w in workers])
    _until(lambda: (manager.raise_dispatch_errors(), manager.pending_dispatches())[1] == 0)
    assert ray.get([w.seen.remote() for w in workers]) == [[[1, 2]], [[3, 4]]]  # verl's split, in order


def test_a_failed_dispatch_raises_at_the_next_look(ray_local):
    ray = ray_local
    (worker,) = _started(ray, [_worker_cls(ray).remote()])
    manager = _manager([worker])
    manager.generate_sequences(_batch([5], bad=True))
    ray.get(worker.release.remote())
    with pytest.raises(ray.exceptions.RayTaskError, match="could not start the batch"):
        _until(lambda: manager.raise_dispatch_errors() and False)
    assert manager.pending_dispatches() == 0

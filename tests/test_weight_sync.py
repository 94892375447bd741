"""The `tide_shm` checkpoint engine through verl's own registry and topology calls (no Ray needed)."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry

import verl_tide.weight_sync as ws


def _engines(tmp_path, actors=2, rollouts=2, timeout_s=600.0):
    cls = CheckpointEngineRegistry.get(ws.BACKEND)
    actor = [cls(bucket_size=1 << 20, is_master=(i == 0), root=str(tmp_path), timeout_s=timeout_s)
             for i in range(actors)]
    rollout = [cls(bucket_size=1 << 20, root=str(tmp_path), timeout_s=timeout_s) for _ in range(rollouts)]
    metadata = [e.prepare() for e in actor + rollout]
    a_kwargs, r_kwargs = cls.build_topology(actors, rollouts, metadata)
    for i, e in enumerate(actor):
        e.init_process_group(**{k: v[i] for k, v in a_kwargs.items()})
    for i, e in enumerate(rollout):
        e.init_process_group(**{k: v[i] for k, v in r_kwargs.items()})
    return actor, rollout


async def _sync(actor, rollout, weights, step):
    walked = []

    def gen(rank):
        for name, t in weights.items():
            walked.append(rank)
            yield name, t

    async def receive(e):
        return {name: t.clone() async for name, t in e.receive_weights(global_steps=step)}

    # Receivers start first and wait for the sender, as in verl's update_weights.
    recv = [asyncio.ensure_future(receive(e)) for e in rollout]
    await asyncio.sleep(0.05)
    metrics = await asyncio.gather(*[e.send_weights(gen(i), global_steps=step) for i, e in enumerate(actor)])
    return await asyncio.gather(*recv), metrics, walked


def test_every_rollout_worker_receives_the_exact_weights_and_the_file_is_removed(tmp_path):
    actor, rollout = _engines(tmp_path)
    weights = {"a.weight": torch.randn(8, 4), "b.bias": torch.arange(5, dtype=torch.float32)}
    received, metrics, walked = asyncio.run(_sync(actor, rollout, weights, step=3))
    for got in received:
        assert got.keys() == weights.keys()
        for name in weights:
            assert torch.equal(got[name], weights[name])
    # Every actor rank walks the (collective under FSDP) generator; only rank 0 writes and reports.
    assert walked.count(0) == walked.count(1) == len(weights)
    assert metrics[0]["tide/weight_sync/bytes"] == sum(t.numel() * 4 for t in weights.values())
    assert metrics[1] == {}
    folder = actor[0].folder
    assert os.path.isdir(folder)
    for e in actor + rollout:
        e.finalize()
    assert not os.path.exists(folder)


def test_a_receiver_without_a_sender_times_out_with_the_key_to_change(tmp_path):
    _actor, rollout = _engines(tmp_path, actors=1, rollouts=1, timeout_s=0.2)

    async def receive():
        return [x async for x in rollout[0].receive_weights(global_steps=1)]

    with pytest.raises(ws.WeightSyncTimeout, match=r"engine_kwargs\.tide_shm\.timeout_s"):
        asyncio.run(receive())


def test_topology_without_a_master_folder_is_a_clear_error():
    with pytest.raises(RuntimeError, match="did not report a weight folder"):
        ws.SharedMemoryCheckpointEngine.build_topology(1, 1, [{}, {}])

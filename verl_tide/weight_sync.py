"""Checkpoint-engine backend `tide_shm`: weight sync from trainer ranks to separate rollout ranks
through a shared-memory file on one node.

Why: verl's backends for separate rollout ranks (nccl, hccl, nixl, mooncake, kimi) need an
accelerator fabric. On a single node without one (the CPU test bed, or a GPU user's one-box
debugging run) the trainer still has to push new weights to its rollout ranks. Actor rank 0
writes the full tensors once into `/dev/shm`, every rollout worker maps the same file, and the
sender removes it after the sync. No process group is built, so ranks can be added or removed
between syncs (ERS) without rebuilding anything.

Select it with `actor_rollout_ref.rollout.checkpoint_engine.backend=tide_shm` and
`actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=verl_tide.weight_sync`
(verl imports that module in every process that builds a checkpoint engine).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

BACKEND = "tide_shm"
DEFAULT_ROOT = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class WeightSyncTimeout(TimeoutError):
    """A rollout worker waited longer than `timeout_s` for the trainer's weights."""


@CheckpointEngineRegistry.register(BACKEND)
class SharedMemoryCheckpointEngine(CheckpointEngine):
    """Actor rank 0 writes `step-N.pt` (+ a `.ready` marker); rollout workers poll for the marker and load.

    engine_kwargs (`checkpoint_engine.engine_kwargs.tide_shm.*`): `root` (a folder on a shared-memory
    file system, default /dev/shm), `timeout_s` (how long a receiver waits, default 600).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, root: str = DEFAULT_ROOT,
                 timeout_s: float = 600.0, **_: Any) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.root = root
        self.timeout_s = float(timeout_s)
        self.folder: str | None = None
        self.is_sender = False
        self.is_receiver = False
        self._written: str | None = None

    def prepare(self) -> dict[str, Any]:
        if not self.is_master:
            return {}
        folder = os.path.join(self.root, f"verl_tide_weights_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        os.makedirs(folder, exist_ok=True)
        return {"folder": folder}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        folder = metadata[0].get("folder")
        if not folder:
            raise RuntimeError(f"{BACKEND}: actor rank 0 did not report a weight folder (metadata {metadata[:1]})")
        actor = {"folder": [folder] * actor_wg_world_size,
                 "role": ["sender"] + ["walker"] * (actor_wg_world_size - 1)}
        rollout = {"folder": [folder] * rollout_world_size, "role": ["receiver"] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, folder: str, role: str) -> None:
        self.folder = folder
        self.is_sender = role == "sender"
        self.is_receiver = role == "receiver"

    def finalize(self) -> None:
        # Called after every receiver has loaded (verl waits for all update_weights first).
        if self.is_sender and self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        self.folder, self._written = None, None
        self.is_sender = self.is_receiver = False

    def _path(self, global_steps: int | None) -> str:
        assert self.folder is not None, f"{BACKEND}: init_process_group was not called before the sync"
        return os.path.join(self.folder, f"step-{global_steps if global_steps is not None else 'x'}.pt")

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict:
        # Every actor rank walks the generator: producing a full tensor is collective under FSDP.
        start = time.monotonic()
        state: dict[str, torch.Tensor] = {}
        nbytes = 0
        for name, tensor in weights:
            if self.is_sender:
                t = tensor.detach().to("cpu", copy=True).contiguous()
                state[name] = t
                nbytes += t.numel() * t.element_size()
        if not self.is_sender:
            return {}
        path = self._path(global_steps)
        tmp = path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
        with open(path + ".ready", "w") as f:
            f.write(str(len(state)))
        self._written = path
        return {"tide/weight_sync/bytes": float(nbytes), "tide/weight_sync/write_s": time.monotonic() - start}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        path = self._path(global_steps)
        deadline = time.monotonic() + self.timeout_s
        while not os.path.exists(path + ".ready"):
            if time.monotonic() > deadline:
                raise WeightSyncTimeout(
                    f"{BACKEND}: no weights at {path} after {self.timeout_s:.0f} s "
                    f"(checkpoint_engine.engine_kwargs.{BACKEND}.timeout_s); is actor rank 0 alive?")
            await asyncio.sleep(0.02)
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        for name, tensor in state.items():
            yield name, tensor

"""The Actor worker's side of ERS's trainer resize: its training state out of one FSDP group and into another of a
different size (`ers/train_state.py` does the torch part). Mixed into the Actor's worker class
(`ResizableActorWorker`, which trainer `tide` installs with `tide.ers.resize_trainer`); thin verl adapter.

verl 0.9.1 keeps the engine at `ActorRolloutRefWorker.actor.engine` (a `TrainingWorker`'s `.engine`); its public
`module`, `optimizer`, `lr_scheduler` and `to(...)` are all this uses.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.separation.engine_workers import DetachActorWorker
from verl.single_controller.base.decorator import Dispatch, register

from verl_tide.ers import train_state
from verl_tide.ra2p.handoff_worker import TideActorWorker


def training_engine(worker: Any) -> Any:
    """The FSDP engine of an Actor worker (`ActorRolloutRefWorker`) or of a bare `TrainingWorker`."""
    actor = getattr(worker, "actor", None)
    engine = getattr(actor, "engine", None) if actor is not None else getattr(worker, "engine", None)
    if engine is None or not all(hasattr(engine, a) for a in ("module", "optimizer", "lr_scheduler")):
        raise RuntimeError(f"{type(worker).__name__} holds no verl training engine with module/optimizer/"
                           f"lr_scheduler (verl 0.9.1's `ActorRolloutRefWorker.actor.engine`); is this the Actor role?")
    return engine


class _Resident:
    """The engine's offloaded state on its device for the duration (verl offloads between passes)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.model = bool(getattr(engine, "is_param_offload_enabled", False))
        self.optimizer = bool(getattr(engine, "is_optimizer_offload_enabled", False))

    def __enter__(self) -> Any:
        if self.model or self.optimizer:
            from verl.utils.device import get_device_name

            self.engine.to(device=get_device_name(), model=self.model, optimizer=self.optimizer, grad=False)
        return self.engine

    def __exit__(self, *exc: Any) -> None:
        if self.model or self.optimizer:
            self.engine.to(device="cpu", model=self.model, optimizer=self.optimizer, grad=False)


class TrainStateTransfer:
    """Worker methods (every rank, `ONE_TO_ALL`) the trainer calls around a rebuild of the Actor's group."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_train_state(self, path: str) -> None:
        with _Resident(training_engine(self)) as engine:
            train_state.save_train_state(engine.module, engine.optimizer, engine.lr_scheduler, path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def import_train_state(self, path: str) -> None:
        with _Resident(training_engine(self)) as engine:
            train_state.load_train_state(engine.module, engine.optimizer, engine.lr_scheduler, path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def train_state_digest(self) -> dict[str, str]:
        with _Resident(training_engine(self)) as engine:
            digest = train_state.train_state_digest(engine.module, engine.optimizer)
            if engine.lr_scheduler is not None:
                digest["lr_scheduler.last_lr"] = repr(engine.lr_scheduler.get_last_lr())
            return digest


RESHARDED_DIR = "tide_train_state"  # in verl's `global_step_N/actor`: the state at any world size (torch DCP)


class ResizableActor(TrainStateTransfer):
    """The transfer methods and a load that reads a checkpoint saved at another size; mixed into the Actor's worker."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        """verl's load; or, where verl's per-rank files are of another world size (saved while ERS had resized the
        Actor's group), the re-sharding copy trainer `tide` wrote beside them (`RESHARDED_DIR`). verl 0.9.1 names
        its files `model_world_size_{N}_rank_{r}.pt` and loads only at N."""
        import os

        import torch.distributed as dist

        resharded = os.path.join(local_path, RESHARDED_DIR) if local_path else ""
        own = os.path.join(local_path or "", f"model_world_size_{dist.get_world_size()}_rank_0.pt")
        if local_path and os.path.isdir(resharded) and not os.path.exists(own):
            TrainStateTransfer.import_train_state(self, resharded)
            print(f"verl-tide: the Actor's state loaded at {dist.get_world_size()} rank(s) from {resharded} (saved "
                  f"at another size by ERS's trainer resize)", flush=True)
            return None
        return DetachActorWorker.load_checkpoint(self, local_path, hdfs_path, del_local_after_load)


class ResizableActorWorker(ResizableActor, DetachActorWorker):
    """separate_async's Actor worker with the transfer methods: trainer `tide` installs it for the Actor role when
    `tide.ers.resize_trainer` is on."""


class ResizableHandoffActorWorker(ResizableActor, TideActorWorker):
    """The same for RA2P's hand-off Actor worker (a Ref model with `tide.ra2p.zero_copy`): its update takes the
    inputs its process's Ref pass kept."""

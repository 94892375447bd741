"""RA2P deferred-KL loss: gradients equal verl's `ppo_loss` with `use_kl_loss` for every KL type and
loss aggregation mode, on a tiny model (in-process here; through verl's FSDP engine in
test_ra2p_loss_fsdp.py)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from verl.utils import tensordict_utils as tu
from verl.workers.config import FSDPActorConfig
from verl.workers.utils.losses import ppo_loss
from verl_tide.ra2p.loss import SAMPLE_ID_KEY, DeferredKLLoss, RefLogProbStore, StaticRefSource

KL_TYPES = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "low_var_kl+"]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


def _nested(ts):
    return torch.nested.as_nested_tensor(ts, layout=torch.jagged)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32, attn_implementation="eager")


@pytest.fixture(scope="module")
def batch():
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 500, (n,), generator=g) for n in (5, 3, 7)]
    responses = [torch.randint(5, 500, (n,), generator=g) for n in (4, 6, 2)]
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    masks[1][-2:] = 0  # a padded/ignored tail
    return prompts, responses, masks, g


def _data(prompts, responses, masks, g, with_ref):
    n = len(prompts)
    old = [torch.randn(len(r), generator=g) * 0.1 - 6.0 for r in responses]
    adv = [torch.randn(len(r), generator=g) for r in responses]
    ref = [torch.randn(len(r), generator=g) * 0.3 - 6.0 for r in responses]
    tensors = {
        "prompts": _nested(prompts), "responses": _nested(responses),
        "response_mask": _nested(masks), "old_log_probs": _nested(old), "advantages": _nested(adv),
        SAMPLE_ID_KEY: torch.arange(100, 100 + n),
    }
    if with_ref:
        tensors["ref_log_prob"] = _nested(ref)
    total = int(sum(m.sum() for m in masks))
    data = tu.get_tensordict(tensor_dict=tensors, non_tensor_dict={"dp_size": 1, "batch_num_tokens": total,
                                                                   "global_batch_size": n})
    return data, {100 + i: r for i, r in enumerate(ref)}


def _log_probs(model, prompts, responses):
    """Engine layout: one flat tensor over all tokens, position t holding log p(token t+1)."""
    out = []
    for p, r in zip(prompts, responses):
        ids = torch.cat([p, r])[None]
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        nxt = torch.roll(ids[0], -1)
        out.append(logp.gather(-1, nxt[:, None])[:, 0])
    return _nested(out)


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("kl_type", KL_TYPES)
def test_gradients_equal_verl_ppo_loss_with_kl(model, batch, kl_type, agg):
    prompts, responses, masks, _ = batch
    cfg = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=3, rollout_n=1,
                          use_kl_loss=True, kl_loss_type=kl_type, kl_loss_coef=0.7, loss_agg_mode=agg)
    seed = hash((kl_type, agg)) % 1000
    data_ref, _ = _data(prompts, responses, masks, torch.Generator().manual_seed(seed), with_ref=True)
    data_def, refs = _data(prompts, responses, masks, torch.Generator().manual_seed(seed), with_ref=False)

    loss_verl, metrics_verl = ppo_loss(dataclasses.replace(cfg), {"log_probs": _log_probs(model, prompts, responses)},
                                       data_ref)
    g_verl = _grads(model, loss_verl)

    deferred = DeferredKLLoss(cfg, StaticRefSource(refs))
    loss_def, _ = deferred({"log_probs": _log_probs(model, prompts, responses)}, data_def)
    g_def = _grads(model, loss_def)

    assert len(g_def) == len(g_verl)
    for a, b in zip(g_def, g_verl):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    (kl_verl,) = metrics_verl["kl_loss"].values
    assert deferred.last_kl_loss == pytest.approx(float(kl_verl), rel=1e-5, abs=1e-7)
    # The forward value excludes the KL term (unknown until backward).
    assert float(loss_def) == pytest.approx(float(loss_verl) - 0.7 * float(kl_verl), rel=1e-5, abs=1e-6)


def test_backward_waits_for_ref_log_probs_streamed_later(model, batch):
    prompts, responses, masks, _ = batch
    cfg = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=3, rollout_n=1,
                          use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.5)
    data, refs = _data(prompts, responses, masks, torch.Generator().manual_seed(7), with_ref=False)
    store = RefLogProbStore()
    loss, _ = DeferredKLLoss(cfg, store)({"log_probs": _log_probs(model, prompts, responses)}, data)  # no ref yet

    def ref_rank():  # Ref finishes after the Actor's forward
        time.sleep(0.2)
        for sid, r in refs.items():
            store.put(sid, r)

    threading.Thread(target=ref_rank).start()
    t0 = time.monotonic()
    _grads(model, loss)
    assert time.monotonic() - t0 >= 0.15


def test_missing_ref_times_out_naming_the_samples(model, batch):
    prompts, responses, masks, _ = batch
    cfg = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=3, rollout_n=1,
                          use_kl_loss=True)
    data, _ = _data(prompts, responses, masks, torch.Generator().manual_seed(8), with_ref=False)
    loss, _ = DeferredKLLoss(cfg, RefLogProbStore(), timeout_s=0.1)({"log_probs": _log_probs(model, prompts, responses)}, data)
    with pytest.raises(TimeoutError, match=r"samples \[100, 101, 102\]"):
        loss.backward()


def test_a_micro_batch_that_carries_ref_log_probs_gets_verls_loss_unchanged(model, batch):
    """A colocated step (Ref ran before the update) under the same installed loss: verl's KL term, in the
    forward, and the source is never asked."""
    prompts, responses, masks, _ = batch
    cfg = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=3, rollout_n=1,
                          use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.5)
    data, _ = _data(prompts, responses, masks, torch.Generator().manual_seed(9), with_ref=True)
    loss_verl, metrics_verl = ppo_loss(cfg, {"log_probs": _log_probs(model, prompts, responses)}, data)
    g_verl = _grads(model, loss_verl)

    never = RefLogProbStore()  # empty: a deferred backward would time out
    deferred = DeferredKLLoss(cfg, never, timeout_s=0.1)
    loss, metrics = deferred({"log_probs": _log_probs(model, prompts, responses)}, data)
    for a, b in zip(_grads(model, loss), g_verl):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert float(loss) == pytest.approx(float(loss_verl), rel=1e-6)
    assert metrics["kl_loss"].values == metrics_verl["kl_loss"].values  # verl reports the KL itself
    assert deferred.last_kl_loss is None


def test_kl_tally_reports_an_update_as_verl_reduces_its_own_kl_loss():
    """verl: a mini-batch's `kl_loss` is the sum of its micro-batches' (each normalised by the whole mini-batch),
    averaged over ranks; an update's is the mean over its mini-batches. Two mini-batches of unequal size, 2 ranks,
    2 micro-batches per rank each."""
    import numpy as np
    from verl.utils.metric.utils import Metric

    from verl_tide.ra2p.loss import KLLossTally, kl_report

    # (rank, tokens, masked KL sum) per micro-batch, per mini-batch
    mini_batches = [[(0, 10, 1.0), (0, 30, 6.0), (1, 20, 2.0), (1, 40, 4.0)],
                    [(0, 5, 0.5), (0, 5, 1.5), (1, 15, 0.3), (1, 25, 0.2)]]
    tally, verl_per_mini_batch = KLLossTally(), []
    for micro in mini_batches:
        batch_tokens = sum(t for _, t, _ in micro)
        info = {"dp_size": 2, "batch_num_tokens": batch_tokens}
        per_rank = {0: Metric("sum"), 1: Metric("sum")}
        for rank, tokens, kl_sum in micro:
            value = kl_sum / batch_tokens * 2  # verl's agg_loss, token-mean
            per_rank[rank].append(value)
            tally.add(*kl_report(value, tokens, info))
        verl_per_mini_batch.append(Metric.aggregate_dp([per_rank[0], per_rank[1]]))
    assert tally.take() == pytest.approx(float(np.mean(verl_per_mini_batch)))
    assert tally.take() is None  # the next update starts empty

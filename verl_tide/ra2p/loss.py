"""RA2P's deferred-KL actor loss: the forward graph needs no ref log-probs; the backward fetches them.

verl's `ppo_loss` with `use_kl_loss` adds `kl_loss_coef * agg_loss(kl_penalty(log_prob, ref_log_prob))`,
so the Actor cannot start its forward pass until Ref has produced `ref_log_prob`. Here the KL term
is an autograd node whose forward returns 0 and whose backward obtains the micro-batch's ref
log-probs (by per-sample id, from a `RefLogProbSource`) and applies the KL gradient. Ref forward,
Actor forward and Actor backward can then overlap (paper Sec. 5.1, Fig. 6); the gradient is the
same as verl's, term for term. Install it with verl's `set_loss_fn` on the actor worker.

Mechanism layer: torch + verl's loss helpers, no Ray. The KL value itself is only known in the
backward pass, so it is reported through `DeferredKLLoss.last_kl_loss` and the source's `report_kl`
(aggregated as verl aggregates its own, `KLLossTally`) rather than the forward metrics.
A micro-batch whose data already carries `ref_log_prob` (a colocated step) gets verl's `ppo_loss` unchanged,
so trainer `tide` can switch RA2P's mode per step with one installed loss.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Optional, Protocol

import torch

SAMPLE_ID_KEY = "tide_sample_id"  # per-sample int64 tensor in the actor's data: the key ref log-probs are stored under


class RefLogProbSource(Protocol):
    def get(self, sample_ids: Sequence[int], timeout_s: float) -> list[torch.Tensor]:
        """Ref log-probs (1-D, response length) of these samples; blocks until they exist."""


class RefLogProbStore:
    """Thread-safe in-process source: Ref (or its receiver) `put`s per sample; the backward `get`s."""

    def __init__(self) -> None:
        self._data: dict[int, torch.Tensor] = {}
        self._cond = threading.Condition()

    def put(self, sample_id: int, ref_log_prob: torch.Tensor) -> None:
        with self._cond:
            self._data[int(sample_id)] = ref_log_prob.detach()
            self._cond.notify_all()

    def get(self, sample_ids: Sequence[int], timeout_s: float) -> list[torch.Tensor]:
        ids = [int(i) for i in sample_ids]
        with self._cond:
            if not self._cond.wait_for(lambda: all(i in self._data for i in ids), timeout=timeout_s):
                missing = [i for i in ids if i not in self._data]
                raise TimeoutError(f"ref log-probs of samples {missing[:8]} did not arrive within {timeout_s} s")
            return [self._data[i] for i in ids]

    def discard(self, sample_ids: Sequence[int]) -> None:
        with self._cond:
            for i in sample_ids:
                self._data.pop(int(i), None)


class StaticRefSource:
    """A source whose ref log-probs are all known up front (tests, and colocated hand-off)."""

    def __init__(self, ref_log_probs: dict[int, torch.Tensor]):
        self.ref_log_probs = {int(k): v.detach() for k, v in ref_log_probs.items()}

    def get(self, sample_ids: Sequence[int], timeout_s: float) -> list[torch.Tensor]:
        return [self.ref_log_probs[int(i)] for i in sample_ids]


class _DeferredKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, log_prob: torch.Tensor, spec: dict[str, Any]) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(log_prob.detach())
        ctx.spec = spec
        return log_prob.new_zeros(())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        from verl.trainer.ppo.core_algos import agg_loss, kl_penalty

        (saved,) = ctx.saved_tensors
        spec = ctx.spec
        refs = spec["source"].get(spec["sample_ids"], spec["timeout_s"])
        ref = torch.zeros_like(saved)
        for row, r in enumerate(refs):
            n = min(r.shape[0], ref.shape[1])
            ref[row, :n] = r[:n].to(ref.dtype)
        with torch.enable_grad():
            lp = saved.clone().requires_grad_(True)
            kld = kl_penalty(logprob=lp, ref_logprob=ref, kl_penalty=spec["kl_loss_type"])
            kl_loss = agg_loss(loss_mat=kld, loss_mask=spec["response_mask"], loss_agg_mode=spec["loss_agg_mode"],
                               **spec["global_batch_info"])
            (grad,) = torch.autograd.grad(kl_loss * spec["kl_loss_coef"], lp)
        spec["owner"].last_kl_loss = float(kl_loss.detach())
        report = getattr(spec["source"], "report_kl", None)
        if report is not None:  # the value exists only here: hand it to whoever logs the step
            report(*kl_report(float(kl_loss.detach()), int(spec["response_mask"].sum()), spec["global_batch_info"]))
        return grad_out * grad, None


def kl_report(kl_loss: float, tokens: int, global_batch_info: dict[str, Any]) -> tuple[float, float]:
    """One micro-batch's KL for `KLLossTally`: its value over the data-parallel size, and its share of the
    mini-batch. verl's `kl_loss` of a micro-batch is already normalised by the whole mini-batch (all ranks), and
    verl reports a mini-batch as the sum of its micro-batches, averaged over ranks; a plain mean over
    micro-batches would divide the KL by the number of micro-batches per rank."""
    dp_size = int(global_batch_info.get("dp_size") or 1)
    batch_tokens = global_batch_info.get("batch_num_tokens")
    share = tokens / float(batch_tokens) if batch_tokens else 1.0  # no global count: verl averages micro-batches
    return kl_loss / dp_size, share


class KLLossTally:
    """verl's `actor/kl_loss` of one update from its micro-batches' `kl_report`s: the mean over mini-batches of
    each mini-batch's KL. The shares of one mini-batch's micro-batches, over all ranks, add up to one, so
    sum(values) / sum(shares) is that mean however many mini-batches, epochs and micro-batches the update ran."""

    def __init__(self) -> None:
        self.values = 0.0
        self.shares = 0.0

    def add(self, value: float, share: float) -> None:
        self.values += value
        self.shares += share

    def take(self) -> Optional[float]:
        """The update's KL loss, or None when nothing was reported; starts the next update's tally."""
        values, shares = self.values, self.shares
        self.values = self.shares = 0.0
        return values / shares if shares > 0 else None


class DeferredKLLoss:
    """verl `ppo_loss` with the KL-loss term deferred to backward. Picklable, for `set_loss_fn`."""

    def __init__(self, config: Any, source: RefLogProbSource, timeout_s: float = 600.0):
        self.config = config
        self.pg_config = dataclasses.replace(config, use_kl_loss=False)  # verl's loss minus the KL term
        self.source = source
        self.timeout_s = timeout_s
        self.last_kl_loss: Optional[float] = None

    def __call__(self, model_output: dict[str, Any], data: Any, dp_group: Any = None):
        from verl.workers.utils.losses import ppo_loss
        from verl.workers.utils.padding import no_padding_2_padding

        if self.config.use_kl_loss and "ref_log_prob" in data.keys():
            # A colocated step (the mode can change per step): Ref ran before the update and its log-probs
            # came with the data, so the KL term is verl's own, in the forward graph.
            return ppo_loss(self.config, model_output, data, dp_group)
        loss, metrics = ppo_loss(self.pg_config, model_output, data, dp_group)
        if not self.config.use_kl_loss:
            return loss, metrics
        if SAMPLE_ID_KEY not in data.keys():
            raise KeyError(f"deferred-KL loss: the actor's data has no '{SAMPLE_ID_KEY}' field (per-sample ids "
                           "under which ref log-probs are stored)")
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        mask = data.select("response_mask").to_padded_tensor()["response_mask"].to(bool)
        spec = {
            "source": self.source,
            "sample_ids": data[SAMPLE_ID_KEY].tolist(),
            "timeout_s": self.timeout_s,
            "response_mask": mask,
            "kl_loss_type": self.config.kl_loss_type,
            "kl_loss_coef": self.config.kl_loss_coef,
            "loss_agg_mode": self.config.loss_agg_mode,
            "global_batch_info": dict(self.pg_config.global_batch_info),
            "owner": self,
        }
        metrics["kl_coef"] = self.config.kl_loss_coef
        return loss + _DeferredKL.apply(log_prob, spec), metrics

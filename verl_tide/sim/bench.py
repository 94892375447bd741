"""`verl-tide bench`: every system on one workload and cluster, a table, JSON and a plot.

Systems (names as in the JSON): `verl_sync`; the stock asynchronous systems of `STOCK_SYSTEMS` (verl
`separate_async` with and without its hybrid switch, verl `fully_async` with its `default` dynamic schedule,
an eager hybrid bound, StreamRL-like), each swept over the rollout ratio (verl's modes also over
`parameter_sync_step`) and reported at its best, every run also under `fixed_ratio_sweep`; `tide` (CTB + RA2P +
ERS) from the best stock system's split and from every split (`tide_start_ratio_sweep`); `tide_lend_actor` (the
same with `tide.ers.lend_actor`); under `what_if`, `tide_free_sync_lend` (tide_lend_actor with a weight sync of
zero seconds); the oracle bound (min(rollout capacity, trainer capacity) at the best split, full prefix reuse, no
waiting). `headline`: tide from its best start against the best stock system at its best split. `--ablation`
adds the paper's Table 2: RA2P, ERS and CTB one at a time on top of the best StreamRL-like system.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Optional

from verl_tide.core.config import ERSConfig
from verl_tide.sim.cluster import Result, Simulation, SystemSpec
from verl_tide.sim.hardware import Costs, Hardware
from verl_tide.sim.workload import Workload

RATIOS = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75)  # where the best lies at an end, the sweep is too short
PARAMETER_SYNC_STEPS = (1, 4)  # verl's asynchronous modes: the whole batch, or verl's default 4 mini-batches a sync

# verl's synchronous trainer (trainer_mode=sync): colocated, its sampler looking at the replay buffer every 2 s
VERL_SYNC: dict = {"sync": True, "poll_s": 2.0}

# The stock systems, each swept over the split (and verl's over parameter_sync_step) and reported at its best.
STOCK_SYSTEMS: dict[str, dict] = {
    # trainer_mode=separate_async, actor_rollout_ref.hybrid_engine=False: standalone rollout, the trainer takes PPO
    # mini-batches as its sampler (2 s poll) finds them ready, partial rollout
    "verl_separate_async": {"consume": "mini_batch", "poll_s": 2.0, "partial_rollout": True},
    # the same with hybrid replicas and hybrid_rollout.enable_switch (verl's adaptive threshold and cost gate)
    "verl_separate_async_switch": {"consume": "mini_batch", "poll_s": 2.0, "partial_rollout": True, "hybrid": True,
                                   "hybrid_switch": "separate_async"},
    # experimental/fully_async_policy with dynamic_schedule policy `default` (its message queue: no poll)
    "verl_fully_async_dynamic": {"consume": "mini_batch", "partial_rollout": True, "hybrid": True,
                                 "hybrid_switch": "fully_async_default"},
    # not a verl rule, kept as a stronger bound: hybrid replicas lent whenever the trainer waits for a whole batch
    "hybrid_eager": {"hybrid": True},
    # StreamRL-like: micro-batches streamed, a Ref<->Actor swap each
    "streamrl_fixed": {"consume": "stream_swap"},
}


def free_sync(hw: Hardware) -> Hardware:
    """`hw` with a weight sync of zero seconds (infinitely fast broadcast, no fixed part)."""
    return replace(hw, name=f"{hw.name}, free weight sync", sync_gb_s=float("inf"), sync_overhead_s=0.0)


class BenchError(ValueError):
    """A bench argument that does not fit the workload and cluster (the message names it and the allowed values)."""


def oracle_goodput(w: Workload, gpus: int, hw: Hardware = Hardware(), samples: int = 4000, seed: int = 0) -> float:
    """N GPUs split ideally between rollout and training, no waiting, every reusable prefix cached, decode at
    the largest batch the KV cache holds: N * tokens / (rollout GPU-s + train GPU-s) per trajectory."""
    c = Costs.of(w.model, hw)
    rng = random.Random(seed)
    roll_s = train_s = tokens = ctx_sum = 0.0
    for _ in range(samples):
        n = w.turns.sample_int(rng)
        prompt = w.prompt_tokens.sample_int(rng)
        actions = [w.action_tokens.sample_int(rng) for _ in range(n)]
        obs = [w.observation_tokens.sample_int(rng) for _ in range(n - 1)]
        total = prompt + sum(actions) + sum(obs)
        context, ctx_avg = prompt, 0.0
        for i in range(n):
            ctx_avg += context / n
            context += actions[i] + (obs[i] if i < n - 1 else 0)
            if w.context_window and context > w.context_window.max_tokens:
                context = w.context_window.keep_tokens
        ctx_sum += ctx_avg
        prefill = prompt / w.group_size + sum(obs)  # the group prompt once, then only new observations
        roll_s += prefill / c.prefill_tok_s
        tokens += total
        train_s += total * c.train_s_per_token
        roll_s += sum(actions) * _decode_s_per_token(c, ctx_avg)
    return gpus * tokens / (roll_s + train_s)


def _decode_s_per_token(c: Costs, ctx: float) -> float:
    batch = max(1.0, c.kv_capacity_tokens / max(ctx, 1.0))
    return (c.decode_weight_s + (c.decode_kv_s_per_token * ctx + c.decode_seq_s) * batch) / batch


# The paper's only component breakdown (Table 2: OSWorld, Qwen3-VL-4B, first 10 steps, k tokens/s), cumulative.
PAPER_TABLE2_OSWORLD_K_TOK_S = {"streamrl_fixed": 20.2, "ablation_ra2p": 23.1, "ablation_ra2p_ers": 31.8,
                                "ablation_tide": 33.3}
ABLATION_ADDS = {"streamrl_fixed": "baseline (StreamRL-like: a swap per micro-batch)", "ablation_ra2p": "+ RA2P",
                 "ablation_ra2p_ers": "+ ERS", "ablation_tide": "+ CTB (routing, overlapped evaluation) = tide"}


def run_bench(w: Workload, gpus: int, hw: Hardware = Hardware(), seed: int = 0, ratios=RATIOS,
              progress: Optional[Callable[[str], None]] = None, min_batch: Optional[int] = None,
              ablation: bool = False) -> dict:
    """`min_batch`: also run tide with ERS's elastic batch (`tide.ers.min_batch`, sequences, 1 to B_ideal) as system
    `tide_min_batch`: steps train what is ready within [min_batch, B_ideal], so fewer tokens per update.
    `ablation`: also add tide's components one at a time to the best StreamRL-like system, as the paper's Table 2
    does (`ablation` in the report)."""
    ideal = w.groups_for(gpus) * w.group_size
    if min_batch is not None and not 1 <= min_batch <= ideal:
        raise BenchError(f"--min-batch {min_batch}: must be 1 to {ideal} (B_ideal: {w.groups_for(gpus)} groups x "
                         f"{w.group_size} sequences on {gpus} GPUs)")

    def sim(spec: SystemSpec, tide_ers: ERSConfig = ERSConfig(), on: Hardware = hw) -> Result:
        t0 = time.monotonic()
        s = Simulation(w, gpus, spec, on, seed=seed, tide_ers=tide_ers)
        r = s.run()
        if spec.elastic:
            plan_ms.extend(s.ers_plan_ms)
        if progress:
            progress(f"  {spec.name:<28} goodput {r.goodput_tok_s:>9.0f} tok/s  ({time.monotonic() - t0:.1f}s)")
        return r

    plan_ms: list[float] = []
    parameter_sync_of: dict[str, int] = {}
    results: dict[str, Result] = {"verl_sync": sim(SystemSpec("verl_sync", micro_batch_per_gpu=8, **VERL_SYNC))}
    # every stock system at each split, and verl's modes at each parameter_sync_step of the sweep; each reported
    # at its best
    sweep: dict[str, Result] = {}
    best_of: dict[str, Result] = {}
    for system, rules in STOCK_SYSTEMS.items():
        runs = []
        for psync in (PARAMETER_SYNC_STEPS if rules.get("consume") == "mini_batch" else (None,)):
            for ratio in ratios:
                name = f"{system}_r{ratio:.3g}" + (f"_sync{psync}" if psync else "")
                spec = SystemSpec(name, rollout_ratio=ratio, **rules,
                                  **({"parameter_sync_step": psync} if psync else {}))
                sweep[name] = sim(spec)
                runs.append((sweep[name], psync))
        best, psync = max(runs, key=lambda run: run[0].goodput_tok_s)
        best_of[system] = best
        results[system] = replace(best, system=system)
        if psync:
            parameter_sync_of[system] = psync
    best_stock_name = max(best_of, key=lambda n: best_of[n].goodput_tok_s)
    best_stock = best_of[best_stock_name]
    best_stream = best_of["streamrl_fixed"]

    def tide(ratio: float, name: str = "tide", tide_ers: ERSConfig = ERSConfig(), lend: bool = False,
             on: Hardware = hw, resize: bool = False) -> Result:
        return sim(SystemSpec(name, rollout_ratio=ratio, routing="ctb", consume="ra2p", eval_blocks_trainer=False,
                              elastic=True, lend_actor=lend, resize_trainer=resize), tide_ers, on)

    best = best_stock.rollout_ratio
    results["tide"] = tide(best)
    # tide.ers.lend_actor (trainer tide's default without a Ref model; these jobs model one, which trainer tide
    # does not lend beside yet): the Actor's GPUs roll out through the cold start, before evaluations and after
    # updates when ERS expects the wait for data to pay for the switch.
    results["tide_lend_actor"] = tide(best, "tide_lend_actor", lend=True)
    # Not a system: the lend plus a weight sync that costs nothing (no pause of the rollout ranks, no wait before
    # the next step). What tide still waits there is neither the sync nor the cold start. Not an upper bound: a
    # faster trainer can leave the rollout idling longer at the staleness limit.
    what_if = {"tide_free_sync_lend": tide(best, "tide_free_sync_lend", lend=True, on=free_sync(hw))}
    if min_batch is not None:
        results["tide_min_batch"] = tide(best, "tide_min_batch", replace(ERSConfig(), min_batch=min_batch))
    # tide from every start ratio: ERS moves ranks between rollout and Ref only (a Ref rank takes Ref work off
    # the trainer, no rank joins rollout from it), so from a rollout-starved start it cannot find the split
    # for the user; this shows what a worse (or better) start costs.
    tide_starts = {f"tide_r{r:.3g}": results["tide"] if r == best else tide(r, f"tide_r{r:.3g}") for r in ratios}
    tide_best = max(tide_starts.values(), key=lambda r: r.goodput_tok_s)
    # ... and with ERS resizing the Actor's group (`ers/resize.py`; trainer tide with `tide.ers.resize_trainer=true`)
    resize_starts = {f"tide_resize_r{r:.3g}": tide(r, f"tide_resize_r{r:.3g}", resize=True) for r in ratios}
    worst_resized = min(resize_starts.values(), key=lambda r: r.goodput_tok_s)
    oracle = oracle_goodput(w, gpus, hw)
    ablation_report = None
    if ablation:
        r0 = best_stream.rollout_ratio
        steps_of = {"streamrl_fixed": results["streamrl_fixed"],
                    "ablation_ra2p": sim(SystemSpec("ablation_ra2p", rollout_ratio=r0, consume="ra2p")),
                    "ablation_ra2p_ers": sim(SystemSpec("ablation_ra2p_ers", rollout_ratio=r0, consume="ra2p",
                                                        elastic=True)),
                    "ablation_tide": results["tide"] if r0 == best else tide(r0, "ablation_tide")}
        base = steps_of["streamrl_fixed"].goodput_tok_s
        ablation_report = {"start_ratio": r0, "rows": [
            {"system": name, "adds": ABLATION_ADDS[name], **r.row(), "vs_baseline": round(r.goodput_tok_s / base, 4)}
            for name, r in steps_of.items()], "paper_table2_osworld_k_tok_s": PAPER_TABLE2_OSWORLD_K_TOK_S}
    return {
        "workload": w.name, "gpus": gpus, "hardware": hw.name, "steps": w.steps, "seed": seed,
        "systems": {name: {**r.row(), "rollout_ratio": r.rollout_ratio,
                           **({"parameter_sync_step": parameter_sync_of[name]} if name in parameter_sync_of else {})}
                    for name, r in results.items()},
        # the headline: tide from its best start against the best stock system at that system's best split
        "headline": {"best_stock": best_stock_name, "best_stock_rollout_ratio": best_stock.rollout_ratio,
                     "best_stock_goodput_tok_s": round(best_stock.goodput_tok_s, 1),
                     "tide_best_start": tide_best.rollout_ratio,
                     "tide_best_goodput_tok_s": round(tide_best.goodput_tok_s, 1),
                     "tide_vs_best_stock": round(tide_best.goodput_tok_s / best_stock.goodput_tok_s, 4),
                     "tide_waits_vs_best_stock": round((tide_best.rwt_s + tide_best.twt_s) /
                                                       max(best_stock.rwt_s + best_stock.twt_s, 1e-9) - 1, 4)},
        "fixed_ratio_sweep": {name: {**r.row(), "rollout_ratio": r.rollout_ratio} for name, r in sweep.items()},
        "tide_start_ratio_sweep": {name: {**r.row(), "rollout_ratio": r.rollout_ratio,
                                          "advised_rollout_ratio": r.split_advice and round(r.split_advice.rollout_ratio, 4)}
                                   for name, r in tide_starts.items()},
        "tide_resize_start_ratio_sweep": {name: {**r.row(), "rollout_ratio": r.rollout_ratio}
                                          for name, r in resize_starts.items()},
        # ERS resizing the Actor's group, from its worst start: against tide's best start (no resize) and the best
        # stock system at its best split
        "tide_resize_worst_start": {"rollout_ratio": worst_resized.rollout_ratio,
                                    "goodput_tok_s": round(worst_resized.goodput_tok_s, 1),
                                    "vs_tide_best_start": round(worst_resized.goodput_tok_s / tide_best.goodput_tok_s, 4),
                                    "vs_best_stock": round(worst_resized.goodput_tok_s / best_stock.goodput_tok_s, 4)},
        "oracle_goodput_tok_s": round(oracle, 1),
        # The most any system could make here, as multiples of the baselines (no system beats the oracle).
        "oracle_bound": {"vs_verl_sync": round(oracle / results["verl_sync"].goodput_tok_s, 3),
                         "vs_best_stock": round(oracle / best_stock.goodput_tok_s, 3)},
        "what_if": {name: {**r.row(), "rollout_ratio": r.rollout_ratio,
                           "regenerated_tokens": r.ledger["regenerated_tokens"]} for name, r in what_if.items()},
        "tide_steps": results["tide"].steps,
        "tide_ledger": results["tide"].ledger,
        "tide_ers_plan_ms_max": round(max(plan_ms, default=0.0), 4),
        # wall clock on the machine that ran the bench: the slowest of thousands is partly noise (GC, other work)
        "tide_ers_plan_ms": _quantiles(plan_ms),
        **({"ablation": ablation_report} if ablation_report else {}),
        **({"tide_min_batch": {"min_batch": min_batch, "ideal_batch": ideal,
                               "consumed_tokens": results["tide_min_batch"].consumed_tokens,
                               "tide_consumed_tokens": results["tide"].consumed_tokens,
                               "micro_batches_per_step": [s["micro_batches"] for s in results["tide_min_batch"].steps]}}
           if min_batch is not None else {}),
    }


def _quantiles(ms: list[float]) -> dict:
    """Median, 99th percentile and count of ERS's per-plan wall-clock times (ms)."""
    if not ms:
        return {"plans": 0, "median": 0.0, "p99": 0.0}
    ordered = sorted(ms)
    return {"plans": len(ordered), "median": round(ordered[len(ordered) // 2], 4),
            "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4)}


def format_table(report: dict) -> str:
    sync = report["systems"]["verl_sync"]["goodput_tok_s"]
    lines = [f"workload {report['workload']}, {report['gpus']} x {report['hardware']}, {report['steps']} steps",
             f"{'system':<28}{'ratio':>7}{'goodput tok/s':>15}{'vs sync':>9}{'RWT s':>9}{'TWT s':>9}"
             f"{'KV hit':>8}{'step s':>9}"]
    for name, row in report["systems"].items():
        ratio = "-" if row["rollout_ratio"] is None else f"{row['rollout_ratio']:.3g}"
        lines.append(f"{name:<28}{ratio:>7}{row['goodput_tok_s']:>15.0f}{row['goodput_tok_s'] / sync:>8.2f}x"
                     f"{row['rwt_s']:>9.0f}{row['twt_s']:>9.0f}{row['kv_hit_rate']:>8.1%}{row['step_time_s']:>9.1f}")
    oracle = report["oracle_goodput_tok_s"]
    tide = report["systems"]["tide"]["goodput_tok_s"]
    lines.append(f"{'oracle bound':<28}{'-':>7}{oracle:>15.0f}{oracle / sync:>8.2f}x")
    bound = report["oracle_bound"]
    lines.append(f"the most any system can make here (the oracle): {bound['vs_verl_sync']:.2f}x verl sync, "
                 f"{bound['vs_best_stock']:.2f}x the best stock system")
    head = report["headline"]
    best_name = head["best_stock"]
    fixed = best_fixed = report["systems"][best_name]
    tide_row = report["systems"]["tide"]
    waits_fixed, waits_tide = best_fixed["rwt_s"] + best_fixed["twt_s"], tide_row["rwt_s"] + tide_row["twt_s"]
    lines.append(f"headline: tide from its best start ({head['tide_best_start']:.3g}) "
                 f"{head['tide_vs_best_stock']:.2f}x the best stock system, {best_name} at its best split "
                 f"({head['best_stock_rollout_ratio']:.3g}); RWT+TWT {head['tide_waits_vs_best_stock']:+.0%}")
    lines.append(f"tide / oracle: {tide / oracle:.0%}; tide from {best_name}'s split: "
                 f"{tide / fixed['goodput_tok_s']:.2f}x it; "
                 f"RWT+TWT vs {best_name}: {waits_tide / max(waits_fixed, 1e-9) - 1:+.0%}; "
                 f"ERS plan {report.get('tide_ers_plan_ms', {}).get('median', 0):.3f} ms median, "
                 f"{report.get('tide_ers_plan_ms', {}).get('p99', 0):.3f} ms p99, "
                 f"{report.get('tide_ers_plan_ms_max', 0):.3f} ms slowest")
    lend = report["systems"].get("tide_lend_actor")
    if lend:
        waits_lend = lend["rwt_s"] + lend["twt_s"]
        lines.append(f"tide + tide.ers.lend_actor (the Actor's GPUs roll out as ERS decides, verl's hybrid replicas): "
                     f"goodput {lend['goodput_tok_s']:.0f} tok/s ({lend['goodput_tok_s'] / fixed['goodput_tok_s']:.2f}x "
                     f"the best stock), RWT+TWT vs it {waits_lend / max(waits_fixed, 1e-9) - 1:+.0%}")
    for name in ("tide", "tide_lend_actor"):
        row = report["systems"].get(name)
        if row and "twt_in_step_s" in row:
            lines.append(f"{name}'s waits: RWT {row['rwt_s']:.0f} s = weight syncs {row['rwt_sync_s']:.0f} + out of work "
                         f"{row['rwt_s'] - row['rwt_sync_s']:.0f} (under the staleness bound, or on environments); "
                         f"TWT {row['twt_s']:.0f} s = inside steps {row['twt_in_step_s']:.0f} + before them "
                         f"{row['twt_s'] - row['twt_in_step_s']:.0f}")
    free = report.get("what_if", {}).get("tide_free_sync_lend")
    if free:
        lines.append(f"what-if: the same with a weight sync that costs nothing: RWT+TWT vs the best stock "
                     f"{(free['rwt_s'] + free['twt_s']) / max(waits_fixed, 1e-9) - 1:+.0%} (RWT {free['rwt_s']:.0f} s, "
                     f"TWT {free['twt_s']:.0f} s: neither the sync nor the cold start)")
    if tide_row.get("twt_ref_idle_s"):
        lines.append(f"tide's TWT includes {tide_row['twt_ref_idle_s']:.0f} s of Ref ranks ERS lent idle beside the "
                     "Actor's passes (no data wait; counted as TWT)")
    elastic = report.get("tide_min_batch")
    if elastic:
        lines.append(f"tide_min_batch: tide.ers.min_batch = {elastic['min_batch']} of B_ideal {elastic['ideal_batch']} "
                     f"sequences; a step trains what is ready in that range, so the run's updates took "
                     f"{elastic['consumed_tokens']:,} tokens against tide's {elastic['tide_consumed_tokens']:,}")
    abl = report.get("ablation")
    if abl:
        paper = abl["paper_table2_osworld_k_tok_s"]
        lines.append(f"components added one at a time from rollout ratio {abl['start_ratio']:.3g} (paper Table 2, "
                     f"OSWorld, cumulative: " + ", ".join(f"{v / paper['streamrl_fixed']:.2f}x" for v in paper.values())
                     + "):")
        lines.extend(f"  {row['adds']:<48}{row['goodput_tok_s']:>10.0f} tok/s {row['vs_baseline']:>6.2f}x  "
                     f"RWT {row['rwt_s']:.0f} s  TWT {row['twt_s']:.0f} s" for row in abl["rows"])
    starts = report.get("tide_start_ratio_sweep", {})
    if starts:
        lines.append("tide by start ratio (ERS moves rollout<->Ref only; a rollout-starved start stays so, and ERS's "
                     "split advice names a start): " + ", ".join(
                         f"{row['rollout_ratio']:.3g}: {row['goodput_tok_s']:.0f}" + (
                             f" (advice {row['advised_rollout_ratio']:.3g})" if row.get("advised_rollout_ratio") else "")
                         for row in starts.values()))
    resized = report.get("tide_resize_start_ratio_sweep", {})
    if resized:
        worst = report["tide_resize_worst_start"]
        lines.append("tide by start ratio with ERS resizing the Actor's group (tide.ers.resize_trainer): " + ", ".join(
            f"{row['rollout_ratio']:.3g}: {row['goodput_tok_s']:.0f}" for row in resized.values())
            + f"; worst start {worst['vs_tide_best_start']:.2f}x tide's best start, {worst['vs_best_stock']:.2f}x the "
              "best stock system")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Goodput and waits per system (matplotlib, headless): goodput bars against the oracle bound, and each
    system's rollout and trainer waits stacked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["systems"])
    rows = [report["systems"][n] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.45 * len(names) + 1.8), sharey=True)
    ys = range(len(names))
    left.barh(ys, [r["goodput_tok_s"] for r in rows], color="#1f77b4")
    left.axvline(report["oracle_goodput_tok_s"], color="green", linestyle="--", label="oracle bound")
    left.set_yticks(list(ys), names, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("goodput, tok/s")
    left.legend(fontsize=8)
    rwt, twt = [r["rwt_s"] for r in rows], [r["twt_s"] for r in rows]
    right.barh(ys, rwt, color="#ff7f0e", label="rollout wait (RWT)")
    right.barh(ys, twt, left=rwt, color="#d62728", label="trainer wait (TWT)")
    right.set_xlabel("seconds")
    right.legend(fontsize=8)
    fig.suptitle(f"verl-tide bench: {report['workload']}, {report['gpus']} x {report['hardware']} (simulated)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(workload: str, gpus: int, json_path: Optional[str], plot_path: Optional[str], seed: int,
         steps: Optional[int], quiet: bool, min_batch: Optional[int] = None, ablation: bool = False) -> int:
    from verl_tide.sim.workload import load_workload

    w = load_workload(workload)
    if steps is not None:
        w = replace(w, steps=steps)
    t0 = time.monotonic()
    say = None if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if say:
        say(f"simulating {w.name} on {gpus} GPUs, {w.steps} steps: verl_sync, {len(STOCK_SYSTEMS)} stock systems at "
            f"{len(RATIOS)} splits (verl's also at parameter_sync_step {PARAMETER_SYNC_STEPS}), tide from "
            f"{len(RATIOS)} start ratios")
    report = run_bench(w, gpus, seed=seed, progress=say, min_batch=min_batch, ablation=ablation)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    print(format_table(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    if plot_path:
        plot(report, plot_path)
    return 0

"""`verl-tide bench`: every system on one workload and cluster, a table, JSON and a plot.

Systems (names as in the JSON): `verl_sync`; `verl_async_fixed` (verl separate_async / AReaL-like,
the best rollout ratio of the sweep, each ratio also reported as `verl_async_fixed_r0.XX`);
`verl_async_hybrid` (the same at its best ratio, plus verl's hybrid replicas: trainer GPUs roll out
while the trainer waits for a batch, at a switch cost each way);
`streamrl_fixed` (streaming with a Ref<->Actor swap per micro-batch, best ratio of the same sweep);
`tide` (CTB + RA2P + ERS, starting from the best fixed ratio, as the paper does); `tide_lend_actor` (the same
with `tide.ers.lend_actor`: the Actor's GPUs roll out as ERS decides); under `what_if`, `tide_free_sync_lend`
(tide_lend_actor with a weight sync of zero seconds); and the oracle bound: min(rollout capacity, trainer
capacity) at the best split, with full prefix reuse and no
waiting, also reported as multiples of verl sync and the best fixed ratio (`oracle_bound`). `--ablation` adds
the paper's Table 2: RA2P, ERS and CTB one at a time on top of the best StreamRL-like system.
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
    return (c.decode_weight_s + c.decode_kv_s_per_token * ctx * batch) / batch


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
    results: dict[str, Result] = {"verl_sync": sim(SystemSpec("verl_sync", sync=True, micro_batch_per_gpu=8))}
    sweep: dict[str, Result] = {}
    for ratio in ratios:
        sweep[f"verl_async_fixed_r{ratio:.3g}"] = sim(SystemSpec(f"verl_async_fixed_r{ratio:.3g}", rollout_ratio=ratio))
    best_async = max(sweep.values(), key=lambda r: r.goodput_tok_s)
    results["verl_async_fixed"] = replace(best_async, system="verl_async_fixed")
    results["verl_async_hybrid"] = sim(SystemSpec("verl_async_hybrid", rollout_ratio=best_async.rollout_ratio,
                                                  hybrid=True))
    stream: dict[str, Result] = {}
    for ratio in ratios:
        stream[f"streamrl_fixed_r{ratio:.3g}"] = sim(SystemSpec(f"streamrl_fixed_r{ratio:.3g}", rollout_ratio=ratio,
                                                                consume="stream_swap"))
    best_stream = max(stream.values(), key=lambda r: r.goodput_tok_s)
    results["streamrl_fixed"] = replace(best_stream, system="streamrl_fixed")

    def tide(ratio: float, name: str = "tide", tide_ers: ERSConfig = ERSConfig(), lend: bool = False,
             on: Hardware = hw) -> Result:
        return sim(SystemSpec(name, rollout_ratio=ratio, routing="ctb", consume="ra2p", eval_blocks_trainer=False,
                              elastic=True, lend_actor=lend), tide_ers, on)

    best = best_async.rollout_ratio
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
        "systems": {name: {**r.row(), "rollout_ratio": r.rollout_ratio} for name, r in results.items()},
        "fixed_ratio_sweep": {name: {**r.row(), "rollout_ratio": r.rollout_ratio}
                              for name, r in {**sweep, **stream}.items()},
        "tide_start_ratio_sweep": {name: {**r.row(), "rollout_ratio": r.rollout_ratio,
                                          "advised_rollout_ratio": r.split_advice and round(r.split_advice.rollout_ratio, 4)}
                                   for name, r in tide_starts.items()},
        "oracle_goodput_tok_s": round(oracle, 1),
        # The most any system could make here, as multiples of the baselines (no system beats the oracle).
        "oracle_bound": {"vs_verl_sync": round(oracle / results["verl_sync"].goodput_tok_s, 3),
                         "vs_best_fixed": round(oracle / best_async.goodput_tok_s, 3)},
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
             f"{'system':<20}{'ratio':>7}{'goodput tok/s':>15}{'vs sync':>9}{'RWT s':>9}{'TWT s':>9}"
             f"{'KV hit':>8}{'step s':>9}"]
    for name, row in report["systems"].items():
        ratio = "-" if row["rollout_ratio"] is None else f"{row['rollout_ratio']:.3g}"
        lines.append(f"{name:<20}{ratio:>7}{row['goodput_tok_s']:>15.0f}{row['goodput_tok_s'] / sync:>8.2f}x"
                     f"{row['rwt_s']:>9.0f}{row['twt_s']:>9.0f}{row['kv_hit_rate']:>8.1%}{row['step_time_s']:>9.1f}")
    oracle = report["oracle_goodput_tok_s"]
    tide = report["systems"]["tide"]["goodput_tok_s"]
    lines.append(f"{'oracle bound':<20}{'-':>7}{oracle:>15.0f}{oracle / sync:>8.2f}x")
    bound = report["oracle_bound"]
    lines.append(f"the most any system can make here (the oracle): {bound['vs_verl_sync']:.2f}x verl sync, "
                 f"{bound['vs_best_fixed']:.2f}x the best fixed async")
    fixed = report["systems"]["verl_async_fixed"]
    tide_row = report["systems"]["tide"]
    # the waits are compared with the best fixed-ratio system by goodput, StreamRL-like included
    best_name = max(("verl_async_fixed", "streamrl_fixed"), key=lambda n: report["systems"][n]["goodput_tok_s"])
    best_fixed = report["systems"][best_name]
    waits_fixed, waits_tide = best_fixed["rwt_s"] + best_fixed["twt_s"], tide_row["rwt_s"] + tide_row["twt_s"]
    lines.append(f"tide / oracle: {tide / oracle:.0%}; tide / best fixed async: {tide / fixed['goodput_tok_s']:.2f}x; "
                 f"RWT+TWT vs the best fixed ratio ({best_name}): {waits_tide / max(waits_fixed, 1e-9) - 1:+.0%}; "
                 f"ERS plan {report.get('tide_ers_plan_ms', {}).get('median', 0):.3f} ms median, "
                 f"{report.get('tide_ers_plan_ms', {}).get('p99', 0):.3f} ms p99, "
                 f"{report.get('tide_ers_plan_ms_max', 0):.3f} ms slowest")
    lend = report["systems"].get("tide_lend_actor")
    if lend:
        waits_lend = lend["rwt_s"] + lend["twt_s"]
        lines.append(f"tide + tide.ers.lend_actor (the Actor's GPUs roll out as ERS decides, verl's hybrid replicas): "
                     f"goodput {lend['goodput_tok_s']:.0f} tok/s ({lend['goodput_tok_s'] / fixed['goodput_tok_s']:.2f}x "
                     f"best fixed), RWT+TWT vs the best fixed ratio {waits_lend / max(waits_fixed, 1e-9) - 1:+.0%}")
    for name in ("tide", "tide_lend_actor"):
        row = report["systems"].get(name)
        if row and "twt_in_step_s" in row:
            lines.append(f"{name}'s waits: RWT {row['rwt_s']:.0f} s = weight syncs {row['rwt_sync_s']:.0f} + out of work "
                         f"{row['rwt_s'] - row['rwt_sync_s']:.0f} (under the staleness bound, or on environments); "
                         f"TWT {row['twt_s']:.0f} s = inside steps {row['twt_in_step_s']:.0f} + before them "
                         f"{row['twt_s'] - row['twt_in_step_s']:.0f}")
    free = report.get("what_if", {}).get("tide_free_sync_lend")
    if free:
        lines.append(f"what-if: the same with a weight sync that costs nothing: RWT+TWT vs the best fixed ratio "
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
        say(f"simulating {w.name} on {gpus} GPUs, {w.steps} steps: verl_sync, 2 x {len(RATIOS)} fixed ratios, "
            f"hybrid, tide from {len(RATIOS)} start ratios")
    report = run_bench(w, gpus, seed=seed, progress=say, min_batch=min_batch, ablation=ablation)
    report["wall_s"] = round(time.monotonic() - t0, 1)
    print(format_table(report))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)
    if plot_path:
        plot(report, plot_path)
    return 0

"""The simulator against the test bed: its predicted goodput beside the measured head-to-head, per system.

Inputs, all measured (nothing here is fitted to the goodputs): the test bed's hardware profile and the demo job's
workload from `benchmarks/testbed_calibrate.py` (engine, trainer and environment probes), and the measured
head-to-head (`benchmarks/e2e_compare.py --device-budgets ...`, its JSON) under the same device budgets. The
simulator runs each system of the head-to-head that it models, with the settings the head-to-head gave it (the
split, one weight sync a step, the sampler poll, the staleness bound), over `--seeds`; the report puts the mean
prediction beside the measured goodput pooled over the head-to-head's rounds, says whether each is within 15%, and
whether the systems come out in the same order. Systems the simulator does not model are listed as such.

    python benchmarks/sim_validation.py   # writes benchmarks/results/sim_validation_testbed_cpu.{json,png}

`--measured` repeated pools later sittings' runs of the same job (each system's runs, their mean). Beside the
strict order of the means, the report counts the pairs of systems the runs themselves order (no run of one
within the other's range) and whether the prediction agrees on each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

from verl_tide.sim.bench import STOCK_SYSTEMS, VERL_SYNC
from verl_tide.sim.cluster import Simulation, SystemSpec
from verl_tide.sim.hardware import load_profile
from verl_tide.sim.workload import load_workload
from verl_tide.testing.compare import LENDING_BESIDE_REF, NO_LENDING, WHAT_IF

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.15  # the target: every prediction within 15% of the measured goodput
DT_S = 0.05  # the simulator's tick: the demo's turns last tenths of a second
# the head-to-head's jobs (benchmarks/e2e_compare.py --preset): fake GPUs, tide's rollout GPUs, a Ref model
JOBS = {"demo": (2, 1, False), "every_part": (3, 2, True)}


def specs(gpus: int, tide_rollout_gpus: int, ref_model: bool) -> dict[str, SystemSpec | None]:
    """The head-to-head's systems (their names in its JSON) as the simulator runs them, at every split the fake
    GPUs allow; None: not modelled. `ref_model`: the job has verl's Ref model (KL loss), so trainer tide does not
    lend the Actor's GPUs unless asked (`tide.ers.lend_actor=auto`)."""
    switch = {**STOCK_SYSTEMS["verl_separate_async_switch"], "parameter_sync_step": 1}
    plain = {**STOCK_SYSTEMS["verl_separate_async"], "parameter_sync_step": 1}
    out: dict[str, SystemSpec | None] = {
        "verl sync": SystemSpec("verl_sync", **VERL_SYNC),
        # the hybrid engine time-sharing every GPU between rollout and training, one step off-policy: no model yet
        "verl colocate_async": None,
    }

    def tide(name: str, ratio: float, lend: bool) -> SystemSpec:
        return SystemSpec(name, rollout_ratio=ratio, routing="ctb", consume="ra2p", eval_blocks_trainer=False,
                          elastic=True, lend_actor=lend)

    for rollout in range(1, gpus):
        ratio, split = rollout / gpus, f"{gpus - rollout}T/{rollout}R"
        out[f"verl separate_async {split}"] = SystemSpec("separate_async", rollout_ratio=ratio, **plain)
        out[f"verl separate_async {split} + hybrid switch"] = SystemSpec("separate_async_switch", rollout_ratio=ratio,
                                                                         **switch)
        out[f"{WHAT_IF}verl separate_async {split} + hybrid switch, 0.2 s poll"] = SystemSpec(
            "separate_async_switch_poll02", rollout_ratio=ratio, **{**switch, "poll_s": 0.2})
        # verl's own fully_async trainer, its dynamic schedule's `default` policy lending the trainer's hybrid
        # replicas, the weights synced after every step (the head-to-head's trigger_parameter_sync_step=1)
        out[f"verl fully_async {split} + dynamic schedule"] = SystemSpec(
            "fully_async_dynamic", rollout_ratio=ratio,
            **{**STOCK_SYSTEMS["verl_fully_async_dynamic"], "parameter_sync_step": 1})
        if rollout != tide_rollout_gpus:
            out[f"tide {split}"] = tide(f"tide_{split}", ratio, lend=not ref_model)
    # `+tide=enabled` as a user gets it: without a Ref model the Actor's GPU is lent (tide.ers.lend_actor=auto)
    ratio = tide_rollout_gpus / gpus
    out["tide"] = tide("tide", ratio, lend=not ref_model)
    out[LENDING_BESIDE_REF if ref_model else NO_LENDING] = tide("tide_other_lend", ratio, lend=ref_model)
    return out


def measured_goodput(results: list[dict], after_step1: bool) -> dict:
    """One system's measured goodput: every run it has in the head-to-head reports (sittings pooled, each run
    once), their mean."""
    key = "goodput_after_step1" if after_step1 else "goodput"
    runs = [g for r in results for g in (r.get(f"{key}_runs") or [r[f"{key}_tok_s"]])]
    return {"mean": statistics.fmean(runs), "runs": runs}


def measured_systems(reports: list[dict]) -> dict[str, list[dict]]:
    """Each system's results over the head-to-head reports, in the order the first report names them."""
    out: dict[str, list[dict]] = {}
    for report in reports:
        for name, r in report.items():
            if isinstance(r, dict) and "goodput_tok_s" in r:
                out.setdefault(name, []).append(r)
    return out


def source(path: Path, report: dict) -> dict:
    return {"file": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
            "date": report.get("date"), "commit": report.get("commit"),
            "device_budgets": report.get("device_budgets"), "repeats": report.get("repeats"),
            "clock": report.get("clock")}


def after_step1_tok_s(r) -> float:
    """The simulated run's goodput from the end of step 1 on (the demo's trajectories all have one length, so
    every step consumes the same tokens), as `compare.wall_clock_summary` measures it."""
    n = len(r.steps)
    return r.consumed_tokens * (n - 1) / n / (r.steps[-1]["end_s"] - r.steps[0]["end_s"])


def order(values: dict[str, float]) -> list[str]:
    return sorted(values, key=values.__getitem__, reverse=True)


def resolved_pairs(systems: dict[str, dict], suffix: str = "") -> dict:
    """The pairs of systems whose measured runs do not overlap (every run of one above every run of the other),
    and whether the prediction orders each the same way. The strict order compares means that a second run can
    swap; a pair whose runs interleave is one the measurement has not ordered."""
    names = list(systems)
    resolved, wrong = [], []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = systems[a][f"measured{suffix}_runs_tok_s"], systems[b][f"measured{suffix}_runs_tok_s"]
            if min(ra) > max(rb) or min(rb) > max(ra):
                hi, lo = (a, b) if min(ra) > max(rb) else (b, a)
                resolved.append([hi, lo])
                if systems[hi][f"predicted{suffix}_tok_s"] <= systems[lo][f"predicted{suffix}_tok_s"]:
                    wrong.append([hi, lo])
    return {"pairs": len(names) * (len(names) - 1) // 2, "resolved": len(resolved), "in_order": len(resolved) - len(wrong),
            "out_of_order": wrong}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="testbed-cpu")
    ap.add_argument("--workload", default="testbed_demo")
    ap.add_argument("--measured", action="append", default=None,
                    help="a head-to-head's JSON (benchmarks/e2e_compare.py); repeat it to pool later sittings' runs "
                         "of the same job under the same budgets (default: "
                         "benchmarks/results/e2e_compare_budgeted_cpu.json)")
    ap.add_argument("--job", choices=("demo", "every_part"), default="demo",
                    help="the head-to-head's job: its fake GPUs, tide's split and whether it has a Ref model")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/sim_validation_testbed_cpu.json"))
    ap.add_argument("--plot", default=str(ROOT / "benchmarks/results/sim_validation_testbed_cpu.png"))
    args = ap.parse_args(argv)
    hw = load_profile(args.profile)
    w = load_workload(args.workload)
    paths = [Path(p) for p in (args.measured or [ROOT / "benchmarks/results/e2e_compare_budgeted_cpu.json"])]
    reports = [json.loads(p.read_text()) for p in paths]
    if len({json.dumps(r.get("device_budgets"), sort_keys=True) for r in reports}) != 1:
        raise SystemExit(f"--measured: the head-to-heads ran under different device budgets "
                         f"({[r.get('device_budgets') for r in reports]})")
    measured = measured_systems(reports)
    t0 = time.monotonic()
    systems = {}
    gpus, tide_rollout_gpus, ref_model = JOBS[args.job]
    for name, spec in specs(gpus, tide_rollout_gpus, ref_model).items():
        if name not in measured:
            continue
        m, m1 = measured_goodput(measured[name], False), measured_goodput(measured[name], True)
        row = {"measured_tok_s": round(m["mean"], 1), "measured_runs_tok_s": [round(x, 1) for x in m["runs"]],
               "measured_after_step1_tok_s": round(m1["mean"], 1),
               "measured_after_step1_runs_tok_s": [round(x, 1) for x in m1["runs"]]}
        if spec is None:
            systems[name] = {**row, "predicted_tok_s": None, "note": "not modelled by the simulator"}
            continue
        preds = [Simulation(w, gpus, spec, hw, seed=s, dt=DT_S).run() for s in range(args.seeds)]
        p = statistics.fmean(r.goodput_tok_s for r in preds)
        p1 = statistics.fmean(after_step1_tok_s(r) for r in preds)
        systems[name] = {**row, "predicted_tok_s": round(p, 1),
                         "predicted_seeds_tok_s": [round(r.goodput_tok_s, 1) for r in preds],
                         "predicted_over_measured": round(p / m["mean"], 4),
                         "within_tolerance": abs(p / m["mean"] - 1) <= TOLERANCE,
                         "predicted_after_step1_tok_s": round(p1, 1),
                         "predicted_over_measured_after_step1": round(p1 / m1["mean"], 4),
                         "within_tolerance_after_step1": abs(p1 / m1["mean"] - 1) <= TOLERANCE,
                         "predicted_step_s": round(statistics.fmean(
                             statistics.fmean(s["end_s"] - s["start_s"] for s in r.steps) for r in preds), 3)}
    modelled = {n: r for n, r in systems.items() if r["predicted_tok_s"] is not None}
    order_pred = order({n: r["predicted_tok_s"] for n, r in modelled.items()})
    order_meas = order({n: r["measured_tok_s"] for n, r in modelled.items()})
    order_pred1 = order({n: r["predicted_after_step1_tok_s"] for n, r in modelled.items()})
    order_meas1 = order({n: r["measured_after_step1_tok_s"] for n, r in modelled.items()})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    report = {
        "date": date.today().isoformat(), "commit": commit, "job": f"{args.job} (test bed)", "gpus": gpus,
        "profile": hw.name, "profile_source": hw.measured.source if hw.measured else "",
        "workload": w.name, "seeds": args.seeds, "tick_s": DT_S, "tolerance": TOLERANCE,
        "measured": {**source(paths[0], reports[0]),
                     **({"more": [source(p, r) for p, r in zip(paths[1:], reports[1:])]} if len(paths) > 1 else {})},
        "systems": systems,
        "all_within_tolerance": all(r["within_tolerance"] for r in modelled.values()),
        "same_order": order_pred == order_meas, "order_predicted": order_pred, "order_measured": order_meas,
        "measured_order_resolved_pairs": resolved_pairs(modelled),
        "measured_order_resolved_pairs_after_step1": resolved_pairs(modelled, "_after_step1"),
        "all_within_tolerance_after_step1": all(r["within_tolerance_after_step1"] for r in modelled.values()),
        "same_order_after_step1": order_pred1 == order_meas1, "order_predicted_after_step1": order_pred1,
        "order_measured_after_step1": order_meas1,
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(f"{'system':<62} {'predicted':>9} {'measured':>9} {'ratio':>6} | {'from step 2 on: pred':>20} {'meas':>6} "
          f"{'ratio':>6}")
    for name, r in systems.items():
        if r["predicted_tok_s"] is None:
            print(f"{name:<62} {'-':>9} {r['measured_tok_s']:>9.0f} {'':>6} | {'not modelled':>20} "
                  f"{r['measured_after_step1_tok_s']:>6.0f}")
            continue
        print(f"{name:<62} {r['predicted_tok_s']:>9.0f} {r['measured_tok_s']:>9.0f} "
              f"{r['predicted_over_measured']:>6.2f} | {r['predicted_after_step1_tok_s']:>20.0f} "
              f"{r['measured_after_step1_tok_s']:>6.0f} {r['predicted_over_measured_after_step1']:>6.2f}")
    print(f"whole clock: all within {TOLERANCE:.0%}: {report['all_within_tolerance']}, same order: "
          f"{report['same_order']}; from step 2 on: {report['all_within_tolerance_after_step1']}, "
          f"{report['same_order_after_step1']}")
    for key, label in (("", "whole clock"), ("_after_step1", "from step 2 on")):
        pairs = report[f"measured_order_resolved_pairs{key}"]
        print(f"{label}: {pairs['resolved']} of {pairs['pairs']} pairs ordered by the runs (no overlap), "
              f"{pairs['in_order']} of them in the predicted order" +
              (f"; out of order: {pairs['out_of_order']}" if pairs["out_of_order"] else ""))
    Path(args.json).write_text(json.dumps(report, indent=1))
    plot(report, args.plot)
    return 0


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(n, r) for n, r in report["systems"].items() if r["predicted_tok_s"] is not None]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    xs = range(len(rows))
    labels = [n.replace("verl separate_async", "sep_async").replace("what-if: ", "").replace(" + hybrid switch", "+sw")
              .replace("tide.ers.", "") for n, _ in rows]
    for ax, suffix, title in ((axes[0], "", "whole clock (from the first /start)"),
                              (axes[1], "_after_step1", "from step 2 on")):
        ax.bar([x - 0.2 for x in xs], [r[f"measured{suffix}_tok_s"] for _, r in rows], 0.4,
               label="measured (mean of rounds, range)")
        ax.bar([x + 0.2 for x in xs], [r[f"predicted{suffix}_tok_s"] for _, r in rows], 0.4, label="predicted")
        for x, (_, r) in zip(xs, rows):
            runs = r[f"measured{suffix}_runs_tok_s"]
            ax.plot([x - 0.2, x - 0.2], [min(runs), max(runs)], color="black")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=7)
        ax.set_title(title, fontsize=9)
    axes[0].set_ylabel("goodput, tok/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"simulator vs test bed, {report['job']} ({report['measured']['device_budgets']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())

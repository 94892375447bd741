"""The demo's job under verl sync, colocate_async, separate_async (hybrid replicas, with and without the hybrid
switch, every split) and `+tide=enabled`, on one wall clock (issue 24; `verl_tide/testing/compare.py` says how).

    python benchmarks/e2e_compare.py --workdir outputs/compare --json outputs/compare/compare.json
    python benchmarks/e2e_compare.py --preset every_part --workdir outputs/every_part --json ...

Presets: `demo` (the demo's job: 2 fake GPUs, no Ref model) and `every_part` (issue 24: every part of tide at
once: a Ref model with verl's KL loss, 3 fake GPUs with 2 rollout ranks under tide, rollout engines with a KV
cache small enough that resident contexts contend, environment latency doubled (tiny_slow's heavy tail), an
evaluation every 3 steps; it reports which of tide's mechanisms acted beside the goodputs).

Prints a table, `goodput tide/best stock: N.NNx (best stock = MODE)` and `goodput tide/sync: N.NNx`, writes the
JSON (per system: start-up, wall, tokens, goodputs, per-step reward, step time, weight sync, waits, staleness)
and reward curves against step and against wall-clock (PNG). Each system gets a fresh environment service, whose
first /start is that run's clock zero. Runs one after another (two jobs side by side on 2 cores each take
nearly twice as long: docs/testbed.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from verl_tide.testing.compare import (POLL_AS_VERL, REWARD, best_stock, chosen, is_tide, over_repeats,
                                       run_order, run_system, systems)
from verl_tide.testing import timeline
from verl_tide.testing.demo import PRESETS, plot_rewards, preset_job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, default="demo")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=None,
                    help="prompts per step (data.train_batch_size; demo 4, every_part 6: 12 samples split over "
                         "every trainer GPU count 3 fake GPUs allow)")
    ap.add_argument("--n", type=int, default=2, help="trajectories per prompt (GRPO group size)")
    ap.add_argument("--gpus", type=int, default=None, help="fake GPUs per job (demo 2, every_part 3)")
    ap.add_argument("--seed", type=int, default=0,
                    help="episodes, verl's data order and the rollout's sampling seed (as learning_parity.py)")
    ap.add_argument("--max-staleness", type=int, default=1, help="the staleness bound every async system gets")
    ap.add_argument("--tide-rollout-gpus", type=int, default=None,
                    help="fake GPUs tide rolls out on (demo 1, every_part all but one); the rest train")
    ap.add_argument("--latency-scale", type=float, default=None,
                    help="multiply environment latency (0 = none; demo 1, every_part 2)")
    ap.add_argument("--only", action="append", default=None, help="run only this system (its whole name), or those whose name contains this")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=1500.0, help="seconds per run")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds over every system, the order reversed every other round; each system's result is "
                         "the mean of its rounds (steps and curves of the round nearest it), with every round's "
                         "goodput beside it")
    ap.add_argument("--first-round", type=int, default=1,
                    help="number the rounds from this one (a later sitting's round 2 runs in reverse order)")
    ap.add_argument("--timeline", action="store_true",
                    help="also record where each run's clock went (the trainer's phases, each engine's load polled "
                         "from its /metrics every 1 s, vLLM's stats on for every system): a table, timeline.png in --workdir, and the JSON; the "
                         "poll loads the engines, so do not take headline figures from these runs")
    ap.add_argument("--attribution", action="store_true",
                    help=f"also run '{POLL_AS_VERL}' (tide.sample_poll_s=2: how much of tide's number is its "
                         "faster look for ready groups)")
    ap.add_argument("--device-budgets", default=None, metavar="CORES",
                    help="fake GPUs that idle like GPUs: a CPU quota of CORES per fake GPU (root and a writable "
                         "cgroup CPU controller; testing/device_budgets.py); 'auto': half the machine's cores "
                         "shared by the fake GPUs, the other half the host's, where cgroups are writable, else "
                         "none; 'none' or left out: every fake GPU shares the machine's cores")
    ap.add_argument("--report-partial", action="append", default=None, metavar="PARTIAL_JSON",
                    help="run nothing: report the runs sittings cut short kept in their <json>.partial (repeat it "
                         "to pool sittings under the same budgets; each system with the runs it finished, its "
                         "failed runs listed beside them)")
    ap.add_argument("--host-cores", type=float, default=None,
                    help="with --device-budgets: the host side's quota (default: the cores the fake GPUs leave)")
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="verl_tide_compare_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    pj = preset_job(args.preset, work, args.steps, args.batch, args.n, args.gpus, seed=args.seed,
                    latency_scale=args.latency_scale, tide_rollout_gpus=args.tide_rollout_gpus)
    job, extra, latency, tide_rollout_gpus = pj.job, pj.extra, pj.latency_scale, pj.tide_rollout_gpus
    cores, host = budgets_asked(args.device_budgets, args.host_cores, job.n_gpus)
    budgets = device_budgets_env(cores, host)
    available = {s.name: s for s in systems(job, args.max_staleness, tide_rollout_gpus=tide_rollout_gpus,
                                            attribution=args.attribution)}
    failed: dict[str, list[dict]] = {}
    if args.report_partial:  # sittings cut short: report the runs that finished, as they were kept
        budgets, runs, failed = merged_partials([json.loads(Path(p).read_text()) for p in args.report_partial])
        ran = dict.fromkeys(runs)
    else:
        ran = {name: available[name] for name in chosen(list(available), args.only)}
        runs = run_rounds(args, ran, job, work, latency, extra, budgets)
    results: dict[str, dict] = {name: over_repeats(rs) for name, rs in runs.items()}

    print(f"\n{'system':>44} | {'start-up s':>10} | {'wall s':>7} | {'tokens':>7} | {'goodput tok/s':>13} | "
          f"{'(steps 2+)':>10} | {'every run':>17} | rewards per step")
    for name, r in results.items():
        if r["returncode"] != 0:
            print(f"{name:>44} | failed (exit {r['returncode']})")
            continue
        rewards = " ".join(f"{s['reward']:.3f}" if s["reward"] is not None else "-" for s in r["steps"].values())
        every = "/".join(f"{g:.0f}" for g in r["goodput_runs"])
        print(f"{name:>44} | {r['startup_s']:>10.1f} | {r['wall_s']:>7.1f} | {r['tokens']:>7.0f} | "
              f"{r['goodput_tok_s']:>13.1f} | {r['goodput_after_step1_tok_s']:>10.1f} | {every:>17} | {rewards}")
    finished = {k: v for k, v in results.items() if v["returncode"] == 0}
    for name, r in finished.items():
        if r.get("device_busy"):  # with budgets: each fake GPU's usage / budget, the test bed's GPU utilisation
            print(f"{name}: device busy " + ", ".join(f"{g} {b:.0%}" for g, b in sorted(r["device_busy"].items())))
    for name in (n for n in finished if is_tide(n)):
        print(f"{name}: mechanisms that acted: " + ", ".join(f"{k} {v:g}" for k, v in
                                                            finished[name]["mechanisms"].items()))
    stock = [n for n in finished if not is_tide(n)]
    for tide in (n for n in finished if is_tide(n)):
        if not stock:
            break
        stock_name, stock_goodput = best_stock(finished)
        ratio = finished[tide]["goodput_tok_s"] / stock_goodput
        print(f"goodput {tide}/best stock: {ratio:.2f}x (best stock = {stock_name})")
        results.setdefault("best_stock", {})[tide] = {"system": stock_name, "ratio": ratio}
        if "verl sync" in finished:
            sync_ratio = finished[tide]["goodput_tok_s"] / finished["verl sync"]["goodput_tok_s"]
            print(f"goodput {tide}/sync: {sync_ratio:.2f}x")
            results.setdefault("over_sync", {})[tide] = sync_ratio
    for axis in ("step", "wall_s"):
        curves = {name: [(n if axis == "step" else s["wall_s"], s["reward"] or 0.0) for n, s in r["steps"].items()]
                  for name, r in finished.items()}
        plot_rewards(curves, work / f"rewards_by_{axis}.png", f"reward ({REWARD}) against {axis}",
                     xlabel="step" if axis == "step" else "wall-clock s from the first rollout request")
    if any(r.get("device_timeline") for r in finished.values()):
        plot_device_timeline(finished, work / "device_busy.png")
        print(f"[compare] {work / 'device_busy.png'}")
    if args.timeline:
        print_timeline(finished)
        timeline.plot(finished, str(work / "timeline.png"))
        print(f"[compare] {work / 'timeline.png'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "preset": args.preset,
                                              "device_budgets": budgets or "none (fake GPUs share the cores)",
                                              "clock": "first /start to the last step's metrics line",
                                              "repeats": max(1, args.repeats), "seed": args.seed,
                                              **({"cut_short": "the sitting was cut short: each system's rounds "
                                                               "are its goodput_runs", "failed_runs": failed}
                                                 if args.report_partial else {}),
                                              **results}, indent=2, default=str))
    return 0 if len(finished) == len(ran) else 1


def run_rounds(args, ran: dict, job, work: Path, latency: float, extra: tuple[str, ...], budgets) -> dict[str, list[dict]]:
    """Every system of `ran` once a round, the order reversed every other round; each finished run is kept in
    `<json>.partial` as it ends (`--report-partial` reports them if the sitting is cut short)."""
    runs: dict[str, list[dict]] = {name: [] for name in ran}
    for round_index in range(args.first_round - 1, args.first_round - 1 + max(1, args.repeats)):
        for name in run_order(list(ran), round_index):
            system = ran[name]
            print(f"[compare] round {round_index + 1}: {name}: {len(system.overrides)} overrides on the job's own",
                  flush=True)
            r = run_system(system, job, work / f"round{round_index + 1}", latency, args.timeout, extra,
                           timeline=args.timeline)
            runs[name].append(r)
            if args.json:
                Path(f"{args.json}.partial").write_text(json.dumps(
                    {"preset": args.preset, "device_budgets": budgets, "runs": runs}, default=str))
            print(f"[compare] round {round_index + 1}: {name}: " + (
                f"{r['goodput_tok_s']:.1f} tok/s over {r['wall_s']:.1f} s wall (start-up {r['startup_s']:.1f} s)"
                if r["returncode"] == 0 else f"FAILED (exit {r['returncode']})"), flush=True)
    return runs


def merged_partials(saved: list[dict]) -> tuple[dict, dict[str, list[dict]], dict[str, list[dict]]]:
    """Sittings' kept runs pooled per system: the finished runs, and the failed ones apart (with their errors)."""
    budgets = {json.dumps(s["device_budgets"], sort_keys=True) for s in saved}
    if len(budgets) != 1:
        raise SystemExit(f"--report-partial: the sittings ran under different device budgets ({sorted(budgets)})")
    runs: dict[str, list[dict]] = {}
    failed: dict[str, list[dict]] = {}
    for s in saved:
        for name, rs in s["runs"].items():
            for r in rs:
                if r.get("returncode") == 0:
                    runs.setdefault(name, []).append(restored(r))
                else:
                    failed.setdefault(name, []).append({"returncode": r.get("returncode"),
                                                        "error": str(r.get("error", ""))[-500:]})
    return saved[0]["device_budgets"], runs, failed


def restored(run: dict) -> dict:
    """A run as `<json>.partial` kept it, its steps numbered again (JSON keys are strings)."""
    if isinstance(run.get("steps"), dict):
        run = {**run, "steps": {int(n): s for n, s in run["steps"].items()}}
    return run


def plot_device_timeline(finished: dict[str, dict], path: Path) -> None:
    """Each system's fake GPUs and host busy (CPU used / budget) over the benchmark's clock, one panel a system
    (the round nearest the system's mean): which device idled when."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = {n: r["device_timeline"] for n, r in finished.items() if r.get("device_timeline")}
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 2.2 * len(shown)), sharex=True, squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], shown.items()):
        groups = sorted({g for b in tl["busy"] for g in b})
        for g in groups:
            ax.step(tl["t_s"], [b.get(g, 0.0) for b in tl["busy"]], where="post", label=g)
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("busy")
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7, loc="upper right", ncol=len(groups))
    axes[-1, 0].set_xlabel(f"s from the first rollout request ({next(iter(shown.values()))['bin_s']:g} s bins)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def budgets_asked(value: str | None, host: float | None, gpus: int) -> tuple[float | None, float | None]:
    """`--device-budgets`: a number of cores per fake GPU, or `auto` (half the machine's cores to the fake GPUs,
    half to the host, where this process can write cgroups; none, said why, where it cannot)."""
    import os

    from verl_tide.testing.device_budgets import writable

    if value is None or value == "none":
        return None, host
    if value != "auto":
        try:
            return float(value), host
        except ValueError:
            raise SystemExit(f"--device-budgets {value!r}: a number of cores per fake GPU (e.g. 0.5), 'auto' or 'none'")
    why = writable()
    if why is not None:
        print(f"[compare] --device-budgets auto: no budgets ({why})", flush=True)
        return None, None
    half = (os.cpu_count() or 1) / 2
    return round(half / gpus, 3), (host if host is not None else half)


def device_budgets_env(cores: float | None, host: float | None) -> dict:
    """Put the budgets in this process's environment (every job it launches reads them) and say so at the top."""
    import os

    from verl_tide.testing.device_budgets import BUDGET_ENV, HOST_ENV

    if cores is None:
        print("[compare] device budgets: none (every fake GPU shares the machine's cores)", flush=True)
        return {}
    os.environ[BUDGET_ENV] = str(cores)
    if host is not None:
        os.environ[HOST_ENV] = str(host)
    print(f"[compare] device budgets: {cores} cores per fake GPU, host "
          f"{host if host is not None else 'the cores they leave'} (cgroup CPU quotas, 10 ms period)", flush=True)
    return {"cores_per_fake_gpu": cores, "host_cores": host if host is not None else "the cores they leave"}


def print_timeline(finished: dict[str, dict]) -> None:
    """Where each system's clock went: the trainer's phases (seconds over the run) and each engine's load."""
    from verl_tide.testing.timeline import STEP_PHASES

    names = [n for n in finished if finished[n].get("timeline")]
    if not names:
        return
    phases = [p for p in ("between steps", *STEP_PHASES, "other in step", "testing")
              if any(finished[n]["timeline"]["phase_totals_s"].get(p) for n in names)]
    print(f"\nwhere the clock went (s, verl's timing_s laid out in its order; engines: share of polls running, "
          f"mean running, tokens/s; prefix-cache hit rate pooled)\n{'system':>44} | "
          + " | ".join(f"{p[:12]:>12}" for p in phases) + " | engines")
    for n in names:
        t = finished[n]["timeline"]
        engines = "; ".join(f"{e['busy_share']:.0%} {e['mean_running']:.1f} {e['tokens_per_s']:.0f}"
                            for e in t["engines"].values())
        hit = t.get("prefix_cache_hit_rate")
        engines += f"; hit {hit:.1%}" if hit is not None else "; hit -"
        print(f"{n:>44} | " + " | ".join(f"{t['phase_totals_s'].get(p, 0.0):>12.2f}" for p in phases)
              + f" | {engines}")


if __name__ == "__main__":
    from verl_tide.testing.testbed import unwind_on_sigterm

    unwind_on_sigterm()
    sys.exit(main())

"""The test bed's trainer passes as the simulator charges them: a fixed part per pass and GPU-seconds per token.

On budgeted fake GPUs a trainer pass does not shrink with the ranks as a GPU's would: verl `sync` on 3 fake GPUs
updates the every-part job's Actor in 0.51 s, `separate_async` on 2 in 0.61 s, tide on 1 in 0.87 s (2026-12-06):
each pass has a part that no rank count removes (the driver's dispatch, the batch's transfer, FSDP's gathers over
gloo). So each pass is fitted as `fixed_s + tokens x s_per_token / ranks` from two stock runs of the job at two
trainer sizes (their verl timers, steps 2 on): the Ref forward and the Actor's update from both; the Actor's
forward (`old_log_prob`) from the larger size, split as the Ref forward's (the same model's forward on the same
workers: a run with verl's hybrid switch lengthens its `old_log_prob` after each switch back, which the profile's
`actor_after_switch_s` charges on its own). With one point the fixed parts are 0 and the rates are GPU-seconds.
The fixed parts, summed, join the profile's `step_overhead_s`. `--standalone-sync LOG` sets the profile's
`standalone_sync_s` to a stock `separate_async` run's mean weight sync (`timing_s/update_weights`, steps 2 on): verl's
checkpoint engine to replicas on fake GPUs of their own, which the `sync` probe's colocated sync does not show.

    python benchmarks/trainer_fit.py --point 3=/tmp/ep_sync/round1/verl_sync.log \
        --point 2=/tmp/ep/round1/verl_separate_async_2T-1R_plus_hybrid_switch.log \
        --profile verl_tide/sim/profiles/testbed-cpu-0.5-every-part.yaml \
        --standalone-sync /tmp/ep/round1/verl_separate_async_2T-1R_plus_hybrid_switch.log
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from verl_tide.testing.testbed import parse_step_metrics

SEPARATE_PROBE_STEPS = 6  # steps 2 on are read: five weight syncs to standalone replicas

PASSES = {"ref": "timing_s/ref", "act_f": "timing_s/old_log_prob", "act_fb": "timing_s/update_actor",
          "weight_sync": "timing_s/update_weights"}


def point_from_log(text: str) -> dict[str, float]:
    """Mean seconds per step of each pass and tokens per step, steps 2 on, from a `main_ppo` log."""
    m = parse_step_metrics(text)
    later = [m[n] for n in sorted(m) if n > 1]
    if not later:
        raise ValueError("the log has no step line after step 1")
    out = {k: statistics.fmean(s.get(key, 0.0) for s in later) for k, key in PASSES.items()}
    return {**out, "tokens": statistics.fmean(s["perf/total_num_tokens"] for s in later), "steps": len(later)}


def point_from_calibration(report: dict) -> dict[str, float]:
    """The same from a `testbed_calibrate.py` report's trainer probe."""
    t = report["trainer"]
    return {**{k: t["phase_s"].get(key, 0.0) for k, key in PASSES.items()}, "tokens": t["tokens"] / t["steps_used"],
            "steps": t["steps_used"]}


def probe_separate(work: Path, pj, timeout_s: float) -> dict[str, float]:
    """The job (a `testing.demo.PresetJob`) under stock `separate_async` with one trainer GPU and the others rolling
    out, no hybrid switch: its passes on one rank (the fit's second size) and its weight sync to standalone
    replicas, from verl's timers of steps 2 on."""
    from dataclasses import replace as dc_replace

    from verl_tide.testing.compare import job_overrides, systems
    from verl_tide.testing.demo import env_agent_overrides
    from verl_tide.testing.testbed import run_with_env_service

    job = dc_replace(pj.job, steps=SEPARATE_PROBE_STEPS)
    name = f"verl separate_async 1T/{job.n_gpus - 1}R"
    system = next(s for s in systems(job) if s.name == name)
    run, _ = run_with_env_service(lambda url: job_overrides(job, system, [*env_agent_overrides(url), *pj.extra]),
                                  work, latency_scale=pj.latency_scale, timeout_s=timeout_s,
                                  log_path=work / "verl_separate.log")
    if run.returncode != 0 or len(parse_step_metrics(run.output)) != job.steps:
        raise RuntimeError(f"the probe's {name} job failed (exit {run.returncode}): {run.output[-2000:]}")
    return point_from_log(run.output)


def fit(points: dict[int, dict[str, float]]) -> dict[str, float]:
    """`{ranks: point}` -> each pass's fixed seconds and GPU-seconds per token (`<pass>_fixed_s`,
    `<pass>_s_per_token`), from the largest and smallest trainer sizes given."""
    if not points:
        raise ValueError("no point to fit: give --point RANKS=LOG at least once")
    hi, lo = max(points), min(points)
    out: dict[str, float] = {}

    def line(k: str) -> tuple[float, float]:  # t = fixed + work / ranks; work = tokens x s_per_token
        if hi == lo:
            return 0.0, points[hi][k] * hi
        work = (points[lo][k] - points[hi][k]) / (1 / lo - 1 / hi)
        work = max(0.0, work)
        return max(0.0, points[hi][k] - work / hi), work

    for k in ("ref", "act_fb"):
        fixed, work = line(k)
        out[f"{k}_fixed_s"], out[f"{k}_s_per_token"] = fixed, work / points[hi]["tokens"]
    share = out["ref_fixed_s"] / points[hi]["ref"] if points[hi]["ref"] else 0.0
    out["act_f_fixed_s"] = share * points[hi]["act_f"]
    out["act_f_s_per_token"] = (points[hi]["act_f"] - out["act_f_fixed_s"]) * hi / points[hi]["tokens"]
    return out


def profile_rates(f: dict[str, float], ref_model: bool) -> dict[str, float]:
    """The simulator's three stages (`testbed_calibrate.trainer_rates`' mapping) and the fixed parts' sum."""
    fixed = f["act_f_fixed_s"] + f["act_fb_fixed_s"] + (f["ref_fixed_s"] if ref_model else 0.0)
    if ref_model:
        rates = {"ref_s_per_token": f["ref_s_per_token"], "act_f_s_per_token": f["act_f_s_per_token"],
                 "act_b_s_per_token": f["act_fb_s_per_token"]}
    else:
        rates = {"ref_s_per_token": f["act_f_s_per_token"], "act_f_s_per_token": f["act_f_s_per_token"],
                 "act_b_s_per_token": max(f["act_fb_s_per_token"] - f["act_f_s_per_token"], 0.0)}
    return {**rates, "train_fixed_s": fixed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", action="append", required=True, metavar="RANKS=LOG",
                    help="a stock run of the job with RANKS trainer ranks: its main_ppo log, or a calibration JSON")
    ap.add_argument("--profile", required=True, help="the profile whose trainer terms to rewrite")
    ap.add_argument("--no-ref-model", action="store_true", help="the job has no Ref model (the demo job)")
    ap.add_argument("--standalone-sync", default=None, metavar="LOG",
                    help="a stock separate_async run's log: its mean weight sync becomes standalone_sync_s")
    args = ap.parse_args(argv)
    points: dict[int, dict[str, float]] = {}
    for p in args.point:
        ranks, _, path = p.partition("=")
        if not ranks.isdigit() or int(ranks) < 1 or not path:
            raise SystemExit(f"--point {p!r}: must be RANKS=PATH with RANKS an integer >= 1")
        text = Path(path).read_text()
        points[int(ranks)] = point_from_calibration(json.loads(text)) if path.endswith(".json") else point_from_log(text)
    f = fit(points)
    rates = profile_rates(f, ref_model=not args.no_ref_model)
    prof_path = Path(args.profile)
    prof = yaml.safe_load(prof_path.read_text())
    r = prof["rates"]
    # the step's host time outside verl's passes, as the calibration measured it (without an earlier fit's parts)
    base_overhead = r.get("step_overhead_s", 0.0) - (prof.get("trainer_fit") or {}).get("train_fixed_s", 0.0)
    for k in ("ref_s_per_token", "act_f_s_per_token", "act_b_s_per_token"):
        r[k] = float(f"{rates[k]:.3e}")
    r["step_overhead_s"] = round(base_overhead + rates["train_fixed_s"], 4)
    if args.standalone_sync:
        r["standalone_sync_s"] = round(point_from_log(Path(args.standalone_sync).read_text())["weight_sync"], 4)
    prof["trainer_fit"] = {"by": "benchmarks/trainer_fit.py", "train_fixed_s": round(rates["train_fixed_s"], 4),
                           **{k: float(f"{v:.4g}") for k, v in f.items()},
                           "points": {str(k): {kk: round(v, 4) for kk, v in p.items()} for k, p in points.items()}}
    prof_path.write_text(yaml.safe_dump(prof, sort_keys=False))
    print(json.dumps({"fit": f, "rates": rates, "standalone_sync_s": r.get("standalone_sync_s")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

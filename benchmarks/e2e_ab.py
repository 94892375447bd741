"""tide against variants of itself on the head-to-head's job, alternated in one sitting (an A/B of one product
change, where every system of the head-to-head would take 20 minutes and spread the runs over more of the
machine's drift).

    python benchmarks/e2e_ab.py --preset every_part --rounds 2 --variant "boundaries only=tide.ctb.window_interval_s=0" \\
        --workdir outputs/ab --json outputs/ab/ab.json

Each variant is `+tide=enabled` with the job's tide overrides plus the variant's (`name=override[,override...]`);
`tide` (the defaults) always runs. Order alternates each round (reversed on odd rounds). Prints and writes, per
run: goodput on the head-to-head's clock (first /start to the last step's metrics line), goodput from step 2,
step 1's wall time, the mechanisms that acted and CTB's budget factor at each step's end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from verl_tide.testing.compare import is_tide, run_order, run_system, systems
from verl_tide.testing.demo import PRESETS, preset_job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, default="every_part")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", action="append", default=[], help="name=override[,override...]")
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=1500.0)
    args = ap.parse_args(argv)
    work = Path(args.workdir).resolve()
    pj = preset_job(args.preset, work, args.steps)
    job, extra = pj.job, pj.extra
    tide = next(s for s in systems(job, 1, tide_rollout_gpus=pj.tide_rollout_gpus) if s.name == "tide")
    variants = {"tide": tide}
    for spec in args.variant:
        name, _, overrides = spec.partition("=")
        if not overrides:
            ap.error(f"--variant {spec!r}: expected name=override[,override...]")
        name = name if is_tide(name) else f"tide, {name}"  # the test bed's name for a tide system
        variants[name] = replace(tide, name=name, overrides=(*tide.overrides, *overrides.split(",")))
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in run_order(list(variants), r):
            res = run_system(variants[name], job, work / f"round{r + 1}", pj.latency_scale, args.timeout,
                             extra)
            if res["returncode"] != 0:
                print(f"[ab] round {r + 1}: {name}: FAILED (exit {res['returncode']})\n{res.get('error', '')[-2000:]}",
                      flush=True)
                runs[name].append({"returncode": res["returncode"]})
                continue
            steps = res["steps"]
            row = {"goodput_tok_s": round(res["goodput_tok_s"], 1),
                   "after_step1_tok_s": round(res["goodput_after_step1_tok_s"], 1),
                   "wall_s": round(res["wall_s"], 2), "step1_wall_s": round(steps[min(steps)]["wall_s"], 2),
                   "budget_factors": [s.get("budget_factor") for s in steps.values()],
                   "budget_changes_in_wait": steps[max(steps)].get("budget_changes_in_wait"),
                   "mechanisms": res["mechanisms"], "time": time.strftime("%H:%M")}
            runs[name].append(row)
            print(f"[ab] round {r + 1}: {name}: " + json.dumps(row), flush=True)
    for name, rs in runs.items():
        ok = [x["goodput_tok_s"] for x in rs if "goodput_tok_s" in x]
        print(f"{name:>30}: " + " / ".join(f"{g:.1f}" for g in ok) +
              (f"  mean {sum(ok) / len(ok):.1f}" if ok else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "preset": args.preset,
                                              "clock": "first /start to the last step's metrics line",
                                              "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    from verl_tide.testing.testbed import unwind_on_sigterm

    unwind_on_sigterm()
    sys.exit(main())

"""One table from verl console logs of the same job run different ways (benchmarks/verl_vs_tide/run.sh).

Goodput = tokens of trajectories that reached an update (`perf/total_num_tokens`) over summed step
wall-clock (`timing_s/step`), the same definition for every run; plus the generation wait per step
(`timing_s/gen`: how long the trainer waited for a batch) and the mean step time. Also verl's Ref stage
(`timing_s/ref`) beside its Actor update (`timing_s/update_actor`), per step: the simulator prices a Ref
forward at a third of the Actor's forward and backward, and verl's forward-only Ref offloads its parameters to
the host, so `ref / update` is the number that says whether Ref ranks of their own (ERS) are worth more than
modelled (docs/simulator-calibration.md, "Checks against the paper's own measurements").
`python collect.py verl_sync.log verl_separate_async.log tide.log [--json results.json]`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from verl_tide.testing.demo import goodput
from verl_tide.testing.testbed import parse_step_metrics


def summarize(log_text: str) -> dict[str, float]:
    steps = parse_step_metrics(log_text)
    g = goodput(steps)
    n = max(len(steps), 1)

    def mean(key: str) -> float:
        return sum(m.get(key, 0.0) for m in steps.values()) / n

    return {"steps": len(steps), "goodput_tok_s": g["goodput_tok_s"],
            "goodput_after_step1_tok_s": g["goodput_after_step1_tok_s"],
            "step_time_s": g["seconds"] / n,
            "gen_wait_s": mean("timing_s/gen"),
            "sync_s": mean("timing_s/update_weights"),
            "ref_s": mean("timing_s/ref"), "update_actor_s": mean("timing_s/update_actor")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", help="console logs; the run's name is the file name without .log")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    systems = {Path(p).stem: summarize(Path(p).read_text(errors="replace")) for p in args.logs}
    base = systems.get("verl_sync", {}).get("goodput_tok_s") or 0.0
    print(f"{'system':<22} {'steps':>5} {'goodput tok/s':>14} {'(steps 2+)':>11} {'step s':>8} {'gen wait s':>10} "
          f"{'sync s':>7} {'ref s':>7} {'update s':>9} {'vs verl_sync':>12}")
    for name, s in systems.items():
        ratio = f"{s['goodput_tok_s'] / base:.2f}x" if base else "-"
        print(f"{name:<22} {s['steps']:>5} {s['goodput_tok_s']:>14.1f} {s['goodput_after_step1_tok_s']:>11.1f} "
              f"{s['step_time_s']:>8.2f} {s['gen_wait_s']:>10.2f} {s['sync_s']:>7.2f} {s['ref_s']:>7.2f} "
              f"{s['update_actor_s']:>9.2f} {ratio:>12}")
    if any(s["steps"] == 0 for s in systems.values()):
        print("a log has no `step:N - ...` lines (did the run use trainer.logger=[console]?)", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps({"systems": systems}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

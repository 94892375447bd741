"""What lending the Actor's GPUs inside a step could take back, in the simulator (issue 27).

ERS lends the Actor's GPUs before a step (the cold start, evaluations, after an update when the next mini-batch
is far off); verl switches its hybrid replica only at step boundaries. Lending inside a step would pay where
the Actor, having trained what was ready, waits for the next micro-batch longer than the switch's round trip
(to rollout and back). This prints, for tide with lending (`tide_lend_actor`) on every preset at 32 GPUs, where
its waits are (RWT: weight syncs / out of work; TWT: inside / before steps), and the Actor's in-step waits
longer than the modeled switch round trip, with the seconds beyond it: an upper bound on what lending inside a
step could give back (the replica would still have to make the rollout faster, which an environment-bound
rollout does not). tide's split and the best fixed-ratio system's waits come from `verl-tide bench`'s JSON of the
preset (`--results`); the script checks its tide_lend_actor run against it. Writes JSON with `--json`.

    .venv/bin/python benchmarks/sim_lend_in_step.py --json benchmarks/results/sim_lend_in_step_32gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from dataclasses import replace
from pathlib import Path

from verl_tide.sim.cluster import Simulation, SystemSpec
from verl_tide.sim.workload import load_workload

PRESETS = (("webshop", None), ("alfworld", None), ("osworld", None), ("sciboard", None),
           ("webshop", 100), ("osworld", 100))


def bench_json(results: Path, name: str, steps, gpus: int) -> dict:
    """`verl-tide bench`'s JSON for the preset (committed under benchmarks/results): the split tide ran at and the
    best fixed-ratio system's waits, so this script runs one simulation per preset, not the sweeps again."""
    path = results / f"sim_{name}_{gpus}gpu{f'_{steps}steps' if steps else ''}.json"
    if not path.exists():
        raise SystemExit(f"{path}: missing; run `verl-tide bench --workload {name} --gpus {gpus}"
                         f"{f' --steps {steps}' if steps else ''} --json {path}` first")
    return json.loads(path.read_text())


def measure(results: Path, name: str, steps, gpus: int) -> dict:
    report = bench_json(results, name, steps, gpus)
    w = load_workload(name)
    w = replace(w, steps=steps) if steps else w
    ratio = report["systems"]["tide_lend_actor"]["rollout_ratio"]
    best_name = report["headline"]["best_stock"]
    fixed = report["systems"][best_name]
    sim = Simulation(w, gpus, SystemSpec("tide_lend_actor", rollout_ratio=ratio, routing="ctb", consume="ra2p",
                                         eval_blocks_trainer=False, elastic=True, lend_actor=True))
    r = sim.run()
    if abs(r.goodput_tok_s - report["systems"]["tide_lend_actor"]["goodput_tok_s"]) > 0.1:
        raise SystemExit(f"{name}: tide_lend_actor made {r.goodput_tok_s:.1f} tok/s here and "
                         f"{report['systems']['tide_lend_actor']['goodput_tok_s']} in the bench JSON: regenerate it")
    round_trip = 2 * sim.costs.switch_s
    longer = [x for x in sim.actor_in_step_waits if x > round_trip]
    return {"workload": name, "steps": w.steps, "gpus": gpus, "best_stock": fixed | {"system": best_name},
            "tide_lend_actor": r.row() | {"rollout_ratio": ratio},
            "waits_vs_best_stock": round((r.rwt_s + r.twt_s) / (fixed["rwt_s"] + fixed["twt_s"]) - 1, 4),
            "switch_round_trip_s": round(round_trip, 3), "in_step_waits": len(sim.actor_in_step_waits),
            "in_step_waits_s": round(sum(sim.actor_in_step_waits), 1),
            "in_step_waits_longer_than_round_trip": len(longer),
            "seconds_beyond_round_trip": round(sum(x - round_trip for x in longer), 1),
            "lent_at_boundaries": sum(1 for _, lent, _ in sim.lend_decisions if lent),
            "boundaries": len(sim.lend_decisions)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--json")
    ap.add_argument("--results", default="benchmarks/results", help="where the bench JSONs are")
    ap.add_argument("--quick", action="store_true", help="the 12/10-step presets only")
    args = ap.parse_args()
    t0, rows = time.monotonic(), []
    print(f"{'preset':<16}{'RWT s':>8}{'syncs':>7}{'TWT s':>8}{'in step':>8}{'vs best fixed':>14}"
          f"{'round trip s':>13}{'waits > it':>11}{'s beyond':>9}")
    for name, steps in PRESETS:
        if args.quick and steps:
            continue
        m = measure(Path(args.results), name, steps, args.gpus)
        rows.append(m)
        t = m["tide_lend_actor"]
        label = f"{name} x{m['steps']}"
        print(f"{label:<16}{t['rwt_s']:>8.0f}{t['rwt_sync_s']:>7.0f}{t['twt_s']:>8.0f}{t['twt_in_step_s']:>8.0f}"
              f"{m['waits_vs_best_stock']:>+14.0%}{m['switch_round_trip_s']:>13.1f}"
              f"{m['in_step_waits_longer_than_round_trip']:>6} of {m['in_step_waits']:<3}"
              f"{m['seconds_beyond_round_trip']:>8.0f}", flush=True)
    out = {"date": datetime.date.today().isoformat(), "gpus": args.gpus, "what": __doc__.split("\n\n")[1].strip(),
           "rows": rows, "wall_s": round(time.monotonic() - t0, 1)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

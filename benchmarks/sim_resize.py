"""ERS resizing the Actor's training group, simulated: tide from every start ratio with and without the resize,
against the best stock system at its own best split (from the committed `verl-tide bench --steps N` JSON of the
same preset, GPUs and steps). Prints a table and writes JSON.

    python benchmarks/sim_resize.py --workload webshop --gpus 32 --steps 100 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import date
from pathlib import Path

from verl_tide.sim.bench import RATIOS
from verl_tide.sim.cluster import Simulation, SystemSpec
from verl_tide.sim.workload import load_workload

RESULTS = Path(__file__).parent / "results"


def _run(args: tuple[str, int, int, float, bool]) -> dict:
    workload, gpus, steps, ratio, resize = args
    w = dataclasses.replace(load_workload(workload), steps=steps)
    spec = SystemSpec("tide_resize" if resize else "tide", rollout_ratio=ratio, routing="ctb", consume="ra2p",
                      eval_blocks_trainer=False, elastic=True, resize_trainer=resize)
    sim = Simulation(w, gpus, spec)
    r = sim.run()
    return {"rollout_ratio": ratio, "resize": resize, "goodput_tok_s": round(r.goodput_tok_s, 1),
            "final_actor_gpus": sim.actor_ranks, "final_rollout_gpus": len(sim.rollout.ranks),
            "final_ref_gpus": len(sim.ref_ranks),
            "resizes": [{"step": s, "from": a, "to": b, "stall_s": round(st, 1)} for s, a, b, st, _ in sim.resizes]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="webshop")
    ap.add_argument("--gpus", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    jobs = [(args.workload, args.gpus, args.steps, r, rz) for r in RATIOS for rz in (False, True)]
    with ProcessPoolExecutor(args.workers) as pool:
        rows = list(pool.map(_run, jobs))
    fixed = {r["rollout_ratio"]: r for r in rows if not r["resize"]}
    resized = {r["rollout_ratio"]: r for r in rows if r["resize"]}
    best_fixed = max(r["goodput_tok_s"] for r in fixed.values())
    stock_json = RESULTS / f"sim_{args.workload}_{args.gpus}gpu_{args.steps}steps.json"
    best_stock = None
    if stock_json.exists():
        h = json.loads(stock_json.read_text())["headline"]
        best_stock = {"system": h["best_stock"], "rollout_ratio": h["best_stock_rollout_ratio"],
                      "goodput_tok_s": h["best_stock_goodput_tok_s"], "from": stock_json.name}
    print(f"{args.workload}, {args.gpus} GPUs, {args.steps} steps: tide's goodput (tok/s) by start ratio")
    print(f"{'start':>6} {'fixed Actor':>12} {'resized':>10} {'/ best start':>13} {'final split (rollout/Actor/Ref)':>32}")
    for ratio in RATIOS:
        f, z = fixed[ratio], resized[ratio]
        split = f"{z['final_rollout_gpus']}/{z['final_actor_gpus']}/{z['final_ref_gpus']}"
        print(f"{ratio:>6.3g} {f['goodput_tok_s']:>12.0f} {z['goodput_tok_s']:>10.0f} "
              f"{z['goodput_tok_s'] / best_fixed:>13.2f} {split:>32}")
    worst = min(resized.values(), key=lambda r: r["goodput_tok_s"])
    report = {"date": str(date.today()), "workload": args.workload, "gpus": args.gpus, "steps": args.steps,
              "fixed": list(fixed.values()), "resized": list(resized.values()),
              "tide_best_start_goodput_tok_s": best_fixed, "best_stock": best_stock,
              "resized_worst_start": {"rollout_ratio": worst["rollout_ratio"],
                                      "vs_tide_best_start": round(worst["goodput_tok_s"] / best_fixed, 4),
                                      "vs_best_stock": best_stock and round(worst["goodput_tok_s"]
                                                                            / best_stock["goodput_tok_s"], 4)},
              "wall_s": round(time.monotonic() - t0, 1)}
    if best_stock:
        print(f"best stock ({best_stock['system']} at {best_stock['rollout_ratio']:.3g}): "
              f"{best_stock['goodput_tok_s']:.0f} tok/s; resized tide from its worst start "
              f"{report['resized_worst_start']['vs_best_stock']:.2f}x it, "
              f"{report['resized_worst_start']['vs_tide_best_start']:.2f}x tide's best start")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()

"""ERS's trainer resize on the CPU test bed: does a job started at the wrong split end its run as fast as one
started at the right split?

    python benchmarks/resize_testbed.py --device-budgets 0.5 --host-cores 0.5 --steps 40 --rounds 2 \
        --json benchmarks/results/resize_testbed_budgeted_0.5_cpu.json

The job: the demo's multi-turn environment job on 3 fake GPUs, shaped trainer-bound (4 PPO epochs a step; the
environment answers at once), so the right split gives the Actor 2 of the 3. Systems, alternated within each round:
`+tide=enabled` started at 1T/2R with `tide.ers.resize_trainer=true` (its defaults otherwise: the first move's cost
estimated from start-up); tide fixed at 1T/2R (the wrong split, the control) and at 2T/1R (the right one). Per run:
the step cycles on the benchmark's clock (arrival of one step line to the next), the mean of the last
`--tail` of them (the run's end), goodput over the whole clock, and each resize the log reports. With device
budgets each fake GPU has a CPU quota of its own (`testing/device_budgets.py`), so a GPU that moves to the Actor adds
compute there, as on a cluster; without them every fake GPU shares the machine's cores and a move adds nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_compare import budgets_asked, device_budgets_env  # noqa: E402

from verl_tide.testing.compare import System, run_order, run_system  # noqa: E402
from verl_tide.testing.demo import demo_job  # noqa: E402
from verl_tide.testing.testbed import tide_overrides  # noqa: E402

TRAINER_BOUND = ("actor_rollout_ref.actor.ppo_epochs=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2")
RESIZED = "tide 1T/2R + trainer resize"
MOVE = re.compile(r"ERS resized the Actor's group (\d+) -> (\d+) GPU\(s\) after step (\d+) in ([\d.]+) s")


def systems(job) -> list[System]:
    def tide_at(rollout: int, *extra: str) -> tuple[str, ...]:
        return (*tide_overrides(job, rollout_gpus=rollout, lend_actor=False), *TRAINER_BOUND, *extra)

    return [System(RESIZED, tide_at(2, "tide.ers.resize_trainer=true"), 2),
            System("tide 1T/2R (fixed)", tide_at(2), 2),
            System("tide 2T/1R (fixed)", tide_at(1), 1)]


def cycles(run: dict) -> list[float]:
    """Seconds from one step line to the next on the benchmark's clock."""
    walls = [s["wall_s"] for _, s in sorted(run["steps"].items(), key=lambda kv: int(kv[0]))]
    return [b - a for a, b in zip(walls, walls[1:])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tail", type=int, default=5, help="the last step cycles averaged as the run's end")
    ap.add_argument("--device-budgets", default="auto", metavar="CORES",
                    help="cores per fake GPU, 'auto' (half the machine's cores to the 3 fake GPUs) or 'none'")
    ap.add_argument("--host-cores", type=float, default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    args = ap.parse_args(argv)

    budgets = device_budgets_env(*budgets_asked(args.device_budgets, args.host_cores, gpus=3))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="verl_tide_resize_")).resolve()
    job = demo_job(work, args.steps, batch=4, n=2, gpus=3)
    chosen = systems(job)
    runs: dict[str, list[dict]] = {s.name: [] for s in chosen}
    for r in range(args.rounds):
        for name in run_order([s.name for s in chosen], r):
            system = next(s for s in chosen if s.name == name)
            print(f"[resize] round {r + 1}: {name}", flush=True)
            slug = name.replace(" ", "_").replace("/", "-").replace("+", "plus")  # as run_system names its log
            out = run_system(system, job, work / f"round{r}", latency_scale=0.0, timeout_s=args.timeout)
            if out["returncode"] != 0:
                print(out.get("error", ""), file=sys.stderr)
                print(f"[resize] {name} FAILED (exit {out['returncode']})", file=sys.stderr)
                return 1
            log = (work / f"round{r}" / f"{slug}.log")
            text = log.read_text(errors="replace") if log.exists() else ""
            out["resizes"] = [{"from": int(a), "to": int(b), "after_step": int(s), "seconds": float(t)}
                              for a, b, s, t in MOVE.findall(text)]
            out["cycles_s"] = cycles(out)
            out["end_cycle_s"] = statistics.mean(out["cycles_s"][-args.tail:])
            print(f"[resize] {name}: goodput {out['goodput_tok_s']:.1f} tok/s, end cycle {out['end_cycle_s']:.2f} s, "
                  f"resizes {[(m['from'], m['to'], m['after_step']) for m in out['resizes']]}", flush=True)
            runs[name].append(out)

    write(summarize(runs), runs, args, budgets, Path(args.json) if args.json else work / "resize_testbed.json")
    return 0


def summarize(runs: dict[str, list[dict]]) -> dict:
    summary = {}
    right = statistics.mean(r["end_cycle_s"] for r in runs["tide 2T/1R (fixed)"])
    print(f"\n{'system':>30} | {'end cycle s by round':>22} | {'vs right split':>14} | {'goodput by round':>20} | "
          "resizes")
    for name, rs in runs.items():
        ends = [r["end_cycle_s"] for r in rs]
        summary[name] = {"end_cycle_s_by_round": ends, "end_cycle_s_mean": statistics.mean(ends),
                         "end_cycle_vs_right_split": statistics.mean(ends) / right,
                         "goodput_tok_s_by_round": [r["goodput_tok_s"] for r in rs],
                         "resizes_by_round": [r["resizes"] for r in rs]}
        ends_text = "/".join(f"{e:.2f}" for e in ends)
        goodputs = "/".join(f"{r['goodput_tok_s']:.0f}" for r in rs)
        moves = [[(m["from"], m["to"], m["after_step"]) for m in r["resizes"]] for r in rs]
        print(f"{name:>30} | {ends_text:>22} | {statistics.mean(ends) / right:>13.2f}x | {goodputs:>20} | {moves}")
    return summary


def write(summary: dict, runs: dict, args: argparse.Namespace, budgets: dict, out: Path) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    report = {"benchmark": "resize_testbed", "date": time.strftime("%Y-%m-%d"), "commit": commit,
              "steps": args.steps, "rounds": args.rounds, "tail": args.tail,
              "job": "demo job (tiny_slow environment, no latency), 3 fake GPUs, 4 prompts x 2, 4 PPO epochs, "
                     "2 mini-batches a step", "device_budgets": budgets or "none (fake GPUs share the cores)",
              "clock": "the benchmark's: from the environment service's first /start to each step line",
              "summary": summary, "runs": runs}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    from verl_tide.testing.testbed import unwind_on_sigterm

    unwind_on_sigterm()
    raise SystemExit(main())

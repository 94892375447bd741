"""Learning parity (issue 24): verl `sync`, the best stock asynchronous mode and `+tide=enabled` on a task the
tiny model learns on CPU, with several seeds: reward per step within seed noise of sync's, and the wall-clock to
the same reward.

    python benchmarks/learning_parity.py --steps 30 --seeds 3 --workdir outputs/parity \
        --json benchmarks/results/learning_parity_cpu.json
    python benchmarks/learning_parity.py --device-budgets 0.5 --host-cores 1.0 ...   # fake GPUs that idle like GPUs

The task: the demo's job (tiny model, 2 fake GPUs, 4 prompts x 2, staleness bound 1, weight sync every step) on
`tiny_learn`, the guessing game (1 to a million: no lucky guesses) where each turn scores its answer's share of
digits, with the demo's heavy-tailed ~0.4 s environment latency. Seeds change the episodes (targets, filler text), verl's data order and
the rollout's sampling seed. Each seed runs every system, the order reversed every other seed. The parity and
target arithmetic is `verl_tide/testing/parity.py`; the clock is the head-to-head's (`testing/compare.py`).
Prints a table, writes the JSON and a plot (reward against step, mean and spread over seeds; and against
wall-clock, every run).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_compare import budgets_asked, device_budgets_env  # noqa: E402

from verl_tide.env.envs import LEARN_HIGH
from verl_tide.testing.compare import run_order, run_system, systems
from verl_tide.testing.demo import demo_job
from verl_tide.testing.parity import parity, rewards_of

RESULTS = Path(__file__).resolve().parent / "results"


def default_stock() -> str:
    """The best stock mode of the last committed head-to-head on the demo job (what a user would pick)."""
    try:
        return json.loads((RESULTS / "e2e_compare_cpu.json").read_text())["best_stock"]["tide"]["system"]
    except (OSError, KeyError, ValueError):
        return "verl separate_async 1T/1R"


def seed_overrides(seed: int) -> tuple[str, ...]:
    return (f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}")


def plot(runs: dict[str, list[dict]], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_wall) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (name, rs) in enumerate(runs.items()):
        colour = f"C{i}"
        s = summary["systems"][name]
        steps = sorted(s["reward_mean_by_step"])
        mu = [s["reward_mean_by_step"][n] for n in steps]
        sd = [s["reward_std_by_step"][n] for n in steps]
        by_step.plot(steps, mu, color=colour, label=f"{name} ({len(rs)} seeds)")
        by_step.fill_between(steps, [m - d for m, d in zip(mu, sd)], [m + d for m, d in zip(mu, sd)],
                             color=colour, alpha=0.15)
        for j, r in enumerate(rs):
            rows = rewards_of(r)
            by_wall.plot([w for _, w, _ in rows], [x for _, _, x in rows], color=colour, alpha=0.7,
                         label=name if j == 0 else None)
    for ax in (by_step, by_wall):
        ax.axhline(summary["target_reward"], color="grey", ls="--", lw=1)
        ax.set_ylabel("reward (critic/score/mean)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    by_step.set_xlabel("step (mean over seeds, band: one std)")
    by_wall.set_xlabel("wall-clock s from the first rollout request (every run)")
    fig.suptitle("learning parity on tiny_learn (dashed: the common target)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--stock", default=None, help="the stock async mode to compare with (default: the best stock "
                    "mode of benchmarks/results/e2e_compare_cpu.json)")
    ap.add_argument("--systems", default=None,
                    help="comma-separated system names instead of sync, --stock and tide (e.g. for a trial)")
    ap.add_argument("--latency-scale", type=float, default=1.0)
    ap.add_argument("--target-share", type=float, default=0.8,
                    help="the common target: this share of the way from the start reward to sync's final reward")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG (default: next to --json, else in --workdir)")
    ap.add_argument("--timeout", type=float, default=2400.0, help="seconds per run")
    ap.add_argument("--margin-share", type=float, default=0.25,
                    help="the equivalence margin: this share of the reference's gain from the start reward")
    ap.add_argument("--device-budgets", default=None, metavar="CORES",
                    help="fake GPUs that idle like GPUs, as e2e_compare.py's: cores per fake GPU, 'auto' or 'none'")
    ap.add_argument("--host-cores", type=float, default=None, help="with --device-budgets: the host side's quota")
    ap.add_argument("--reuse", default=None, metavar="JSON",
                    help="an earlier run's JSON: its runs of the systems not re-run here join the comparison "
                         "(their date is kept in the output; e.g. --systems tide --reuse "
                         "benchmarks/results/learning_parity_cpu.json re-runs tide only)")
    args = ap.parse_args(argv)

    budgets = device_budgets_env(*budgets_asked(args.device_budgets, args.host_cores, gpus=2))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="verl_tide_parity_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    names = args.systems.split(",") if args.systems else ["verl sync", args.stock or default_stock(), "tide"]
    reused: dict[str, list[dict]] = {}
    reused_from: dict = {}
    if args.reuse:
        earlier = json.loads(Path(args.reuse).read_text())
        reused = {name: rs[:args.seeds] for name, rs in earlier["runs"].items() if name not in names}
        short = [name for name, rs in reused.items() if len(rs) < args.seeds]
        if short:
            raise SystemExit(f"--reuse: {args.reuse} has fewer than {args.seeds} seeds of {short}")
        reused_from = {"path": args.reuse, "date": earlier.get("date"), "systems": sorted(reused)}
    every = list(reused) + names
    reference = "verl sync" if "verl sync" in every else every[0]
    runs: dict[str, list[dict]] = {**reused, **{name: [] for name in names}}
    started = time.time()
    for seed in range(args.seeds):
        job = demo_job(work, args.steps, 4, 2, env="tiny_learn", seed=seed, task={"low": 1, "high": LEARN_HIGH})
        available = {s.name: s for s in systems(job, max_staleness=1)}
        missing = [n for n in names if n not in available]
        if missing:
            raise SystemExit(f"--stock/--systems: unknown system(s) {missing}; known: {sorted(available)}")
        for name in run_order(names, seed):
            print(f"[parity] seed {seed}: {name}", flush=True)
            r = run_system(available[name], job, work / f"seed{seed}", args.latency_scale, args.timeout,
                           seed_overrides(seed))
            if r["returncode"] != 0:
                print(r.get("error", ""), file=sys.stderr)
                print(f"[parity] seed {seed}: {name} FAILED (exit {r['returncode']})", file=sys.stderr)
                return 1
            rewards = " ".join(f"{x:.2f}" for _, _, x in rewards_of(r))
            print(f"[parity] seed {seed}: {name}: {r['wall_s']:.0f} s wall, rewards {rewards}", flush=True)
            runs[name].append(r)
    summary = parity(runs, reference, target_share=args.target_share, margin_share=args.margin_share)

    print(f"\nreference {reference}; start reward {summary['start_reward']:.3f}, target "
          f"{summary['target_reward']:.3f} ({args.target_share:.0%} of the way to {reference}'s final reward)")
    print(f"{'system':>36} | {'final reward by seed':>22} | {'vs ref':>7} | {'in noise':>8} | "
          f"{'steps in noise':>14} | {'s to target by seed':>22} | {'wall s':>14}")
    for name, s in summary["systems"].items():
        finals = "/".join(f"{x:.3f}" for x in s["final_reward_by_seed"])
        times = "/".join("-" if t is None else f"{t:.0f}" for t in s["time_to_target_s_by_seed"])
        walls = "/".join(f"{w:.0f}" for w in s["wall_s_by_seed"])
        print(f"{name:>36} | {finals:>22} | {s['final_difference_from_reference']:>+7.3f} | "
              f"{str(s['final_within_seed_noise']):>8} | {s['steps_within_seed_noise']:>6}/{s['steps_compared']:<7} | "
              f"{times:>22} | {walls:>14}")
    print(f"equivalence margin {summary['equivalence_margin']:.3f} ({args.margin_share:.0%} of {reference}'s gain): "
          + ", ".join(f"{name} {'equivalent' if s['final_equivalent'] else 'not shown equivalent'} "
                      f"(difference interval {s['final_difference_interval'][0]:+.3f} .. "
                      f"{s['final_difference_interval'][1]:+.3f})"
                      for name, s in summary["systems"].items() if name != reference))
    ref_time = summary["systems"][reference]["time_to_target_s_median"]
    for name, s in summary["systems"].items():
        if name != reference and ref_time and s["time_to_target_s_median"]:
            print(f"wall-clock to the target, {name}/{reference}: {s['time_to_target_s_median'] / ref_time:.2f}x")
    out = Path(args.json) if args.json else work / "parity.json"
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(runs, summary, png)
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "task": "tiny_learn", "steps": args.steps, "seeds": args.seeds,
        "clock": "first /start to the step's metrics line", "benchmark_s": time.time() - started,
        "device_budgets": budgets or "none (fake GPUs share the cores)",
        "reused": reused_from or None, **summary, "runs": runs}, indent=2, default=str))
    print(f"[parity] {out}, {png}")
    return 0


if __name__ == "__main__":
    from verl_tide.testing.testbed import unwind_on_sigterm

    unwind_on_sigterm()
    sys.exit(main())

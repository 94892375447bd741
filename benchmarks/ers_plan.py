"""ERS plan latency at production batch sizes: what trainer `tide` computes at each post-update boundary.

Trainer `tide` records one ready time per GRPO group, so a step of B groups gives the cost model B arrivals
(the simulator's presets give it 9-13 micro-batches). Timed here, per step, as `_ra2p_decision` and
`_scaling_plan` run it: RA2P's mode choice (with split), the decoupled break-even RAS and `ERSPolicy.plan`, here
on its slowest path (a confirmed consumption deficit, so it asks the cost model's Ref-rank outlook). Arrivals: a
quarter of the groups ready at the start, the rest over a minute.
Target (issue 6): a plan in < 1 ms. Prints a table; `--json PATH` writes the numbers.
`--per-group` feeds each group's own ready time and one-group break-even candidates, the input trainer `tide`
gave the cost model before 2026-11-30 (run against today's cost functions: the "before" numbers in the README
were taken with the code of that time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

from verl_tide.core.config import ERSConfig
from verl_tide.core.readiness import ReadinessSignals, mini_batch_ready_times
from verl_tide.ers.policy import ERSPolicy, Role
from verl_tide.ra2p.cost import StageTimes, choose_mode, decoupled_break_even_ras, ref_rank_outlook

MINI_BATCHES_PER_STEP = 16
ACTOR_RANKS, ROLLOUT_RANKS = 20, 12


def one_step(groups: int, rng: random.Random, per_group: bool) -> float:
    """Milliseconds for one boundary's decision over `groups` arrivals."""
    per_mini_batch = max(1, groups // MINI_BATCHES_PER_STEP)
    raw = [0.0 if rng.random() < 0.25 else rng.uniform(0.0, 60.0) for _ in range(groups)]
    col = StageTimes(t_ref=0.05, t_act_f=0.05, t_act_b=0.1, t_swap=1.0)  # one group on the Actor's ranks

    def on_ref_ranks(k: int) -> StageTimes:
        return dataclasses.replace(col, t_ref=col.t_ref * ACTOR_RANKS / k, t_swap=0.0)

    roles = {r: Role.ROLLOUT for r in range(ROLLOUT_RANKS)}
    signals = ReadinessSignals(ready_at_start=groups // 4, time_per_ready_microbatch=0.3, tprm_smoothed=0.3,
                               hol_latency=5.0, ready_volume=groups * 8, mean_step_time=60.0,
                               generation_deficit=False, consumption_deficit=True, rollout_wait_s=8.0,
                               trainer_wait_s=0.5, rollout_capacity_rate=40.0, rollout_utilization=0.8)
    policy = ERSPolicy(ERSConfig(), ideal_batch=groups * 8, confirm_steps=1)
    t0 = time.perf_counter()
    if per_group:
        ready, unit = sorted(raw), 1
    else:
        ready, unit = mini_batch_ready_times(raw, per_mini_batch), per_mini_batch
    choose_mode(ready, on_ref_ranks(1), actor_ranks=1, max_aggregate=len(ready), colocated_times=col,
                split_ref_t_ref=on_ref_ranks(1).t_ref)
    kwargs = {} if per_group else {"per_mini_batch": unit}
    decoupled_break_even_ras(len(ready), 0.3, col, ACTOR_RANKS, len(ready), **kwargs)
    # a confirmed consumption deficit with rollout to spare: the plan asks the cost model (the slow path)
    policy.plan(1, signals, roles, ref_outlook=lambda reach: ref_rank_outlook(ready, on_ref_ranks, col, len(ready), 0,
                                                                              reach, split=True))
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[64, 256, 1024], help="GRPO groups per step")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--per-group", action="store_true", help="the input before mini-batch arrivals")
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []
    print(f"{'groups/step':>12}{'median ms':>12}{'max ms':>10}")
    for groups in args.groups:
        ms = sorted(one_step(groups, rng, args.per_group) for _ in range(args.repeats))
        rows.append({"groups_per_step": groups, "mini_batches_per_step": MINI_BATCHES_PER_STEP,
                     "plan_ms_median": round(ms[len(ms) // 2], 3), "plan_ms_max": round(ms[-1], 3)})
        print(f"{groups:>12}{ms[len(ms) // 2]:>12.3f}{ms[-1]:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"per_group": args.per_group, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

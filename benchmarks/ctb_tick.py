"""CTB scheduling-tick latency: 10,000 tasks over 64 ranks (target: <= 1 ms per tick).

Fills the ranks, then replays turns whose contexts grow by 500-3000 tokens until ranks go over budget, so ticks
include pauses, resumes and admissions. Prints a table; `--json PATH` writes the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

from verl_tide.core.config import CTBConfig
from verl_tide.ctb.policy import CTBScheduler, TaskState


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--events", type=int, default=5_000)
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = random.Random(0)
    s = CTBScheduler(dataclasses.replace(CTBConfig(), kv_headroom=0.9),
                     {r: 160 * 600 for r in range(args.ranks)})  # room for ~160 fresh tasks a rank
    for i in range(args.tasks):
        s.add_task(i, group_id=i // 8, prompt_tokens=500, group_size=8, task_type=rng.choice("abc"))
    t0 = time.perf_counter()
    s.tick()
    first_ms = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(args.events):
        resident = list(s._by_state[TaskState.RESIDENT].values())
        task = rng.choice(resident)
        if rng.random() < 0.05:
            s.task_finished(task.task_id)
        else:
            s.turn_started(task.task_id, max(task.context_tokens, 500) + rng.randint(500, 3000))
            s.turn_finished(task.task_id)
        t0 = time.perf_counter()
        s.tick()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    row = {"tasks": args.tasks, "ranks": args.ranks, "first_tick_ms": first_ms,
           "tick_ms_median": times[len(times) // 2], "tick_ms_p99": times[int(len(times) * 0.99)],
           "tick_ms_max": times[-1], **{k: v for k, v in s.counters.items() if k in ("pauses", "resumes", "admissions")}}
    for k, v in row.items():
        print(f"{k:<16}{v:>12.4g}" if isinstance(v, float) else f"{k:<16}{v:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)


if __name__ == "__main__":
    main()

"""Learning parity (issue 24): does `+tide=enabled` learn as well as verl `sync` and reach the same reward in less
wall-clock? Pure arithmetic over the per-step numbers `compare.wall_clock_summary` gives each run.

Each system runs the same learnable task with several seeds. Per step, a system's reward is compared with
`sync`'s: the difference of the seed means against the seeds' own spread (two standard errors of the
difference). The wall-clock question is asked of a target every run can reach: a share of the way from the
reward all runs start at to the reward `sync` ends at, on a moving average (one step's reward is noisy).
"""

from __future__ import annotations

import math
from statistics import mean, stdev

def moving_average(values: list[float], window: int) -> list[float]:
    """The trailing mean over up to `window` values (the first ones average what there is)."""
    if window < 1:
        raise ValueError(f"window = {window}: must be >= 1")
    return [mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))]


def rewards_of(run: dict) -> list[tuple[int, float, float]]:
    """(step, wall-clock s from the first rollout request, reward) of one run, in step order."""
    steps = run["steps"]
    return [(int(n), float(steps[n]["wall_s"]), float(steps[n]["reward"] or 0.0))
            for n in sorted(steps, key=int)]


def final_reward(run: dict, last: int) -> float:
    """The mean reward of the run's last `last` steps."""
    rewards = [r for _, _, r in rewards_of(run)]
    return mean(rewards[-last:])


def time_to_reward(run: dict, target: float, window: int) -> float | None:
    """Wall-clock seconds until the reward's moving average first reaches `target`; None if it never does."""
    rows = rewards_of(run)
    averaged = moving_average([r for _, _, r in rows], window)
    for (_, wall, _), value in zip(rows, averaged):
        if value >= target:
            return wall
    return None


def _se_of_difference(a: list[float], b: list[float]) -> float:
    def var_of_mean(xs: list[float]) -> float:
        return stdev(xs) ** 2 / len(xs) if len(xs) > 1 else 0.0
    return math.sqrt(var_of_mean(a) + var_of_mean(b))


def parity(runs: dict[str, list[dict]], reference: str, last: int = 5, window: int = 3,
           target_share: float = 0.8, margin_share: float = 0.25) -> dict:
    """Every system's learning against `reference`'s (`runs`: system -> its seeds' runs, each a
    `wall_clock_summary`).

    Returns per system: the reward per step over seeds (mean, std), the final reward (mean of the last `last`
    steps) per seed, whether it is within seed noise of the reference's (|difference| <= 2 standard errors),
    how many steps are, and the wall-clock to the common target per seed and its median. And the equivalence
    test: within seed noise only says a difference was not shown (two noisy seeds pass it); equivalent says the
    difference's interval (mean +- 2 standard errors over seeds) lies inside +- the margin, `margin_share` of
    the reference's gain from the start reward, so noisy seeds fail it."""
    if reference not in runs or not runs[reference]:
        raise ValueError(f"reference system {reference!r} has no run (systems: {sorted(runs)})")
    start = mean(rewards_of(r)[0][2] for rs in runs.values() for r in rs)
    ref_final = [final_reward(r, last) for r in runs[reference]]
    target = start + target_share * (mean(ref_final) - start)
    ref_by_step = _by_step(runs[reference])
    margin = margin_share * abs(mean(ref_final) - start)
    out: dict = {"reference": reference, "start_reward": start, "target_reward": target,
                 "target_share": target_share, "final_steps": last, "moving_average_steps": window,
                 "equivalence_margin": margin, "equivalence_margin_share": margin_share, "systems": {}}
    for name, rs in runs.items():
        finals = [final_reward(r, last) for r in rs]
        by_step = _by_step(rs)
        steps_within = sum(
            1 for n in by_step if n in ref_by_step
            and abs(mean(by_step[n]) - mean(ref_by_step[n])) <= 2 * _se_of_difference(by_step[n], ref_by_step[n]))
        times = [time_to_reward(r, target, window) for r in rs]
        reached = sorted(t for t in times if t is not None)
        diff = mean(finals) - mean(ref_final)
        se = _se_of_difference(finals, ref_final)
        out["systems"][name] = {
            "seeds": len(rs),
            "reward_mean_by_step": {n: mean(v) for n, v in by_step.items()},
            "reward_std_by_step": {n: stdev(v) if len(v) > 1 else 0.0 for n, v in by_step.items()},
            "final_reward_by_seed": finals,
            "final_reward_mean": mean(finals),
            "final_difference_from_reference": diff,
            "final_within_seed_noise": abs(diff) <= 2 * se,
            "final_difference_interval": (diff - 2 * se, diff + 2 * se),
            "final_equivalent": abs(diff) + 2 * se <= margin,
            "steps_within_seed_noise": steps_within,
            "steps_compared": sum(1 for n in by_step if n in ref_by_step),
            "time_to_target_s_by_seed": times,
            "time_to_target_s_median": reached[(len(reached) - 1) // 2] if len(reached) == len(rs) else None,
            "wall_s_by_seed": [rewards_of(r)[-1][1] for r in rs],
        }
    return out


def _by_step(runs: list[dict]) -> dict[int, list[float]]:
    """Each step's rewards over the runs that reached it."""
    out: dict[int, list[float]] = {}
    for r in runs:
        for n, _, reward in rewards_of(r):
            out.setdefault(n, []).append(reward)
    return out

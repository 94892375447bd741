"""The same GRPO job under every trainer a verl user could pick instead of `+tide=enabled`, on one wall clock.

The head-to-head: verl `sync`; verl `colocate_async`; verl `separate_async` with verl's default hybrid
replicas, with and without the hybrid switch, at every rollout/trainer split the job's fake GPUs allow; verl's
`fully_async` trainer (its own entry point) with its dynamic schedule's `default` policy at each split; and
`+tide=enabled`. Same model, data, environment, seeds, steps, staleness bound (`max_staleness`) and weight-sync
cadence (every step) where the mode has one.

One clock for all: goodput = tokens of the trajectories an update consumed (verl's `perf/total_num_tokens`)
over the wall-clock from the first rollout request (the environment service's first /start: every system's
agent loop starts an episode before its first generation) to the end of the last update (the arrival of the
last step's metrics line). The job's start-up (Ray, model load, engine start) is reported apart.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from verl_tide.ers.lending import resolve_lend_actor
from verl_tide.job_config import fully_async_staleness_threshold, off_policy_threshold
from verl_tide.testing.demo import env_agent_overrides, under_tide
from verl_tide.testing.testbed import (GRPOJob, grpo_overrides, parse_step_metrics, run_with_env_service,
                                       tide_overrides, with_overrides)

REWARD = "critic/score/mean"
NO_LENDING = "tide, tide.ers.lend_actor=false"
LENDING_BESIDE_REF = "tide, tide.ers.lend_actor=true"
_STEP = re.compile(r"step:(\d+) - ")
GLOBAL_STEP = "training/global_step"
HIT_RATE_PREFIX = "tide/engine/prefix_hit_rate/"

# Per-step metrics each system reports where it has them (None where a system has no such number).
REPORTED = {
    "reward": REWARD,
    "step_s": "timing_s/step",
    "weight_sync_s": "timing_s/update_weights",
    "rwt_s": "tide/readiness/rwt_s",
    "twt_s": "tide/readiness/twt_s",
    "stale_dropped_groups": "tide/ledger/groups_dropped_stale",
    "evicted_samples": "training/off_policy/evicted_samples",
    "actor_lent_turns": "tide/ers/actor_lent_turns",
    "switch_wait_s": "timing_s/switch_wait",
    "kl_loss": "actor/kl_loss",
    # which of tide's mechanisms acted (cumulative counters, or the step's mode)
    "ctb_pauses": "tide/ctb/pauses",
    "ctb_resumes": "tide/ctb/resumes",
    "ra2p_decoupled": "tide/ra2p/step_mode_decoupled",
    "ra2p_split": "tide/ra2p/step_mode_split",
    "ers_moves": "tide/ers/moves_applied",
    "ers_ref_ranks": "tide/ers/ranks_ref",
    # CTB's budget window: the factor the step ran under at its end, the next, and changes made in waits (cumulative)
    "budget_factor": "tide/ctb/budget_factor",
    "next_budget_factor": "tide/ctb/next_budget_factor",
    "budget_changes_in_wait": "tide/ctb/budget_changes_in_wait",
}


@dataclass(frozen=True)
class System:
    """One trainer configuration of the comparison: a name and the overrides on top of the job's own."""

    name: str
    overrides: tuple[str, ...]
    rollout_gpus: int  # fake GPUs that roll out (all of them for hybrid engines)
    entry: str = "verl.trainer.main_ppo"  # the verl entry point it runs under
    # verl's fully_async trainer logs a step's training metrics one step late (in the line after its next update)
    # and the step number of its own line is the policy version: its steps are read by `training/global_step`
    metrics_by_global_step: bool = False


FULLY_ASYNC_ENTRY = "verl.experimental.fully_async_policy.fully_async_main"


POLL_AS_VERL = "tide, verl's 2 s sampler poll"
WHAT_IF = "what-if: "  # not a mode a user picks: stock verl plus user code (never the "best stock" baseline)


def fast_poll_overrides(trainer_mode: str) -> tuple[str, ...]:
    """verl's replay buffer with tide's 0.2 s poll, through verl's custom-sampler keys (`poll_sampler.py`)."""
    from verl_tide.testing import poll_sampler

    name = "FastPollReplayBuffer" if trainer_mode == "sync" else "FastPollReplayBufferAsync"
    return (f"trainer.v1.sampler.custom_sampler.path={poll_sampler.__file__}",
            f"trainer.v1.sampler.custom_sampler.name={name}")


def systems(job: GRPOJob, max_staleness: int = 1, tide_rollout_gpus: int = 1,
            attribution: bool = False) -> list[System]:
    """Every system the comparison runs for `job` (`job.n_gpus` fake GPUs in all); tide rolls out on
    `tide_rollout_gpus` of them, and is also run at every other split, as stock `separate_async` is (and, lending
    by default, the Actor's too; without a Ref model, tide without lending is run beside it; with one, tide with
    lending asked for beside verl's Ref). `attribution`: also tide with verl's 2 s sampler poll
    (`tide.sample_poll_s=2`) and the what-ifs `sync` and `colocate_async` with tide's 0.2 s poll (a custom
    sampler), to say how much of tide's number its faster look at TransferQueue is."""
    # one staleness bound for all: verl's threshold counts versions spanned, tide's bound versions of lag
    sync_every_step = f"trainer.v1.sampler.max_off_policy_threshold={off_policy_threshold(max_staleness)}"
    colocate = ("trainer.v1.trainer_mode=colocate_async", sync_every_step)
    out = [System("verl sync", (), job.n_gpus), System("verl colocate_async", colocate, job.n_gpus)]
    for rollout in range(1, job.n_gpus):  # every split the fake GPUs allow: at least one of each
        split = [
            "trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=true",
            f"trainer.n_gpus_per_node={job.n_gpus - rollout}", "actor_rollout_ref.rollout.nnodes=1",
            f"actor_rollout_ref.rollout.n_gpus_per_node={rollout}",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=tide_shm",  # as tide's: same weight path
            # verl imports this in every process that builds a checkpoint engine (stock verl's workers never
            # import the trainer `tide` that registers the backend otherwise)
            "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=verl_tide.weight_sync",
            "trainer.v1.separate_async.parameter_sync_step=1", sync_every_step,
        ]
        for switch in (False, True):
            label = f"verl separate_async {job.n_gpus - rollout}T/{rollout}R" + (" + hybrid switch" if switch else "")
            out.append(System(label, (*split, f"trainer.v1.separate_async.hybrid_rollout.enable_switch={switch}"),
                              rollout))
        if attribution:  # the control: the same stock mode looking for ready groups every 0.2 s, as tide does
            out.append(System(f"{WHAT_IF}verl separate_async {job.n_gpus - rollout}T/{rollout}R + hybrid switch, "
                              "0.2 s poll", (*split, "trainer.v1.separate_async.hybrid_rollout.enable_switch=True",
                                             *fast_poll_overrides("separate_async")), rollout))
    for rollout in range(1, job.n_gpus):  # verl's fully_async trainer, its dynamic schedule's default policy
        out.append(System(f"verl fully_async {job.n_gpus - rollout}T/{rollout}R + dynamic schedule",
                          fully_async_overrides(job, rollout, max_staleness), rollout, entry=FULLY_ASYNC_ENTRY,
                          metrics_by_global_step=True))
    # tide as a user gets it: `+tide=enabled` with its defaults (tide.ers.lend_actor=auto: the Actor's GPUs roll
    # out as ERS decides, unless the job has a Ref model)
    def tide_at(rollout: int) -> tuple[str, ...]:
        return (*tide_overrides(job, rollout_gpus=rollout, lend_actor=None), f"tide.max_staleness={max_staleness}")

    tide = tide_at(tide_rollout_gpus)
    lends, _ = resolve_lend_actor("auto", has_ref_model=job.use_kl_loss, hybrid_engine=True)  # trainer tide's rule
    tide_gpus = job.n_gpus if lends else tide_rollout_gpus
    out.append(System("tide", tide, tide_gpus))
    for rollout in (r for r in range(1, job.n_gpus) if r != tide_rollout_gpus):  # tide at the other splits too
        out.append(System(f"tide {job.n_gpus - rollout}T/{rollout}R", tide_at(rollout),
                          job.n_gpus if lends else rollout))
    if attribution:
        out.append(System(POLL_AS_VERL, (*tide, "tide.sample_poll_s=2.0"), tide_gpus))
        out.append(System(f"{WHAT_IF}verl sync, 0.2 s poll", fast_poll_overrides("sync"), job.n_gpus))
        out.append(System(f"{WHAT_IF}verl colocate_async, 0.2 s poll",
                          (*colocate, *fast_poll_overrides("colocate_async")), job.n_gpus))
    if lends:  # what lending the Actor's GPUs adds: tide without it
        out.append(System(NO_LENDING, (*tide, "tide.ers.lend_actor=false"), tide_rollout_gpus))
    else:  # a Ref model (verl's, on the trainer's GPUs): lending is opt-in there, beside verl's Ref
        out.append(System(LENDING_BESIDE_REF, (*tide, "tide.ers.lend_actor=true"), job.n_gpus))
    return out


def fully_async_overrides(job: GRPOJob, rollout_gpus: int, max_staleness: int) -> tuple[str, ...]:
    """The job under `python -m verl.experimental.fully_async_policy.fully_async_main` (its config composes
    `ppo_trainer` and adds `async_training` and a top-level `rollout`): `rollout_gpus` standalone rollout fake GPUs,
    the rest train and lend a hybrid replica to rollout as the dynamic schedule's `default` policy decides; one
    prompt per sample (its `gen_batch_size`), a step trains `train_batch_size` prompts (its `required_samples` =
    `ppo_mini_batch_size` x `require_batches`), the weights synced every step, the staleness bound as every other
    system's."""
    prompts = job.train_batch_size
    return (
        "data.train_batch_size=0", "data.gen_batch_size=1",
        f"trainer.n_gpus_per_node={job.n_gpus - rollout_gpus}", "rollout.nnodes=1",
        f"rollout.n_gpus_per_node={rollout_gpus}", f"rollout.n={job.rollout_n}",
        f"rollout.total_rollout_steps={job.steps * prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}", "async_training.require_batches=1",
        f"async_training.staleness_threshold={fully_async_staleness_threshold(max_staleness)}",
        "async_training.trigger_parameter_sync_step=1",
        "async_training.use_dynamic_resource_scheduling=True", "async_training.dynamic_schedule_policy=default",
        # its rollouter picks `single_turn_agent` for every sample unless multi-turn is on (detach_utils.py)
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        "actor_rollout_ref.hybrid_engine=false",  # its dynamic schedule builds the hybrid replicas itself
        "actor_rollout_ref.rollout.checkpoint_engine.backend=tide_shm",
        "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=verl_tide.weight_sync",
        # its trainer logs the last step's metrics only where `version % test_freq != 0` (never validating here)
        "trainer.test_freq=1000000",
        # its trainer and rollouter actors ask Ray for 10 CPUs each
        "ray_kwargs.ray_init.num_cpus=40",
    )


def mechanisms(steps: dict[int, dict]) -> dict[str, float]:
    """Which of tide's mechanisms acted over a run, from its per-step numbers (`wall_clock_summary`'s steps)."""
    if not steps:
        return {}
    last = steps[max(steps)]
    hit = [s["prefix_cache_hit_rate"] for s in steps.values() if s.get("prefix_cache_hit_rate") is not None]
    return {
        "ctb_pauses": float(last.get("ctb_pauses") or 0.0), "ctb_resumes": float(last.get("ctb_resumes") or 0.0),
        "ra2p_decoupled_steps": float(sum(bool(s.get("ra2p_decoupled")) for s in steps.values())),
        "ra2p_split_steps": float(sum(bool(s.get("ra2p_split")) for s in steps.values())),
        "ers_moves": float(sum(s.get("ers_moves") or 0.0 for s in steps.values())),
        "ers_steps_with_ref_ranks": float(sum(bool(s.get("ers_ref_ranks")) for s in steps.values())),
        "prefix_cache_hit_rate_mean": sum(hit) / len(hit) if hit else float("nan"),
    }


def is_tide(name: str) -> bool:
    return name.startswith("tide")


def job_overrides(job: GRPOJob, system: System, agent: list[str]) -> list[str]:
    """The full override list of `system` running `job` with the environment agent loop `agent`."""
    overrides = with_overrides(grpo_overrides(job), [*agent, *system.overrides])
    return under_tide(overrides) if is_tide(system.name) else overrides


def run_system(system: System, job: GRPOJob, work: Path, latency_scale: float, timeout_s: float,
               extra: tuple[str, ...] = (), timeline: bool = False) -> dict:
    """One run of `system` on `job` against an environment service of its own (its first /start is the run's
    clock zero): `wall_clock_summary`'s numbers, the mechanisms that acted and the episodes' count, or the exit
    code and the log's tail when the job failed. `timeline`: also where the clock went (`testing/timeline.py`:
    the trainer's phases, each engine's load, polled from its /metrics)."""
    from verl_tide.testing.timeline import EnginePoller

    work.mkdir(parents=True, exist_ok=True)
    lines: list[tuple[float, str]] = []
    poller = EnginePoller() if timeline else None

    def on_line(line: str) -> None:
        lines.append((time.time(), line))
        if poller is not None:
            poller.watch_line(line)

    slug = system.name.replace(" ", "_").replace("/", "-").replace("+", "plus")
    # The engines' /metrics move only with vLLM's stats on (`+tide=enabled` turns them on for CTB; verl's default
    # is off): every system gets them for a timeline, or stock engines would read idle.
    stats = ("actor_rollout_ref.rollout.disable_log_stats=False",) if timeline else ()
    started = time.time()
    try:
        run, health = run_with_env_service(
            lambda url: job_overrides(job, system, [*env_agent_overrides(url), *extra, *stats]), work,
            latency_scale=latency_scale, timeout_s=timeout_s, log_path=work / f"{slug}.log", on_line=on_line,
            module=system.entry, done=lambda line: f"step:{job.steps} - " in line)
    finally:
        if poller is not None:
            poller.stop()
    if run.returncode != 0:
        return {"returncode": run.returncode, "error": run.output[-3000:]}
    summary = wall_clock_summary(lines, started, health.get("first_start_unix"),
                                 by_global_step=system.metrics_by_global_step)
    missing = missing_steps(summary["steps"], job.steps)
    if missing:
        return {"returncode": -1, "error": missing}
    result = {"returncode": 0, **summary, "mechanisms": mechanisms(summary["steps"]),
              "episodes_started": health["started"], "episodes_ended": health["ended"],
              "stopped_after_last_step": run.stopped_after_done}
    if run.device_busy is not None:  # device budgets: each fake GPU's (and the host's) usage / budget
        result.update(device_busy_on_clock(run.usage_samples or [], run.budgets or {}, health["first_start_unix"],
                                           summary["wall_s"]))
        result["device_busy_job"] = {g: round(b, 4) for g, b in run.device_busy.items()}
    if poller is not None:
        result["timeline"] = run_timeline(lines, health["first_start_unix"], summary["wall_s"], poller.samples)
    return result


def device_busy_on_clock(samples: list, budgets: dict[str, float], first_request_unix: float, wall_s: float,
                         bin_s: float = 5.0) -> dict:
    """Each fake GPU's (and the host's) busy fraction over the benchmark's clock (first /start to the last step
    line; the start-up left out), and the same per `bin_s` of it: the test bed's GPU utilisation and its timeline."""
    from verl_tide.testing.device_budgets import busy_between

    end = first_request_unix + wall_s
    edges = [first_request_unix + i * bin_s for i in range(int(wall_s // bin_s) + 1)] + [end]
    edges = sorted(set(edges))
    return {"device_busy": {g: round(b, 4) for g, b in busy_between(samples, budgets, first_request_unix,
                                                                      end).items()},
            "device_timeline": {"bin_s": bin_s, "t_s": [round(t0 - first_request_unix, 2) for t0 in edges[:-1]],
                                "busy": [{g: round(f, 3) for g, f in busy_between(samples, budgets, t0, t1).items()}
                                         for t0, t1 in zip(edges, edges[1:])]}}


def missing_steps(steps: dict[int, dict], expected: int) -> str | None:
    """Why a run whose step lines are not exactly 1..`expected` is no result (fewer tokens over a shorter clock
    would pass for one), or None."""
    seen = sorted(steps)
    if seen == list(range(1, expected + 1)):
        return None
    return f"step lines seen: {seen}, expected 1..{expected}: a run with a missing step line fails"


def run_timeline(timed_lines: list[tuple[float, str]], first_request_unix: float, wall_s: float,
                 engine_samples: dict) -> dict:
    """The trainer's phases per step and over the run, and each engine's load, on the run's clock."""
    from verl_tide.testing.timeline import engine_load, phase_totals, pooled_engine_hit_rate, trainer_phases

    arrivals, steps = _step_lines(timed_lines)
    phases = trainer_phases(steps, arrivals, first_request_unix)
    engines = engine_load(engine_samples, first_request_unix, wall_s)
    return {"trainer": phases, "phase_totals_s": phase_totals(phases), "engines": engines,
            "prefix_cache_hit_rate": pooled_engine_hit_rate(engines)}


def _step_lines(timed_lines: list[tuple[float, str]], by_global_step: bool = False
                ) -> tuple[dict[int, float], dict[int, dict[str, float]]]:
    """When each step ended (its first metrics line arrived), and each step's metrics. `by_global_step`: a step's
    metrics are the line whose `training/global_step` names it, wherever it came (verl's fully_async trainer logs
    them after the next step's update, under the policy version's number)."""
    arrivals: dict[int, float] = {}
    for t, text in timed_lines:
        for match in _STEP.finditer(text):
            arrivals.setdefault(int(match.group(1)), t)
    steps = parse_step_metrics("".join(text if text.endswith("\n") else text + "\n" for _, text in timed_lines),
                               key_by=GLOBAL_STEP if by_global_step else None)
    return arrivals, steps


def wall_clock_summary(timed_lines: list[tuple[float, str]], started_unix: float,
                       first_request_unix: float | None, by_global_step: bool = False) -> dict:
    """Goodput and the per-step numbers of one run on the benchmark's clock.

    `timed_lines`: (Unix time the line arrived, text) for every output line of the run; `started_unix`: when the
    job was launched; `first_request_unix`: the environment service's first /start (None: no episode started)."""
    arrivals, steps = _step_lines(timed_lines, by_global_step)
    done = sorted(n for n in steps if n in arrivals)
    if not done or first_request_unix is None:
        raise ValueError(f"no step finished or no rollout request seen (steps {sorted(steps)}, first request "
                         f"{first_request_unix}): nothing to time")
    end = arrivals[done[-1]]
    tokens = sum(steps[n].get("perf/total_num_tokens", 0.0) for n in done)
    wall = end - first_request_unix
    later = [n for n in done if n > done[0]]
    later_tokens = sum(steps[n].get("perf/total_num_tokens", 0.0) for n in later)
    later_wall = end - arrivals[done[0]]
    per_step = {n: {name: steps[n].get(key) for name, key in REPORTED.items()} for n in done}
    for n in done:
        per_step[n]["wall_s"] = arrivals[n] - first_request_unix
        per_step[n]["prefix_cache_hit_rate"] = _mean_hit_rate(steps[n])
    return {
        "startup_s": first_request_unix - started_unix,
        "wall_s": wall,
        "tokens": tokens,
        "goodput_tok_s": tokens / wall if wall > 0 else 0.0,
        "goodput_after_step1_tok_s": later_tokens / later_wall if later and later_wall > 0 else 0.0,
        "steps": per_step,
    }


def _mean_hit_rate(step: dict[str, float]) -> float | None:
    """The step's prefix-cache hit rate over trainer tide's rollout engines (`tide/engine/prefix_hit_rate/<rank>`,
    from each engine's own /metrics); None where a system reports none."""
    rates = [v for k, v in step.items() if k.startswith(HIT_RATE_PREFIX)]
    return sum(rates) / len(rates) if rates else None


def chosen(names: list[str], only: list[str] | None) -> list[str]:
    """The systems `--only` picks: a value that is a system's whole name picks that one alone (else "verl sync"
    would pick every "..._async" too), any other value every name containing it."""
    if not only:
        return list(names)
    return [n for n in names if any(o == n or (o not in names and o in n) for o in only)]


def run_order(names: list[str], round_index: int) -> list[str]:
    """Round r runs the systems in order, r+1 in reverse: no system always starts on a machine the one before
    it warmed (page cache, CPU frequency)."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


def over_repeats(runs: list[dict]) -> dict:
    """One system's rounds as one result: goodputs pooled as the mean of the rounds, with every round's and the
    spread; the steps and curves of the round nearest that mean. A failed round fails the system."""
    failed = [r for r in runs if r.get("returncode") != 0]
    if failed:
        return failed[0]
    goodputs = [r["goodput_tok_s"] for r in runs]
    mean = sum(goodputs) / len(goodputs)
    nearest = min(runs, key=lambda r: abs(r["goodput_tok_s"] - mean))
    later = [r["goodput_after_step1_tok_s"] for r in runs]
    return {**nearest, "goodput_tok_s": mean, "goodput_after_step1_tok_s": sum(later) / len(later),
            "pooled": f"mean of {len(runs)} round(s)", "goodput_runs": goodputs, "goodput_min": min(goodputs),
            "goodput_max": max(goodputs), "goodput_after_step1_runs": later,
            "startup_runs_s": [r["startup_s"] for r in runs],
            **({"device_busy_runs": [r.get("device_busy") for r in runs],
                "device_busy_job_runs": [r.get("device_busy_job") for r in runs]} if nearest.get("device_busy") else {})}


def best_stock(results: dict[str, dict]) -> tuple[str, float]:
    """The stock verl system with the highest wall-clock goodput, and that goodput."""
    stock = {name: r["goodput_tok_s"] for name, r in results.items()
             if not is_tide(name) and not name.startswith(WHAT_IF) and "goodput_tok_s" in r}
    if not stock:
        raise ValueError("no stock verl system finished: nothing to compare tide with")
    name = max(stock, key=stock.__getitem__)
    return name, stock[name]
